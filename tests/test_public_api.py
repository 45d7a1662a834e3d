"""The public face of evflow: what users import."""

from __future__ import annotations

import subprocess
import sys

import pytest

import evflow

PUBLIC = {
    "DataStore",
    "EventMeta",
    "EvflowError",
    "Module",
    "Param",
    "Path",
    "ProcessOptions",
    "RecordInput",
    "RecordOutput",
    "RootInput",
    "RootOutput",
    "RunMeta",
    "RunSummary",
    "Source",
    "ToyGenerator",
    "__version__",
    "process",
}


def test_public_names_are_exactly_the_documented_ones() -> None:
    assert set(evflow.__all__) == PUBLIC
    assert len(evflow.__all__) == len(PUBLIC)  # no name listed twice


def test_public_names_are_exported() -> None:
    for name in evflow.__all__:
        assert hasattr(evflow, name), name
        assert name in dir(evflow), name


def test_public_names_are_the_defining_objects() -> None:
    from evflow.errors import EvflowError
    from evflow.event import DataStore, EventMeta, RunMeta
    from evflow.io.generators import ToyGenerator
    from evflow.io.records import RecordInput, RecordOutput
    from evflow.io.root import RootInput, RootOutput
    from evflow.processing.api import process
    from evflow.processing.module import Module, Param, Source
    from evflow.processing.options import ProcessOptions
    from evflow.processing.path import Path
    from evflow.processing.summary import RunSummary

    expected = {
        "DataStore": DataStore,
        "EventMeta": EventMeta,
        "EvflowError": EvflowError,
        "Module": Module,
        "Param": Param,
        "Path": Path,
        "ProcessOptions": ProcessOptions,
        "RecordInput": RecordInput,
        "RecordOutput": RecordOutput,
        "RootInput": RootInput,
        "RootOutput": RootOutput,
        "RunMeta": RunMeta,
        "RunSummary": RunSummary,
        "Source": Source,
        "ToyGenerator": ToyGenerator,
        "process": process,
    }
    for name, obj in expected.items():
        assert getattr(evflow, name) is obj, name


def test_io_classes_are_imported_on_first_use_only() -> None:
    # import evflow stays light (no numpy, no uproot) until an I/O class is asked for
    code = (
        "import sys, evflow\n"
        "heavy = ('numpy', 'uproot', 'awkward', 'evflow.io.root', 'evflow.io.generators')\n"
        "assert not [m for m in heavy if m in sys.modules], sorted(sys.modules)\n"
        "evflow.ToyGenerator\n"
        "assert 'evflow.io.generators' in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'RootInputt'"):
        evflow.RootInputt  # noqa: B018


def test_every_error_derives_from_evflow_error() -> None:
    from evflow import errors

    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert len(classes) > 5
    for cls in classes:
        assert issubclass(cls, errors.EvflowError), cls

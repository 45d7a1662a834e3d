"""evflow: reliable parallel event processing for particle physics over ZeroMQ.

The I/O modules (``RecordInput``, ``RecordOutput``, ``RootInput``, ``RootOutput``,
``ToyGenerator``) are imported on first use: they pull in numpy and uproot, which
would make ``import evflow`` about six times slower (measured: ~65 ms -> ~400 ms).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

try:
    from evflow.errors import EvflowError
    from evflow.processing import DataStore, EventMeta, Module, Param, Path, RunMeta, Source
    from evflow.processing.api import process
    from evflow.processing.options import ProcessOptions
    from evflow.processing.summary import RunSummary
except KeyboardInterrupt:  # the evflow command, interrupted while it starts: one line
    from evflow._startup import interrupted_during_import

    interrupted_during_import()
    raise

if TYPE_CHECKING:
    from evflow.io.generators import ToyGenerator
    from evflow.io.records import RecordInput, RecordOutput
    from evflow.io.root import RootInput, RootOutput

__version__ = "0.1.0"

__all__ = [
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
]

#: public names imported on first access, and the module that defines each
_LAZY = {
    "RecordInput": "evflow.io.records",
    "RecordOutput": "evflow.io.records",
    "RootInput": "evflow.io.root",
    "RootOutput": "evflow.io.root",
    "ToyGenerator": "evflow.io.generators",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'evflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

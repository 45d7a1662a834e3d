"""The readers and writers of files, by extension, for code that opens a file by its
name: the output of ``output=``, the record files that take quarantined events, a
file to replay.

They live in ``io/`` (above processing), so they are named as ``module:Class`` and
imported when first used, the way the device registry names application devices:
processing (and hlt) never import ``io``.
"""

from __future__ import annotations

import importlib
from typing import Any

from evflow.processing.module import Module, Source

__all__ = [
    "INPUT_READERS",
    "OUTPUT_WRITERS",
    "QUARANTINE_WRITER",
    "file_source",
    "output_writer",
    "quarantine_writer",
]

#: the reader of an input file by its (lower-case) extension; "" for any other
INPUT_READERS: dict[str, str] = {
    ".root": "evflow.io.root:RootInput",
    "": "evflow.io.records:RecordInput",
}

#: the writer of an ``output=`` file by its (lower-case) extension; "" for any other
OUTPUT_WRITERS: dict[str, str] = {
    ".root": "evflow.io.root:RootOutput",
    "": "evflow.io.records:RecordOutput",
}
#: the writer of quarantine files (evflow record files: they take raw events)
QUARANTINE_WRITER = "evflow.io.records:RecordOutput"


def _module(target: str, **params: Any) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(**params)


def _by_extension(table: dict[str, str], file: str) -> str:
    lower = file.lower()
    return next((t for ext, t in table.items() if ext and lower.endswith(ext)), table[""])


def file_source(file: str, tree: str = "events", branches: list[str] | None = None) -> Source:
    """The source that reads ``file``: a ROOT file's ``tree`` (``branches``: None for
    all), or an evflow record file."""
    target = _by_extension(INPUT_READERS, file)
    if target == INPUT_READERS.get(".root"):
        source: Source = _module(target, file=file, tree=tree, branches=branches)
    else:
        source = _module(target, file=file)
    return source


def output_writer(file: str, name: str = "output") -> Module:
    """The writer of ``file``, chosen by its extension (``OUTPUT_WRITERS``)."""
    writer: Module = _module(_by_extension(OUTPUT_WRITERS, file), name=name, file=file)
    return writer


def quarantine_writer(file: str, name: str) -> Module:
    """A record file that takes quarantined events raw (``QUARANTINE_WRITER``)."""
    writer: Module = _module(QUARANTINE_WRITER, name=name, file=file)
    return writer

"""The readers and writers of files, by extension, for code that opens a file by its
name: the output of ``output=``, the record files that take quarantined events, a
file to replay.

They live in ``io/`` (above processing), so they are named as ``module:Class`` and
imported when first used, the way the device registry names application devices:
processing (and hlt) never import ``io``.
"""

from __future__ import annotations

import pkgutil
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


def _extension(table: dict[str, str], file: str) -> str:
    """The key of ``table`` that ``file`` ends with ("" when none does)."""
    lower = file.lower()
    return next((ext for ext in table if ext and lower.endswith(ext)), "")


def file_source(file: str, tree: str = "events", branches: list[str] | None = None) -> Source:
    """The source that reads ``file``: a ROOT file's ``tree`` (``branches``: None for
    all), or an evflow record file."""
    ext = _extension(INPUT_READERS, file)
    params: dict[str, Any] = {"tree": tree, "branches": branches} if ext == ".root" else {}
    source: Source = pkgutil.resolve_name(INPUT_READERS[ext])(file=file, **params)
    return source


def output_writer(file: str, name: str = "output") -> Module:
    """The writer of ``file``, chosen by its extension (``OUTPUT_WRITERS``)."""
    cls = pkgutil.resolve_name(OUTPUT_WRITERS[_extension(OUTPUT_WRITERS, file)])
    writer: Module = cls(name=name, file=file)
    return writer


def quarantine_writer(file: str, name: str) -> Module:
    """A record file that takes quarantined events raw (``QUARANTINE_WRITER``)."""
    writer: Module = pkgutil.resolve_name(QUARANTINE_WRITER)(name=name, file=file)
    return writer

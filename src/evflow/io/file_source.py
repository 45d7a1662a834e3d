"""``file-source``: a device that reads a record file or a ROOT TTree into a topology.

ROOT files (``.root``) are read with uproot in chunks of ``step_size`` entries
(``RootInput``: one event per entry, uid = entry index), record files record by record
(``RecordInput``); the events go out as ``SourceDevice`` sends them (EVENTS batches of
the safe codec, which ``qc-producer``, ``event-sink`` and paths decode), then END with
the counts. ``copies`` instances share one file: instance ``NAME_k`` sends the k-th
contiguous part of its entries.

``file`` is a path; a bare name that is not a file here but one of the files shipped by
scikit-hep-testdata (``uproot-HZZ.root``) is taken from there (never downloaded).
A missing file, a file that is neither, a missing tree or branch is one error before
anything starts (``evflow up`` calls :meth:`FileSource.check_params`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from evflow.errors import InputError
from evflow.event import DataStore
from evflow.io.root import resolve_input_file
from evflow.params import Param
from evflow.processing.module import Source
from evflow.runtime.devices.source import SourceDevice

__all__ = ["FileSource", "open_file_input", "resolve_input_file"]


def open_file_input(
    file: str,
    tree: str = "events",
    branches: list[str] | None = None,
    step_size: int = 10_000,
    experiment: int = 0,
    run: int = 0,
    on_corrupt: str = "raise",
) -> Source:
    """The path source that reads ``file``: ``RootInput`` for ``.root``, else
    ``RecordInput``; InputError (or CorruptRecordError) naming what is wrong."""
    path = resolve_input_file(file)
    if path.endswith(".root"):
        from evflow.io.root import RootInput

        return RootInput(file=path, tree=tree, branches=branches, step_size=step_size,
                         experiment=experiment, run=run)  # fmt: skip
    from evflow.io.records import RecordInput

    return RecordInput(file=path, on_corrupt=on_corrupt)


class FileSource(SourceDevice):
    description = "reads a record file or a ROOT TTree (in chunks) and sends its events, then END"

    file = Param(str, doc="record file or ROOT file (.root); or a scikit-hep-testdata name")
    tree = Param(str, "events", "TTree of a ROOT file")
    branches = Param(str, "", "comma-separated branches of a ROOT file (empty: all readable)")
    step_size = Param(int, 10_000, "ROOT entries read per chunk")
    max_events = Param(int, 0, "send at most this many events of the file (0: all)")
    experiment = Param(int, 0, "experiment number in the events' meta (ROOT)")
    run_number = Param(int, 0, "run number in the events' meta (ROOT)")
    on_corrupt = Param(str, "raise", "a damaged record file: raise or skip", ("raise", "skip"))

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        cls.input_for(params)

    @staticmethod
    def input_for(params: dict[str, Any]) -> Source:
        if int(params["step_size"]) < 1 or int(params["max_events"]) < 0:
            raise InputError("step_size must be >= 1 and max_events >= 0")
        branches = [b.strip() for b in str(params["branches"]).split(",") if b.strip()] or None
        return open_file_input(
            params["file"], params["tree"], branches, params["step_size"],
            params["experiment"], params["run_number"], params["on_corrupt"],
        )  # fmt: skip

    def init_task(self) -> None:
        self._input = self.input_for(self._params)
        total = self._input.total()
        if total is None:  # (record and ROOT readers always know)
            raise InputError(f"device {self.id!r}: cannot tell how many events {self.file!r} holds")
        if self.max_events:
            total = min(total, self.max_events)
        self.part = self.share(total)

    def events(self) -> Iterator[DataStore]:
        # the reader's generator holds the file: closed with ours (end_stream closes us)
        reader = self._input.events(self.part.start)
        try:
            yield from itertools.islice(reader, len(self.part))
        finally:
            close = getattr(reader, "close", None)
            if close is not None:
                close()

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        part = getattr(self, "part", range(0))
        out["source"].update(file=self.file, first=part.start, entries=len(part))
        return out

"""The base class of output modules: what the parallel output needs from a writer."""

from __future__ import annotations

from collections.abc import Sequence

from evflow.event import DataStore, EventMeta
from evflow.processing.module import Module


class Writer(Module):
    """An output module: writes every event that reaches it.

    Subclasses implement ``write``, ``write_raw``, ``flush``, ``close`` and
    ``written_uids``. The parallel output process relies on this contract:

    - ``flush()``: everything written so far is durable and readable; the output calls
      it before it confirms uids to the input (so a confirmed event is never lost).
    - ``written_uids()``: the uids already in the output (after a reopen following a
      crash, the ones found in the file), so that a resumed run skips them.
    - ``write_raw(meta, frames)``: an event still in its encoded form (codec frames),
      written without decoding, e.g. a quarantined event that crashed every worker.
    - ``terminate()`` closes the writer, so that a path run closes its files.
    - ``columnar``: the writer keeps a fixed set of columns taken from the first event
      (a TTree's branches). A quarantined event is written raw, without what later
      modules add, so the parallel output sends it to a quarantine record file beside
      the writer's file (``quarantine_file_for``) instead of to the writer.
    """

    columnar: bool = False

    def event(self, store: DataStore) -> bool | None:
        self.write(store)
        return None

    def write(self, store: DataStore) -> None:
        """Write one decoded event."""
        raise NotImplementedError(f"writer {self.name!r} does not implement write()")

    def write_raw(self, meta: EventMeta, frames: Sequence[bytes | memoryview]) -> None:
        """Write one event given as codec frames (``encode_event`` output) and its meta."""
        raise NotImplementedError(f"writer {self.name!r} does not implement write_raw()")

    def flush(self) -> None:
        """Make everything written so far durable and readable."""

    def close(self) -> None:
        """Flush and close; further writes raise ``ClosedError``. Closing twice is fine."""

    def written_uids(self) -> set[int]:
        """The uids of every event in the output (including those found on reopen)."""
        raise NotImplementedError(f"writer {self.name!r} does not implement written_uids()")

    def terminate(self) -> None:
        self.close()


#: the quarantine record file of a columnar writer: ``<its file>`` + this suffix
QUARANTINE_SUFFIX = ".quarantine.evr"


def quarantine_file_for(writer: object) -> str | None:
    """Where a parallel run writes the quarantined events ``writer`` cannot hold (it is
    columnar, or has no ``write_raw``): a record file beside the writer's file; None
    for a writer that takes them."""
    no_raw = getattr(type(writer), "write_raw", None) is Writer.write_raw
    if not (getattr(writer, "columnar", False) or no_raw):
        return None
    file = getattr(writer, "file", None)
    return f"{file}{QUARANTINE_SUFFIX}" if file else None

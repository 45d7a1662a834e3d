"""Record files as path modules: ``RecordOutput`` writes events, ``RecordInput`` reads them.

Each record holds ``pack_frames(encode_event(store))`` (see ``evflow.wire.codec``) with
the event's uid and flags in the record header. ``RecordWriter``/``RecordReader``
(re-exported here) handle the file itself: buffering, CRCs, torn tails, reopening.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from evflow.errors import CodecError, CorruptRecordError, OutputError
from evflow.event import DataStore, EventMeta
from evflow.io._recfile import Record, RecordReader, RecordWriter, TornTail
from evflow.processing.module import Param, Source
from evflow.processing.writer import Writer
from evflow.wire.codec import decode_event, encode_event, unpack_frames

__all__ = ["Record", "RecordInput", "RecordOutput", "RecordReader", "RecordWriter", "TornTail"]


def decode_record(path: str, record: Record) -> DataStore:
    """The event stored in ``record``; its header flags are OR-ed into ``meta.flags``."""
    try:
        store = decode_event(unpack_frames(record.payload))
    except CodecError as err:
        raise CorruptRecordError(
            f"record file {path!r}: record at offset {record.offset} (uid {record.uid}) "
            f"does not decode: {err}"
        ) from err
    store.meta.flags |= record.flags
    return store


class RecordInput(Source):
    """Reads the events of a record file, in file order; position = record index.

    A torn tail (the writer was killed) is logged and skipped. Damage in the middle
    raises ``CorruptRecordError`` unless ``on_corrupt="skip"``.
    """

    file = Param(str, doc="record file to read")
    on_corrupt = Param(
        str, "raise", "damaged record in the middle: raise or skip", ("raise", "skip")
    )

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(name, **params)
        # Fail at construction (in the steering file) for a missing or foreign file.
        with RecordReader(self.file, on_corrupt=self.on_corrupt):
            pass
        self._total: int | None = None

    def total(self) -> int:
        if self._total is None:
            with RecordReader(self.file, on_corrupt=self.on_corrupt) as reader:
                self._total = len(reader)
        return self._total

    def events(self, start: int = 0) -> Iterator[DataStore]:
        reader = RecordReader(self.file, on_corrupt=self.on_corrupt)
        try:
            for record in reader.records(start):
                yield decode_record(self.file, record)
        finally:
            reader.close()

    def encoded_events(self, start: int = 0) -> Iterator[tuple[int, int, int, list[Any]]]:
        """``(uid, experiment, run, frames)``: the records' encoded events, not decoded.

        Decoding the frames gives what ``events(start)`` yields (the parallel input's
        fast path); the entries are checked by whoever decodes them.
        """
        from evflow.io._encoded_records import encoded_record_events

        return encoded_record_events(self.file, self.on_corrupt, start)


class RecordOutput(Writer):
    """Writes every event that reaches it to a record file.

    ``append=False`` creates (or truncates) the file; ``append=True`` continues an
    existing file, truncating a torn tail left by a crash (``written_uids()`` then
    holds the uids already there). The file opens in ``initialize()`` (in the process
    that writes, e.g. the parallel output) or on first use. ``flush()`` writes the
    buffer and fsyncs it (with ``fsync=True``).
    """

    file = Param(str, doc="record file to write")
    append = Param(bool, False, "continue an existing file instead of truncating it")
    buffer_bytes = Param(int, 4 << 20, "write buffer size in bytes")
    fsync = Param(bool, True, "flush() also fdatasyncs the file (durable on power loss)")

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(name, **params)
        # Check the directory now so that a bad path fails in the steering file, but
        # open the file only in the process that writes it.
        parent = os.path.dirname(os.path.abspath(self.file))
        if not os.path.isdir(parent):
            raise OutputError(f"cannot write record output {self.file!r}: no directory {parent!r}")
        if not os.access(parent, os.W_OK):
            raise OutputError(
                f"cannot write record output {self.file!r}: directory {parent!r} is not writable"
            )
        self._writer: RecordWriter | None = None

    def _open(self) -> RecordWriter:
        if self._writer is None:
            self._writer = RecordWriter(
                self.file, append=self.append, buffer_bytes=self.buffer_bytes, fsync=self.fsync
            )
        return self._writer

    def initialize(self) -> None:
        self._open()

    def write(self, store: DataStore) -> None:
        meta = store.meta
        # an event still in the frames it came in (nobody changed it): as they are
        received = getattr(store, "as_received", None)
        frames = received() if received is not None else None
        self._open().write_frames(meta.uid, meta.flags, frames or encode_event(store))

    def write_raw(self, meta: EventMeta, frames: Sequence[bytes | memoryview]) -> None:
        self._open().write_frames(meta.uid, meta.flags, frames)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def written_uids(self) -> set[int]:
        return self._open().written_uids()

    @property
    def writer(self) -> RecordWriter | None:
        """The open file writer (None before the first use)."""
        return self._writer

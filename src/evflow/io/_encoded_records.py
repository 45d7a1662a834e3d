"""``RecordInput`` events as the encoded frames stored in the file (the fast path).

A record's payload is ``pack_frames(encode_event(store))``: the frames are views into
the file's map, nothing is decoded or copied. The record header's flags are OR-ed into
the meta as ``decode_record`` does (only then is the 48-byte meta rewritten).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from evflow.errors import CodecError, CorruptRecordError
from evflow.io._recfile import RecordReader
from evflow.wire.codec import peek_meta, unpack_frames, with_meta

EncodedEvent = tuple[int, int, int, list[Any]]


def encoded_record_events(file: str, on_corrupt: str, start: int) -> Iterator[EncodedEvent]:
    """``(uid, experiment, run, frames)`` of the records from the ``start``-th on.

    Payload CRCs are checked as for ``events()``; the header's meta is read and checked
    here, the rest of the event is decoded (and checked) by whoever opens it.
    """
    reader = RecordReader(file, on_corrupt=on_corrupt)
    try:
        for record in reader.records(start):
            try:
                frames = unpack_frames(record.payload)
                meta = peek_meta(frames)
                if record.flags & ~meta.flags:
                    meta.flags |= record.flags
                    frames = with_meta(frames, meta)
            except CodecError as err:
                raise CorruptRecordError(
                    f"record file {file!r}: record at offset {record.offset} (uid "
                    f"{record.uid}) does not decode: {err}"
                ) from err
            yield (meta.uid, meta.experiment, meta.run, frames)
    finally:
        reader.close()

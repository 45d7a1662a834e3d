"""Fragment batches on the wire: many small fragments of one source in one message.

A batch is an EVENTS message whose header has ``s`` (the source id), ``e`` (the event
ids, little-endian u64 bytes) and ``n`` (each fragment's length, u32 bytes), and one
payload frame: the fragments back to back. This is the RORC publisher's trick of
announcing many events in one message; per fragment the receiver does no Python work.

Everything here comes from a socket: :func:`decode_fragments` checks every field and
raises :class:`~evflow.errors.ProtocolError` naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evflow.errors import ProtocolError
from evflow.wire.messages import Message, MsgType, encode_message

__all__ = ["FragmentBatch", "decode_fragments", "encode_fragments", "fragment_header"]

#: a fragment batch carries this header key (other EVENTS messages do not)
BATCH_KEY = "s"


@dataclass(slots=True)
class FragmentBatch:
    """Decoded fragments of one source: ids, lengths, offsets into ``data``."""

    source: int
    ids: np.ndarray  # int64 (event ids >= 2**63 show as negative: refused as "far")
    lengths: np.ndarray  # int64
    offsets: np.ndarray  # int64, into data
    data: Any  # a buffer (zmq.Frame, bytes, memoryview)

    def __len__(self) -> int:
        return len(self.ids)

    def tail(self, start: int) -> FragmentBatch:
        """The fragments from ``start`` on (same buffer, no copy)."""
        return FragmentBatch(
            self.source,
            self.ids[start:],
            self.lengths[start:],
            self.offsets[start:],
            self.data,
        )


def _le_bytes(values: Any, dtype: str) -> bytes:
    """``values`` as little-endian ``dtype`` bytes (bytes are taken as they are)."""
    if type(values) is bytes:
        return values
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def fragment_header(source: int, ids: Any, lengths: Any) -> dict[str, Any]:
    """The header of a batch; ``ids`` and ``lengths`` as arrays, or already as their
    ``<u8`` / ``<u4`` bytes (a sender that slices precomputed bytes does no numpy)."""
    return {BATCH_KEY: int(source), "e": _le_bytes(ids, "<u8"), "n": _le_bytes(lengths, "<u4")}


def encode_fragments(
    source: int,
    ids: Sequence[int] | np.ndarray | bytes,
    fragments: Sequence[Any] | tuple[Any, Any],
) -> list[Any]:
    """Frames of one batch. ``fragments`` is a list of buffers (one per id) or a pair
    ``(lengths, data)`` with the fragments already back to back in ``data``. ``ids``
    and ``lengths`` may be given as their wire bytes (``<u8``, ``<u4``)."""
    if isinstance(fragments, tuple):
        lengths, data = fragments
    else:
        lengths = [memoryview(f).nbytes for f in fragments]
        data = b"".join(fragments)
    header = fragment_header(source, ids, lengths)
    n_ids, n_lengths = len(header["e"]) // 8, len(header["n"]) // 4
    if n_ids != n_lengths:
        raise ProtocolError(f"{n_ids} event ids for {n_lengths} fragments")
    return encode_message(MsgType.EVENTS, header, (data,))


def is_fragment_batch(msg: Message) -> bool:
    return msg.type is MsgType.EVENTS and BATCH_KEY in msg.header


def decode_fragments(msg: Message) -> FragmentBatch:
    """The batch in ``msg``; ProtocolError for any inconsistency."""
    h = msg.header
    source, ids_b, lens_b = h.get(BATCH_KEY), h.get("e"), h.get("n")
    if type(source) is not int or not 0 <= source < 2**32:
        raise ProtocolError(f"fragment batch: bad source id {source!r}")
    if not isinstance(ids_b, bytes) or not isinstance(lens_b, bytes):
        raise ProtocolError("fragment batch: 'e' and 'n' must be bytes")
    if len(ids_b) % 8 or len(lens_b) % 4 or len(ids_b) // 8 != len(lens_b) // 4:
        raise ProtocolError(
            f"fragment batch: {len(ids_b)} bytes of ids do not match {len(lens_b)} bytes of lengths"
        )
    if len(msg.payload) != 1:
        raise ProtocolError(f"fragment batch: {len(msg.payload)} payload frames, expected 1")
    data = msg.payload[0]
    size = memoryview(data).nbytes
    ids = np.frombuffer(ids_b, dtype="<i8")  # (ids >= 2**63 read negative: refused as far)
    lengths = np.frombuffer(lens_b, dtype="<u4").astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    if total != size:
        raise ProtocolError(f"fragment batch: lengths add up to {total} bytes, payload has {size}")
    return FragmentBatch(source, ids, lengths, ends - lengths, data)

"""The default event codec: a ``DataStore`` <-> a list of frames, safe and zero-copy.

Frame 0 is a msgpack header; the frames after it are raw array buffers::

    event:  [CODEC_VERSION, KIND_EVENT, meta, entries]       + one frame per large buffer
    batch:  [CODEC_VERSION, KIND_BATCH, [h_1..h_n], [k_1..k_n]] + the events' frames in order
    meta:   [uid, experiment, run, event, flags, attempt]
    entry:  [name, 0, value]                                  msgpack value (scalars, str,
                                                              bytes, dicts/lists of those)
            [name, 1, dtype, shape, data]                     numpy array
            [name, 2, form_json, length, [[key, data], ...]]  awkward array (ak.to_buffers)
    data:   bytes (inline, buffers <= INLINE_MAX_BYTES) or int (index of its own frame)

A batch carries each event's own packed header ``h_i`` (a msgpack bin) and its frame
count ``k_i``, so already-encoded events can be joined into a batch and split out of
one without re-encoding (:func:`join_events`, :func:`split_batch`).

Small buffers travel inline in the header (one frame for a whole 1 kB event or for a
batch of them); buffers above ``INLINE_MAX_BYTES`` get their own frame, which is a
memoryview of the array (zero-copy). Decoded arrays are views on the received bytes and
may be **read-only**: copy (``np.array(x)``) before writing into one.

Decoding treats every frame as hostile: any deviation raises :class:`CodecError`
(never another exception) and nothing is ever unpickled. :class:`PickleCodec` exists
for same-host runs that carry arbitrary Python objects, as an explicit opt-in.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import numpy as np

from evflow.errors import CodecError
from evflow.processing.datastore import DataStore, EventMeta
from evflow.wire._arrays import (
    array_from_buffer,
    as_bytes_view,
    dtype_str,
    ext_default,
    ext_hook,
    parse_dtype,
)
from evflow.wire._pickle_codec import PICKLE_MAGIC, PickleCodec

__all__ = [
    "CODEC_VERSION",
    "INLINE_MAX_BYTES",
    "Frame",
    "PickleCodec",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "encode_event",
    "join_events",
    "pack_frames",
    "peek_meta",
    "peek_metas",
    "split_batch",
    "unpack_frames",
    "with_meta",
]

CODEC_VERSION = 1
KIND_EVENT = 0
KIND_BATCH = 1
T_VALUE, T_ARRAY, T_AWKWARD = 0, 1, 2
# Buffers up to this size are copied into the header; larger ones get a zero-copy frame.
# Below ~16 kB a memcpy costs less than a separate ZeroMQ frame (~1-2 µs each).
INLINE_MAX_BYTES = 16 * 1024
UINT64_MAX = (1 << 64) - 1
# Upper bound of an awkward array's declared length (the buffers bound the rest).
MAX_AWKWARD_LENGTH = 1 << 40

Frame = bytes | memoryview
_PLAIN = frozenset({int, float, str, bytes, bool, type(None), dict, list, tuple})
_UNPACK_KW: dict[str, Any] = {"raw": False, "strict_map_key": False, "ext_hook": ext_hook}


def _packb(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, default=ext_default)
    except CodecError:
        raise
    except (OverflowError, ValueError, TypeError) as exc:
        raise CodecError(f"cannot encode event header: {exc}") from None


# --- encoding --------------------------------------------------------------------------
def _encode_objects(objects: dict[str, Any], frames: list[Frame]) -> list[Any]:
    entries: list[Any] = []
    append = entries.append
    for name, value in objects.items():
        t = type(value)
        if t is np.ndarray:
            if value.nbytes <= INLINE_MAX_BYTES:
                data: Any = value.tobytes()
            else:
                frames.append(as_bytes_view(value))
                data = len(frames) - 1
            append((name, T_ARRAY, dtype_str(value.dtype), value.shape, data))
        elif t in _PLAIN or isinstance(value, np.generic):
            append((name, T_VALUE, value))
        elif t.__module__.startswith("awkward"):
            append(_encode_awkward(name, value, frames))
        else:
            raise CodecError(
                f"cannot encode object {name!r} of type {t.__module__}.{t.__qualname__}; the "
                "codec carries numpy and awkward arrays, scalars, strings, bytes and "
                "dicts/lists of those (use codec='pickle' for other objects on one host)"
            )
    return entries


def _encode_awkward(name: str, value: Any, frames: list[Frame]) -> tuple[Any, ...]:
    import awkward as ak

    if not isinstance(value, ak.Array):
        raise CodecError(f"cannot encode object {name!r}: only ak.Array is supported")
    form, length, container = ak.to_buffers(value)
    bufs = []
    for key, buf in container.items():
        arr = np.asarray(buf)
        if arr.nbytes <= INLINE_MAX_BYTES:
            data: Any = arr.tobytes()
        else:
            frames.append(as_bytes_view(arr))
            data = len(frames) - 1
        bufs.append((key, data))
    return (name, T_AWKWARD, form.to_json(), length, bufs)


def _meta_list(m: EventMeta) -> tuple[int, ...]:
    return (m.uid, m.experiment, m.run, m.event, m.flags, m.attempt)


def encode_event(store: DataStore) -> list[Frame]:
    """Encode one event: ``[header, *buffers]``; large buffers are zero-copy views.

    The returned memoryviews keep the store's arrays alive; do not modify those arrays
    until the frames are sent.
    """
    frames: list[Frame] = [b""]
    entries = _encode_objects(store.objects, frames)
    frames[0] = _packb((CODEC_VERSION, KIND_EVENT, _meta_list(store.meta), entries))
    return frames


def encode_batch(stores: Iterable[DataStore]) -> list[Frame]:
    """Encode many events as one message: one header frame + their large buffers."""
    headers: list[bytes] = []
    counts: list[int] = []
    frames: list[Frame] = [b""]
    for store in stores:
        own: list[Frame] = [b""]
        entries = _encode_objects(store.objects, own)
        headers.append(_packb((CODEC_VERSION, KIND_EVENT, _meta_list(store.meta), entries)))
        counts.append(len(own) - 1)
        frames.extend(own[1:])
    frames[0] = _packb((CODEC_VERSION, KIND_BATCH, headers, counts))
    return frames


def join_events(events: Iterable[Sequence[Frame]]) -> list[Frame]:
    """Join already-encoded events (``encode_event`` outputs) into one batch, no re-encode."""
    headers: list[Any] = []
    counts: list[int] = []
    frames: list[Frame] = [b""]
    for ev in events:
        if not ev:
            raise CodecError("cannot join an empty frame list into a batch")
        headers.append(ev[0])
        counts.append(len(ev) - 1)
        frames.extend(ev[1:])
    frames[0] = _packb((CODEC_VERSION, KIND_BATCH, headers, counts))
    return frames


# --- decoding --------------------------------------------------------------------------
def _unpack_header(frames: Sequence[Any]) -> list[Any]:
    if not frames:
        raise CodecError("no frames: an encoded event has at least a header frame")
    head = frames[0]
    try:
        header = msgpack.unpackb(head, **_UNPACK_KW)
    except CodecError:
        raise
    except Exception as exc:
        if bytes(head[: len(PICKLE_MAGIC)]) == PICKLE_MAGIC:
            raise CodecError(
                "these frames were encoded by the pickle codec; the default codec never "
                "unpickles (decode with PickleCodec, and only data from this host)"
            ) from None
        raise CodecError(
            f"event header is not valid msgpack: {type(exc).__name__}: {exc}"
        ) from None
    if type(header) is not list or len(header) < 2:
        raise CodecError(f"event header is not a codec header: {_short(header)}")
    if header[0] != CODEC_VERSION or type(header[0]) is not int:
        raise CodecError(
            f"unknown codec format version {_short(header[0])} (this evflow reads version "
            f"{CODEC_VERSION}); encode and decode with the same evflow version"
        )
    return header


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def _meta(m: Any) -> EventMeta:
    if type(m) is not list or len(m) != 6:
        raise CodecError(f"bad event meta in header: {_short(m)} (expected 6 ints)")
    for x in m:
        if type(x) is not int:
            raise CodecError(f"bad event meta in header: {_short(m)} (expected 6 ints)")
    if not 0 <= m[0] <= UINT64_MAX:
        raise CodecError(f"bad event uid {m[0]} (expected an unsigned 64-bit int)")
    return EventMeta(m[0], m[1], m[2], m[3], m[4], m[5])


class _FrameCursor:
    """Hands out data frames in order and checks that each is used exactly once."""

    __slots__ = ("end", "frames", "next")

    def __init__(self, frames: Sequence[Any], first: int, count: int) -> None:
        self.frames = frames
        self.next = first
        self.end = first + count

    def take(self, data: Any, first: int) -> Any:
        if type(data) is bytes:
            return data
        # frame numbers in a header are 1-based within the event; they must come in order
        if type(data) is not int or data != self.next - first + 1 or self.next >= self.end:
            raise CodecError(
                f"bad buffer reference {_short(data)} in header (expected frame "
                f"{self.next - first + 1} of {self.end - first})"
            )
        frame = self.frames[self.next]
        self.next += 1
        return frame


def _decode_body(header: list[Any], frames: Sequence[Any], first: int, count: int) -> DataStore:
    if header[1] != KIND_EVENT or len(header) != 4:
        if header[1] == KIND_BATCH:
            raise CodecError("these frames are a batch of events; use decode_batch")
        raise CodecError(f"bad event header: kind {_short(header[1])}, {len(header)} fields")
    meta = _meta(header[2])
    entries = header[3]
    if type(entries) is not list:
        raise CodecError("bad event header: entries are not a list")
    cursor = _FrameCursor(frames, first, count)
    objects: dict[str, Any] = {}
    for entry in entries:
        if type(entry) is not list or len(entry) < 3 or type(entry[0]) is not str:
            raise CodecError(f"bad object entry in header: {_short(entry)}")
        tag = entry[1]
        if tag == T_VALUE and len(entry) == 3:
            objects[entry[0]] = entry[2]
        elif tag == T_ARRAY and len(entry) == 5:
            buf = cursor.take(entry[4], first)
            objects[entry[0]] = array_from_buffer(parse_dtype(entry[2]), entry[3], buf)
        elif tag == T_AWKWARD and len(entry) == 5:
            objects[entry[0]] = _decode_awkward(entry, cursor, first)
        else:
            raise CodecError(f"bad object entry in header: {_short(entry)}")
    if cursor.next != cursor.end:
        raise CodecError(
            f"event has {count} buffer frames but its header uses {cursor.next - first}"
        )
    return DataStore(meta, objects)


def _decode_awkward(entry: list[Any], cursor: _FrameCursor, first: int) -> Any:
    name, _, form, length, bufs = entry
    if type(form) is not str or type(length) is not int or type(bufs) is not list:
        raise CodecError(f"bad awkward entry {name!r} in header")
    if not 0 <= length <= MAX_AWKWARD_LENGTH:
        raise CodecError(f"bad awkward array {name!r}: length {length}")
    container: dict[str, Any] = {}
    for item in bufs:
        if type(item) is not list or len(item) != 2 or type(item[0]) is not str:
            raise CodecError(f"bad awkward buffer entry in {name!r}: {_short(item)}")
        container[item[0]] = cursor.take(item[1], first)
    import awkward as ak

    try:
        return ak.from_buffers(form, length, container, highlevel=True)
    except Exception as exc:
        raise CodecError(f"awkward array {name!r} does not decode: {exc}") from None


def decode_event(frames: Sequence[Any]) -> DataStore:
    """Decode the frames of one event (bytes, memoryview or ``zmq.Frame``) to a store.

    Arrays may be read-only views on ``frames``. Raises :class:`CodecError`.
    """
    header = _unpack_header(frames)
    return _decode_body(header, frames, 1, len(frames) - 1)


def _batch_parts(frames: Sequence[Any]) -> tuple[list[Any], list[int]]:
    header = _unpack_header(frames)
    if header[1] != KIND_BATCH or len(header) != 4:
        if header[1] == KIND_EVENT:
            raise CodecError("these frames are a single event, not a batch; use decode_event")
        raise CodecError(f"bad batch header: kind {_short(header[1])}, {len(header)} fields")
    headers, counts = header[2], header[3]
    if type(headers) is not list or type(counts) is not list or len(headers) != len(counts):
        raise CodecError("bad batch header: event headers and frame counts do not match")
    total = 0
    for k in counts:
        if type(k) is not int or k < 0:
            raise CodecError(f"bad batch header: frame count {_short(k)}")
        total += k
    if total != len(frames) - 1:
        raise CodecError(f"batch header lists {total} buffer frames, message has {len(frames) - 1}")
    return headers, counts


def decode_batch(frames: Sequence[Any]) -> list[DataStore]:
    """Decode a batch made by :func:`encode_batch` or :func:`join_events`."""
    headers, counts = _batch_parts(frames)
    stores = []
    first = 1
    for head, k in zip(headers, counts, strict=True):
        if type(head) is not bytes:
            raise CodecError("bad batch header: an event header is not bytes")
        stores.append(_decode_body(_unpack_header((head,)), frames, first, k))
        first += k
    return stores


def split_batch(frames: Sequence[Any]) -> list[list[Any]]:
    """The events of a batch as separate ``encode_event``-style frame lists (no decode)."""
    headers, counts = _batch_parts(frames)
    out = []
    first = 1
    for head, k in zip(headers, counts, strict=True):
        if type(head) is not bytes:
            raise CodecError("bad batch header: an event header is not bytes")
        out.append([head, *frames[first : first + k]])
        first += k
    return out


def peek_meta(frames: Sequence[Any]) -> EventMeta:
    """The meta of one encoded event, reading only its header frame."""
    header = _unpack_header(frames[:1])
    if header[1] != KIND_EVENT or len(header) != 4:
        raise CodecError("peek_meta needs a single event's frames (use peek_metas for batches)")
    return _meta(header[2])


def peek_metas(frames: Sequence[Any]) -> list[EventMeta]:
    """The metas of a batch (or of a single event, as a one-element list)."""
    header = _unpack_header(frames[:1])
    if header[1] == KIND_EVENT:
        return [peek_meta(frames)]
    headers, _ = _batch_parts(frames)
    return [peek_meta((h,)) for h in headers]


def with_meta(frames: Sequence[Any], meta: EventMeta) -> list[Any]:
    """A copy of an encoded event's frames with a new meta (e.g. attempt or flags changed).

    Only the header is rewritten; buffer frames are reused as they are.
    """
    header = _unpack_header(frames[:1])
    if header[1] != KIND_EVENT or len(header) != 4:
        raise CodecError("with_meta needs a single event's frames")
    _meta(header[2])
    header[2] = _meta_list(meta)
    return [_packb(header), *frames[1:]]


# --- one contiguous buffer -------------------------------------------------------------
_U32 = struct.Struct("<I")


def pack_frames(frames: Sequence[Any]) -> bytes:
    """Frames as one buffer: ``u32 count, count x u64 length, the frames' bytes``."""
    lens = [memoryview(f).nbytes if type(f) is not bytes else len(f) for f in frames]
    head = _U32.pack(len(lens)) + struct.pack(f"<{len(lens)}Q", *lens)
    return b"".join([head, *frames])


def unpack_frames(buf: Any) -> list[memoryview]:
    """The inverse of :func:`pack_frames`: zero-copy views into ``buf``."""
    try:
        view = memoryview(buf).cast("B")
    except TypeError as exc:
        raise CodecError(f"cannot read packed frames from {type(buf).__name__}: {exc}") from None
    size = view.nbytes
    if size < 4:
        raise CodecError(f"packed frames too short: {size} bytes (need at least 4)")
    (count,) = _U32.unpack_from(view, 0)
    pos = 4 + 8 * count
    if pos > size:
        raise CodecError(f"packed frames claim {count} frames but hold only {size} bytes")
    lens = struct.unpack_from(f"<{count}Q", view, 4)
    if sum(lens) != size - pos:
        raise CodecError(
            f"packed frames: lengths add up to {sum(lens)} bytes, buffer has {size - pos}"
        )
    out = []
    for n in lens:
        out.append(view[pos : pos + n])
        pos += n
    return out

"""The default event codec: a ``DataStore`` <-> a list of frames, safe and zero-copy.

Frame 0 is a msgpack header; the frames after it are raw array buffers::

    event:  [CODEC_VERSION, KIND_EVENT, meta, entries]       + one frame per large buffer
    batch:  [CODEC_VERSION, KIND_BATCH, [h_1..h_n], [k_1..k_n]] + the events' frames in order
    meta:   48-byte bin, little-endian uid u64, experiment i64, run i64, event i64,
            flags u64, attempt i64 (fixed size and offset: peek_meta and with_meta
            read or replace bytes 5..53 of an event header without parsing the rest)
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

import functools
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np

from evflow.errors import CodecError, ConfigurationError
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
    "DefaultCodec",
    "Frame",
    "PickleCodec",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "encode_event",
    "get_codec",
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
_META = struct.Struct("<QqqqQq")
# A version-1 event header starts with fixarray(4), 1, 0, bin8(48): the meta follows.
_EVENT_PREFIX = bytes([0x94, CODEC_VERSION, KIND_EVENT, 0xC4, _META.size])
_META_START = len(_EVENT_PREFIX)
_META_END = _META_START + _META.size
# An awkward array may declare at most 8 elements per buffer byte (bit-masks) plus this
# slack: zero-width nodes (empty records, size-0 RegularArray) otherwise let a tiny
# message declare a length of 2**40 that later hangs whoever iterates it.
AWKWARD_LENGTH_SLACK = 4096

Frame = bytes | memoryview
_T = TypeVar("_T")
_PLAIN = frozenset({int, float, str, bytes, bool, type(None), dict, list, tuple})
# Subclasses (IntEnum members, OrderedDict, ...) travel as their base type.
_PLAIN_BASES = (int, float, str, bytes, dict, list, tuple, np.generic)


_local = threading.local()


def _packb(obj: Any) -> bytes:
    # A Packer per thread: reusing one saves ~0.3 µs per call, but its ``default``
    # hook runs Python code, so two threads must not share one.
    try:
        packer = _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(default=ext_default)
    try:
        packed: bytes = packer.pack(obj)
        return packed
    except CodecError:
        raise
    except (OverflowError, ValueError, TypeError) as exc:
        raise CodecError(f"cannot encode event header: {exc}") from None


# --- encoding --------------------------------------------------------------------------
def _encode_objects(objects: dict[str, Any], frames: list[Frame]) -> list[Any]:
    entries: list[Any] = []
    append = entries.append
    for name, value in objects.items():
        if type(name) is not str:
            raise CodecError(f"cannot encode object name {name!r}: names are strings")
        t = type(value)
        if t is np.ndarray:
            if value.nbytes <= INLINE_MAX_BYTES:
                data: Any = value.tobytes()
            else:
                frames.append(as_bytes_view(value))
                data = len(frames) - 1
            append((name, T_ARRAY, dtype_str(value.dtype), value.shape, data))
        elif t in _PLAIN:
            append((name, T_VALUE, value))
        elif t.__module__.startswith("awkward"):
            append(_encode_awkward(name, value, frames))
        elif isinstance(value, _PLAIN_BASES):
            append((name, T_VALUE, value))
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


def _meta_bytes(m: EventMeta) -> bytes:
    try:
        return _META.pack(m.uid, m.experiment, m.run, m.event, m.flags, m.attempt)
    except struct.error as exc:
        raise CodecError(
            f"cannot encode event meta {m}: {exc} (uid and flags are unsigned 64-bit, "
            "experiment, run, event and attempt signed 64-bit integers)"
        ) from None


def encode_event(store: DataStore) -> list[Frame]:
    """Encode one event: ``[header, *buffers]``; large buffers are zero-copy views.

    The returned memoryviews keep the store's arrays alive; do not modify those arrays
    until the frames are sent.
    """
    frames: list[Frame] = [b""]
    entries = _encode_objects(store.objects, frames)
    frames[0] = _packb((CODEC_VERSION, KIND_EVENT, _meta_bytes(store.meta), entries))
    return frames


def encode_batch(stores: Iterable[DataStore]) -> list[Frame]:
    """Encode many events as one message: one header frame + their large buffers."""
    headers: list[bytes] = []
    counts: list[int] = []
    frames: list[Frame] = [b""]
    for store in stores:
        own: list[Frame] = [b""]
        entries = _encode_objects(store.objects, own)
        headers.append(_packb((CODEC_VERSION, KIND_EVENT, _meta_bytes(store.meta), entries)))
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
        head = ev[0]
        headers.append(head if type(head) is bytes else memoryview(head))  # packs as bin
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
        header = msgpack.unpackb(head, raw=False, strict_map_key=False, ext_hook=ext_hook)
    except CodecError:
        raise
    except Exception as exc:
        if _starts_with(head, PICKLE_MAGIC):
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


def _starts_with(frame: Any, prefix: bytes) -> bool:
    try:
        return bytes(memoryview(frame)[: len(prefix)]) == prefix
    except Exception:
        return False


def _unexpected(what: str, exc: Exception) -> CodecError:
    # The decoders check everything they know of; this is the net under those checks,
    # so that nothing but CodecError ever leaves a decoder.
    return CodecError(f"frames do not decode ({what}): {type(exc).__name__}: {exc}")


def _guarded(func: Callable[..., _T]) -> Callable[..., _T]:
    @functools.wraps(func)
    def wrapper(*args: Any) -> _T:
        try:
            return func(*args)
        except CodecError:
            raise
        except Exception as exc:
            raise _unexpected(func.__name__, exc) from None

    return wrapper


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def _meta(m: Any) -> EventMeta:
    if type(m) is not bytes or len(m) != _META.size:
        raise CodecError(f"bad event meta in header: {_short(m)} (expected {_META.size} bytes)")
    return EventMeta(*_META.unpack(m))


def _take(data: Any, frames: Sequence[Any], nxt: int, end: int, first: int) -> Any:
    """The buffer frame that ``data`` (an int) refers to; frames must be used in order."""
    # frame numbers in a header are 1-based within the event and come in order
    if type(data) is not int or data != nxt - first + 1 or nxt >= end:
        raise CodecError(
            f"bad buffer reference {_short(data)} in header (expected frame "
            f"{nxt - first + 1} of {end - first})"
        )
    return frames[nxt]


def _decode_body(
    header: list[Any], frames: Sequence[Any], first: int, count: int, writable: bool = False
) -> DataStore:
    if header[1] != KIND_EVENT or len(header) != 4:
        if header[1] == KIND_BATCH:
            raise CodecError("these frames are a batch of events; use decode_batch")
        raise CodecError(f"bad event header: kind {_short(header[1])}, {len(header)} fields")
    meta = _meta(header[2])
    entries = header[3]
    if type(entries) is not list:
        raise CodecError("bad event header: entries are not a list")
    nxt = first  # index of the next unused buffer frame
    end = first + count
    objects: dict[str, Any] = {}
    for entry in entries:
        if type(entry) is not list or type(entry[0]) is not str:
            raise CodecError(f"bad object entry in header: {_short(entry)}")
        n = len(entry)
        tag = entry[1]
        if tag == T_VALUE and n == 3:
            objects[entry[0]] = entry[2]
        elif tag == T_ARRAY and n == 5:
            buf = entry[4]
            if type(buf) is not bytes:
                buf = _take(buf, frames, nxt, end, first)
                nxt += 1
            arr = array_from_buffer(parse_dtype(entry[2]), entry[3], buf)
            if writable and not arr.flags.writeable:
                arr = arr.copy()
            objects[entry[0]] = arr
        elif tag == T_AWKWARD and n == 5:
            objects[entry[0]], nxt = _decode_awkward(entry, frames, nxt, end, first)
        else:
            raise CodecError(f"bad object entry in header: {_short(entry)}")
    if nxt != end:
        raise CodecError(f"event has {count} buffer frames but its header uses {nxt - first}")
    return DataStore(meta, objects)


def _decode_awkward(
    entry: list[Any], frames: Sequence[Any], nxt: int, end: int, first: int
) -> tuple[Any, int]:
    name, _, form, length, bufs = entry
    if type(form) is not str or type(length) is not int or type(bufs) is not list:
        raise CodecError(f"bad awkward entry {name!r} in header")
    if length < 0:
        raise CodecError(f"bad awkward array {name!r}: length {length}")
    container: dict[str, Any] = {}
    nbytes = 0
    for item in bufs:
        if type(item) is not list or len(item) != 2 or type(item[0]) is not str:
            raise CodecError(f"bad awkward buffer entry in {name!r}: {_short(item)}")
        data = item[1]
        if type(data) is not bytes:
            data = _take(data, frames, nxt, end, first)
            nxt += 1
        container[item[0]] = data
        nbytes += len(data) if type(data) is bytes else memoryview(data).nbytes
    if length > AWKWARD_LENGTH_SLACK + 8 * nbytes:
        raise CodecError(
            f"awkward array {name!r} declares length {length} but carries only {nbytes} "
            f"bytes of buffers (at most 8 elements per byte + {AWKWARD_LENGTH_SLACK})"
        )
    import awkward as ak

    try:
        return ak.from_buffers(form, length, container, highlevel=True), nxt
    except Exception as exc:
        raise CodecError(f"awkward array {name!r} does not decode: {exc}") from None


def decode_event(frames: Sequence[Any], *, writable: bool = False) -> DataStore:
    """Decode the frames of one event (bytes, memoryview or ``zmq.Frame``) to a store.

    Arrays are views on ``frames`` and read-only when the frames are (``bytes``);
    ``writable=True`` copies those (only those) so that modules may modify arrays in
    place, as they can in a sequential run. Raises :class:`CodecError`.
    """
    try:
        header = _unpack_header(frames)
        return _decode_body(header, frames, 1, len(frames) - 1, writable)
    except CodecError:
        raise
    except Exception as exc:
        raise _unexpected("decode_event", exc) from None


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


def decode_batch(frames: Sequence[Any], *, writable: bool = False) -> list[DataStore]:
    """Decode a batch made by :func:`encode_batch` or :func:`join_events`.

    ``writable`` as for :func:`decode_event`.
    """
    try:
        headers, counts = _batch_parts(frames)
        stores = []
        first = 1
        for head, k in zip(headers, counts, strict=True):
            if type(head) is not bytes:
                raise CodecError("bad batch header: an event header is not bytes")
            stores.append(_decode_body(_unpack_header((head,)), frames, first, k, writable))
            first += k
        return stores
    except CodecError:
        raise
    except Exception as exc:
        raise _unexpected("decode_batch", exc) from None


@_guarded
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


def _single_meta(frames: Sequence[Any], what: str) -> EventMeta:
    if not frames:
        raise CodecError("no frames: an encoded event has at least a header frame")
    head = frames[0]
    if type(head) is not bytes:
        head = memoryview(head)
    if len(head) > _META_END and head[:_META_START] == _EVENT_PREFIX:
        return EventMeta(*_META.unpack_from(head, _META_START))
    header = _unpack_header(frames[:1])  # raises the precise error, or:
    if header[1] == KIND_BATCH:
        raise CodecError(f"{what} needs a single event's frames, these are a batch")
    if len(header) == 4:
        _meta(header[2])  # names the problem with the meta
    raise CodecError(f"{what}: bad event header: {_short(header)}")


@_guarded
def peek_meta(frames: Sequence[Any]) -> EventMeta:
    """The meta of one encoded event from the first bytes of its header (< 1 µs).

    Only the meta is read; :func:`decode_event` validates the rest.
    """
    return _single_meta(frames, "peek_meta (use peek_metas for batches)")


@_guarded
def peek_metas(frames: Sequence[Any]) -> list[EventMeta]:
    """The metas of a batch (or of a single event, as a one-element list)."""
    if frames and _starts_with(frames[0], _EVENT_PREFIX):
        return [peek_meta(frames)]
    headers, _ = _batch_parts(frames)
    metas = []
    for head in headers:
        if type(head) is not bytes:
            raise CodecError("bad batch header: an event header is not bytes")
        metas.append(peek_meta((head,)))
    return metas


@_guarded
def with_meta(frames: Sequence[Any], meta: EventMeta) -> list[Any]:
    """A copy of an encoded event's frames with a new meta (e.g. attempt or flags changed).

    Only the meta bytes of the header are replaced; buffer frames are reused as they are.
    """
    _single_meta(frames, "with_meta")
    head = memoryview(frames[0])
    new_head = b"".join((head[:_META_START], _meta_bytes(meta), head[_META_END:]))
    return [new_head, *frames[1:]]


# --- one contiguous buffer -------------------------------------------------------------
_U32 = struct.Struct("<I")


def pack_frames(frames: Sequence[Any]) -> bytes:
    """Frames as one buffer: ``u32 count, count x u64 length, the frames' bytes``."""
    lens = [memoryview(f).nbytes if type(f) is not bytes else len(f) for f in frames]
    head = _U32.pack(len(lens)) + struct.pack(f"<{len(lens)}Q", *lens)
    return b"".join([head, *frames])


@_guarded
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


# --- choosing a codec ------------------------------------------------------------------
class DefaultCodec:
    """The safe msgpack codec as an object with the same methods as :class:`PickleCodec`."""

    name = "msgpack"
    encode_event = staticmethod(encode_event)
    decode_event = staticmethod(decode_event)
    encode_batch = staticmethod(encode_batch)
    decode_batch = staticmethod(decode_batch)


def get_codec(name: str = "msgpack") -> DefaultCodec | PickleCodec:
    """``"msgpack"`` (the default, safe anywhere) or ``"pickle"`` (same host only)."""
    if name in ("msgpack", "default"):
        return DefaultCodec()
    if name == "pickle":
        return PickleCodec()
    raise ConfigurationError(
        f"unknown codec {name!r} (choose 'msgpack', or 'pickle' for same-host runs only)"
    )

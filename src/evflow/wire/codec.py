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

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from evflow.errors import CodecError, ConfigurationError
from evflow.event import DataStore
from evflow.wire._pickle_codec import PickleCodec
from evflow.wire.arrays import (
    array_from_buffer,
    as_bytes_view,
    dtype_str,
    parse_dtype,
)
from evflow.wire.header import (
    CODEC_VERSION,
    INLINE_MAX_BYTES,
    KIND_BATCH,
    KIND_EVENT,
    T_ARRAY,
    T_AWKWARD,
    T_VALUE,
    Frame,
    batch_parts,
    meta_bytes,
    meta_from_bytes,
    packb,
    short,
    unexpected,
    unpack_header,
)
from evflow.wire.raw import (
    join_events,
    pack_frames,
    peek_meta,
    peek_metas,
    peek_metas_at,
    split_batch,
    unpack_frames,
    with_meta,
    with_value,
)

__all__ = [
    "CODEC_VERSION",
    "INLINE_MAX_BYTES",
    "DefaultCodec",
    "Frame",
    "PickleCodec",
    "array_from_buffer",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "encode_event",
    "get_codec",
    "join_events",
    "pack_frames",
    "parse_dtype",
    "peek_meta",
    "peek_metas",
    "peek_metas_at",
    "split_batch",
    "unpack_frames",
    "with_meta",
    "with_value",
]

# An awkward array may declare at most 8 elements per buffer byte (bit-masks) plus this
# slack: zero-width nodes (empty records, size-0 RegularArray) otherwise let a tiny
# message declare a length of 2**40 that later hangs whoever iterates it.
AWKWARD_LENGTH_SLACK = 4096

_PLAIN = frozenset({int, float, str, bytes, bool, type(None), dict, list, tuple})
# Subclasses (IntEnum members, OrderedDict, ...) travel as their base type.
_PLAIN_BASES = (int, float, str, bytes, dict, list, tuple, np.generic)


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


def encode_event(store: DataStore) -> list[Frame]:
    """Encode one event: ``[header, *buffers]``; large buffers are zero-copy views.

    The returned memoryviews keep the store's arrays alive; do not modify those arrays
    until the frames are sent.
    """
    frames: list[Frame] = [b""]
    entries = _encode_objects(store.objects, frames)
    frames[0] = packb((CODEC_VERSION, KIND_EVENT, meta_bytes(store.meta), entries))
    return frames


def encode_batch(stores: Iterable[DataStore]) -> list[Frame]:
    """Encode many events as one message: one header frame + their large buffers."""
    headers: list[bytes] = []
    counts: list[int] = []
    frames: list[Frame] = [b""]
    for store in stores:
        own: list[Frame] = [b""]
        entries = _encode_objects(store.objects, own)
        headers.append(packb((CODEC_VERSION, KIND_EVENT, meta_bytes(store.meta), entries)))
        counts.append(len(own) - 1)
        frames.extend(own[1:])
    frames[0] = packb((CODEC_VERSION, KIND_BATCH, headers, counts))
    return frames


# --- decoding --------------------------------------------------------------------------
def _take(data: Any, frames: Sequence[Any], nxt: int, end: int, first: int) -> Any:
    """The buffer frame that ``data`` (an int) refers to; frames must be used in order."""
    # frame numbers in a header are 1-based within the event and come in order
    if type(data) is not int or data != nxt - first + 1 or nxt >= end:
        raise CodecError(
            f"bad buffer reference {short(data)} in header (expected frame "
            f"{nxt - first + 1} of {end - first})"
        )
    return frames[nxt]


def _decode_body(
    header: list[Any], frames: Sequence[Any], first: int, count: int, writable: bool = False
) -> DataStore:
    if header[1] != KIND_EVENT or len(header) != 4:
        if header[1] == KIND_BATCH:
            raise CodecError("these frames are a batch of events; use decode_batch")
        raise CodecError(f"bad event header: kind {short(header[1])}, {len(header)} fields")
    meta = meta_from_bytes(header[2])
    entries = header[3]
    if type(entries) is not list:
        raise CodecError("bad event header: entries are not a list")
    nxt = first  # index of the next unused buffer frame
    end = first + count
    objects: dict[str, Any] = {}
    for entry in entries:
        if type(entry) is not list or type(entry[0]) is not str:
            raise CodecError(f"bad object entry in header: {short(entry)}")
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
            raise CodecError(f"bad object entry in header: {short(entry)}")
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
            raise CodecError(f"bad awkward buffer entry in {name!r}: {short(item)}")
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
        header = unpack_header(frames)
        return _decode_body(header, frames, 1, len(frames) - 1, writable)
    except CodecError:
        raise
    except Exception as exc:
        raise unexpected("decode_event", exc) from None


def decode_batch(frames: Sequence[Any], *, writable: bool = False) -> list[DataStore]:
    """Decode a batch made by :func:`encode_batch` or :func:`join_events`.

    ``writable`` as for :func:`decode_event`.
    """
    try:
        headers, counts = batch_parts(frames)
        stores = []
        first = 1
        for head, k in zip(headers, counts, strict=True):
            if type(head) is not bytes:
                raise CodecError("bad batch header: an event header is not bytes")
            stores.append(_decode_body(unpack_header((head,)), frames, first, k, writable))
            first += k
        return stores
    except CodecError:
        raise
    except Exception as exc:
        raise unexpected("decode_batch", exc) from None


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

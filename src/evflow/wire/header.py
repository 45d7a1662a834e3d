"""The codec's header format: constants, packing, and validation of untrusted headers.

Private helper of :mod:`evflow.wire.codec` and :mod:`evflow.wire.raw` (the format is
described in the codec's docstring). Every reader here treats its input as hostile and
raises :class:`CodecError`, never another exception.
"""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack

from evflow.errors import CodecError
from evflow.event import EventMeta
from evflow.wire._pickle_codec import PICKLE_MAGIC
from evflow.wire.arrays import ext_default, ext_hook

CODEC_VERSION = 1
KIND_EVENT = 0
KIND_BATCH = 1
T_VALUE, T_ARRAY, T_AWKWARD = 0, 1, 2
# Buffers up to this size are copied into the header; larger ones get a zero-copy frame.
# Below ~16 kB a memcpy costs less than a separate ZeroMQ frame (~1-2 µs each).
INLINE_MAX_BYTES = 16 * 1024
META = struct.Struct("<QqqqQq")
# A version-1 event header starts with fixarray(4), 1, 0, bin8(48): the meta follows.
EVENT_PREFIX = bytes([0x94, CODEC_VERSION, KIND_EVENT, 0xC4, META.size])
META_START = len(EVENT_PREFIX)
META_END = META_START + META.size

Frame = bytes | memoryview
_T = TypeVar("_T")

_local = threading.local()


def packb(obj: Any) -> bytes:
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


def meta_bytes(m: EventMeta) -> bytes:
    try:
        return META.pack(m.uid, m.experiment, m.run, m.event, m.flags, m.attempt)
    except struct.error as exc:
        raise CodecError(
            f"cannot encode event meta {m}: {exc} (uid and flags are unsigned 64-bit, "
            "experiment, run, event and attempt signed 64-bit integers)"
        ) from None


def unpack_header(frames: Sequence[Any]) -> list[Any]:
    if not frames:
        raise CodecError("no frames: an encoded event has at least a header frame")
    head = frames[0]
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=False, ext_hook=ext_hook)
    except CodecError:
        raise
    except Exception as exc:
        if starts_with(head, PICKLE_MAGIC):
            raise CodecError(
                "these frames were encoded by the pickle codec; the default codec never "
                "unpickles (decode with PickleCodec, and only data from this host)"
            ) from None
        raise CodecError(
            f"event header is not valid msgpack: {type(exc).__name__}: {exc}"
        ) from None
    if type(header) is not list or len(header) < 2:
        raise CodecError(f"event header is not a codec header: {short(header)}")
    if header[0] != CODEC_VERSION or type(header[0]) is not int:
        raise CodecError(
            f"unknown codec format version {short(header[0])} (this evflow reads version "
            f"{CODEC_VERSION}); encode and decode with the same evflow version"
        )
    return header


def starts_with(frame: Any, prefix: bytes) -> bool:
    try:
        return bytes(memoryview(frame)[: len(prefix)]) == prefix
    except Exception:
        return False


def unexpected(what: str, exc: Exception) -> CodecError:
    # The decoders check everything they know of; this is the net under those checks,
    # so that nothing but CodecError ever leaves a decoder.
    return CodecError(f"frames do not decode ({what}): {type(exc).__name__}: {exc}")


def guarded(func: Callable[..., _T]) -> Callable[..., _T]:
    @functools.wraps(func)
    def wrapper(*args: Any) -> _T:
        try:
            return func(*args)
        except CodecError:
            raise
        except Exception as exc:
            raise unexpected(func.__name__, exc) from None

    return wrapper


def short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def meta_from_bytes(m: Any) -> EventMeta:
    if type(m) is not bytes or len(m) != META.size:
        raise CodecError(f"bad event meta in header: {short(m)} (expected {META.size} bytes)")
    return EventMeta(*META.unpack(m))


def batch_parts(frames: Sequence[Any]) -> tuple[list[Any], list[int]]:
    header = unpack_header(frames)
    if header[1] != KIND_BATCH or len(header) != 4:
        if header[1] == KIND_EVENT:
            raise CodecError("these frames are a single event, not a batch; use decode_event")
        raise CodecError(f"bad batch header: kind {short(header[1])}, {len(header)} fields")
    headers, counts = header[2], header[3]
    if type(headers) is not list or type(counts) is not list or len(headers) != len(counts):
        raise CodecError("bad batch header: event headers and frame counts do not match")
    total = 0
    for k in counts:
        if type(k) is not int or k < 0:
            raise CodecError(f"bad batch header: frame count {short(k)}")
        total += k
    if total != len(frames) - 1:
        raise CodecError(f"batch header lists {total} buffer frames, message has {len(frames) - 1}")
    return headers, counts

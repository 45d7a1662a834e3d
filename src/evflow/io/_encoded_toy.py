"""``ToyGenerator`` events encoded without building a ``DataStore`` (the fast path).

``encode_event(make_event(k))`` costs ~8 µs for a 1 kB toy event; the header of a toy
event has a fixed layout (see ``evflow.wire.codec``), so it can be assembled from
pre-packed pieces and the few per-event values in ~1-2 µs, with the same bytes.

Each event is ``(uid, experiment, run, frames)``; ``frames`` equal
``encode_event(make_event(k))`` byte for byte. The encoder checks that once per
iterator against the real codec and falls back to it when they differ (a changed
codec never produces different events, only slower ones).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from evflow.wire._arrays import dtype_str
from evflow.wire.codec import CODEC_VERSION, INLINE_MAX_BYTES, encode_event

if TYPE_CHECKING:
    from evflow.io.generators import ToyGenerator

EncodedEvent = tuple[int, int, int, list[Any]]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_META = struct.Struct("<QqqqQq")
_DOUBLE = struct.Struct(">d")  # msgpack float 64 (0xcb + big-endian)
_KIND_EVENT, _T_VALUE, _T_ARRAY = 0, 0, 1
_FIXINT = [bytes((i,)) for i in range(16)]  # msgpack positive fixint 0..15


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _array_header(n: int) -> bytes:
    return _pack([None] * n)[: -n or None] if n else _pack([])


def _bin_header(n: int) -> bytes:
    return _pack(bytes(n))[: len(_pack(bytes(n))) - n]


class ToyEncoder:
    """Pre-packed header pieces of one ``ToyGenerator``'s events."""

    def __init__(self, gen: ToyGenerator, window: int) -> None:
        self.experiment = int(gen.experiment)
        self.run = int(gen.run)
        self.pack_int = msgpack.Packer().pack
        self.window = window
        self.nbytes = int(gen.payload_bytes)
        self.block = memoryview(gen._block).cast("B")
        self.salt = gen._salt
        self.inline = self.nbytes <= INLINE_MAX_BYTES
        dtype = dtype_str(np.dtype(np.uint8))
        payload_head = (
            _array_header(5) + _pack("payload") + _pack(_T_ARRAY) + _pack(dtype)
            + _pack((self.nbytes,))
        )  # fmt: skip
        head = bytes([0x94, CODEC_VERSION, _KIND_EVENT, 0xC4, _META.size])
        self.head = head
        self.entries = _array_header(4) + payload_head
        # inline: a bin with the bytes; else: a reference to buffer frame 1
        self.data = _bin_header(self.nbytes) if self.inline else _pack(1)
        value = _array_header(3)
        self.position = value + _pack("position") + _pack(_T_VALUE)
        self.value = value + _pack("value") + _pack(_T_VALUE) + b"\xcb"
        self.tag = value + _pack("tag") + _pack(_T_VALUE)

    def frames(self, position: int) -> list[Any]:
        """The encoded frames of the event at ``position``."""
        h = ((position + 1) * _GOLDEN ^ self.salt) & _MASK64
        offset = h % self.window
        payload = self.block[offset : offset + self.nbytes]
        parts = [
            self.head,
            _META.pack(position, self.experiment, self.run, position, 0, 1),
            self.entries,
            self.data,
            payload,
            self.position,
            self.pack_int(position),
            self.value,
            _DOUBLE.pack((h >> 11) / 9007199254740992.0),
            self.tag,
            _FIXINT[h & 15],
        ]
        if self.inline:
            return [b"".join(parts)]
        del parts[4]
        return [b"".join(parts), payload]


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(bytes(x) == bytes(y) for x, y in zip(a, b, strict=True))


def encoded_toy_events(gen: ToyGenerator, start: int, window: int) -> Iterator[EncodedEvent]:
    """``(uid, experiment, run, frames)`` of the events from ``start`` on."""
    from evflow.io.generators import burn_cpu

    enc = ToyEncoder(gen, window)
    experiment, run, work_ms = gen.experiment, gen.run, gen.work_ms
    frames = enc.frames
    if start < gen.n_events and not _same(frames(start), encode_event(gen.make_event(start))):
        frames = _slow_frames(gen)  # the codec changed: stay correct, only slower
    for position in range(start, gen.n_events):
        if work_ms > 0:
            burn_cpu(work_ms)
        yield (position, experiment, run, frames(position))


def _slow_frames(gen: ToyGenerator) -> Any:
    make = gen.make_event
    return lambda position: encode_event(make(position))

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
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, overload

import msgpack
import numpy as np

from evflow.io.cpuwork import burn_cpu
from evflow.wire.arrays import dtype_str
from evflow.wire.codec import CODEC_VERSION, INLINE_MAX_BYTES, encode_event


class ToyLike(Protocol):
    """What the encoder reads of a ``evflow.io.generators.ToyGenerator`` (a Protocol,
    so that this module does not import the generator that imports it)."""

    _block: np.ndarray[Any, Any]
    _salt: int

    @property
    def n_events(self) -> int: ...
    @property
    def payload_bytes(self) -> int: ...
    @property
    def work_ms(self) -> float: ...
    @property
    def experiment(self) -> int: ...
    @property
    def run(self) -> int: ...
    def make_event(self, position: int) -> Any: ...


EncodedEvent = tuple[int, int, int, list[Any]]
EncodedBatch = tuple[list[int], int, int, Sequence[list[Any]]]

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

    def __init__(self, gen: ToyLike, window: int) -> None:
        self.experiment = int(gen.experiment)
        self.run = int(gen.run)
        self.pack_int = msgpack.Packer().pack
        self.window = window
        self.nbytes = int(gen.payload_bytes)
        self.block_np = gen._block
        self._pool: list[np.ndarray] = [np.empty(1, dtype=np.uint8)]
        self._free_refs = self._refs(0)  # what a buffer only the pool holds counts
        self._pool.clear()  # chunk buffers, reused once nobody else holds them
        # every window of the block as one item of ``nbytes`` bytes (an overlapping
        # view): a chunk's payloads are one gather, not a copy byte by byte
        block, item = gen._block, max(self.nbytes, 1)
        self.payloads = np.ndarray((max(len(block) - item + 1, 0),), f"V{item}", block, 0, (1,))
        self.block = memoryview(gen._block.data).cast("B")
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

    def _buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes for a chunk: a pooled buffer nothing refers to any more.

        Every view, memoryview or slice of a chunk (the input's batches in its ledger
        until confirmed, the frames a consumer kept) holds a reference to its buffer,
        so a buffer whose only reference is the pool's is free to be overwritten (the
        count a free buffer shows is measured once, on a probe, not assumed).
        Reuse spares the kernel faulting fresh pages in for every chunk (~0.2 page
        faults per 1 kB event in the input). The pool holds at most ``POOL_BUFFERS``.
        """
        pool = self._pool
        too_small = -1
        for i in range(len(pool)):
            if self._refs(i) == self._free_refs:
                buf = pool[i]
                if buf.nbytes >= nbytes:
                    return buf[:nbytes]
                too_small = i
        buf = np.empty(nbytes + nbytes // 8, dtype=np.uint8)  # room for wider ints later
        if len(pool) < POOL_BUFFERS:
            pool.append(buf)
        elif too_small >= 0:
            pool[too_small] = buf
        return buf[:nbytes]

    def _refs(self, i: int) -> int:
        """References to pool buffer ``i`` (the same count for any free one)."""
        buf = self._pool[i]
        return sys.getrefcount(buf)

    def chunk(self, start: int, stop: int) -> Sequence[list[Any]]:
        """The frames of the events ``start .. stop - 1``, built with numpy in one go.

        All positions must have the same msgpack int width (see :func:`_width_stop`).
        The header frames are memoryviews into one array per chunk (~0.5 µs per 1 kB
        event instead of ~2 µs for :meth:`frames`). Inline events (one frame each) come
        as :class:`RowEvents`: the frames are made only when asked, and the input's
        fast path packs a batch from the rows without looking at single events.
        """
        k = stop - start
        pos = np.arange(start, stop, dtype=np.uint64)
        with np.errstate(over="ignore"):  # the hash wraps modulo 2**64, as intended
            h = ((pos + np.uint64(1)) * np.uint64(_GOLDEN)) ^ np.uint64(self.salt)
        offsets = h % np.uint64(self.window)
        meta = np.zeros(k, dtype=_META_DTYPE)
        meta["uid"] = pos
        meta["experiment"] = self.experiment
        meta["run"] = self.run
        meta["event"] = pos
        meta["attempt"] = 1
        inline_n = self.nbytes if self.inline else 0
        pieces: list[Any] = [
            self.head,
            meta.view(np.uint8).reshape(k, _META.size),
            self.entries + self.data,
            inline_n,  # placeholder for the payload columns
            self.position,
            _int_columns(pos, start),
            self.value,
            ((h >> np.uint64(11)).astype(np.float64) / 9007199254740992.0)
            .astype(">f8")
            .view(np.uint8)
            .reshape(k, 8),
            self.tag,
            (h & np.uint64(15)).astype(np.uint8).reshape(k, 1),
        ]
        width = sum(p if type(p) is int else len(p) if type(p) is bytes else p.shape[1]
                    for p in pieces)  # fmt: skip
        rows = self._buffer(k * width).reshape(k, width)
        columns = []  # (first column, width, bytes per row or None for the payload)
        col = 0
        for p in pieces:
            n = p if type(p) is int else len(p) if type(p) is bytes else p.shape[1]
            if type(p) is bytes:
                p = np.frombuffer(p, dtype=np.uint8)
            columns.append((col, n, None if type(p) is int else p))
            col += n
        index = offsets.astype(np.intp)
        # row blocks that stay in the cache while every column is written into them
        for a in range(0, k, FILL_ROWS):
            b = min(k, a + FILL_ROWS)
            for col, n, p in columns:
                if p is None:  # the payload: one p-byte item per event, gathered
                    if n:
                        into = np.ndarray((b - a,), self.payloads.dtype, rows[a:b], col, (width,))
                        into[...] = self.payloads[index[a:b]]
                elif p.ndim == 1:  # the same bytes in every row
                    rows[a:b, col : col + n] = p
                else:
                    rows[a:b, col : col + n] = p[a:b]
        flat = rows.reshape(-1).data
        if self.inline:
            return RowEvents(flat, width, k)
        heads = [flat[a : a + width] for a in range(0, k * width, width)]
        block, size = self.block, self.nbytes
        return [
            [head, block[o : o + size]] for head, o in zip(heads, offsets.tolist(), strict=True)
        ]


class RowEvents(Sequence[list[Any]]):
    """Single-frame events of ``width`` bytes each, back to back in ``buffer``.

    A sequence of frame lists like any chunk (``[memoryview]`` per event, made when
    asked); ``contiguous`` ``(buffer, width)`` lets the input take a run of them as
    one slice (``fastpath.read_encoded``).
    """

    __slots__ = ("_n", "contiguous")

    def __init__(self, buffer: memoryview, width: int, n: int) -> None:
        self.contiguous = (buffer, width)
        self._n = n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> list[Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[list[Any]]: ...
    def __getitem__(self, i: int | slice) -> list[Any] | list[list[Any]]:
        buffer, width = self.contiguous
        if isinstance(i, slice):
            return [[buffer[a * width : (a + 1) * width]] for a in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(f"event {i} of a chunk of {self._n}")
        i %= self._n
        return [buffer[i * width : (i + 1) * width]]


_META_DTYPE = np.dtype(
    [("uid", "<u8"), ("experiment", "<i8"), ("run", "<i8"), ("event", "<i8"),
     ("flags", "<u8"), ("attempt", "<i8")]
)  # fmt: skip
#: msgpack encodes a non-negative int in 1 byte below 128, then 0xcc/0xcd/0xce/0xcf + 1/2/4/8
_WIDTHS = ((128, None, ""), (256, 0xCC, ">u1"), (1 << 16, 0xCD, ">u2"),
           (1 << 32, 0xCE, ">u4"), (1 << 64, 0xCF, ">u8"))  # fmt: skip


def _width_stop(position: int) -> int:
    """The first position above ``position`` whose msgpack int has another width."""
    for bound, _, _ in _WIDTHS:
        if position < bound:
            return bound
    raise ValueError(f"position {position} does not fit in 64 bits")


def _int_columns(pos: np.ndarray, first: int) -> np.ndarray:
    """The msgpack encodings of ``pos`` (all of the width of ``first``) as byte rows."""
    k = len(pos)
    for bound, marker, dtype in _WIDTHS:
        if first < bound:
            if marker is None:
                return pos.astype(np.uint8).reshape(k, 1)
            body = pos.astype(dtype).view(np.uint8).reshape(k, -1)
            return np.concatenate([np.full((k, 1), marker, dtype=np.uint8), body], axis=1)
    raise ValueError(f"position {first} does not fit in 64 bits")


#: chunk buffers a ToyEncoder keeps for reuse (at 1 kB, 4096 events: ~4.6 MB each)
POOL_BUFFERS = 16
#: events built per numpy chunk
CHUNK_EVENTS = 256
#: rows of a chunk filled at a time (~300 kB at 1 kB: they stay in the cache)
FILL_ROWS = 256
#: ... when the source burns no CPU per event: larger chunks hold most of the input's
#: batches whole (a batch then goes out as a slice of one chunk, not joined), up to
#: ``CHUNK_BYTES`` of rows (16 kB inline events: 288 a chunk, not 64 MB of them)
CHUNK_EVENTS_FREE = 4096
CHUNK_BYTES = 4096 * 1160


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(bytes(x) == bytes(y) for x, y in zip(a, b, strict=True))


def encoded_toy_batches(
    gen: ToyLike, start: int, window: int, burn: bool = True
) -> Iterator[EncodedBatch]:
    """``(uids, experiment, run, frames)`` of up to ``CHUNK_EVENTS`` events at a time
    (``CHUNK_EVENTS_FREE`` when the source burns no CPU).

    ``burn=False`` leaves the source's ``work_ms`` to the caller.
    """
    enc = ToyEncoder(gen, window)
    experiment, run, work_ms, n_events = gen.experiment, gen.run, gen.work_ms, gen.n_events
    if start >= n_events:
        return
    reference = encode_event(gen.make_event(start))
    chunk: Callable[[int, int], Sequence[list[Any]]] = enc.chunk
    if not _same(chunk(start, start + 1)[0], reference) or not _same(enc.frames(start), reference):
        slow = _slow_frames(gen)  # the codec changed: stay correct, only slower

        def slow_chunk(first: int, stop: int) -> Sequence[list[Any]]:
            return [slow(p) for p in range(first, stop)]

        chunk = slow_chunk

    row_b = 160 + (enc.nbytes if enc.inline else 0)  # a row's header bytes (+ payload)
    size = CHUNK_EVENTS if work_ms > 0 else min(CHUNK_EVENTS_FREE, CHUNK_BYTES // row_b)
    size = max(size, CHUNK_EVENTS)
    position = start
    while position < n_events:
        stop = min(n_events, position + size, _width_stop(position))
        if burn and work_ms > 0:
            burn_cpu(work_ms * (stop - position))
        yield (list(range(position, stop)), experiment, run, chunk(position, stop))
        position = stop


def encoded_toy_events(gen: ToyLike, start: int, window: int) -> Iterator[EncodedEvent]:
    """``(uid, experiment, run, frames)`` of the events from ``start`` on."""
    work_ms = gen.work_ms
    for uids, experiment, run, frames in encoded_toy_batches(gen, start, window, burn=False):
        for uid, event_frames in zip(uids, frames, strict=True):
            if work_ms > 0:
                burn_cpu(work_ms)
            yield (uid, experiment, run, event_frames)


def _slow_frames(gen: ToyLike) -> Any:
    make = gen.make_event
    return lambda position: encode_event(make(position))

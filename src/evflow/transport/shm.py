"""Shared-memory transport: event bytes in a shared arena, only their place over ZeroMQ.

One writer (the input of a parallel run) owns a :class:`ShmArena`, a file in
``/dev/shm`` named after the session and the writer's pid. :meth:`ShmArena.place`
copies a batch of events into it once and returns a :class:`ShmBatch`, whose
:attr:`~ShmBatch.where` goes into the message header in place of the payload frames
(``x`` segment name, ``xo`` offsets, ``xl`` lengths). Readers (workers, the output)
map the segment read-only on first use (:class:`ShmViews`) and get memoryviews: the
bytes cross no socket and are not copied again.

Lifetime. An :class:`Extent` returns its bytes to the arena's free list when its last
reference goes (CPython frees at refcount zero, so at a known moment). The writer's
ledger holds a batch, hence its extent, until the output has confirmed every event of
it written. A message can still outlive its extent: an event re-sent after a worker
died is confirmed from the dead worker's result, which arrived after all, while the
re-send waits in another worker's queue. So every extent starts with a generation
number, written when it is allocated and zeroed when it is freed, and a message
carries it (``xh`` where, ``xg`` what): a reader checks it before and after using the
bytes (:meth:`ShmViews.current`) and drops a message whose extent was freed, whose
events are all confirmed by then. A restarted writer makes a new segment (its own pid), so
nothing writes into the segment of a dead one; the run removes every segment of its
session when it ends (``remove_session_files``), and the next run removes those of a
run killed with ``kill -9``.

Space is reserved with ``posix_fallocate`` as the arena fills, in steps of
``RESERVE_STEP_B``: a sparse file on a full tmpfs would kill the writer with SIGBUS
on first touch instead of failing cleanly. A batch that does not fit (arena full,
tmpfs full) gets ``None`` and travels over ZeroMQ as before.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from evflow.errors import ConfigurationError, PeerLostError
from evflow.transport.freelist import FreeList
from evflow.transport.paths import SHM_PREFIX

__all__ = ["Extent", "ShmArena", "ShmBatch", "ShmEvent", "ShmViews", "segment_prefix"]

SHM_DIR = "/dev/shm"
#: every frame starts on a cache line
ALIGN_B = 64
#: the arena reserves tmpfs space in steps of this many bytes
RESERVE_STEP_B = 16 * 1024 * 1024
#: readers keep at most this many segments mapped (one per input incarnation)
MAX_MAPPED = 4
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def segment_prefix(session: str) -> str:
    """Names of ``session``'s segments start with this (and ``remove_session_files``
    removes every file in ``/dev/shm`` that does)."""
    return f"{SHM_PREFIX}{session}-"


def _nbytes(frame: Any) -> int:
    return len(frame) if isinstance(frame, bytes) else memoryview(frame).nbytes


class Extent:
    """``size`` bytes at ``offset`` of an arena, given back when this object dies.

    Its first ``ALIGN_B`` bytes hold its generation ``gen`` (u64); data follows.
    """

    __slots__ = ("_arena", "gen", "offset", "size")

    def __init__(self, arena: ShmArena, offset: int, size: int, gen: int) -> None:
        self._arena: ShmArena | None = arena
        self.offset = offset
        self.size = size
        self.gen = gen

    def __del__(self) -> None:
        arena, self._arena = self._arena, None
        if arena is not None:
            arena._give(self.offset, self.size)


class ShmEvent(list[memoryview]):
    """One event's frames as views into the arena; keeps its extent alive."""

    __slots__ = ("extent", "lengths", "offsets")

    extent: Extent
    offsets: list[int]
    lengths: list[int]


class ShmBatch(Sequence[ShmEvent]):
    """The events of one message, placed in the arena."""

    __slots__ = ("_events", "arena", "where")

    def __init__(self, arena: ShmArena, events: list[ShmEvent]) -> None:
        self.arena = arena
        self._events = events
        offsets = [o for e in events for o in e.offsets]
        lengths = [n for e in events for n in e.lengths]
        extent = events[0].extent  # one per message (place() makes sure)
        #: the header keys that tell a reader where the frames are
        self.where: dict[str, Any] = {
            "x": arena.name,
            "xo": np.array(offsets, dtype=np.uint64).tobytes(),
            "xl": np.array(lengths, dtype=np.uint32).tobytes(),
            "xh": extent.offset,
            "xg": extent.gen,
        }

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, i: int) -> ShmEvent:  # type: ignore[override]
        return self._events[i]

    def __iter__(self) -> Iterator[ShmEvent]:
        return iter(self._events)


class ShmArena:
    """The writer's segment: first-fit allocation of extents, copies in, views out."""

    def __init__(self, session: str, size_b: int, role: str = "input") -> None:
        if size_b < RESERVE_STEP_B:
            raise ConfigurationError(
                f"shared-memory arena of {size_b} bytes is too small "
                f"(at least {RESERVE_STEP_B // 2**20} MB)"
            )
        self.name = f"{segment_prefix(session)}{role}-{os.getpid()}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.size_b = size_b
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot create the shared-memory segment {self.path}: {exc.strerror}"
            ) from exc
        try:
            os.ftruncate(fd, size_b)
            self._mm = mmap.mmap(fd, size_b)
        except OSError as exc:
            os.close(fd)
            os.unlink(self.path)
            raise ConfigurationError(f"cannot map {self.path}: {exc.strerror}") from exc
        self._fd = fd
        self._view = memoryview(self._mm)
        self._gens = np.frombuffer(self._mm, dtype=np.uint64)  # extent headers
        self._next_gen = 1
        self._reserved_b = 0  # bytes backed by tmpfs pages (posix_fallocate)
        self._free = FreeList(0, size_b)
        self.used_b = 0
        self.full = 0  # batches that did not fit (sent over ZeroMQ instead)
        self.events = 0  # events copied in (a re-send is not counted again)

    # --- allocation ---------------------------------------------------------------------
    def _take(self, size: int) -> int | None:
        return self._free.take(size)

    def _give(self, offset: int, size: int) -> None:
        if self._view is None:
            return  # closed: nothing to give back to
        self._gens[offset // 8] = 0  # a reader holding a message for it sees it is gone
        self.used_b -= size
        self._free.give(offset, size)

    def _reserve(self, end: int) -> bool:
        if end <= self._reserved_b:
            return True
        new_end = min(self.size_b, -(-end // RESERVE_STEP_B) * RESERVE_STEP_B)
        try:
            os.posix_fallocate(self._fd, self._reserved_b, new_end - self._reserved_b)
        except OSError:
            return False  # tmpfs full: this batch goes over ZeroMQ
        self._reserved_b = new_end
        return True

    def allocate(self, size: int) -> Extent | None:
        """An extent with room for ``size`` bytes of data, or None when the arena is full."""
        size = ALIGN_B + max(ALIGN_B, -(-size // ALIGN_B) * ALIGN_B)  # + its header
        offset = self._take(size)
        if offset is None:
            return None
        self.used_b += size
        if not self._reserve(offset + size):
            self._give(offset, size)
            return None
        gen = self._next_gen
        self._next_gen += 1
        self._gens[offset // 8] = gen
        return Extent(self, offset, size, gen)

    # --- placing events -------------------------------------------------------------------
    def place(self, events: Sequence[Sequence[Any]]) -> ShmBatch | None:
        """``events`` (each a list of frames) copied into one extent; None if full.

        Events already in this arena (a re-send) keep their place: no copy.
        """
        first = events[0]
        if type(first) is ShmEvent and all(
            type(e) is ShmEvent and e.extent is first.extent for e in events
        ):
            return ShmBatch(self, list(events))  # type: ignore[arg-type]
        lengths = [[_nbytes(f) for f in frames] for frames in events]
        padded = sum(-(-n // ALIGN_B) * ALIGN_B for ls in lengths for n in ls)
        extent = self.allocate(padded)
        if extent is None:
            self.full += 1
            return None
        view = self._view
        at = extent.offset + ALIGN_B  # after the generation
        placed = []
        for frames, lens in zip(events, lengths, strict=True):
            event = ShmEvent()
            event.extent, event.offsets, event.lengths = extent, [], lens
            for frame, n in zip(frames, lens, strict=True):
                view[at : at + n] = memoryview(frame).cast("B")
                event.append(view[at : at + n])
                event.offsets.append(at)
                at += -(-n // ALIGN_B) * ALIGN_B
            placed.append(event)
        self.events += len(placed)
        return ShmBatch(self, placed)

    def close(self) -> None:
        """Unmap and remove the segment (readers that mapped it keep their mapping)."""
        if self._view is None:
            return
        view, self._view = self._view, None  # type: ignore[assignment]
        view.release()
        del self._gens
        with contextlib.suppress(BufferError):  # views still held: unmapped when they go
            self._mm.close()
        os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ShmViews:
    """A reader's mapped segments of one session, read-only, mapped on first use."""

    def __init__(self, session: str) -> None:
        self.prefix = segment_prefix(session)
        self._maps: OrderedDict[str, memoryview] = OrderedDict()
        self._gens: dict[str, np.ndarray] = {}  # each mapping as u64 words

    def frames(self, header: dict[str, Any]) -> list[memoryview]:
        """The frames a header's ``x``/``xo``/``xl`` point at (ValueError if bad)."""
        view = self._segment(header["x"])
        offsets = np.frombuffer(header["xo"], dtype=np.uint64)
        lengths = np.frombuffer(header["xl"], dtype=np.uint32)
        if len(offsets) != len(lengths):
            raise ValueError(f"{len(offsets)} shared-memory offsets for {len(lengths)} lengths")
        if len(offsets) and int((offsets + lengths).max()) > len(view):
            raise ValueError(f"a frame lies beyond the end of segment {header['x']}")
        return [view[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)]

    def current(self, header: dict[str, Any]) -> bool:
        """False once the extent of a message has been freed (its events are confirmed).

        Check before using the bytes and again after: an extent freed and reused in
        between shows a different generation.
        """
        self._segment(header["x"])
        gens = self._gens[header["x"]]
        at = header["xh"]
        if type(at) is not int or at % 8 or not 0 <= at < 8 * len(gens):
            raise ValueError(f"invalid shared-memory extent offset {at!r}")
        return bool(gens[at // 8] == header["xg"])

    def _segment(self, name: Any) -> memoryview:
        view = self._maps.get(name)
        if view is not None:
            return view
        # the name came over a socket: only this session's segments, no path tricks
        if not isinstance(name, str) or not name.startswith(self.prefix):
            raise ValueError(f"shared-memory segment {name!r} is not of this run")
        if not _NAME.fullmatch(name):
            raise ValueError(f"invalid shared-memory segment name {name!r}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        except FileNotFoundError as exc:
            # the run removes its segments only when it ends: someone else did it
            raise PeerLostError(
                f"shared-memory segment /dev/shm/{name} was removed while the run used it"
            ) from exc
        except OSError as exc:
            raise ValueError(f"cannot open shared-memory segment {name}: {exc.strerror}") from exc
        try:
            view = memoryview(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
        finally:
            os.close(fd)
        self._maps[name] = view
        self._gens[name] = np.frombuffer(view, dtype=np.uint64)
        while len(self._maps) > MAX_MAPPED:  # an old input's segment: unmapped when unused
            old, _ = self._maps.popitem(last=False)
            del self._gens[old]
        return view

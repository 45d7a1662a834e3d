"""The shared-memory region of a ``transport = "shm"`` device channel.

A sending channel owns one region,
``/dev/shm/evflow-dc-<pid>-<session>-<channel>-<nonce>`` (``shmSize`` bytes, reserved
with ``posix_fallocate`` up front: a full tmpfs is an error at start, never a SIGBUS
later). The sender carves *chunks* out of it (first
fit, :mod:`evflow.transport.freelist`, as the path engine's arena); the receiver maps it
and reads the chunks in place. Layout, all words u64 little-endian::

    0     magic, file size, version, release-queue write count (receiver),
          release-queue read count (sender), highest send sequence claimed (receiver),
          pid of a second receiver that was refused (that receiver), highest send
          sequence given out (sender)
    4096  release queue: QUEUE_N chunk offsets written by the receiver
    DATA  chunks: a 64-byte header (generation, state, length, holder pid, send
          sequence) and the data, 64-byte aligned

A chunk's state moves FILLING (sender) -> SENT (sender) -> HELD (receiver, its pid in
the header) -> RELEASED (receiver, and its offset appended to the release queue) ->
free (sender). Each transition is written by one side only, so no atomics are needed.
The sender takes a chunk back only when it is RELEASED, or HELD by a process that no
longer exists, or SENT before a later message the receiver got (one FIFO pipe: that
message was lost with a dead receiver): a chunk a live receiver holds is never reused.

Send sequence: one counter per sender numbers its chunks (in the chunk's header) and
its ZeroMQ messages (in their markers, after the chunks they carry), including those
with no chunk (copied over ZeroMQ because the region was full, or all inline). The
receiver that holds the region's lock raises "claimed" to the sequence of each
message it gets. Were only chunks counted, chunks lost with a killed receiver that
fill the whole region would never be taken back: every later message is a copy, no
later chunk is ever claimed, and the channel would stay in copy mode. A marker's
sequence comes from a socket: the receiver refuses one above "given out", so a forged
one cannot make the sender take back chunks it has not sent yet.

One receiver per region: the receiver holds an exclusive ``flock`` on the region's
file while it maps it (the kernel drops it when the process dies, so a receiver started
after a ``kill -9`` takes over). A second receiver (two PULL peers of one PUSH) gets
:class:`SecondReceiverError` for every message naming the region, and writes its pid
in the header; the sender's next ``send`` then raises a ConfigurationError.

Cleanup: the sender removes its region when the channel closes; a region whose owner
died (``kill -9``) is removed by the next region made or mapped on this host (the
owner's pid is in the name, ``/proc/<pid>`` tells if it lives). Mappings stay valid
after the file is removed: the pages go when the last view of them goes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import threading
from typing import Any

import numpy as np

from evflow.errors import ConfigurationError, ProtocolError
from evflow.transport.freelist import FreeList

__all__ = [
    "ALIGN_B",
    "DATA_OFF",
    "RING_PREFIX",
    "RegionReader",
    "SecondReceiverError",
    "ShmRegion",
    "Slot",
    "ring_name",
    "sweep_stale_rings",
]

log = logging.getLogger("evflow.transport")

SHM_DIR = "/dev/shm"
RING_PREFIX = "evflow-dc-"
MAGIC = 0x31305243_44465645  # "EVFDCR01"
VERSION = 4  # 4: the "given out" word (send sequences of messages without chunks)
ALIGN_B = 64
QUEUE_OFF = 4096
QUEUE_N = 8192
DATA_OFF = QUEUE_OFF + 8 * QUEUE_N
# header words
_W_MAGIC, _W_SIZE, _W_VERSION, _W_RQ_W, _W_RQ_R, _W_CLAIMED, _W_REFUSED, _W_GIVEN = range(8)
# chunk header words (relative to the chunk's first word)
_C_GEN, _C_STATE, _C_LEN, _C_HOLDER, _C_SEQ = range(5)
FREE, FILLING, SENT, HELD, RELEASED = range(5)
#: no MAP_POPULATE: filling the page tables of a 512 MB region took 0.3 s here; pages
#: are faulted in once on first use and stay mapped as chunks are reused (first fit)
_MAP_FLAGS = mmap.MAP_SHARED
#: a receiver's claims and releases: one at a time in this process (a release may come
#: from any thread, by garbage collection; two mappings of one region share the queue)
#: (re-entrant: a garbage collection inside a claim may release another chunk)
_RECEIVER_LOCK = threading.RLock()
_NAME = re.compile(r"evflow-dc-(\d+)-[A-Za-z0-9_.-]+")


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def ring_name(session: str, label: str, pid: int | None = None) -> str:
    return f"{RING_PREFIX}{pid or os.getpid()}-{_safe(session)}-{_safe(label)}"


def _alive(pid: int) -> bool:
    return pid > 0 and os.path.exists(f"/proc/{pid}")


def sweep_stale_rings() -> list[str]:
    """Remove the regions of processes that no longer exist; return their names."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(SHM_DIR):
            m = _NAME.fullmatch(name)
            if m is None or _alive(int(m.group(1))):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    if removed:
        log.info("removed shared-memory rings of dead processes: %s", ", ".join(removed))
    return removed


class Slot:
    """One chunk's data, exported to numpy; its owner is told when the last view goes.

    Every view handed out (``np.asarray(slot)``, a memoryview of that) keeps the slot
    alive through the array's ``base``, so the chunk cannot be reused while any view of
    it exists; CPython frees at refcount zero, so that happens at a known moment.
    """

    __slots__ = ("_keep", "_owner", "gen", "nbytes", "offset", "readonly", "sent")

    def __init__(
        self, owner: ShmRegion | _Mapping, offset: int, nbytes: int, gen: int, readonly: bool
    ) -> None:
        self._owner: ShmRegion | _Mapping | None = owner
        self._keep = owner.keep  # the mapping stays while this slot lives (views point in it)
        self.offset = offset
        self.nbytes = nbytes
        self.gen = gen
        self.readonly = readonly
        self.sent = False

    @property
    def __array_interface__(self) -> dict[str, Any]:
        owner = self._owner
        if owner is None:
            raise ValueError("shared-memory slot already given back")
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (owner.address + self.offset + ALIGN_B, self.readonly),
            "version": 3,
        }

    def __del__(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            with contextlib.suppress(Exception):  # e.g. at interpreter exit
                owner.slot_gone(self)


class SecondReceiverError(ProtocolError):
    """A receiver got descriptors of a region that another live receiver consumes."""


class ShmRegion:
    """The sender's region: allocates chunks, takes them back when released."""

    def __init__(self, session: str, label: str, size_b: int) -> None:
        if size_b < 1 << 20:
            raise ConfigurationError(f"shmSize of {size_b} bytes is too small (at least 1 MB)")
        size_b -= size_b % 4096  # whole pages
        sweep_stale_rings()
        # a new name per region: a receiver that mapped an earlier region of this
        # channel (reopened after a reset, or a reused pid) never takes one for the other
        self.name = f"{ring_name(session, label)}-{os.urandom(4).hex()}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.size_b = size_b
        # made under a hidden name and renamed once mapped: a sweeper that removes
        # unmapped evflow segments (test fixtures do) never sees it half made
        tmp = os.path.join(SHM_DIR, f".{self.name}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size_b)
            os.posix_fallocate(fd, 0, size_b)  # a full tmpfs fails here, not with SIGBUS
            mm = mmap.mmap(fd, size_b, flags=_MAP_FLAGS)
            os.rename(tmp, self.path)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise ConfigurationError(
                f"cannot make the shared-memory ring {self.path} ({size_b} bytes): {exc.strerror}"
            ) from exc
        os.close(fd)
        self.keep: np.ndarray = np.frombuffer(mm, np.uint8)
        self._w = memoryview(mm).cast("Q")  # u64 words (faster to index than numpy)
        self.address: int = self.keep.__array_interface__["data"][0]
        self._w[_W_SIZE] = size_b
        self._w[_W_VERSION] = VERSION
        self._w[_W_MAGIC] = MAGIC
        self._free = FreeList(DATA_OFF, size_b - DATA_OFF)
        self._live: dict[int, int] = {}  # chunk offset -> chunk size (not free)
        self._next_gen = 1
        self._next_seq = 1
        self.closed = False
        self.allocated = 0
        self.full = 0  # allocations that did not fit
        self.reclaimed_dead = 0  # chunks taken back from a dead or lost receiver
        # the free list changes on allocation and when an unsent buffer dies, which may
        # happen in any thread or inside a garbage collection: one at a time
        self._lock = threading.RLock()

    # --- allocation -------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Slot | None:
        """A chunk for ``nbytes`` of data, state FILLING; None when the region is full."""
        with self._lock:
            return self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> Slot | None:
        size = ALIGN_B + max(ALIGN_B, -(-nbytes // ALIGN_B) * ALIGN_B)
        if self.closed or size > self.size_b - DATA_OFF:
            self.full += 1
            return None
        self._drain()
        offset = self._free.take(size)
        if offset is None:
            self._scan()
            offset = self._free.take(size)
            if offset is None:
                self.full += 1
                return None
        gen = self._next_gen
        self._next_gen += 1
        w, at = self._w, offset // 8
        w[at + _C_GEN] = gen
        w[at + _C_LEN] = nbytes
        w[at + _C_HOLDER] = 0
        w[at + _C_STATE] = FILLING
        self._live[offset] = size
        self.allocated += 1
        return Slot(self, offset, nbytes, gen, False)

    def mark_sent(self, slot: Slot) -> None:
        """The chunk's descriptor goes out now: it belongs to the receiver."""
        at = slot.offset // 8
        self._w[at + _C_SEQ] = self._next_seq
        self._next_seq += 1
        self._w[at + _C_STATE] = SENT
        slot.sent = True

    def stamp(self) -> int:
        """The send sequence of the ZeroMQ message going out now (after its chunks'),
        published as "given out" first: a receiver refuses a higher one as forged."""
        seq = self._next_seq
        self._next_seq += 1
        self._w[_W_GIVEN] = seq
        return seq

    def unsend(self, slot: Slot) -> None:
        """The send failed (e.g. ``zmq.Again``): the chunk is the sender's again."""
        self._w[slot.offset // 8 + _C_STATE] = FILLING
        slot.sent = False

    def slot_gone(self, slot: Slot) -> None:
        if not slot.sent and not self.closed:  # never sent: ours to take back
            with self._lock:
                self._give(slot.offset)

    def _give(self, offset: int) -> None:
        size = self._live.pop(offset, None)
        if size is None:
            return
        w, at = self._w, offset // 8
        w[at + _C_STATE] = FREE
        w[at + _C_GEN] = 0
        self._free.give(offset, size)

    def _drain(self) -> None:
        """Take back the chunks the receiver listed in the release queue."""
        w = self._w
        r, end = int(w[_W_RQ_R]), int(w[_W_RQ_W])
        if r == end:
            return
        if end - r > QUEUE_N:  # a corrupt counter: trust only the states (_scan)
            r = end - QUEUE_N
        base = QUEUE_OFF // 8
        live = self._live
        while r < end:
            offset = int(w[base + r % QUEUE_N])
            if offset in live and w[offset // 8 + _C_STATE] == RELEASED:
                self._give(offset)
            r += 1
        w[_W_RQ_R] = end

    def _scan(self) -> None:
        """Full: look at every chunk out; take back the released and the lost ones."""
        w = self._w
        claimed = int(w[_W_CLAIMED])
        dead: dict[int, bool] = {}
        for offset in list(self._live):
            at = offset // 8
            state = w[at + _C_STATE]
            if state == RELEASED:
                self._give(offset)
            elif state == HELD:
                pid = int(w[at + _C_HOLDER])
                if pid not in dead:
                    dead[pid] = not _alive(pid)
                if dead[pid]:
                    self.reclaimed_dead += 1
                    self._give(offset)
            elif state == SENT and w[at + _C_SEQ] < claimed:
                self.reclaimed_dead += 1  # sent before what the receiver got since
                self._give(offset)

    def reclaim(self) -> None:
        """Take back now what would be taken back when full: released chunks, and
        those of a dead receiver or lost with it."""
        with self._lock:
            if not self.closed:
                self._drain()
                self._scan()

    def refused_receiver(self) -> int:
        """The pid of a second receiver that was refused this region's chunks, or 0."""
        return 0 if self.closed else int(self._w[_W_REFUSED])

    def in_use(self) -> int:
        """Chunks not free (filling, sent, held, or released but not yet taken back)."""
        with self._lock:
            if not self.closed:
                self._drain()
            return len(self._live)

    def close(self) -> None:
        """Remove the file and unmap it (at once, or when the last slot of it goes)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._w.release()
        del self.keep  # unsent buffers keep their own reference


class _Mapping:
    """A receiver's mapping of one region."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self.size_b = len(mm)
        self.keep: np.ndarray = np.frombuffer(mm, np.uint8)
        self.w = memoryview(mm).cast("Q")
        self.address: int = self.keep.__array_interface__["data"][0]
        self.lock = _RECEIVER_LOCK
        self.pid = os.getpid()
        self.lock_fd = -1  # holds the region's flock: we are its receiver

    def slot_gone(self, slot: Slot) -> None:
        w, at = self.w, slot.offset // 8
        with self.lock:
            if w[at + _C_GEN] != slot.gen or w[at + _C_STATE] != HELD:
                return  # taken back already (we were thought dead): not ours now
            w[at + _C_STATE] = RELEASED
            n = int(w[_W_RQ_W])
            if n - int(w[_W_RQ_R]) < QUEUE_N:  # else the sender finds it by its state
                w[QUEUE_OFF // 8 + n % QUEUE_N] = slot.offset
                w[_W_RQ_W] = n + 1

    def take_receiver_lock(self) -> bool:
        """True if we are (or now become) the region's one receiver."""
        if self.lock_fd >= 0:
            return True
        try:
            fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDONLY)
        except OSError:
            return False  # removed: its sender closed it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.lock_fd = fd
        return True

    def forget(self) -> None:
        """Give up the receiver's lock (the mapping stays while slots of it live)."""
        fd, self.lock_fd = self.lock_fd, -1
        if fd >= 0:
            os.close(fd)


class RegionReader:
    """The receiver's side: maps regions named in descriptors, checks and claims chunks."""

    def __init__(self, session: str) -> None:
        sweep_stale_rings()
        self.session = _safe(session)
        self._maps: dict[str, _Mapping] = {}

    def _mapping(self, name: Any, missing_ok: bool = False) -> _Mapping | None:
        """The mapping of region ``name`` (mapped now if new); None if ``missing_ok``
        and there is no such file (its sender closed it)."""
        mapping = self._maps.get(name)
        if mapping is not None:
            return mapping
        m = _NAME.fullmatch(name) if isinstance(name, str) else None
        if m is None or f"-{self.session}-" not in name:
            raise ProtocolError(f"shared-memory ring {name!r} is not one of this session")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise ProtocolError(f"cannot open shared-memory ring {name}: no such file") from None
        except OSError as exc:
            raise ProtocolError(f"cannot open shared-memory ring {name}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < DATA_OFF + 2 * ALIGN_B or size % 4096:
                raise ProtocolError(f"shared-memory ring {name} has a bad size ({size} bytes)")
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        mapping = _Mapping(name, mm)
        w = mapping.w
        if w[_W_MAGIC] != MAGIC or w[_W_VERSION] != VERSION or w[_W_SIZE] != size:
            raise ProtocolError(f"shared-memory ring {name} has a bad header")
        for old in [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]:
            self._maps.pop(old).forget()  # its sender closed it: unmapped when unused
        if len(self._maps) >= 16:  # senders come and go: forget the oldest
            self._maps.pop(next(iter(self._maps))).forget()
        self._maps[name] = mapping
        return mapping

    def claim_all(self, name: Any, descs: list[tuple[Any, Any, Any]], seq: int) -> list[Slot]:
        """The chunks ``(offset, length, generation)`` of region ``name``, now HELD by
        us, sent in a message of send sequence ``seq``; all or none: ProtocolError (and
        nothing written) if any is not valid."""
        for offset, nbytes, gen in descs:
            if not (
                type(offset) is int
                and type(nbytes) is int
                and type(gen) is int
                and offset >= 0
                and nbytes >= 0
                and gen > 0
            ):
                raise ProtocolError("bad shared-memory descriptor: offset, length, generation")
        mapping = self._mapping(name)
        assert mapping is not None  # not missing_ok: raised instead
        size_b = mapping.size_b
        for offset, nbytes, _ in descs:
            if offset % ALIGN_B or offset < DATA_OFF or offset + ALIGN_B + nbytes > size_b:
                raise ProtocolError(
                    f"no shared-memory chunk can be at {offset} (+{nbytes}) in {name}"
                )
        if len(descs) > 1 and len({d[0] for d in descs}) != len(descs):
            raise ProtocolError(f"shared-memory descriptors name a chunk of {name} twice")
        w = mapping.w
        with mapping.lock:
            top = 0  # the latest of the chunks' sequences
            for offset, nbytes, gen in descs:
                at = offset // 8
                if w[at + _C_GEN] != gen or w[at + _C_LEN] != nbytes:
                    raise ProtocolError(
                        f"shared-memory chunk at {offset} of {name}: stale or forged"
                    )
                if w[at + _C_STATE] != SENT:
                    raise ProtocolError(
                        f"shared-memory chunk at {offset} of {name}: not sent to us"
                    )
                top = max(top, w[at + _C_SEQ])
            # the sender numbers a message after its chunks, and publishes it before
            # sending: anything else is not what it sent
            if not top < seq <= w[_W_GIVEN]:
                raise ProtocolError(
                    f"shared-memory marker of {name}: send sequence {seq} is forged"
                )
            if not mapping.take_receiver_lock():
                # genuine descriptors (checked above) of a region another receiver has:
                # tell the sender, which raises, and refuse them
                w[_W_REFUSED] = mapping.pid
                raise SecondReceiverError(
                    f"shared-memory ring {name} has another receiver: a shm channel has "
                    f"one receiver per sender (this one, pid {mapping.pid}, is refused)"
                )
            pid = mapping.pid
            for offset, _, _ in descs:
                at = offset // 8
                w[at + _C_HOLDER] = pid
                w[at + _C_STATE] = HELD
            if seq > w[_W_CLAIMED]:  # after the HELD states: its chunks are never lost ones
                w[_W_CLAIMED] = seq
        return [Slot(mapping, offset, nbytes, gen, True) for offset, nbytes, gen in descs]

    def passed(self, name: Any, seq: int) -> None:
        """A message of send sequence ``seq`` with no chunk in region ``name`` came (a
        copy over ZeroMQ, or all inline): messages before it that did not come to us
        were lost, so their chunks may be taken back (ProtocolError if ``seq`` is
        forged). A second receiver of the region gets the message but changes nothing;
        nor does a message whose region is gone."""
        mapping = self._mapping(name, missing_ok=True)
        if mapping is None:
            return  # its sender closed the region: nothing left to take back
        w = mapping.w
        with mapping.lock:
            if seq > w[_W_GIVEN]:
                raise ProtocolError(
                    f"shared-memory marker of {name}: send sequence {seq} is forged"
                )
            if seq > w[_W_CLAIMED] and mapping.take_receiver_lock():
                w[_W_CLAIMED] = seq

    def close(self) -> None:
        """Forget the mappings; each is unmapped when its last slot goes."""
        for mapping in self._maps.values():
            mapping.forget()
        self._maps.clear()

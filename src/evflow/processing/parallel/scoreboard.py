"""A shared-memory scoreboard: which event each worker slot is processing right now.

Exact blame (Apache-style scoreboard). The parent creates an anonymous shared mapping
(``mmap.mmap(-1, size)``: MAP_SHARED, no file, nothing under /dev/shm to clean up)
*before* the zygote forks, so the zygote, every worker it forks, the input and the
output all share the same pages. Each worker slot (``worker-3``, ``worker-3.1``, ...:
index 3) owns one fixed-size slot. A worker writes the uid (and batch id) of the
event it is about to give to the modules into its slot and clears the slot after
(one ``struct.pack_into`` each, well under a microsecond). When a worker dies the
parent reads its slot: ``BUSY`` names the one event it died on (charged an attempt),
``IDLE`` means it died between events (nobody is charged), ``UNKNOWN`` (a torn or
never-written slot) lets the ledger fall back to its READY-based guess.

A slot is ``state, uid, batch, check`` (little-endian u64 each); ``check`` ties the
other three together, so a write torn by a SIGKILL between two stores reads UNKNOWN,
never a wrong uid.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

__all__ = ["BUSY", "IDLE", "UNKNOWN", "Scoreboard", "SlotReading", "current", "install"]

BUSY = "busy"
IDLE = "idle"
UNKNOWN = "unknown"

_SLOT = struct.Struct("<QQqQ")  # state, uid, batch id, check: 32 bytes (slot << 5)
_MASK = (1 << 64) - 1
_MAGIC = 0x9E3779B97F4A7C15  # any odd constant: a zeroed slot does not check
_STATE_IDLE = 1
_STATE_BUSY = 2


def _check(state: int, uid: int, batch: int) -> int:
    # the multiplications mix the words: a tear (new uid, old batch) does not check
    return (state * 0x100000001B3 ^ uid ^ (batch & _MASK) * 0xC2B2AE3D27D4EB4F ^ _MAGIC) & _MASK


_IDLE_CHECK = _check(_STATE_IDLE, 0, -1)
_BUSY_MIX = _STATE_BUSY * 0x100000001B3 ^ _MAGIC


@dataclass(frozen=True, slots=True)
class SlotReading:
    """What a slot said: ``state`` BUSY (``uid``, ``batch`` valid), IDLE or UNKNOWN."""

    state: str
    uid: int = -1
    batch: int = -1


class Scoreboard:
    """``n_slots`` slots in one anonymous shared mapping; create before forking."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = max(1, int(n_slots))
        self._map = mmap.mmap(-1, _SLOT.size * self.n_slots)  # MAP_SHARED | MAP_ANONYMOUS
        self._view = memoryview(self._map)
        for i in range(self.n_slots):
            self.clear(i)

    def begin(self, slot: int, uid: int, batch: int = -1) -> None:
        """Worker ``slot`` is about to process event ``uid`` (hot path)."""
        uid &= _MASK  # uids travel as u64; never let a pack error kill the worker
        c = (uid ^ (batch & _MASK) * 0xC2B2AE3D27D4EB4F ^ _BUSY_MIX) & _MASK
        _SLOT.pack_into(self._view, slot << 5, _STATE_BUSY, uid, batch, c)

    def clear(self, slot: int) -> None:
        """Worker ``slot`` is between events (after an event; a fresh worker at start)."""
        _SLOT.pack_into(self._view, slot << 5, _STATE_IDLE, 0, -1, _IDLE_CHECK)

    def read(self, slot: int) -> SlotReading:
        """The slot's state; UNKNOWN for a slot out of range, torn or never written."""
        if not 0 <= slot < self.n_slots:
            return SlotReading(UNKNOWN)
        state, uid, batch, check = _SLOT.unpack_from(self._view, slot * _SLOT.size)
        if check != _check(state, uid, batch):
            return SlotReading(UNKNOWN)
        if state == _STATE_BUSY:
            return SlotReading(BUSY, uid, batch)
        if state == _STATE_IDLE:
            return SlotReading(IDLE)
        return SlotReading(UNKNOWN)

    def close(self) -> None:
        """Unmap (this process only; forked processes keep their own mapping)."""
        self._view.release()
        self._map.close()


def slot_of(worker_name: str) -> int:
    """``worker-3`` and its replacements ``worker-3.1``, ``worker-3.2``: slot 3."""
    return int(worker_name.split("-")[1].split(".")[0])


_current: Scoreboard | None = None


def install(board: Scoreboard | None) -> None:
    """Set the run's scoreboard (the parent, before the zygote forks)."""
    global _current
    _current = board


def current() -> Scoreboard | None:
    """The scoreboard inherited from the parent, or None (e.g. a worker run elsewhere)."""
    return _current

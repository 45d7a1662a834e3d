"""A shared-memory scoreboard: which event each worker slot is processing right now.

Exact blame (Apache-style scoreboard). The parent creates an anonymous shared mapping
(``mmap.mmap(-1, size)``: MAP_SHARED, no file, nothing under /dev/shm to clean up)
*before* the zygote forks, so the zygote, every worker it forks, the input and the
output all share the same pages. Each worker slot (``worker-3``, ``worker-3.1``, ...:
index 3) owns one fixed-size slot. When a worker dies the parent reads its slot:
``BUSY`` names the one event it died on (charged an attempt), ``IDLE`` means it died
between events (nobody is charged), ``UNKNOWN`` (a torn, zeroed or nonsensical slot)
lets the ledger fall back to its READY-based guess.

A slot is u64 words: ``cursor, batch, count, check, uid[0] .. uid[CAPACITY-1]``.
A worker copies a batch's uids into its slot once per batch (:meth:`begin_batch`,
while the cursor says idle), then per event stores only the cursor: ``i + 1`` before
event ``i`` goes to the modules, ``0`` after (one aligned 8-byte store each, ~50 ns:
a SIGKILL cannot tear it). ``check`` ties batch and count together, so a slot whose
batch header was half written when its worker died reads UNKNOWN, never a wrong uid.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

__all__ = ["BUSY", "IDLE", "UNKNOWN", "Scoreboard", "SlotReading", "current", "install"]

BUSY = "busy"
IDLE = "idle"
UNKNOWN = "unknown"

#: uids one slot holds: the largest batch the input sends (batching.MAX_BATCH_EVENTS)
CAPACITY = 1024
_HEAD_WORDS = 4
_SLOT_WORDS = _HEAD_WORDS + CAPACITY
_MASK = (1 << 64) - 1
_MAGIC = 0x9E3779B97F4A7C15  # any odd constant: a zeroed slot does not check


def _check(batch: int, count: int) -> int:
    # the multiplications mix the words: a tear (new batch, old count) does not check
    return ((batch & _MASK) * 0xC2B2AE3D27D4EB4F ^ count * 0x100000001B3 ^ _MAGIC) & _MASK


def _signed(word: int) -> int:
    return word - (1 << 64) if word >> 63 else word


@dataclass(frozen=True, slots=True)
class SlotReading:
    """What a slot said: ``state`` BUSY (``uid``, ``batch`` valid), IDLE or UNKNOWN.

    An IDLE reading carries the ``batch`` last given to the slot (-1: none yet): a new
    batch id means the worker moved on, i.e. finished events (the restart backoff).
    """

    state: str
    uid: int = -1
    batch: int = -1


class Scoreboard:
    """``n_slots`` slots in one anonymous shared mapping; create before forking."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = max(1, int(n_slots))
        self._map = mmap.mmap(-1, 8 * _SLOT_WORDS * self.n_slots)  # MAP_SHARED|ANONYMOUS
        self._bytes = memoryview(self._map)
        self._words = self._bytes.cast("Q")
        for i in range(self.n_slots):
            self._set_batch(i, -1, b"")

    # --- the worker's side (hot path) -------------------------------------------------
    def begin_batch(self, slot: int, uids: bytes, batch: int = -1) -> bool:
        """Slot ``slot`` receives the batch whose uids are ``uids`` (u64 little-endian).

        Returns False when the batch holds more than ``CAPACITY`` events: then call
        :meth:`begin` per event instead of :meth:`enter`.
        """
        base = slot * _SLOT_WORDS
        self._words[base] = 0  # idle while the batch is copied in
        if len(uids) > 8 * CAPACITY:
            self._set_batch(slot, batch, b"")
            return False
        self._set_batch(slot, batch, uids)
        return True

    def cursor(self, slot: int) -> tuple[memoryview, int]:
        """``(words, index)``: ``words[index] = i + 1`` is :meth:`enter`, ``= 0`` :meth:`clear`.

        For the worker's event loop, which stores the cursor without a method call.
        """
        return self._words, slot * _SLOT_WORDS

    def enter(self, slot: int, i: int) -> None:
        """Event ``i`` of the current batch is about to go to the modules."""
        self._words[slot * _SLOT_WORDS] = i + 1

    def begin(self, slot: int, uid: int, batch: int = -1) -> None:
        """One event ``uid`` (a batch of one) is about to go to the modules."""
        self._words[slot * _SLOT_WORDS] = 0
        self._set_batch(slot, batch, (uid & _MASK).to_bytes(8, "little"))
        self._words[slot * _SLOT_WORDS] = 1

    def clear(self, slot: int) -> None:
        """Worker ``slot`` is between events (after an event; a fresh worker at start)."""
        self._words[slot * _SLOT_WORDS] = 0

    def _set_batch(self, slot: int, batch: int, uids: bytes) -> None:
        base = slot * _SLOT_WORDS
        count = len(uids) // 8
        words = self._words
        words[base + 1] = batch & _MASK
        words[base + 2] = count
        words[base + 3] = _check(batch, count)
        if count:
            start = 8 * (base + _HEAD_WORDS)
            self._bytes[start : start + 8 * count] = uids

    # --- the parent's side ------------------------------------------------------------
    def read(self, slot: int) -> SlotReading:
        """The slot's state; UNKNOWN for a slot out of range, torn or never written."""
        if not 0 <= slot < self.n_slots:
            return SlotReading(UNKNOWN)
        base = slot * _SLOT_WORDS
        cursor, batch_word, count, check = self._words[base : base + _HEAD_WORDS].tolist()
        batch = _signed(batch_word)
        if check != _check(batch, count) or count > CAPACITY:
            return SlotReading(IDLE if cursor == 0 and check else UNKNOWN)
        if cursor == 0:
            return SlotReading(IDLE, batch=batch)
        if cursor > count:
            return SlotReading(UNKNOWN)
        return SlotReading(BUSY, self._words[base + _HEAD_WORDS + cursor - 1], batch)

    def close(self) -> None:
        """Unmap (this process only; forked processes keep their own mapping)."""
        self._words.release()
        self._bytes.release()
        self._map.close()


def slot_of(worker_name: str) -> int:
    """``worker-3`` and its replacements ``worker-3.1``, ``worker-3.2``: slot 3."""
    return int(worker_name.split("-")[1].split(".")[0])


def worker_name(slot: int, generation: int) -> str:
    """The name of the ``generation``-th process of worker slot ``slot`` (0: the first)."""
    return f"worker-{slot}" if generation == 0 else f"worker-{slot}.{generation}"


def successor_name(worker_name_: str) -> str:
    """The name of the process that replaces ``worker_name_`` in its slot."""
    base, _, gen = worker_name_.partition(".")
    return f"{base}.{int(gen or 0) + 1}"


_current: Scoreboard | None = None


def install(board: Scoreboard | None) -> None:
    """Set the run's scoreboard (the parent, before the zygote forks)."""
    global _current
    _current = board


def current() -> Scoreboard | None:
    """The scoreboard inherited from the parent, or None (e.g. a worker run elsewhere)."""
    return _current

"""Module statistics of every worker slot in shared memory, so a killed worker's
calls still count.

A worker reports its module statistics in its final RESULT; a worker killed by a
timeout, a crash or a second Ctrl-C never sends one. Like the scoreboard, the parent
creates one anonymous shared mapping before the zygote forks (nothing under /dev/shm
to clean up). After every batch a worker copies its cumulative counters (calls,
dropped, time per module) into its slot: a few 8-byte stores per module, each atomic,
so a SIGKILL leaves the counts of its last finished batch. The parent reads the slot
when the worker has exited, before a replacement in the same slot writes to it.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence

import numpy as np

from evflow.processing.statistics import ModuleStatistics, StatisticsCollector

__all__ = ["StatsBoard", "current", "install"]


class StatsBoard:
    """``n_slots`` x ``names`` counters in one anonymous shared mapping; create before
    forking."""

    def __init__(self, n_slots: int, names: Sequence[str]) -> None:
        self.n_slots = max(1, int(n_slots))
        self.names = list(names)
        n = max(1, len(self.names))
        self._map = mmap.mmap(-1, 8 * 3 * n * self.n_slots)  # MAP_SHARED|ANONYMOUS, zeroed
        words = np.frombuffer(self._map, dtype=np.uint64).reshape(self.n_slots, 3, n)
        self._calls = words[:, 0, :]
        self._dropped = words[:, 1, :]
        self._time_s = words[:, 2, :].view(np.float64)

    def store(self, slot: int, stats: StatisticsCollector) -> None:
        """The worker in ``slot``: its counters so far (after a batch)."""
        if not 0 <= slot < self.n_slots or len(stats.calls) != len(self.names):
            return  # a worker of another path layout: nothing sensible to store
        self._calls[slot] = stats.calls
        self._dropped[slot] = stats.dropped
        self._time_s[slot] = stats.time_s

    def clear(self, slot: int) -> None:
        """A new worker in ``slot`` starts from zero."""
        if 0 <= slot < self.n_slots:
            self._calls[slot] = 0
            self._dropped[slot] = 0
            self._time_s[slot] = 0.0

    def read(self, slot: int, process: str) -> list[ModuleStatistics]:
        """The rows the (exited) worker ``process`` in ``slot`` left; [] if it did nothing."""
        if not 0 <= slot < self.n_slots or not self._calls[slot].any():
            return []
        return [
            ModuleStatistics(
                name,
                int(self._calls[slot, i]),
                float(self._time_s[slot, i]),
                int(self._dropped[slot, i]),
                process,
            )
            for i, name in enumerate(self.names)
        ]

    def close(self) -> None:
        # the numpy views hold exports of the mapping: drop them before closing it
        del self._calls, self._dropped, self._time_s
        with contextlib.suppress(BufferError):  # a view still alive: it goes with it
            self._map.close()


_current: StatsBoard | None = None


def install(board: StatsBoard | None) -> None:
    """Set the run's stats board (the parent, before the zygote forks)."""
    global _current
    _current = board


def current() -> StatsBoard | None:
    """The stats board inherited from the parent, or None."""
    return _current

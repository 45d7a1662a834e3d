"""Restart policy of a parallel run: worker backoff, and which outputs can restart.

Worker backoff: a path that crashes on every event must not spin.

The parent replaces every worker that dies (up to ``max_restarts``). Workers that keep
*crashing* (an exit code, or a signal such as SIGSEGV or SIGABRT) before they finished
a single event say that the path, not bad luck, is failing; forking the next one at
once would only burn CPU on forks. So a streak of such deaths delays the next fork
exponentially: the first restart of a streak is immediate, then ``backoff_s``,
``2 * backoff_s``, ``4 * backoff_s``, ... at most ``backoff_max_s``.

What ends a streak: the crash of a *productive* worker (it finished at least one
event, or lived ``healthy_after_s``), or a quiet period with no crash (``reset_after_s``
= ``backoff_max_s + 2 * healthy_after_s``, longer than any gap inside a crash loop).

What a streak ignores: deaths by SIGKILL or SIGTERM. They come from outside (an
operator, the OOM killer, a chaos drill) or from the parent itself for a timeout, whose
pace ``event_timeout_s`` already bounds; they tell nothing about a crash loop and are
replaced at once.

The parent learns about progress from the scoreboard (``scoreboard.py``): on every
pass of its loop (at least every 100 ms) it reads the slots of workers not yet known
productive (:meth:`RestartPolicy.observe`). A worker seen with two different batch ids
has finished the first batch; one seen busy with uid U and later idle, or busy with
another uid, has finished U. A worker that finishes events and crashes before the
parent saw it move on counts as unproductive: the streak grows by one, a short delay
at worst.

The streak counts the crashes of all slots together: when every slot crashes, each
new crash waits longer, whichever slot it was.

The engine never sleeps: a delayed fork is *due* at a ``time.monotonic()`` instant;
the watch loop polls no longer than :meth:`RestartPolicy.next_due_in_s` and forks what
:meth:`RestartPolicy.pop_due` returns. When the run ends (end of input, an error, a
second interrupt) :meth:`RestartPolicy.cancel` drops the forks still waiting.

Output restarts: a restarted output continues its files, which needs writers with an
``append`` parameter (``RecordOutput``). :func:`output_restart_refusal` says, before any
fork, why an output path cannot be restarted (e.g. ``RootOutput``: a ROOT file cannot
be appended to), so the run stops with that reason instead of a second failure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from evflow.errors import ConfigurationError
from evflow.processing.chain import is_writer
from evflow.processing.module import Module
from evflow.processing.parallel.scoreboard import BUSY, UNKNOWN

__all__ = [
    "BACKOFF_MAX_S",
    "BACKOFF_S",
    "HEALTHY_AFTER_S",
    "RestartPolicy",
    "RestartStats",
    "output_restart_refusal",
]

#: delay (s) of the second fork of a streak of crashes (the first is immediate)
BACKOFF_S = 0.05
#: longest delay (s) before a replacement is forked
BACKOFF_MAX_S = 2.0
#: a worker that lived this long (s) counts as productive even without a finished event
HEALTHY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class RestartStats:
    """What the backoff did: ``delayed``: forks that happened after a delay;
    ``total_delay_s``: seconds slots stood empty for it (a fork cancelled at the end
    counts until then); ``max_delay_s``: the longest delay; ``streak``: the current
    streak of crashes before a finished event."""

    delayed: int
    total_delay_s: float
    max_delay_s: float
    streak: int


class RestartPolicy:
    """When to fork the replacement of a dead worker slot (all times in seconds).

    Times are passed in (``now_s``, from ``time.monotonic()``), so the policy is pure
    and its tests need no clock.
    """

    def __init__(
        self,
        backoff_s: float = BACKOFF_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        healthy_after_s: float = HEALTHY_AFTER_S,
    ) -> None:
        for name, value in (
            ("restart_backoff_s", backoff_s),
            ("restart_backoff_max_s", backoff_max_s),
            ("healthy_after_s", healthy_after_s),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ConfigurationError(
                    f"option {name!r} must be a number of seconds >= 0, got {value!r}"
                )
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.healthy_after_s = float(healthy_after_s)
        #: no crash for this long (s) ends a streak; longer than any gap in a crash loop
        self.reset_after_s = self.backoff_max_s + 2.0 * self.healthy_after_s
        self._last_crash_s = -math.inf
        self.streak = 0  # crashes before a finished event, all slots together
        self.pending: dict[int, float] = {}  # slot -> monotonic time its fork is due
        self._born_s: dict[int, float] = {}  # slot -> when its current worker was forked
        self._busy_uid: dict[int, int | None] = {}  # slot -> uid last seen busy (None: idle)
        self._first_batch: dict[int, int | None] = {}  # slot -> first batch id seen
        self._stale_batch: dict[int, int] = {}  # slot -> the dead worker's batch id
        self.productive: set[int] = set()  # slots whose current worker finished an event
        self._delayed = 0
        self._total_delay_s = 0.0
        self._max_delay_s = 0.0

    @classmethod
    def from_options(cls, extra: dict[str, Any]) -> RestartPolicy:
        """From ``ProcessOptions.extra``: ``restart_backoff_s``, ``restart_backoff_max_s``."""
        return cls(
            extra.get("restart_backoff_s", BACKOFF_S),
            extra.get("restart_backoff_max_s", BACKOFF_MAX_S),
        )

    def delay_s(self, streak: int) -> float:
        """Delay (s) of the fork after the ``streak``-th crash of a streak."""
        if streak <= 1 or self.backoff_s == 0.0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(streak - 2, 60))

    def spawned(self, slot: int, now_s: float, stale_batch: int = -1) -> None:
        """A worker was forked for ``slot`` at ``now_s``; ``stale_batch``: the batch id
        the slot still shows from the worker before (not this one's progress)."""
        self._born_s[slot] = now_s
        self._busy_uid[slot] = None
        self._first_batch[slot] = None
        self._stale_batch[slot] = stale_batch
        self.productive.discard(slot)
        self.pending.pop(slot, None)

    def observe(self, slot: int, state: str, uid: int = -1, batch: int = -1) -> None:
        """The scoreboard says ``slot`` is ``state`` (busy with ``uid``, idle, unknown)
        and was last given batch ``batch``.

        Two different batch ids, or busy with U and then idle or busy with another uid:
        the worker finished events, it is productive. An unknown (torn) reading tells
        nothing.
        """
        if state == UNKNOWN or slot in self.productive:
            return
        if batch != -1 and batch != self._stale_batch.get(slot, -1):
            first = self._first_batch.get(slot)
            if first is None:
                self._first_batch[slot] = batch
            elif batch != first:
                self.productive.add(slot)
                return
        now = uid if state == BUSY else None
        last = self._busy_uid.get(slot)
        if last is not None and now != last:
            self.productive.add(slot)
        self._busy_uid[slot] = now

    def watching(self) -> list[int]:
        """Slots with a live worker not yet known productive (to :meth:`observe`)."""
        return [slot for slot in self._born_s if slot not in self.productive]

    def died(self, slot: int, now_s: float, crashed: bool = True) -> int:
        """The worker of ``slot`` died at ``now_s``: return the streak of unproductive
        crashes it belongs to (0: not part of one, fork at once).

        Call :meth:`observe` with the slot's reading at its death first. ``crashed``:
        False for a SIGKILL or SIGTERM, which leaves the streak as it is.
        """
        lived_s = now_s - self._born_s.pop(slot, now_s)
        if not crashed:
            return 0
        quiet = now_s - self._last_crash_s >= self.reset_after_s
        self._last_crash_s = now_s
        if slot in self.productive or lived_s >= self.healthy_after_s:
            self.streak = 0
            return 0
        self.streak = 1 if quiet else self.streak + 1
        return self.streak

    def replace(self, slot: int, now_s: float, crashed: bool = True) -> float:
        """The worker of ``slot`` died at ``now_s``; return the delay (s) of its fork.

        0 (fork now) for the first crash of a streak and for deaths outside a streak
        (see :meth:`died`). A delay > 0 leaves the slot pending until ``now_s + delay``.
        """
        delay = self.delay_s(self.died(slot, now_s, crashed))
        if delay > 0.0:
            self.pending[slot] = now_s + delay
            self._delayed += 1
            self._total_delay_s += delay
            self._max_delay_s = max(self._max_delay_s, delay)
        return delay

    def next_due_in_s(self, now_s: float) -> float | None:
        """Seconds until the next pending fork is due (0 if overdue), None if none."""
        if not self.pending:
            return None
        return max(0.0, min(self.pending.values()) - now_s)

    def pop_due(self, now_s: float) -> list[int]:
        """The slots whose fork is due at ``now_s`` (no longer pending), earliest first."""
        due = sorted((t, slot) for slot, t in self.pending.items() if t <= now_s)
        for _, slot in due:
            del self.pending[slot]
        return [slot for _, slot in due]

    def cancel(self, now_s: float) -> int:
        """The run is ending at ``now_s``: drop every pending fork; return how many.

        The statistics keep only forks that happened and the time really waited.
        """
        n = len(self.pending)
        for due_s in self.pending.values():
            self._delayed -= 1
            self._total_delay_s -= max(0.0, due_s - now_s)
        self.pending.clear()
        return n

    def limit_hint(self, streak: int) -> str:
        """What to say when ``max_restarts`` stops a run whose last crash ended ``streak``."""
        raise_it = "raise the limit with extra={'max_restarts': N} if these deaths are expected"
        if streak < 2:
            return raise_it[0].upper() + raise_it[1:]
        return (
            f"The last {streak} workers crashed before finishing an event: the path "
            f"probably fails on every event (restarts were delayed {self._delayed} times, "
            f"{self._total_delay_s:.2f} s in all). Fix the module that crashes, or {raise_it}"
        )

    def stats(self) -> RestartStats:
        return RestartStats(self._delayed, self._total_delay_s, self._max_delay_s, self.streak)

    def __repr__(self) -> str:
        return (
            f"<RestartPolicy backoff_s={self.backoff_s} backoff_max_s={self.backoff_max_s} "
            f"streak={self.streak} pending={sorted(self.pending)}>"
        )


def output_restart_refusal(modules: Iterable[Module]) -> str | None:
    """Why an output path of ``modules`` cannot be restarted after a crash; None if it can.

    A restarted output reopens every writer's file in append mode; a writer without an
    ``append`` parameter cannot continue its file.
    """
    for module in modules:
        if not is_writer(module) or "append" in type(module).declared_params():
            continue
        kind = type(module).__name__
        file = getattr(module, "file", None)
        what = f"its writer {module.name!r} ({kind}) cannot reopen {file!r} after a crash"
        if kind == "RootOutput":
            what += " (a ROOT file cannot be appended to; this one is incomplete)"
        return (
            f"{what}; to finish, run again from the start (the file is rewritten), or write "
            "record output (RecordOutput, e.g. -o out.evr), which a restarted output and "
            "--resume continue"
        )
    return None

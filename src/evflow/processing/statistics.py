"""Module statistics: how often each module ran, how long it took, what it dropped.

The hot loop counts into a ``StatisticsCollector`` (plain lists, no objects per event);
at the end it becomes frozen ``ModuleStatistics`` rows, one per module and process.
Rows of the same module from several processes merge with ``+`` (``sum()`` works).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from evflow.errors import ConfigurationError


@dataclass(frozen=True, slots=True)
class ModuleStatistics:
    """One module's figures in one process (or merged over processes).

    ``calls`` counts ``event()`` calls (for a source: events it produced), ``time_s``
    the wall time spent in them in seconds, ``dropped`` the events it dropped
    (``event`` returned False). ``process`` names where it ran: "main" for a
    sequential run, e.g. "input", "worker-3", "output" for a parallel one, "all" when
    merged over processes.
    """

    module: str
    calls: int = 0
    time_s: float = 0.0
    dropped: int = 0
    process: str = "main"

    @property
    def mean_ms(self) -> float:
        """Mean time per call in milliseconds (0 when never called)."""
        return 1e3 * self.time_s / self.calls if self.calls else 0.0

    def __add__(self, other: ModuleStatistics) -> ModuleStatistics:
        if not isinstance(other, ModuleStatistics):
            return NotImplemented
        if other.module != self.module:
            raise ConfigurationError(
                f"cannot merge statistics of module {self.module!r} with those of "
                f"module {other.module!r}"
            )
        process = self.process if self.process == other.process else "all"
        return ModuleStatistics(
            self.module,
            self.calls + other.calls,
            self.time_s + other.time_s,
            self.dropped + other.dropped,
            process,
        )

    def __radd__(self, other: object) -> ModuleStatistics:
        # 0 + stats works, so sum() works
        if other == 0:
            return self
        return NotImplemented

    def as_dict(self) -> dict[str, Any]:
        """Plain types only (msgpack-able, to travel from worker processes)."""
        return {
            "module": self.module,
            "calls": self.calls,
            "time_s": self.time_s,
            "dropped": self.dropped,
            "process": self.process,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModuleStatistics:
        return cls(
            module=str(d["module"]),
            calls=int(d.get("calls", 0)),
            time_s=float(d.get("time_s", 0.0)),
            dropped=int(d.get("dropped", 0)),
            process=str(d.get("process", "main")),
        )


class StatisticsCollector:
    """Counters for the modules of one path in one process, indexed by position.

    The processor adds to the lists directly (``calls[i] += 1``) to keep per-event
    overhead at a few list operations.
    """

    __slots__ = ("calls", "dropped", "names", "process", "time_s")

    def __init__(self, names: Sequence[str], process: str = "main") -> None:
        self.names = list(names)
        self.process = process
        self.calls = [0] * len(self.names)
        self.time_s = [0.0] * len(self.names)
        self.dropped = [0] * len(self.names)

    def snapshot(self) -> list[ModuleStatistics]:
        """Frozen rows, in path order."""
        return [
            ModuleStatistics(name, self.calls[i], self.time_s[i], self.dropped[i], self.process)
            for i, name in enumerate(self.names)
        ]


def merge_statistics(rows: Iterable[ModuleStatistics]) -> list[ModuleStatistics]:
    """Sum rows of the same module over processes; first-seen module order is kept."""
    merged: dict[str, ModuleStatistics] = {}
    for row in rows:
        merged[row.module] = merged[row.module] + row if row.module in merged else row
    return list(merged.values())


def processes_of(rows: Iterable[ModuleStatistics]) -> list[str]:
    """The process names that appear in ``rows``, in first-seen order."""
    return list(dict.fromkeys(row.process for row in rows))

"""The output's memory of what it wrote: exactly once at the output (invariant 3).

A result may reach the output twice: a worker finished just after its timeout fired
and the retry finished too, or the input re-sent everything unconfirmed after the
output restarted. The output asks ``check_and_add(uid)`` before writing; a uid seen
before is dropped and counted. After a restart ``from_writer`` rebuilds the set from
the uids already in the reopened file.

Memory: a Python set of ints, about 60 bytes per uid written (1 M events ~ 60 MB).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class _HasWrittenUids(Protocol):
    def written_uids(self) -> set[int]: ...


@dataclass(frozen=True, slots=True)
class DedupStatistics:
    written: int  # distinct uids known as written (including rebuilt ones)
    rebuilt: int  # uids found in the file when the set was rebuilt
    duplicates_dropped: int
    already_written: int = 0  # of those, uids that were in the file before


class WrittenUids:
    """The set of uids the output has written (or decided: dropped, quarantined)."""

    __slots__ = ("_duplicates", "_earlier", "_initial", "_rebuilt", "_uids")

    def __init__(self, uids: Iterable[int] = ()) -> None:
        self._uids: set[int] = set(uids)
        self._initial = frozenset(self._uids)  # written by an earlier run or process
        self._rebuilt = len(self._uids)
        self._duplicates = 0
        self._earlier = 0

    @classmethod
    def from_writer(cls, writer: _HasWrittenUids) -> WrittenUids:
        """Rebuild from a reopened writer's ``written_uids()``."""
        return cls(writer.written_uids())

    def seen(self, uid: int) -> bool:
        """True if ``uid`` was written already (does not count a duplicate)."""
        return uid in self._uids

    def add(self, uid: int) -> None:
        self._uids.add(uid)

    def count_seen(self, uids: list[int]) -> int:
        """How many of ``uids`` were written already (counts no duplicate)."""
        return sum(map(self._uids.__contains__, uids))

    def add_if_all_new(self, uids: list[int]) -> bool:
        """Remember ``uids`` and return True if none was seen; else change nothing.

        The output's fast path: one set operation per batch instead of one per uid.
        """
        known = self._uids
        if not known.isdisjoint(uids):
            return False
        known.update(uids)
        return True

    def check_and_add(self, uid: int) -> bool:
        """True if ``uid`` is new (and remember it); False, counted, if it is a duplicate."""
        uids = self._uids
        if uid in uids:
            self._duplicates += 1
            if uid in self._initial:
                self._earlier += 1
            return False
        uids.add(uid)
        return True

    def drop_duplicate(self) -> None:
        """Count a duplicate found by ``seen``."""
        self._duplicates += 1

    @property
    def duplicates_dropped(self) -> int:
        return self._duplicates

    @property
    def already_written(self) -> int:
        """Duplicates whose uid was in the file before (a resumed or restarted output)."""
        return self._earlier

    def __contains__(self, uid: object) -> bool:
        return uid in self._uids

    def __len__(self) -> int:
        return len(self._uids)

    def statistics(self) -> DedupStatistics:
        return DedupStatistics(len(self._uids), self._rebuilt, self._duplicates, self._earlier)

    def __repr__(self) -> str:
        return f"<WrittenUids written={len(self._uids)} duplicates_dropped={self._duplicates}>"

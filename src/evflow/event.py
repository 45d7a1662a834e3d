"""The event in memory: named objects plus the event's metadata."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

# EventMeta.flags bits
FLAG_QUARANTINED = 1 << 0  # written raw after max_attempts failures
FLAG_DROPPED = 1 << 1  # a module returned False (a trigger decision)
#: the object a quarantined event carries in the output: why it was quarantined
QUARANTINE_REASON = "evflow_quarantine_reason"


@dataclass(slots=True)
class EventMeta:
    """Who an event is: experiment, run, event number and the source-given ``uid``.

    ``uid`` is unique within a run's input (a 64-bit unsigned integer); the reliability
    machinery keys every ledger and dedup table on it. ``attempt`` counts processing
    attempts (1 for the first).
    """

    uid: int
    experiment: int = 0
    run: int = 0
    event: int = 0
    flags: int = 0
    attempt: int = 1

    def as_dict(self) -> dict[str, int]:
        return {
            "uid": self.uid,
            "experiment": self.experiment,
            "run": self.run,
            "event": self.event,
            "flags": self.flags,
            "attempt": self.attempt,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EventMeta:
        return cls(
            uid=int(d["uid"]),
            experiment=int(d.get("experiment", 0)),
            run=int(d.get("run", 0)),
            event=int(d.get("event", 0)),
            flags=int(d.get("flags", 0)),
            attempt=int(d.get("attempt", 1)),
        )


@dataclass(slots=True)
class RunMeta:
    """What ``begin_run``/``end_run`` receive."""

    experiment: int = 0
    run: int = 0


class DataStore(MutableMapping[str, Any]):
    """One event: a mapping of named objects plus ``meta`` and the run-level ``persistent``.

    Values are numpy arrays, awkward arrays, scalars, strings or small dicts/lists of
    those (what the codec can carry). ``persistent`` is shared by all events of a
    process: modules keep run-level objects there (histograms to be merged at the end).
    It never travels with the event.
    """

    __slots__ = ("_objects", "meta", "persistent")

    def __init__(
        self,
        meta: EventMeta,
        objects: dict[str, Any] | None = None,
        persistent: dict[str, Any] | None = None,
    ) -> None:
        self.meta = meta
        self._objects: dict[str, Any] = objects if objects is not None else {}
        self.persistent: dict[str, Any] = persistent if persistent is not None else {}

    def __getitem__(self, key: str) -> Any:
        try:
            return self._objects[key]
        except KeyError:
            have = ", ".join(sorted(self._objects)) or "nothing"
            raise KeyError(
                f"event uid={self.meta.uid} has no object {key!r} (it has: {have})"
            ) from None

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(f"DataStore keys are strings, got {type(key).__name__}")
        self._objects[key] = value

    def __delitem__(self, key: str) -> None:
        del self._objects[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._objects)

    def __len__(self) -> int:
        return len(self._objects)

    @property
    def objects(self) -> dict[str, Any]:
        """The underlying dict (what the codec encodes)."""
        return self._objects

    def __repr__(self) -> str:
        return f"<DataStore uid={self.meta.uid} objects={sorted(self._objects)}>"

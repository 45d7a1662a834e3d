"""The verdict of a check: a ``Quality`` (Good < Medium < Bad < Null), flags with reasons.

Qualities are ordered from best to worst, Null last: an object nobody could judge
(a check raised, too few sources contributed) must never look better than a Bad one,
so "worst of" over a set of results is simply ``max``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class Quality(enum.IntEnum):
    """Ordered from best to worst: ``Quality.GOOD < Quality.BAD < Quality.NULL``."""

    GOOD = 1
    MEDIUM = 2
    BAD = 3
    NULL = 4

    @property
    def label(self) -> str:
        """``Good``, ``Medium``, ``Bad`` or ``Null`` (the names users see)."""
        return self.name.capitalize()

    @classmethod
    def parse(cls, text: str) -> Quality:
        """``Quality.parse("good")`` -> ``Quality.GOOD``; raises ValueError naming the choices."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            choices = ", ".join(q.label for q in cls)
            raise ValueError(f"unknown quality {text!r} (one of {choices})") from None

    def __str__(self) -> str:
        return self.label


def worst(qualities: Iterable[Quality]) -> Quality:
    """The worst of ``qualities``; Null if there are none (nothing was judged)."""
    return max(qualities, default=Quality.NULL)


@dataclass(frozen=True)
class Flag:
    """Why a quality is what it is: a short name and a human reason."""

    name: str
    reason: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Flag:
        return cls(str(data["name"]), str(data.get("reason", "")))

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}" if self.reason else self.name


def union_flags(groups: Iterable[Iterable[Flag]]) -> tuple[Flag, ...]:
    """All flags of ``groups`` once each, in first-seen order."""
    seen: dict[Flag, None] = {}
    for flags in groups:
        for f in flags:
            seen.setdefault(f, None)
    return tuple(seen)


@dataclass(frozen=True)
class QualityObject:
    """The result of one check or aggregator on one or more objects."""

    quality: Quality
    check: str
    paths: tuple[str, ...] = ()
    flags: tuple[Flag, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (the repository and the HTTP API use it)."""
        return {
            "quality": self.quality.label,
            "check": self.check,
            "paths": list(self.paths),
            "flags": [f.to_dict() for f in self.flags],
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QualityObject:
        return cls(
            quality=Quality.parse(data["quality"]),
            check=str(data["check"]),
            paths=tuple(data.get("paths", ())),
            flags=tuple(Flag.from_dict(f) for f in data.get("flags", ())),
            metadata=dict(data.get("metadata", {})),
        )


def aggregate(name: str, results: Iterable[QualityObject]) -> QualityObject:
    """Worst of ``results`` with the union of their flags and paths (Null if empty)."""
    items = list(results)
    paths: dict[str, None] = {}
    for r in items:
        for p in r.paths:
            paths.setdefault(p, None)
    flags = union_flags(r.flags for r in items)
    if not items:
        flags = (Flag("no_input", "no check result to aggregate"),)
    return QualityObject(
        quality=worst(r.quality for r in items),
        check=name,
        paths=tuple(paths),
        flags=flags,
        metadata={
            "inputs": [
                {"check": r.check, "paths": list(r.paths), "quality": r.quality.label}
                for r in items
            ]
        },
    )

"""What the repository hands back: version records, stored objects and qualities, retention."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from evflow.errors import ConfigurationError
from evflow.qc.quality import Flag


@dataclass(frozen=True)
class VersionInfo:
    """One stored version of one path (no object bytes).

    ``valid_from``/``valid_until`` are unix seconds; ``valid_until`` is None while the
    version is the newest of its path. ``quality`` is a label (``"Good"``...) or None
    when no check judged the object; ``hash`` is the sha256 of the encoded object.
    """

    id: int
    path: str
    run: int | None
    cycle: int | None
    valid_from: float
    valid_until: float | None
    created: float
    hash: str
    size: int
    quality: str | None
    flags: tuple[Flag, ...]
    metadata: dict[str, Any]
    completeness: dict[str, Any]
    task: str | None
    name: str | None
    sequence: int | None
    event_count: int | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (flags as ``{"name", "reason"}`` dicts)."""
        data = {k: getattr(self, k) for k in VersionInfo.__dataclass_fields__}
        data["flags"] = [f.to_dict() for f in self.flags]
        return data


@dataclass(frozen=True)
class StoredObject(VersionInfo):
    """A version with its decoded object in ``obj``."""

    obj: Any = None


@dataclass(frozen=True)
class StoredQuality:
    """One stored check or aggregator result."""

    id: int
    check: str
    quality: str
    paths: tuple[str, ...]
    flags: tuple[Flag, ...]
    metadata: dict[str, Any]
    run: int | None
    cycle: int | None
    created: float
    version_id: int | None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["paths"] = list(self.paths)
        data["flags"] = [f.to_dict() for f in self.flags]
        return data


@dataclass(frozen=True)
class Gap:
    """A time the writer could not store (disk full): what it lost and why."""

    id: int
    started: float
    ended: float
    stored_late: int
    lost: int
    reason: str


@dataclass(frozen=True)
class Retention:
    """Which old versions to delete: beyond the newest ``keep_last`` of a path, and
    those superseded more than ``max_age_s`` ago. The newest version of a path is
    always kept."""

    keep_last: int | None = None
    max_age_s: float | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigurationError(f"retention keep_last must be >= 1, got {self.keep_last}")
        if self.max_age_s is not None and self.max_age_s < 0:
            raise ConfigurationError(f"retention max_age_s must be >= 0, got {self.max_age_s}")

    @classmethod
    def from_config(cls, config: dict[str, Any] | Retention | None) -> Retention | None:
        if config is None or isinstance(config, Retention):
            return config
        unknown = sorted(set(config) - {"keep_last", "max_age_s"})
        if unknown:
            raise ConfigurationError(f"retention has unknown keys {unknown} (keep_last, max_age_s)")
        return cls(config.get("keep_last"), config.get("max_age_s"))


def dumps(value: Any) -> str:
    """JSON for metadata columns: numpy scalars and other odd values become strings."""
    return json.dumps(value, default=_jsonable, sort_keys=True)


def _jsonable(value: Any) -> Any:
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def flags_json(flags: tuple[Flag, ...] | list[Flag]) -> str:
    return json.dumps([f.to_dict() for f in flags])


def flags_from_json(text: str | None) -> tuple[Flag, ...]:
    return tuple(Flag.from_dict(f) for f in json.loads(text or "[]"))

"""A set of checks and aggregators, built from a dict or a TOML file, run on each object.

``CheckSuite.run(published)`` runs every check that applies to the object's path; a
check that raises gives Null with the exception as a flag and the others still run.
When the object's completeness (sources seen / expected) is below
``min_completeness`` every verdict on it is forced to Null. Aggregators take the worst
of the latest results of the checks they name, with the union of their flags::

    min_completeness = 0.9
    [checks.pt_ks]
    type = "ks_reference"
    objects = ["qc/hzz/pt"]
    reference = "reference.root:pt"     # or {path = "qc/hzz/pt", run = 1} from the repository
    [aggregators.hzz]
    type = "worst_of"
    checks = ["pt_ks"]
"""

from __future__ import annotations

import importlib
import inspect
import logging
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evflow.errors import ConfigurationError
from evflow.qc.checks import BUILTIN_CHECKS, Check
from evflow.qc.publication import PublishedObject
from evflow.qc.quality import Flag, Quality, QualityObject, aggregate

if TYPE_CHECKING:
    from evflow.qc.repository import Repository

log = logging.getLogger("evflow.qc.checks")

OBJECT_QUALITY = "object_quality"


def completeness_fraction(completeness: Mapping[str, Any] | None) -> float | None:
    """Sources seen / expected of a completeness record; None when it does not say."""
    if not completeness:
        return None
    if "fraction" in completeness:
        return float(completeness["fraction"])

    def count(value: Any) -> int | None:
        if value is None:
            return None
        return len(value) if isinstance(value, list | tuple | set | frozenset) else int(value)

    seen, expected = count(completeness.get("seen")), count(completeness.get("expected"))
    if seen is None or not expected:
        return None
    return seen / expected


@dataclass(frozen=True)
class Aggregator:
    """Worst of the latest results of ``checks`` (by name), with the union of their flags."""

    name: str
    checks: tuple[str, ...]


@dataclass
class SuiteResult:
    """What a suite says about one object: each check, the object's overall quality
    (None when no check applies and it is complete), and the aggregators it changed."""

    checks: list[QualityObject] = field(default_factory=list)
    quality: QualityObject | None = None
    aggregates: list[QualityObject] = field(default_factory=list)


class CheckSuite:
    """Checks and aggregators; keeps the latest result of each (check, path)."""

    def __init__(
        self,
        checks: Iterable[Check] = (),
        aggregators: Iterable[Aggregator] = (),
        *,
        min_completeness: float = 0.0,
    ) -> None:
        self.checks = list(checks)
        self.aggregators = list(aggregators)
        self.min_completeness = float(min_completeness)
        names = [c.name for c in self.checks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigurationError(f"check names must be unique; repeated: {', '.join(dupes)}")
        for agg in self.aggregators:
            unknown = [c for c in agg.checks if c not in names]
            if unknown:
                raise ConfigurationError(
                    f"aggregator {agg.name!r} names unknown checks {unknown} (known: {names})"
                )
        self._latest: dict[tuple[str, str], QualityObject] = {}
        self._warned: set[tuple[str, str, str]] = set()

    def run(self, published: PublishedObject) -> SuiteResult:
        result = SuiteResult()
        for check in self.checks:
            if check.applies_to(published.path):
                result.checks.append(self._run_one(check, published))
        incomplete = self._incompleteness(published)
        if incomplete is not None:
            result.checks = [_force_null(r, incomplete) for r in result.checks]
        if result.checks:  # already Null with the flag when incomplete
            result.quality = replace(aggregate(OBJECT_QUALITY, result.checks), metadata={})
        elif incomplete is not None:
            result.quality = QualityObject(
                Quality.NULL, OBJECT_QUALITY, (published.path,), (incomplete,)
            )
        changed = set()
        for r in result.checks:
            self._latest[(r.check, published.path)] = r
            changed.add(r.check)
        for agg in self.aggregators:
            if changed.intersection(agg.checks):
                inputs = [v for (name, _), v in self._latest.items() if name in agg.checks]
                result.aggregates.append(aggregate(agg.name, inputs))
        return result

    def _run_one(self, check: Check, published: PublishedObject) -> QualityObject:
        try:
            return check(published)
        except Exception as exc:  # a broken check must never stop the chain
            reason = f"{type(exc).__name__}: {exc}"
            key = (check.name, published.path, type(exc).__name__)
            if key not in self._warned:  # the flag says it every time; the log once
                self._warned.add(key)
                log.warning("check %r on %s raised %s", check.name, published.path, reason)
            return QualityObject(
                Quality.NULL, check.name, (published.path,), (Flag("check_raised", reason),)
            )

    def _incompleteness(self, published: PublishedObject) -> Flag | None:
        fraction = completeness_fraction(published.completeness)
        if fraction is None or fraction >= self.min_completeness:
            return None
        missing = published.completeness.get("missing") or []
        reason = f"{fraction:.0%} of sources contributed (minimum {self.min_completeness:.0%})"
        if missing:
            reason += f"; missing: {', '.join(str(m) for m in missing)}"
        return Flag("incomplete", reason)

    # --- configuration -----------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        repository: Repository | None = None,
        references: Mapping[str, Any] | None = None,
        base_dir: Path | None = None,
        source: str = "check config",
    ) -> CheckSuite:
        """Build from a dict (the TOML layout in the module docstring; a ``[qc]`` table
        around it is accepted). References resolve from ``references`` by name, from a
        ROOT file (``"file.root:key"``) or from ``repository`` (``{path=..., run=...}``)."""
        if "qc" in config and isinstance(config["qc"], Mapping):
            config = config["qc"]
        known = {"checks", "aggregators", "min_completeness"}
        extra = sorted(set(config) - known)
        if extra:
            raise ConfigurationError(f"{source}: unknown keys {extra} (known: {sorted(known)})")
        resolver = _References(repository, references or {}, base_dir or Path.cwd(), source)
        checks = [
            _build_check(name, spec, resolver, source)
            for name, spec in _table(config, "checks", source).items()
        ]
        aggregators = []
        for name, spec in _table(config, "aggregators", source).items():
            kind = spec.get("type", "worst_of")
            if kind != "worst_of":
                raise ConfigurationError(f"{source}: aggregator {name!r} has unknown type {kind!r}")
            inputs = spec.get("checks")
            if not isinstance(inputs, list) or not inputs:
                raise ConfigurationError(f"{source}: aggregator {name!r} needs checks = [names]")
            aggregators.append(Aggregator(name, tuple(str(c) for c in inputs)))
        try:
            return cls(checks, aggregators, min_completeness=config.get("min_completeness", 0.0))
        except ConfigurationError as exc:
            raise ConfigurationError(f"{source}: {exc}") from None

    @classmethod
    def from_toml(cls, path: str | Path, **kwargs: Any) -> CheckSuite:
        path = Path(path)
        try:
            config = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigurationError(f"cannot read check config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"check config {path} is not valid TOML: {exc}") from None
        kwargs.setdefault("base_dir", path.parent)
        return cls.from_config(config, source=str(path), **kwargs)


def _force_null(result: QualityObject, flag: Flag) -> QualityObject:
    meta = dict(result.metadata)
    if result.quality is not Quality.NULL:
        meta["quality_before_completeness"] = result.quality.label
    return replace(result, quality=Quality.NULL, flags=(*result.flags, flag), metadata=meta)


def _table(config: Mapping[str, Any], key: str, source: str) -> Mapping[str, Mapping[str, Any]]:
    table = config.get(key, {})
    if not isinstance(table, Mapping) or not all(isinstance(v, Mapping) for v in table.values()):
        raise ConfigurationError(f"{source}: [{key}] must be tables, one per name")
    return table


def _build_check(name: str, spec: Mapping[str, Any], refs: _References, source: str) -> Check:
    params = dict(spec)
    kind = params.pop("type", None)
    if kind not in BUILTIN_CHECKS:
        raise ConfigurationError(
            f"{source}: check {name!r} has type {kind!r}; one of {sorted(BUILTIN_CHECKS)}"
        )
    check_cls = BUILTIN_CHECKS[kind]
    if "reference" in params:
        params["reference"] = refs.resolve(name, params["reference"])
    if kind == "function":
        params["function"] = _import_function(name, params.get("function"), source)
    accepted = set(inspect.signature(check_cls.__init__).parameters) - {"self", "name"}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ConfigurationError(
            f"{source}: check {name!r} ({kind}) has unknown parameters {unknown}; "
            f"it takes {sorted(accepted)}"
        )
    try:
        return check_cls(name, **params)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"{source}: check {name!r} ({kind}): {exc}") from None


def _import_function(name: str, target: Any, source: str) -> Any:
    if not isinstance(target, str) or ":" not in target:
        raise ConfigurationError(f"{source}: check {name!r} needs function = 'module:attribute'")
    module_name, attr = target.split(":", 1)
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"{source}: check {name!r}: cannot import {target}: {exc}"
        ) from None


class _References:
    """Finds a reference object by name, in a ROOT file, or in a repository."""

    def __init__(
        self, repository: Any, named: Mapping[str, Any], base_dir: Path, source: str
    ) -> None:
        self.repository, self.named, self.base_dir, self.source = (
            repository,
            named,
            base_dir,
            source,
        )

    def resolve(self, check: str, value: Any) -> Any:
        where = f"{self.source}: check {check!r}"
        if isinstance(value, str) and value in self.named:
            return self.named[value]
        if isinstance(value, str) and ".root:" in value:
            file, key = value.rsplit(":", 1)
            return self._from_root(where, file, key)
        if isinstance(value, Mapping) and "file" in value:
            return self._from_root(where, str(value["file"]), str(value.get("key", "")))
        if isinstance(value, str) and value.startswith("qc/"):
            value = {"path": value}
        if isinstance(value, Mapping) and "path" in value:
            return self._from_repository(where, value)
        raise ConfigurationError(
            f"{where}: reference {value!r} is neither a named reference, 'file.root:key' "
            "nor {path = 'qc/...', run = N}"
        )

    def _from_root(self, where: str, file: str, key: str) -> Any:
        import uproot

        path = Path(file) if Path(file).is_absolute() else self.base_dir / file
        try:
            with uproot.open(path) as f:
                return f[key].to_hist()
        except (OSError, KeyError, ValueError) as exc:
            raise ConfigurationError(
                f"{where}: cannot read reference {key!r} from {path}: {exc}"
            ) from None

    def _from_repository(self, where: str, spec: Mapping[str, Any]) -> Any:
        from evflow.qc.repository import Repository

        repo = self.repository
        owned = None
        if "repository" in spec:
            repo_path = Path(str(spec["repository"]))
            repo = owned = Repository(self.base_dir / repo_path, readonly=True)
        if repo is None:
            raise ConfigurationError(f"{where}: a reference from the repository needs a repository")
        try:
            stored = repo.latest(str(spec["path"]), run=spec.get("run"), at=spec.get("at"))
        finally:
            if owned is not None:
                owned.close()
        if stored is None:
            raise ConfigurationError(f"{where}: no reference {dict(spec)} in the repository")
        return stored.obj

"""Built-in checks on merged QC objects, and the ``Check`` base class for your own.

A check looks at one published object and returns a ``QualityObject``. Checks raise
freely (a wrong binning, an empty histogram): the ``CheckSuite`` turns any exception
into Null with the exception as a flag, so one broken check never stops the others.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from evflow.errors import ConfigurationError
from evflow.qc.publication import PublishedObject
from evflow.qc.quality import Flag, Quality, QualityObject
from evflow.qc.stats import TestResult, chi2_test, ks_test

Verdict = tuple[Quality, Sequence[Flag], Mapping[str, Any]]


class Check:
    """Base class: set ``kind`` (the config ``type``) and implement ``evaluate``.

    ``objects`` are the paths (fnmatch patterns allowed) the check applies to.
    """

    kind: ClassVar[str] = ""

    def __init__(self, name: str, objects: Sequence[str] = ("*",)) -> None:
        if isinstance(objects, str):
            objects = (objects,)
        self.name = name
        self.objects = tuple(objects)

    def applies_to(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in self.objects)

    def evaluate(self, obj: Any, published: PublishedObject) -> Verdict:
        raise NotImplementedError

    def __call__(self, published: PublishedObject) -> QualityObject:
        quality, flags, metadata = self.evaluate(published.obj, published)
        return QualityObject(quality, self.name, (published.path,), tuple(flags), dict(metadata))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, objects={list(self.objects)!r})"


# --- reading objects -------------------------------------------------------------------
def is_histogram(obj: Any) -> bool:
    return hasattr(obj, "axes") and hasattr(obj, "values") and hasattr(obj, "variances")


def contents(obj: Any, *, flow: bool = False) -> np.ndarray:
    """Bin contents of a histogram, or the values of an array or a number."""
    if is_histogram(obj):
        return np.asarray(obj.values(flow=flow), dtype=float)
    if isinstance(obj, np.ndarray | int | float | np.number):
        return np.asarray(obj, dtype=float)
    raise TypeError(f"cannot read contents of a {type(obj).__name__}")


def variances(obj: Any) -> np.ndarray | None:
    return None if not is_histogram(obj) else obj.variances(flow=False)


def entries(obj: Any) -> float:
    """Sum of weights including under/overflow (histograms), or sum of an array."""
    return float(contents(obj, flow=True).sum())


def mean(obj: Any, axis: int = 0) -> float:
    """Mean along ``axis`` of a histogram (bin centres, flow excluded) or mean of an array."""
    if not is_histogram(obj):
        return float(np.mean(contents(obj)))
    values = contents(obj)
    other = tuple(i for i in range(values.ndim) if i != axis)
    projected = values.sum(axis=other) if other else values
    total = projected.sum()
    if total <= 0:
        raise ValueError("mean of an empty histogram")
    return float(np.dot(obj.axes[axis].centers, projected) / total)


def _same_binning(obj: Any, ref: Any) -> None:
    if not (is_histogram(obj) and is_histogram(ref)):
        raise TypeError(f"reference test of {type(obj).__name__} against {type(ref).__name__}")
    if len(obj.axes) != len(ref.axes):
        raise ValueError(f"object has {len(obj.axes)} axes, reference {len(ref.axes)}")
    for i, (a, b) in enumerate(zip(obj.axes, ref.axes, strict=True)):
        if len(a) != len(b) or not np.allclose(a.edges, b.edges):
            raise ValueError(
                f"axis {i}: object has {len(a)} bins, reference {len(b)} or other edges"
            )


# --- built-ins -----------------------------------------------------------------------
class MeanInRange(Check):
    """Bad when the mean (along ``axis``) is outside ``[min, max]``."""

    kind = "mean_in_range"

    def __init__(
        self, name: str, objects: Sequence[str] = ("*",), *, min: float, max: float, axis: int = 0
    ) -> None:
        super().__init__(name, objects)
        self.low, self.high, self.axis = float(min), float(max), int(axis)

    def evaluate(self, obj: Any, published: PublishedObject) -> Verdict:
        m = mean(obj, self.axis)
        if self.low <= m <= self.high:
            return Quality.GOOD, (), {"mean": m}
        flag = Flag("mean_out_of_range", f"mean {m:.6g} outside [{self.low:g}, {self.high:g}]")
        return Quality.BAD, (flag,), {"mean": m}


class RangeInBounds(Check):
    """Bad when more than ``max_outside_fraction`` of the entries lie outside ``[min, max]``.

    For a histogram the bins (and under/overflow) along ``axis`` whose edges leave the
    interval count as outside; for an array, its elements outside the interval.
    """

    kind = "range_in_bounds"

    def __init__(
        self,
        name: str,
        objects: Sequence[str] = ("*",),
        *,
        min: float,
        max: float,
        axis: int = 0,
        max_outside_fraction: float = 0.0,
    ) -> None:
        super().__init__(name, objects)
        self.low, self.high, self.axis = float(min), float(max), int(axis)
        self.max_outside = float(max_outside_fraction)

    def evaluate(self, obj: Any, published: PublishedObject) -> Verdict:
        if is_histogram(obj):
            values = contents(obj, flow=True)
            other = tuple(i for i in range(values.ndim) if i != self.axis)
            projected = values.sum(axis=other) if other else values
            axis = obj.axes[self.axis]
            edges = axis.edges
            lows, highs = edges[:-1], edges[1:]
            # flow bins as (-inf, first edge) and (last edge, inf) where the axis has them
            if axis.traits.underflow:
                lows, highs = np.r_[-math.inf, lows], np.r_[edges[0], highs]
            if axis.traits.overflow:
                lows, highs = np.r_[lows, edges[-1]], np.r_[highs, math.inf]
            outside = (lows < self.low) | (highs > self.high)
            total = float(projected.sum())
            out = float(projected[outside].sum())
        else:
            values = contents(obj).ravel()
            total = float(values.size)
            out = float(np.count_nonzero((values < self.low) | (values > self.high)))
        fraction = out / total if total > 0 else 0.0
        meta = {"outside_fraction": fraction}
        if fraction <= self.max_outside:
            return Quality.GOOD, (), meta
        reason = f"{fraction:.3%} of entries outside [{self.low:g}, {self.high:g}]"
        return Quality.BAD, (Flag("out_of_range", reason),), meta


class EntriesIncreasing(Check):
    """The integral must grow from cycle to cycle: a drop is Bad, a standstill ``stalled``.

    Remembers the last entries of each path and run; a new run starts afresh.
    """

    kind = "entries_increasing"

    def __init__(
        self, name: str, objects: Sequence[str] = ("*",), *, stalled: str = "Medium"
    ) -> None:
        super().__init__(name, objects)
        self.stalled = Quality.parse(stalled)
        self._last: dict[str, tuple[int, int, float]] = {}  # path -> (run, cycle, entries)

    def evaluate(self, obj: Any, published: PublishedObject) -> Verdict:
        now = entries(obj)
        before = self._last.get(published.path)
        self._last[published.path] = (published.run, published.cycle, now)
        meta = {"entries": now}
        if before is None or before[0] != published.run:
            return Quality.GOOD, (), meta
        _, cycle, was = before
        meta["previous_entries"] = was
        where = f"cycle {cycle} -> {published.cycle}"
        if now < was:
            flag = Flag("entries_decreased", f"entries fell from {was:g} to {now:g} ({where})")
            return Quality.BAD, (flag,), meta
        if now == was:
            flag = Flag("entries_stalled", f"no new entries ({now:g}, {where})")
            return self.stalled, (flag,), meta
        return Quality.GOOD, (), meta


class _ReferenceTest(Check):
    """Compares the object's shape with a reference histogram by a p-value."""

    test: ClassVar[Callable[..., TestResult]]
    label: ClassVar[str] = ""

    def __init__(
        self,
        name: str,
        objects: Sequence[str] = ("*",),
        *,
        reference: Any,
        pvalue_bad: float = 0.01,
        pvalue_medium: float = 0.05,
    ) -> None:
        super().__init__(name, objects)
        if reference is None:
            raise ConfigurationError(f"check {name!r} needs a reference object")
        self.reference = reference
        self.pvalue_bad, self.pvalue_medium = float(pvalue_bad), float(pvalue_medium)

    def evaluate(self, obj: Any, published: PublishedObject) -> Verdict:
        _same_binning(obj, self.reference)
        result = type(self).test(
            contents(obj), contents(self.reference), variances(obj), variances(self.reference)
        )
        meta: dict[str, Any] = {"statistic": result.statistic, "pvalue": result.pvalue}
        if result.ndf:
            meta["ndf"] = result.ndf
        reason = f"{self.label} p-value {result.pvalue:.3g} against the reference"
        if result.pvalue < self.pvalue_bad:
            return Quality.BAD, (Flag(f"{self.kind}_failed", reason),), meta
        if result.pvalue < self.pvalue_medium:
            return Quality.MEDIUM, (Flag(f"{self.kind}_marginal", reason),), meta
        return Quality.GOOD, (), meta


class Chi2Reference(_ReferenceTest):
    """Chi-square comparison with a reference histogram (same binning)."""

    kind = "chi2_reference"
    label = "chi2"
    test = staticmethod(chi2_test)


class KolmogorovReference(_ReferenceTest):
    """Kolmogorov-Smirnov comparison with a 1D reference histogram (same binning)."""

    kind = "ks_reference"
    label = "Kolmogorov"
    test = staticmethod(ks_test)


class EmptyBinFraction(Check):
    """Medium above ``medium_above``, Bad above ``bad_above`` of the bins being empty."""

    kind = "empty_bin_fraction"

    def __init__(
        self,
        name: str,
        objects: Sequence[str] = ("*",),
        *,
        medium_above: float = 0.1,
        bad_above: float = 0.5,
    ) -> None:
        super().__init__(name, objects)
        self.medium_above, self.bad_above = float(medium_above), float(bad_above)

    def evaluate(self, obj: Any, published: PublishedObject) -> Verdict:
        values = contents(obj)
        if values.size == 0:
            raise ValueError("object has no bins")
        fraction = float(np.count_nonzero(values == 0)) / values.size
        meta = {"empty_fraction": fraction}
        reason = f"{fraction:.1%} of {values.size} bins empty"
        if fraction > self.bad_above:
            return Quality.BAD, (Flag("empty_bins", reason),), meta
        if fraction > self.medium_above:
            return Quality.MEDIUM, (Flag("empty_bins", reason),), meta
        return Quality.GOOD, (), meta


class FunctionCheck(Check):
    """A plain function ``fn(obj) -> Quality | (Quality, flags) | QualityObject``."""

    kind = "function"

    def __init__(
        self, name: str, objects: Sequence[str] = ("*",), *, function: Callable[[Any], Any]
    ) -> None:
        super().__init__(name, objects)
        self.function = function

    def evaluate(self, obj: Any, published: PublishedObject) -> Verdict:
        out = self.function(obj)
        if isinstance(out, QualityObject):
            return out.quality, out.flags, out.metadata
        if isinstance(out, Quality):
            return out, (), {}
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Quality):
            flags = tuple(f if isinstance(f, Flag) else Flag(str(f)) for f in out[1])
            return out[0], flags, {}
        raise TypeError(
            f"check function returned {type(out).__name__}; "
            "expected a Quality, (Quality, flags) or a QualityObject"
        )


BUILTIN_CHECKS: dict[str, type[Check]] = {
    c.kind: c
    for c in (
        MeanInRange,
        RangeInBounds,
        EntriesIncreasing,
        Chi2Reference,
        KolmogorovReference,
        EmptyBinFraction,
        FunctionCheck,
    )
}

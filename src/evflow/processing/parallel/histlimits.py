"""Size limits a histogram description from a peer must keep before it is built.

``boost_histogram.serialization.from_uhi`` allocates every bin the axes declare before
it looks at the bins that came with them: a 300-byte description of two axes of
3 x 10^6 bins asks for 7 x 10^13 cells and the process dies of ``std::bad_alloc``.
:func:`check_histogram` reads the declared axes first and refuses, with
:class:`CodecError`, a description

- with more axes than ``max_axes`` or more cells (flow bins included) than ``max_cells``;
- of an axis or storage kind it does not know, or sizes that are not ints >= 0;
- without its bins, or whose bins are fewer than the axes declare (what a histogram
  keeps is then never more than the bytes that came with it).

The limits come from the environment (read once per process; see
:func:`current_limits`), or are passed explicitly.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from evflow.errors import CodecError, ConfigurationError

__all__ = [
    "ENV_MAX_AXES",
    "ENV_MAX_CELLS",
    "ENV_MAX_OBJECTS",
    "HistogramLimits",
    "check_histogram",
    "current_limits",
]

ENV_MAX_CELLS = "EVFLOW_MAX_HIST_CELLS"
ENV_MAX_AXES = "EVFLOW_MAX_HIST_AXES"
ENV_MAX_OBJECTS = "EVFLOW_MAX_QC_OBJECTS"

#: boost-histogram refuses 32 axes or more
_AXES_CEILING = 31

# the storage arrays of each UHI storage type (all of one shape: the axes' extents)
_STORAGE_KEYS: dict[str, tuple[str, ...]] = {
    "int": ("values",),
    "double": ("values",),
    "weighted": ("values", "variances"),
    "mean": ("counts", "values", "variances"),
    "weighted_mean": ("sum_of_weights", "sum_of_weights_squared", "values", "variances"),
}


@dataclass(frozen=True, slots=True)
class HistogramLimits:
    """What one decoded message may declare.

    ``max_cells``: cells of one histogram, flow bins included (10^7 by default: 80 MB
    of Double bins, 320 MB of WeightedMean); every axis is bounded by it too.
    ``max_axes``: axes of one histogram. ``max_objects``: objects named in one QC
    message (a producer's delta lists each of its objects once).
    """

    max_cells: int = 10_000_000
    max_axes: int = 16
    max_objects: int = 65_536

    def __post_init__(self) -> None:
        for name in ("max_cells", "max_axes", "max_objects"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigurationError(
                    f"histogram limit {name} must be an int >= 1, got {value!r}"
                )
        if self.max_axes > _AXES_CEILING:
            raise ConfigurationError(
                f"histogram limit max_axes must be <= {_AXES_CEILING} (boost-histogram's "
                f"own limit), got {self.max_axes}"
            )


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw.replace("_", ""))
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise ConfigurationError(f"{name}={raw!r} must be >= 1")
    return value


@lru_cache(maxsize=1)
def current_limits() -> HistogramLimits:
    """The limits of this process: the defaults, or ``EVFLOW_MAX_HIST_CELLS``,
    ``EVFLOW_MAX_HIST_AXES`` and ``EVFLOW_MAX_QC_OBJECTS`` when set (read once; a bad
    value raises ConfigurationError naming the variable)."""
    d = HistogramLimits()
    return HistogramLimits(
        max_cells=_env_int(ENV_MAX_CELLS, d.max_cells),
        max_axes=_env_int(ENV_MAX_AXES, d.max_axes),
        max_objects=_env_int(ENV_MAX_OBJECTS, d.max_objects),
    )


def _count(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise CodecError(f"histogram {what} is {value!r:.40}, expected an int >= 0")
    return value


def _length(value: Any, what: str) -> int:
    if not isinstance(value, list | np.ndarray):
        raise CodecError(f"histogram {what} is a {type(value).__name__}, expected a list")
    return len(value)


def _flow(ax: dict[Any, Any], *keys: str) -> tuple[int, int]:
    """(fewest, most) flow bins the flags ``keys`` of ``ax`` may add (a flag that is not
    a bool may still be read as one)."""
    values = [ax.get(k) for k in keys]
    return sum(v is True for v in values), sum(v is not False for v in values)


def _axis_bins(ax: Any) -> tuple[int, int]:
    """(fewest, most) cells the axis ``ax`` (a UHI dict) may have, flow bins included.

    Every reading ``from_uhi`` may take is counted (an Integer axis or a transformed
    Regular one declares its bins twice), so the true size lies in between.
    """
    if type(ax) is not dict:
        raise CodecError(f"histogram axis is a {type(ax).__name__}, expected a map")
    info = ax.get("writer_info", {})
    mine = info.get("boost-histogram", {}) if type(info) is dict else {}
    if type(mine) is not dict:
        raise CodecError("histogram axis with a malformed writer_info")
    kind = ax.get("type")
    under_over = _flow(ax, "underflow", "overflow")
    if kind == "regular":
        readings = [(_count(ax.get("bins"), "axis bins"), under_over)]
    elif kind == "variable":
        readings = [(max(_length(ax.get("edges"), "axis edges") - 1, 0), under_over)]
    elif kind in ("category_int", "category_str"):
        readings = [(_length(ax.get("categories"), "axis categories"), _flow(ax, "flow"))]
    elif kind == "boolean":
        readings = [(2, (0, 0))]
    else:
        raise CodecError(f"histogram axis of unknown type {kind!r:.40}")
    if mine.get("orig_type") == "Integer":
        lower, upper = ax.get("lower"), ax.get("upper")
        if type(lower) is not int or type(upper) is not int:
            raise CodecError("integer histogram axis with bounds that are not ints")
        readings.append((_count(upper - lower, "integer axis size"), under_over))
    if mine.get("transform"):  # rebuilt as a Regular axis with both flow bins
        readings.append((_count(mine.get("bins"), "transformed axis bins"), (2, 2)))
    fewest = min(bins + flow[0] for bins, flow in readings)
    most = max(bins + flow[1] for bins, flow in readings)
    return fewest, most


def check_histogram(desc: Any, limits: HistogramLimits | None = None) -> None:
    """Raise CodecError unless the UHI description ``desc`` (its arrays restored) keeps
    the limits and carries the bins its axes declare; see the module docstring."""
    lim = limits or current_limits()
    if type(desc) is not dict:
        raise CodecError(f"histogram description is a {type(desc).__name__}, expected a map")
    axes = desc.get("axes")
    if type(axes) is not list:
        raise CodecError("histogram description without a list of axes")
    if len(axes) > lim.max_axes:
        raise CodecError(
            f"histogram of {len(axes)} axes refused (at most {lim.max_axes}; "
            f"{ENV_MAX_AXES} raises the limit)"
        )
    bounds = [_axis_bins(ax) for ax in axes]
    fewest = math.prod(low for low, _ in bounds)
    # (an axis alone is bounded too: another one of 0 cells makes the product 0)
    if math.prod(high for _, high in bounds) > lim.max_cells or any(
        low > lim.max_cells for low, _ in bounds
    ):
        sizes = " x ".join(str(high) for _, high in bounds)
        raise CodecError(
            f"histogram of {sizes} cells (flow bins included) refused: at most "
            f"{lim.max_cells} cells ({ENV_MAX_CELLS} raises the limit)"
        )
    storage = desc.get("storage")
    if type(storage) is not dict or storage.get("type") not in _STORAGE_KEYS:
        kind = storage.get("type") if type(storage) is dict else None
        raise CodecError(f"histogram of unknown storage {kind!r:.40}")
    for key in _STORAGE_KEYS[storage["type"]]:
        data = storage.get(key)
        if type(data) is not np.ndarray:
            raise CodecError(f"histogram without its bins ({key!r} missing)")
        # the bins are the view with flow bins; each axis declares at least ``low``
        if data.ndim != len(axes) or math.prod(data.shape) < fewest:
            raise CodecError(
                f"histogram bins {key!r} of shape {data.shape} do not fit its "
                f"{len(axes)} axes of at least {fewest} cells"
            )

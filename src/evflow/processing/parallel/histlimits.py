"""Size limits a histogram description from a peer must keep before it is built.

``boost_histogram.serialization.from_uhi`` allocates every bin the axes declare before
it looks at the bins that came with them: a 240-byte description of two axes of
3 x 10^6 bins asks for 9 x 10^12 cells and the process dies of ``std::bad_alloc``.
:func:`check_histogram` reads the declared axes first and refuses, with
:class:`CodecError`, a description

- of an axis or storage kind it does not know, or sizes and flags of the wrong type;
- without its bins, or whose bins have another shape than its axes make: what a
  histogram holds is then exactly the bytes that came with it;
- with more axes than ``max_axes`` or more cells (flow bins included) than
  ``max_cells``.

QC decoding (mergers, the repository, the viewer) uses :func:`current_limits`: the
defaults, or the environment. The parallel engine's own persistent objects (between
the processes of one run) use :data:`ENGINE_LIMITS`: only the bins must come along, a
histogram may be as large as the user books it.
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
    "ENGINE_LIMITS",
    "ENV_MAX_AXES",
    "ENV_MAX_CELLS",
    "ENV_MAX_OBJECTS",
    "HistogramLimits",
    "axis_extent",
    "check_histogram",
    "current_limits",
]

ENV_MAX_CELLS = "EVFLOW_MAX_HIST_CELLS"
ENV_MAX_AXES = "EVFLOW_MAX_HIST_AXES"
ENV_MAX_OBJECTS = "EVFLOW_MAX_QC_OBJECTS"

#: boost-histogram refuses 32 axes or more
_AXES_CEILING = 31
#: transforms a Regular axis is rebuilt with from its writer_info
_TRANSFORMS = ("pow", "log", "sqrt")

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


#: the parallel engine's persistent objects: bins backed by the bytes received, no cap
ENGINE_LIMITS = HistogramLimits(max_cells=1 << 62, max_axes=_AXES_CEILING, max_objects=1 << 31)


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


def _flag(ax: dict[Any, Any], key: str) -> int:
    value = ax.get(key)
    if type(value) is not bool:  # (boost-histogram reads any object as a bool)
        raise CodecError(f"histogram axis flag {key!r} is {value!r:.40}, expected a bool")
    return int(value)


def axis_extent(ax: Any) -> int:
    """The cells, flow bins included, of the axis that ``from_uhi`` builds from the UHI
    dict ``ax`` (read as boost-histogram reads it: a transformed Regular axis from its
    writer_info, with both flow bins)."""
    if type(ax) is not dict:
        raise CodecError(f"histogram axis is a {type(ax).__name__}, expected a map")
    info = ax.get("writer_info", {})
    mine = info.get("boost-histogram", {}) if type(info) is dict else None
    if type(mine) is not dict:
        raise CodecError("histogram axis with a malformed writer_info")
    if mine.get("transform") in _TRANSFORMS:
        return _count(mine.get("bins"), "transformed axis bins") + 2
    kind = ax.get("type")
    if kind == "regular":
        bins = _count(ax.get("bins"), "axis bins")
        if mine.get("orig_type") == "Integer":
            lower, upper = ax.get("lower"), ax.get("upper")
            if type(lower) is not int or type(upper) is not int or upper - lower != bins:
                raise CodecError("integer histogram axis whose bounds do not give its bins")
        return bins + _flag(ax, "underflow") + _flag(ax, "overflow")
    if kind == "variable":
        edges = _length(ax.get("edges"), "axis edges")
        return max(edges - 1, 0) + _flag(ax, "underflow") + _flag(ax, "overflow")
    if kind in ("category_int", "category_str"):
        return _length(ax.get("categories"), "axis categories") + _flag(ax, "flow")
    if kind == "boolean":
        return 2
    raise CodecError(f"histogram axis of unknown type {kind!r:.40}")


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
    extents = tuple(axis_extent(ax) for ax in axes)
    # (an axis alone is bounded too: another one of 0 cells makes the product 0)
    if math.prod(extents) > lim.max_cells or any(n > lim.max_cells for n in extents):
        sizes = " x ".join(map(str, extents))
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
        # the bins are the view with flow bins: as many as the axes make (the shape
        # may differ: a histogram without axes sends its one cell as shape (1,))
        if data.size != math.prod(extents):
            raise CodecError(
                f"histogram bins {key!r} of shape {data.shape}, its axes make {extents}"
            )

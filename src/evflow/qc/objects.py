"""QC objects on the wire and in the repository: a safe, versioned codec (no pickle),
and merging by name.

``encode_object(obj) -> bytes`` and ``decode_object(data) -> obj`` are the contract
the producers, mergers, repository and viewer share. What travels:

- hist / boost-histogram histograms of any dimension and storage (their UHI
  description, arrays as raw buffers: the persistent-object codec of the parallel
  engine);
- numbers (counters) and numeric numpy arrays (added element-wise);
- :class:`~evflow.qc.recordbatch.RecordBatch` (columns appended, like a TTree, with a
  size cap) and :class:`~evflow.qc.recordbatch.ConcatArray` (an array that grows).

``merge(a, b)`` is ``a += b`` with the QC rules: incompatible objects (type, binning,
columns) raise :class:`~evflow.errors.IncompatibleObjectsError` naming both sides; an
object with no merge raises :class:`~evflow.errors.NotMergeableError`.

Format (version 1): msgpack ``{"qv": 1, "h": header, "f": frames}`` for the kinds of
the persistent-object codec, ``{"qv": 1, "k": "rb" | "cat", "cap", "dropped",
"cols": [[name, dtype, bytes], ...]}`` for record batches.
"""

from __future__ import annotations

import numbers
from typing import Any

import msgpack
import numpy as np

from evflow.errors import (
    CodecError,
    ConfigurationError,
    IncompatibleObjectsError,
    NotMergeableError,
)
from evflow.processing.parallel.histlimits import HistogramLimits, current_limits
from evflow.processing.parallel.persist import decode_persistent, encode_persistent
from evflow.qc.recordbatch import ConcatArray, RecordBatch

__all__ = [
    "OBJECT_FORMAT_VERSION",
    "check_compatible",
    "copy_object",
    "decode_object",
    "describe",
    "encode_object",
    "is_mergeable",
    "merge",
    "subtract",
]

OBJECT_FORMAT_VERSION = 1
_NAME = "o"
_BATCH_KINDS: dict[str, type[RecordBatch]] = {"rb": RecordBatch, "cat": ConcatArray}


def _histogram_type() -> Any:
    # (Any, not type: an isinstance against a plain ``type`` hides the histogram's API)
    import boost_histogram

    return boost_histogram.Histogram


def encode_object(obj: Any) -> bytes:
    """One QC object as bytes; raises CodecError for a type that cannot travel safely."""
    if isinstance(obj, RecordBatch):
        kind = "cat" if isinstance(obj, ConcatArray) else "rb"
        cols = [[k, v.dtype.str, v.tobytes()] for k, v in obj.columns().items()]
        return msgpack.packb(
            {
                "qv": OBJECT_FORMAT_VERSION,
                "k": kind,
                "cap": obj.max_rows,
                "dropped": obj.dropped,
                "cols": cols,
            }
        )
    header, frames, skipped = encode_persistent({_NAME: obj})
    if skipped:
        raise CodecError(f"QC object of type {type(obj).__name__} cannot be encoded")
    blobs = [bytes(f) for f in frames]
    return msgpack.packb({"qv": OBJECT_FORMAT_VERSION, "h": header, "f": blobs})


def _decode_batch(outer: dict[Any, Any]) -> RecordBatch:
    cls = _BATCH_KINDS[outer["k"]]
    cols = outer["cols"]
    if not isinstance(cols, list) or not cols:
        raise CodecError("record batch without columns")
    schema = {str(name): dtype for name, dtype, _ in cols}
    if cls is ConcatArray:
        if list(schema) != ["values"]:
            raise CodecError(f"concat array with columns {list(schema)}")
        out: RecordBatch = ConcatArray(schema["values"], int(outer["cap"]))
    else:
        out = RecordBatch(schema, int(outer["cap"]))
    arrays = {str(n): np.frombuffer(raw, dtype=out.schema[str(n)]) for n, _, raw in cols}
    if len(next(iter(arrays.values()))) > out.max_rows:
        raise CodecError(f"record batch of more rows than its cap {out.max_rows}")
    out.extend(arrays, dropped=int(outer["dropped"]))
    return out


def decode_object(data: bytes | memoryview, limits: HistogramLimits | None = None) -> Any:
    """Inverse of ``encode_object``; raises CodecError for bytes that are not one, and
    for a histogram beyond ``limits`` (default: ``current_limits()``, see
    :mod:`evflow.processing.parallel.histlimits`)."""
    try:
        outer = msgpack.unpackb(data)
        if not isinstance(outer, dict) or outer.get("qv") != OBJECT_FORMAT_VERSION:
            version = outer.get("qv") if isinstance(outer, dict) else None
            raise CodecError(
                f"QC object in format version {version!r}, "
                f"this evflow reads version {OBJECT_FORMAT_VERSION}"
            )
        if "k" in outer:
            if outer["k"] not in _BATCH_KINDS:
                raise CodecError(f"QC object of unknown kind {outer['k']!r:.40}")
            return _decode_batch(outer)
        lim = limits or current_limits()
        return decode_persistent(outer["h"], list(outer["f"]), lim)[_NAME]
    except CodecError:
        raise
    except (
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        ConfigurationError,
        IncompatibleObjectsError,
        msgpack.UnpackException,
    ) as exc:
        raise CodecError(f"not a QC object: {type(exc).__name__}: {exc}") from None


# --- merging -------------------------------------------------------------------------
def describe(obj: Any) -> str:
    """A short description naming the type and, for a histogram, its axes and storage."""
    hist_type = _histogram_type()
    if isinstance(obj, hist_type):
        axes = ", ".join(
            f"{type(ax).__name__}({len(ax)}, {ax.edges[0]:g}..{ax.edges[-1]:g})"
            if hasattr(ax, "edges") and len(ax)
            else f"{type(ax).__name__}({len(ax)})"
            for ax in obj.axes
        )
        return f"{type(obj).__name__}[{axes}; {obj.storage_type.__name__}]"
    if isinstance(obj, np.ndarray):
        return f"ndarray[{obj.dtype}, shape {obj.shape}]"
    if isinstance(obj, RecordBatch):
        return repr(obj)
    return type(obj).__name__


def _is_number(obj: Any) -> bool:
    return isinstance(obj, numbers.Number) and not isinstance(
        obj, bool | complex | np.bool_ | np.complexfloating
    )


def is_mergeable(obj: Any) -> bool:
    """Whether ``obj`` is of a kind that ``merge`` knows."""
    return (
        isinstance(obj, _histogram_type() | RecordBatch)
        or (isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc")
        or _is_number(obj)
    )


def _incompatible(name: str, a: Any, b: Any, sides: tuple[str, str], why: str) -> None:
    label = f"QC object {name!r}: " if name else ""
    raise IncompatibleObjectsError(
        f"{label}cannot merge {describe(b)} from {sides[1]} into {describe(a)} "
        f"from {sides[0]} ({why})"
    )


def check_compatible(
    a: Any, b: Any, name: str = "", sides: tuple[str, str] = ("merged", "delta")
) -> None:
    """Raise unless ``merge(a, b)`` can work (see :func:`merge` for the errors)."""
    for obj, side in ((a, sides[0]), (b, sides[1])):
        if not is_mergeable(obj):
            label = f"QC object {name!r}" if name else "QC object"
            raise NotMergeableError(
                f"{label} from {side} is a {type(obj).__name__}, which cannot be merged "
                f"(histograms, numbers, numeric arrays and record batches can)"
            )
    hist_type = _histogram_type()
    if isinstance(a, hist_type) or isinstance(b, hist_type):
        if not (isinstance(a, hist_type) and isinstance(b, hist_type)):
            _incompatible(name, a, b, sides, "not both histograms")
        if a.storage_type is not b.storage_type:
            _incompatible(name, a, b, sides, "other storage")
        if a.axes != b.axes and not any(ax.traits.growth for ax in a.axes):
            _incompatible(name, a, b, sides, "other binning")
    elif isinstance(a, RecordBatch) or isinstance(b, RecordBatch):
        if not (isinstance(a, RecordBatch) and a.compatible(b)):
            _incompatible(name, a, b, sides, "other type or columns")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            _incompatible(name, a, b, sides, "not both arrays")
        if a.shape != b.shape:
            _incompatible(name, a, b, sides, "other shape")
        if not np.can_cast(b.dtype, a.dtype, "same_kind"):
            _incompatible(name, a, b, sides, "other dtype")


def merge(a: Any, b: Any, name: str = "", sides: tuple[str, str] = ("merged", "delta")) -> Any:
    """``a += b`` for QC objects; returns the merged object (``a`` itself when in place).

    Raises IncompatibleObjectsError (naming both sides: ``sides`` says where each came
    from) or NotMergeableError (a kind with no merge).
    """
    check_compatible(a, b, name, sides)
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        return a + b
    try:
        a += b
    except (ValueError, TypeError) as exc:
        _incompatible(name, a, b, sides, str(exc))
    return a


def subtract(later: Any, earlier: Any, name: str = "") -> Any:
    """What was added to an object between two of its integrals: ``later - earlier``.

    ``earlier`` is an older integral of the same source (a lower merger's publication
    of a previous cycle); the result is a new object. Histograms of additive storages
    subtract bin by bin (a Weight's sum of weights and of squared weights alike);
    numbers and arrays subtract; record batches keep the rows after those of
    ``earlier``, which must be their first rows (a lower merger's integral of its
    producers' deltas is; one of producers in full mode is not). Raises
    NotMergeableError for a kind that does not subtract (Mean storages) and
    IncompatibleObjectsError if the two do not match (binning changed, rows not
    appended).
    """
    sides = ("a later integral", "an earlier integral")
    check_compatible(later, earlier, name, sides)
    if isinstance(later, RecordBatch):
        out = later.empty_like()
        start = len(earlier)
        cols, before = later.columns(), earlier.columns()
        if any(not np.array_equal(cols[k][:start], v) for k, v in before.items()):
            _incompatible(name, later, earlier, sides, "rows not appended: cannot subtract")
        out.extend(
            {k: v[start:] for k, v in cols.items()},
            dropped=max(0, later.dropped - earlier.dropped),
        )
        return out
    if isinstance(later, _histogram_type()):
        if later.axes != earlier.axes:
            _incompatible(name, later, earlier, sides, "binning changed: cannot subtract")
        from boost_histogram import storage

        if not issubclass(later.storage_type, storage.Double | storage.Int64 | storage.Weight):
            label = f"QC object {name!r}" if name else "QC object"
            raise NotMergeableError(
                f"{label} has {later.storage_type.__name__} storage: it cannot be subtracted "
                "(the window or reset of an upper merger needs Double, Int64 or Weight)"
            )
        out = later.copy(deep=False)
        mine = out.view(flow=True).view(np.ndarray)
        theirs = earlier.view(flow=True).view(np.ndarray)
        for field in mine.dtype.names or (None,):
            if field is None:
                mine -= theirs
            else:
                mine[field] -= theirs[field]
        return out
    return later - earlier


def copy_object(obj: Any) -> Any:
    """A deep copy of a QC object (histograms, arrays, record batches; numbers as is)."""
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, _histogram_type()):
        # the bins are copied; a deep copy would also copy the axes' Python metadata
        # (5-10 times slower), which nothing here changes
        return obj.copy(deep=False)
    copy = getattr(obj, "copy", None)
    return copy() if callable(copy) else obj

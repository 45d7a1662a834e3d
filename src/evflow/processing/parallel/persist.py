"""Run-level objects (``store.persistent``) over the wire and merged, never pickled.

Histograms (hist / boost-histogram) travel as their UHI description (axes, storage
type, metadata) with numpy arrays as raw frames; numpy arrays and plain numbers
travel as themselves. Merging uses ``+=`` (falling back to ``+``), like basf2's
HistoManager adding up the histograms of all workers.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any

import msgpack
import numpy as np

from evflow.errors import CodecError, ConfigurationError
from evflow.processing.parallel.histlimits import ENGINE_LIMITS, HistogramLimits, check_histogram
from evflow.wire.codec import array_from_buffer, parse_dtype

FORMAT_VERSION = 1


def _strip_arrays(obj: Any, frames: list[Any]) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        frames.append(arr.tobytes())
        return {"__nd__": len(frames) - 1, "dtype": arr.dtype.str, "shape": list(arr.shape)}
    if isinstance(obj, dict):
        return {k: _strip_arrays(v, frames) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strip_arrays(v, frames) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _restore_arrays(obj: Any, frames: list[Any], copy: bool = True) -> Any:
    """``obj`` with its array references replaced by the arrays; ``copy=False``: read-only
    views on the frames (for a histogram, whose storage copies them in any case)."""
    if isinstance(obj, dict):
        if "__nd__" in obj:
            index = obj["__nd__"]
            if type(index) is not int or not 0 <= index < len(frames):
                raise CodecError(f"array reference {index!r:.20} to none of {len(frames)} frames")
            # (dtype, shape and byte count checked as in the event codec)
            arr = array_from_buffer(parse_dtype(obj.get("dtype")), obj.get("shape"), frames[index])
            return arr.copy() if copy else arr
        return {k: _restore_arrays(v, frames, copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore_arrays(v, frames, copy) for v in obj]
    return obj


def loaded_histogram_type() -> Any:
    """``boost_histogram.Histogram`` if that package is imported, else None.

    A histogram exists only if its package was imported, so code that only asks "is
    this a histogram?" must not import it: that cost every role ~0.1 s at the end of
    a run that had none.
    """
    # (Any, not type: an isinstance against a plain ``type`` hides the histogram's API)
    bh = sys.modules.get("boost_histogram")
    return None if bh is None else bh.Histogram


def encode_persistent(objects: dict[str, Any]) -> tuple[bytes, list[Any], list[str]]:
    """Encode the mergeable objects of ``objects``.

    Returns (header bytes, frames, names skipped because they cannot travel safely).
    """
    histogram = loaded_histogram_type()  # (no import: none exists if it is not loaded)
    items: list[Any] = []
    frames: list[Any] = []
    skipped: list[str] = []
    for name, value in objects.items():
        if histogram is not None and isinstance(value, histogram):
            from boost_histogram import serialization

            kind = "hist" if type(value).__module__.startswith("hist") else "bh"
            desc = _strip_arrays(serialization.to_uhi(value), frames)
            items.append([name, kind, desc])
        elif isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
            items.append([name, "nd", _strip_arrays(value, frames)])
        elif isinstance(value, numbers.Number) and not isinstance(value, bool):
            v = value.item() if isinstance(value, np.generic) else value
            if isinstance(v, complex):
                skipped.append(name)
                continue
            items.append([name, "num", v])
        else:
            skipped.append(name)
    header = msgpack.packb({"v": FORMAT_VERSION, "items": items})
    return header, frames, skipped


def decode_persistent(
    header: bytes | memoryview, frames: list[Any], limits: HistogramLimits | None = None
) -> dict[str, Any]:
    """Inverse of ``encode_persistent``; raises ConfigurationError on an unknown version
    and CodecError for a histogram beyond ``limits`` (default ``ENGINE_LIMITS``: its
    bins must come along; QC passes ``current_limits()``) or an array that does not
    match its frame."""
    lim = limits or ENGINE_LIMITS
    head = msgpack.unpackb(header)
    if type(head) is not dict or head.get("v") != FORMAT_VERSION:
        version = head.get("v") if type(head) is dict else None
        raise ConfigurationError(
            f"persistent objects in format version {version!r}, "
            f"this evflow reads version {FORMAT_VERSION}"
        )
    items = head.get("items")
    if type(items) is not list or len(items) > lim.max_objects:
        count = len(items) if type(items) is list else None
        raise CodecError(
            f"persistent objects: {count!r} items (a list of at most {lim.max_objects})"
        )
    out: dict[str, Any] = {}
    for name, kind, desc in items:
        if kind in ("hist", "bh"):
            # from_uhi copies the bins into the histogram's storage: no copy before it
            data = _restore_arrays(desc, frames, copy=False)
            check_histogram(data, lim)  # before from_uhi allocates what the axes declare
            if kind == "hist":
                from hist import serialization as hser

                out[name] = hser.from_uhi(data)
            else:
                from boost_histogram import serialization

                out[name] = serialization.from_uhi(data)
        elif kind == "nd":
            out[name] = _restore_arrays(desc, frames)
        elif kind == "num":
            out[name] = desc
    return out


def merge_into(target: dict[str, Any], other: dict[str, Any], source: str) -> None:
    """Add every object of ``other`` into ``target`` (``+=``; new names are taken as is)."""
    for name, value in other.items():
        if name not in target:
            target[name] = value
            continue
        mine = target[name]
        try:
            try:
                mine += value
            except TypeError:
                mine = mine + value
        except Exception as exc:
            raise ConfigurationError(
                f"cannot merge persistent object {name!r} from {source} "
                f"({type(value).__name__}) into {type(target[name]).__name__}: {exc}"
            ) from exc
        target[name] = mine

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

from evflow.errors import ConfigurationError

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
            raw = frames[int(obj["__nd__"])]
            arr = np.frombuffer(raw, dtype=obj["dtype"]).reshape(obj["shape"])
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


def decode_persistent(header: bytes | memoryview, frames: list[Any]) -> dict[str, Any]:
    """Inverse of ``encode_persistent``; raises ConfigurationError on an unknown version."""
    head = msgpack.unpackb(header)
    if head.get("v") != FORMAT_VERSION:
        raise ConfigurationError(
            f"persistent objects in format version {head.get('v')!r}, "
            f"this evflow reads version {FORMAT_VERSION}"
        )
    out: dict[str, Any] = {}
    for name, kind, desc in head["items"]:
        if kind in ("hist", "bh"):
            # from_uhi copies the bins into the histogram's storage: no copy before it
            data = _restore_arrays(desc, frames, copy=False)
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

"""Persistent-object deltas: what a worker filled since its last send, merged per batch.

A worker that dies loses what is in its memory. So that the merged histograms equal
those of the events actually written, a worker sends with every batch's results the
*delta* of its ``store.persistent`` objects (what that batch filled) and resets them
to empty; the output merges a delta when it accepts the batch's events (and drops it
when every event of the batch is a duplicate). A batch that dies with its worker
takes its delta with it, and the events are re-sent: nothing is lost or counted twice.

What is mergeable with ``+=`` (and so what can travel as a delta):

- boost-histogram / hist histograms. Double, Int64, AtomicInt64 and Weight storages
  travel as their raw bin array (flow bins included; the axes travel once per worker
  and object as a cached *spec*), reset with ``h.reset()``; other storages (Mean,
  WeightedMean, Unlimited) travel whole and are merged with ``+=``.
- numeric numpy arrays (added element-wise, reset to zero in place so modules that
  hold a reference keep filling the same array);
- int and float numbers: counters, summed (reset to 0). A number that is *set* rather
  than added (a version, a maximum) is not mergeable this way: keep it elsewhere.

Everything else stays in the worker and is reported once, as not merged, at the end.
Objects are seen by a module as "this worker's fills since its last batch": a module
must not read its own histogram to make decisions during the run.

Wire format of a delta (extra payload frames at the end of the worker's EVENTS
message, ``d`` = how many): ``[head, *arrays]`` where ``head`` is msgpack
``{"v": 1, "items": [[name, kind, ...], ...]}``. Kinds: ``h`` [spec bytes, frame
index] raw bin array of an additive histogram; ``x`` [spec bytes] a whole histogram
(``spec``: msgpack ``[head, *frames]`` of ``encode_persistent``, a frame of zeros
given as its length: an empty histogram's spec holds no bins); ``nd`` [dtype, shape, frame
index]; ``num`` [value]. A malformed delta raises ``CodecError``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from evflow.errors import CodecError, ConfigurationError
from evflow.processing.parallel.histlimits import ENGINE_LIMITS, HistogramLimits
from evflow.processing.parallel.persist import (
    decode_persistent,
    encode_persistent,
    loaded_histogram_type,
    merge_into,
)
from evflow.wire.codec import array_from_buffer, parse_dtype

DELTA_VERSION = 1


def _bh() -> Any:
    """boost_histogram, imported on first use: importing the engine must stay quick (a
    Ctrl-C right after start must find evflow's handlers, not a C extension's init)."""
    import boost_histogram

    return boost_histogram


def _additive() -> tuple[type, ...]:
    """Storages whose bins add up element-wise (so the raw array is the whole delta)."""
    st = _bh().storage
    return (st.Double, st.Int64, st.AtomicInt64, st.Weight)


#: the most zero bytes one spec may ask for (a frame sent as its length)
MAX_ZERO_FRAME = 1 << 31
#: beyond the size of the message itself, the zero bytes a whole histogram (kind ``x``)
#: may ask for: an empty non-additive histogram travels as its description only
X_ZERO_ALLOWANCE = 1 << 26


def _pack_spec(obj: Any) -> bytes:
    """A histogram's description: its persistent encoding, a frame of zeros (the bins of
    an empty histogram) sent as its length. The spec of an empty 500 kB histogram is a
    few hundred bytes, not 500 kB: it travels in every delta head and the merger
    compares heads to find their plan."""
    head, frames, _ = encode_persistent({"t": obj})
    packed = [len(f) if not np.frombuffer(f, dtype=np.uint8).any() else bytes(f) for f in frames]
    return msgpack.packb([head, *packed])


def _unpack_spec(spec: bytes, zero_limit: int, limits: HistogramLimits) -> tuple[Any, int]:
    """The histogram of a spec and the zero bytes it asked for. ``zero_limit``: the most
    zero bytes the spec may ask for in all. A spec comes from a peer: without a limit a
    few hundred bytes could make us allocate gigabytes."""
    head, *frames = msgpack.unpackb(spec)
    asked = 0
    for i, frame in enumerate(frames):
        if type(frame) is int:
            if not 0 <= frame <= min(MAX_ZERO_FRAME, zero_limit - asked):
                raise CodecError(
                    f"histogram delta spec asks for {frame} zero bytes (at most "
                    f"{min(MAX_ZERO_FRAME, zero_limit - asked)} here)"
                )
            asked += frame
            frames[i] = bytes(frame)
    return decode_persistent(head, frames, limits)["t"], asked


class _HistEntry:
    """What the encoder keeps per histogram: its spec and, without growing axes, its view."""

    __slots__ = ("additive", "hist", "shape", "spec", "view")

    def __init__(self, hist: Any) -> None:
        self.hist = hist
        view = hist.view(flow=True)
        self.shape = view.shape
        self.additive = issubclass(hist.storage_type, _additive())
        # a histogram without growing axes never reallocates its bins (reset and fill
        # work in place), so its view can be kept: asking for one costs ~8 us (dtype
        # parsing), storage_type ~40 us
        self.view = None if any(ax.traits.growth for ax in hist.axes) else view
        empty = hist.copy()
        empty.reset()
        self.spec = _pack_spec(empty) if self.additive else b""


class DeltaEncoder:
    """Encodes the persistent objects of one process as deltas (the worker's side).

    ``take(objects)`` returns the frames of everything filled since the last call and
    resets the objects; ``snapshot(objects)`` encodes without resetting (the output's
    saved state). A histogram's spec (axes, storage type, metadata) is computed once
    per object and bin-array shape (a growing axis changes the shape), so a delta of
    a 100-bin histogram costs a copy of its bins, not a full serialization.
    """

    __slots__ = ("_hists",)

    def __init__(self) -> None:
        self._hists: dict[str, _HistEntry] = {}

    def _entry(self, name: str, hist: Any) -> tuple[_HistEntry, Any]:
        entry = self._hists.get(name)
        if entry is not None and entry.hist is hist:
            if entry.view is not None:
                return entry, entry.view
            view = hist.view(flow=True)  # growing axes: the bins may have moved
            if view.shape == entry.shape:
                return entry, view
        entry = self._hists[name] = _HistEntry(hist)
        return entry, hist.view(flow=True)

    def take(self, objects: dict[str, Any]) -> list[bytes] | None:
        """Frames of the delta since the last call, objects reset; None if nothing filled."""
        return self._encode(objects, reset=True)

    def snapshot(self, objects: dict[str, Any]) -> list[bytes] | None:
        """Frames of ``objects`` as a delta from empty (no reset); None if all empty."""
        return self._encode(objects, reset=False)

    def _encode(self, objects: dict[str, Any], reset: bool) -> list[bytes] | None:
        items: list[list[Any]] = []
        frames: list[bytes] = [b""]  # frame 0 is the head
        histogram = loaded_histogram_type()
        for name, value in objects.items():
            if histogram is not None and isinstance(value, histogram):
                entry, view = self._entry(name, value)
                raw = np.ascontiguousarray(view).tobytes()
                if not np.frombuffer(raw, dtype=np.uint8).any():
                    continue  # nothing filled: nothing to send
                if entry.additive:
                    items.append([name, "h", entry.spec, len(frames)])
                    frames.append(raw)
                else:
                    items.append([name, "x", _pack_spec(value)])
                if reset:
                    value.reset()
            elif isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
                if not value.any():
                    continue
                items.append([name, "nd", value.dtype.str, list(value.shape), len(frames)])
                frames.append(np.ascontiguousarray(value).tobytes())
                if reset:
                    value[...] = 0
            elif (
                isinstance(value, numbers.Number)
                and not isinstance(value, bool | complex | np.bool_ | np.complexfloating)
                and value
            ):
                v = value.item() if isinstance(value, np.generic) else value
                items.append([name, "num", v])
                if reset:
                    zero: Any = type(value)  # (int, float or a numpy scalar type)
                    objects[name] = zero(0)
        if not items:
            return None
        frames[0] = msgpack.packb({"v": DELTA_VERSION, "items": items})
        return frames


class DeltaMerger:
    """The running merged state of the deltas (the output's side).

    ``merge(frames)`` decodes and adds one delta into ``merged``; it raises
    ``CodecError`` for a malformed delta (nothing of it merged) and records objects
    that cannot be merged (another type or binning under the same name) in
    ``not_merged`` instead of raising, so a bad peer never stops the output.
    """

    __slots__ = ("_plans", "_targets", "_templates", "limits", "merged", "not_merged")

    def __init__(self, limits: HistogramLimits | None = None) -> None:
        #: what a decoded histogram may declare (default ``ENGINE_LIMITS``; QC mergers
        #: pass ``current_limits()``)
        self.limits = limits or ENGINE_LIMITS
        self.merged: dict[str, Any] = {}
        self.not_merged: set[str] = set()
        # spec -> (empty histogram, bin dtype, bin shape)
        self._templates: dict[bytes, tuple[Any, np.dtype[Any], tuple[int, ...]]] = {}
        # delta head -> how to read its bins (histograms only: the head is the same
        # for every delta of the same objects, so it is parsed once)
        self._plans: dict[bytes, list[tuple[str, Any, bytes, Any, tuple[int, ...], int]]] = {}
        # name -> (merged histogram, its spec, its bins as a plain ndarray view)
        self._targets: dict[str, tuple[Any, bytes, np.ndarray]] = {}

    def _template(self, spec: bytes, bins: int) -> tuple[Any, np.dtype[Any], tuple[int, ...]]:
        """``bins``: the byte size of the delta's bin frame; an empty histogram of this
        spec holds no more zeros than that (kept templates stay bounded by what came)."""
        found = self._templates.get(spec)
        if found is None:
            tmpl, _ = _unpack_spec(spec, bins, self.limits)
            if not isinstance(tmpl, _bh().Histogram):
                raise CodecError("histogram delta spec does not describe a histogram")
            if len(self._templates) > 4096:  # growing axes make new specs: stay bounded
                self._templates.clear()
            view = tmpl.view(flow=True)
            found = self._templates[spec] = (tmpl, view.dtype, view.shape)
        return found

    def decode(self, frames: Sequence[Any]) -> list[tuple[str, str, Any]]:
        """(name, kind, object) of a delta; raises CodecError naming the problem."""
        try:
            head_bytes = bytes(frames[0])
            plan = self._plans.get(head_bytes)
            if plan is not None:  # the same objects as a recent delta: only the bins differ
                out = []
                for name, tmpl, spec, dtype, shape, index in plan:
                    arr = np.frombuffer(frames[index], dtype=dtype).reshape(shape)
                    out.append((name, "h", (tmpl, spec, arr)))
                return out
            return self._decode(head_bytes, frames)
        except CodecError:
            raise
        except Exception as exc:  # msgpack, numpy, uhi: any bad byte lands here
            raise CodecError(f"malformed persistent delta: {type(exc).__name__}: {exc}") from None

    def _decode(self, head_bytes: bytes, frames: Sequence[Any]) -> list[tuple[str, str, Any]]:
        head = msgpack.unpackb(head_bytes)
        if type(head) is not dict or head.get("v") != DELTA_VERSION:
            raise CodecError(f"persistent delta of unknown format {head!r:.60}")
        items = head.get("items")
        max_objects = self.limits.max_objects
        if type(items) is not list or len(items) > max_objects:
            count = len(items) if type(items) is list else None
            raise CodecError(f"persistent delta of {count!r} items (at most {max_objects})")
        # whole histograms (kind x) of one delta share one allowance of zero bytes
        x_zeros = sum(len(f) for f in frames) + X_ZERO_ALLOWANCE
        out: list[tuple[str, str, Any]] = []
        plan: list[tuple[str, Any, bytes, Any, tuple[int, ...], int]] | None = []
        for item in items:
            name, kind = str(item[0]), item[1]
            if kind == "h":
                spec = bytes(item[2])
                index = int(item[3])
                # (+4 kB: an axis array of zeros, e.g. the category 0, is sent so too)
                tmpl, dtype, shape = self._template(spec, len(frames[index]) + 4096)
                arr = np.frombuffer(frames[index], dtype=dtype).reshape(shape)
                out.append((name, kind, (tmpl, spec, arr)))
                if plan is not None:
                    plan.append((name, tmpl, spec, dtype, shape, index))
                continue
            plan = None  # other kinds carry values in the head: no reusable plan
            if kind == "x":
                whole, asked = _unpack_spec(bytes(item[2]), x_zeros, self.limits)
                x_zeros -= asked
                out.append((name, kind, whole))
            elif kind == "nd":
                arr = array_from_buffer(parse_dtype(item[2]), item[3], frames[int(item[4])])
                out.append((name, kind, arr.copy()))
            elif kind == "num":
                if isinstance(item[2], bool) or not isinstance(item[2], int | float):
                    raise CodecError(f"persistent delta number {name!r} is {item[2]!r:.40}")
                out.append((name, kind, item[2]))
            else:
                raise CodecError(f"persistent delta item {name!r} of unknown kind {kind!r}")
        if plan:
            if len(self._plans) > 1024:  # one per worker and set of filled objects
                self._plans.clear()
            self._plans[head_bytes] = plan
        return out

    def merge(self, frames: Sequence[Any], source: str = "a worker") -> None:
        """Add one delta into ``merged`` (all of it, or nothing if it is malformed)."""
        self.add(self.decode(frames), source)

    def add(self, decoded: list[tuple[str, str, Any]], source: str = "a worker") -> None:
        """Add a delta returned by ``decode``."""
        for name, kind, obj in decoded:
            try:
                if kind == "h":
                    self._add_bins(name, *obj)
                else:
                    merge_into(self.merged, {name: obj}, source)
            except ConfigurationError:
                self.not_merged.add(name)

    def _add_bins(self, name: str, tmpl: Any, spec: bytes, arr: np.ndarray) -> None:
        target = self.merged.get(name)
        known = self._targets.get(name)
        if known is not None and known[0] is target and known[1] == spec:
            _add(known[2], arr)  # the common case: same object, same binning
            return
        if target is None:
            target = self.merged[name] = tmpl.copy()
        elif not isinstance(target, _bh().Histogram) or target.axes != tmpl.axes:
            # another binning under the same name (e.g. a grown axis): a whole ``+=``
            whole = tmpl.copy()
            _add(whole.view(flow=True).view(np.ndarray), arr)
            merge_into(self.merged, {name: whole}, "a worker")
            self._targets.pop(name, None)
            return
        view = target.view(flow=True).view(np.ndarray)
        _add(view, arr)
        if not any(ax.traits.growth for ax in target.axes):  # its bins never move
            self._targets[name] = (target, spec, view)


def _add(view: np.ndarray, arr: np.ndarray) -> None:
    if view.dtype.names:
        for field in view.dtype.names:
            view[field] += arr[field]
    else:
        view += arr

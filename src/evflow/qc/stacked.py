"""The merger's fast path: the histograms of a batched delta added as one array.

A producer sends all its histograms of a cycle in one message, one raw bin array per
histogram (the parallel engine's delta format). Producers of one task send the same
objects, so their delta heads are byte-identical: the head is parsed and checked once,
into a ``StackPlan`` that groups the histograms by bin layout. Each later delta with
that head is joined into one buffer per group and added with a single numpy operation
into a *pending* stack (rows = histograms); ``flush`` adds the pending rows into the
merged histograms (before a publication, a checkpoint, a reset or any other merge), so
the integral that is published is exactly the sum of every delta. A 1 kB histogram
then costs ~0.5 us to merge instead of ~7 us.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from evflow.errors import CodecError
from evflow.processing.parallel.deltas import DeltaMerger

#: plans kept per task (one per distinct set of filled histograms)
MAX_PLANS = 64
#: histograms of at least this many bytes are added one by one into the merged ones
LARGE_BYTES = 64 * 1024


class _Group:
    """Histograms of one bin layout in a delta: frame indices, names, pending sums."""

    __slots__ = ("dtype", "frames", "names", "nbytes", "pending", "shape", "specs", "templates")

    def __init__(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
        self.dtype = dtype
        self.shape = shape
        self.frames: list[int] = []
        self.names: list[str] = []
        self.templates: list[Any] = []
        self.specs: list[bytes] = []
        self.pending: np.ndarray = np.empty(0)
        self.nbytes = 0

    def seal(self) -> None:
        flat = _flat_dtype(self.dtype)
        per_item = int(np.prod(self.shape)) * (len(self.dtype.names) if self.dtype.names else 1)
        self.nbytes = len(self.names) * per_item * flat.itemsize
        # large histograms are added straight into the merged ones (a second copy of
        # megabytes of bins would only cost cache); small ones wait in one stack
        rows = 0 if self.large else len(self.names)
        self.pending = np.zeros((rows, per_item), dtype=flat)

    @property
    def large(self) -> bool:
        return self.dtype.itemsize * int(np.prod(self.shape)) >= LARGE_BYTES


def _flat_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype that adds like ``dtype`` element by element (a Weight's two f8 fields: f8)."""
    if dtype.names is None:
        return dtype
    kinds = {dtype.fields[n][0] for n in dtype.names}  # type: ignore[index]
    if len(kinds) != 1:
        raise CodecError(f"bin dtype {dtype} has fields of different types")
    return kinds.pop()  # type: ignore[no-any-return]


class StackPlan:
    """How to add the histograms of one delta head; see the module docstring."""

    __slots__ = ("contiguous", "dirty", "groups", "n_items")

    def __init__(self, decoded: list[tuple[str, str, Any]], frames_used: list[int]) -> None:
        groups: dict[tuple[str, tuple[int, ...]], _Group] = {}
        for (name, _, (tmpl, spec, arr)), index in zip(decoded, frames_used, strict=True):
            key = (arr.dtype.str, arr.shape)
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group(arr.dtype, arr.shape)
            group.frames.append(index)
            group.names.append(name)
            group.templates.append(tmpl)
            group.specs.append(spec)
        for group in groups.values():
            group.seal()
        self.groups = list(groups.values())
        self.n_items = len(decoded)
        self.dirty = False
        # one stack whose frames follow each other: a joined payload is added as it came
        only = self.groups[0] if len(self.groups) == 1 else None
        self.contiguous = (
            only is not None
            and not only.large
            and only.frames == list(range(only.frames[0], only.frames[0] + len(only.frames)))
            and only.frames[0] == 1
        )

    def add_joined(self, blob: Any, sizes: Any) -> None:
        """Add a payload whose bin arrays came joined in one buffer (``contiguous`` plans)."""
        group = self.groups[0]
        row_bytes = group.nbytes // len(group.names)
        if (
            type(sizes) is not list
            or len(sizes) != len(group.names)
            or sizes.count(row_bytes) != len(sizes)
        ):
            raise CodecError("joined delta 'sizes' do not match the histograms of its head")
        view = memoryview(blob)
        if view.nbytes != group.nbytes:
            raise CodecError(f"joined delta bins of {view.nbytes} bytes, expected {group.nbytes}")
        group.pending += np.frombuffer(view, dtype=group.pending.dtype).reshape(group.pending.shape)
        self.dirty = True

    def add(self, frames: Sequence[Any], targets: list[DeltaMerger], source: str) -> None:
        """Add one delta's bins (CodecError, and nothing added, if they do not fit)."""
        parts: list[tuple[_Group, list[Any]]] = []
        for group in self.groups:
            try:
                raws = [frames[i] for i in group.frames]
            except IndexError:
                raise CodecError("delta frames do not match their head") from None
            row_bytes = group.nbytes // len(group.names)
            if any(memoryview(raw).nbytes != row_bytes for raw in raws):
                raise CodecError(f"delta bins of another size than the {row_bytes} bytes announced")
            parts.append((group, raws))
        for group, raws in parts:  # every size checked: add all
            if group.large:
                for raw, name, tmpl, spec in zip(
                    raws, group.names, group.templates, group.specs, strict=True
                ):
                    arr = np.frombuffer(raw, dtype=group.dtype).reshape(group.shape)
                    for dm in targets:
                        dm.add([(name, "h", (tmpl, spec, arr))], source)
            else:  # one buffer, one addition for all of them
                joined = np.frombuffer(b"".join(raws), dtype=group.pending.dtype)
                group.pending += joined.reshape(group.pending.shape)
                self.dirty = True

    def flush(self, targets: list[DeltaMerger], source: str) -> None:
        """Add the pending sums into the merged histograms and zero them."""
        if not self.dirty:
            return
        for group in self.groups:
            if group.large:
                continue
            for row, name, tmpl, spec in zip(
                group.pending, group.names, group.templates, group.specs, strict=True
            ):
                if not row.any():
                    continue
                arr = row.view(group.dtype).reshape(group.shape)
                for dm in targets:
                    dm.add([(name, "h", (tmpl, spec, arr))], source)
            group.pending[...] = 0
        self.dirty = False


def plan_frames(head: Any) -> list[int] | None:
    """The frame index of every item of a parsed delta head, or None if one is not a bin
    array (whole objects, numbers, arrays go the ordinary way)."""
    out = []
    for item in head["items"]:
        if item[1] != "h":
            return None
        out.append(int(item[3]))
    return out


#: heads up to this size are looked up by their bytes; larger ones by a short key
SMALL_HEAD = 4096
_EDGE = 256


class PlanIndex:
    """Stacked plans by delta head, found without hashing or copying a large head.

    The head of a delta of 1000 histograms is ~300 kB (each histogram's spec: axes and
    storage; it was 1.3 MB while specs carried their empty bins): hashing a new copy
    of it for every message cost more than merging its bins. Large heads are keyed by
    their length and first and last bytes, and confirmed by a numpy comparison of the
    whole head (no copy).
    """

    __slots__ = ("_large", "_small", "count")

    def __init__(self) -> None:
        self._small: dict[bytes, StackPlan] = {}
        self._large: dict[tuple[int, bytes, bytes], list[tuple[np.ndarray, StackPlan]]] = {}
        self.count = 0

    @staticmethod
    def _key(view: memoryview) -> tuple[int, bytes, bytes]:
        return (view.nbytes, bytes(view[:_EDGE]), bytes(view[-_EDGE:]))

    def find(self, head: Any) -> StackPlan | None:
        view = memoryview(head).cast("B")
        if view.nbytes <= SMALL_HEAD:
            return self._small.get(bytes(view))
        candidates = self._large.get(self._key(view))
        if candidates:
            mine = np.frombuffer(view, dtype=np.uint8)
            for known, plan in candidates:
                if np.array_equal(mine, known):
                    return plan
        return None

    def add(self, head: Any, plan: StackPlan) -> None:
        """Index ``plan``; beyond MAX_PLANS start afresh (flush them first)."""
        if self.count >= MAX_PLANS:
            self.clear()
        view = memoryview(head).cast("B")
        if view.nbytes <= SMALL_HEAD:
            self._small[bytes(view)] = plan
        else:
            known = np.frombuffer(bytes(view), dtype=np.uint8)
            self._large.setdefault(self._key(view), []).append((known, plan))
        self.count += 1

    def plans(self) -> list[StackPlan]:
        return [*self._small.values(), *(p for lst in self._large.values() for _, p in lst)]

    def clear(self) -> None:
        self._small.clear()
        self._large.clear()
        self.count = 0

"""What a QC merger holds: merged objects per task, exactly once, and what to publish.

``MergeState`` is the merger's logic without sockets, so that it can be tested and
checkpointed on its own:

- ``accept(header, payload)`` takes one producer message (a delta, or the full objects
  of a producer), checks it (run, format, binning) and merges it unless its
  ``(source, seq)`` was merged before (dedup: ``upto`` plus a bounded set above it);
- ``accept_publication(source, pub)`` takes a lower-layer merger's published integral
  (full-object mode: the latest per source and object is kept and summed);
- ``publish()`` closes a merger cycle: the integral per object (and the moving window
  of the last k cycles, if asked), with the completeness record;
- ``to_bytes()`` / ``from_bytes()``: the checkpoint a restarted merger resumes from.

Deltas merge through the parallel engine's ``DeltaMerger`` (raw bin arrays added in
place); the other kinds (record batches, whole objects) through ``objects.merge``.

The window and the reset hold in every layer. Deltas are kept per cycle (the last k
cycles of the window). Full objects (a lower merger's integral, a producer in full
mode) are integrals that only grow, so the merger keeps, per source, its latest one
at each of the last k cycle ends and at the last reset: the window is the latest
minus the one of k cycles ago, the integral since a reset the latest minus the one
at the reset (``objects.subtract``), summed over the sources. Lower mergers publish
their plain integral (``layers.merger_params`` gives the window and the reset to the
top merger only).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import msgpack

from evflow.errors import CodecError, IncompatibleObjectsError, NotMergeableError
from evflow.processing.parallel.deltas import DeltaMerger
from evflow.processing.parallel.histlimits import current_limits
from evflow.qc.objects import (
    check_compatible,
    copy_object,
    decode_object,
    describe,
    encode_object,
    merge,
    subtract,
)
from evflow.qc.publication import PublishedObject, qc_path
from evflow.qc.sources import SourceState, check_header, split_payload
from evflow.qc.stacked import PlanIndex, StackPlan, plan_frames

#: merged sequence numbers kept above a source's contiguous ``upto`` (out-of-order re-sends)
MAX_SEQ_GAP = 4096
_NO_OBJECTS = msgpack.packb([])

#: source -> (events, name -> object): the latest full objects of every source
Latest = dict[str, tuple[int, dict[str, Any]]]


def snapshot(latest: Latest) -> Latest:
    """A copy of ``latest`` that later publications do not change (objects are shared:
    a received object is never changed in place)."""
    return {src: (n, dict(objs)) for src, (n, objs) in latest.items()}


class TaskState:
    """The objects of one task: integral, this cycle's part (for the window), latest full."""

    def __init__(self, window_cycles: int) -> None:
        self.integral = DeltaMerger(current_limits())
        self.integral_events = 0
        self.window_cycles = window_cycles
        self.cycle = DeltaMerger(current_limits()) if window_cycles else None
        self.cycle_events = 0
        self.window: deque[tuple[dict[str, Any], int]] = deque(maxlen=max(window_cycles, 1))
        # full-object mode: source -> (events, name -> object)
        self.latest: Latest = {}
        # ``latest`` at the end of each of the last k cycles (window) and at the last reset
        self.snapshots: deque[Latest] = deque(maxlen=max(window_cycles, 1))
        self.reset_base: Latest = {}
        self.latest_seq: dict[str, int] = {}
        # name -> (spec, id of the merged object) of the last delta found compatible
        self.checked: dict[str, tuple[bytes, int]] = {}
        # delta head -> its stacked plan (the fast path of batched histogram deltas)
        self.plans = PlanIndex()

    def targets(self) -> list[DeltaMerger]:
        return [self.integral] if self.cycle is None else [self.integral, self.cycle]

    def flush(self) -> None:
        """Add what the stacked plans hold into the merged objects."""
        targets = self.targets()
        for plan in self.plans.plans():
            plan.flush(targets, "a producer")

    def names(self) -> list[str]:
        names = dict.fromkeys(self.integral.merged)
        for _, objs in self.latest.values():
            names.update(dict.fromkeys(objs))
        return list(names)


def _merge_into(target: dict[str, Any], name: str, obj: Any, source: str) -> None:
    if name in target:
        target[name] = merge(target[name], obj, name, ("merged", source))
    else:
        target[name] = copy_object(obj)


class MergeState:
    """Merged objects of every task, the sources' dedup records, counters; see module doc."""

    def __init__(
        self,
        merger_id: str,
        run: int = -1,
        expected: list[str] | int = 0,
        window_cycles: int = 0,
        reset_every: int = 0,
        max_sources: int = 10_000,
    ) -> None:
        self.merger_id = merger_id
        self.run = run  # -1: the first producer's run
        self.expected = expected
        self.window_cycles = window_cycles
        self.reset_every = reset_every
        self.max_sources = max_sources
        self.cycle = 0  # merger cycles published
        self.sequence = 0  # publications (one per cycle)
        self.resets = 0
        self.tasks: dict[str, TaskState] = {}
        self.sources: dict[str, SourceState] = {}
        self.seen_this_cycle: set[str] = set()
        self.counters: dict[str, int] = {
            "deltas": 0,
            "merged_objects": 0,
            "duplicates": 0,
            "late": 0,
            "full_objects": 0,
        }
        #: reason -> count of dropped messages or objects
        self.dropped: dict[str, int] = {}
        #: (reason, source or object) reported once each (the caller logs them)
        self.problems: list[str] = []
        self._reported: set[tuple[str, str]] = set()

    # --- problems ------------------------------------------------------------------------
    def _drop(self, reason: str, key: str, text: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if (reason, key) not in self._reported and len(self._reported) < 10_000:
            self._reported.add((reason, key))
            self.problems.append(text)

    def _warn(self, reason: str, key: str, text: str) -> None:
        """Report once, drop nothing."""
        if (reason, key) not in self._reported and len(self._reported) < 10_000:
            self._reported.add((reason, key))
            self.problems.append(text)

    def take_problems(self) -> list[str]:
        out, self.problems = self.problems, []
        return out

    def _task(self, name: str) -> TaskState:
        task = self.tasks.get(name)
        if task is None:
            task = self.tasks[name] = TaskState(self.window_cycles)
        return task

    def _source(self, src: str, task: str) -> SourceState | None:
        state = self.sources.get(src)
        if state is None:
            if len(self.sources) >= self.max_sources:
                self._drop(
                    "too_many_sources",
                    src,
                    f"source {src!r} refused: {self.max_sources} "
                    "sources already (raise max_sources)",
                )
                return None
            state = self.sources[src] = SourceState(task)
        return state

    def _check_run(self, src: str, run: int) -> bool:
        if self.run < 0:
            self.run = run
        if run != self.run:
            self._drop(
                "other_run",
                src,
                f"source {src!r} is of run {run}, this merger merges "
                f"run {self.run}: its messages are dropped",
            )
            return False
        return True

    # --- producer messages ---------------------------------------------------------------
    def accept(self, header: dict[Any, Any], payload: list[Any]) -> str:
        """Merge one producer message; returns merged | duplicate | late | dropped."""
        try:
            src, task, run, cycle, seq, events, mode = check_header(header)
        except CodecError as exc:
            self._drop("bad_header", str(header.get("src", "?"))[:200], str(exc))
            return "dropped"
        if not self._check_run(src, run):
            return "dropped"
        source = self._source(src, task)
        if source is None:
            return "dropped"
        if source.merged(seq):
            self.counters["duplicates"] += 1
            return "duplicate"
        if seq > source.upto + MAX_SEQ_GAP:
            self._drop(
                "seq_gap",
                src,
                f"source {src!r}: sequence {seq} is more than "
                f"{MAX_SEQ_GAP} ahead of {source.upto}: dropped",
            )
            return "dropped"
        state = self._task(task)
        try:
            if mode == "delta" and self._fast(state, task, src, header, payload):
                items = None
            else:
                state.flush()
                items = self._decode(task, src, split_payload(header, payload))
        except CodecError as exc:
            self._drop("garbage", src, f"source {src!r}: undecodable QC payload ({exc})")
            source.mark(seq)  # a re-send would be the same bytes: never ask for it again
            return "dropped"
        if items is None:
            state.integral_events += events
            state.cycle_events += events
            source.events += events
        elif mode == "full":
            state.latest[src] = (events, {n: o for n, _, o in items})
            self.counters["full_objects"] += len(items)
        else:
            self._merge_delta(state, src, items)
            state.integral_events += events
            state.cycle_events += events
            source.events += events
        source.mark(seq)
        self.seen_this_cycle.add(src)
        self.counters["deltas"] += 1
        late = cycle <= source.published_cycle
        source.last_cycle = max(source.last_cycle, cycle)
        if late:
            self.counters["late"] += 1
            return "late"
        return "merged"

    def _fast(
        self, state: TaskState, task: str, src: str, header: dict[Any, Any], payload: list[Any]
    ) -> bool:
        """Merge a histograms-only delta through its stacked plan; False if it has none."""
        if len(payload) < 2 or bytes(payload[0]) != _NO_OBJECTS:
            return False
        plan = state.plans.find(payload[1])
        if plan is not None and plan.contiguous and "sizes" in header and len(payload) == 3:
            plan.add_joined(payload[2], header["sizes"])
            self.counters["merged_objects"] += plan.n_items
            return True
        payload = split_payload(header, payload)
        if plan is None:
            try:
                frames_used = plan_frames(msgpack.unpackb(payload[1]))
            except Exception:
                return False  # the ordinary path says what is wrong with it
            if frames_used is None:
                return False
            state.flush()  # the check below must see every object merged so far
            items = self._decode(task, src, payload)
            if len(items) != len(frames_used):
                self._merge_delta(state, src, items)  # some were dropped: no plan for it
                return True
            plan = StackPlan(items, frames_used)
            state.plans.add(payload[1], plan)  # (flushed above: clearing loses nothing)
        plan.add(payload[1:], state.targets(), src)
        self.counters["merged_objects"] += plan.n_items
        return True

    def _decode(self, task: str, src: str, payload: list[Any]) -> list[tuple[str, str, Any]]:
        """(name, kind, object) of every object of a payload, incompatible ones dropped."""
        if not payload:
            raise CodecError("QC message without payload")
        try:
            extra = msgpack.unpackb(bytes(payload[0]))
            if type(extra) is not list:
                raise CodecError("QC object list is not a list")
            if len(extra) > current_limits().max_objects:
                raise CodecError(
                    f"QC message of {len(extra)} objects (at most "
                    f"{current_limits().max_objects}; EVFLOW_MAX_QC_OBJECTS raises it)"
                )
            items: list[tuple[str, str, Any]] = [
                (str(n), "o", decode_object(bytes(b))) for n, b in extra
            ]
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"{type(exc).__name__}: {exc}") from None
        if len(payload) > 1:
            integral = self._task(task).integral
            items.extend(integral.decode(payload[1:]))
            # DeltaMerger keeps up to 1024 parsed heads; a head of 1000 histograms is
            # ~1.3 MB, so keep few here (plans cache what the fast path needs)
            if len(integral._plans) > 16:
                integral._plans.clear()
        state = self._task(task)
        merged = state.integral.merged
        checked = state.checked
        good: list[tuple[str, str, Any]] = []
        for name, kind, obj in items:
            mine = merged.get(name)
            if mine is None:
                good.append((name, kind, obj))
                continue
            if kind == "h":
                # the same binning as the last delta into the same object: checked already
                # (a full check costs ~40 us, the merge of a 1 kB histogram ~1 us)
                if checked.get(name) == (obj[1], id(mine)):
                    good.append((name, kind, obj))
                    continue
                checked[name] = (obj[1], id(mine))
            theirs = obj[0] if kind == "h" else obj
            try:
                check_compatible(mine, theirs, name, ("merged", f"source {src!r}"))
            except (IncompatibleObjectsError, NotMergeableError) as exc:
                checked.pop(name, None)
                reason = (
                    "incompatible" if isinstance(exc, IncompatibleObjectsError) else "not_mergeable"
                )
                self._drop(reason, f"{task}/{name}/{src}", f"task {task!r}: {exc}; dropped")
                continue
            good.append((name, kind, obj))
        return good

    def _merge_delta(self, state: TaskState, src: str, items: list[tuple[str, str, Any]]) -> None:
        targets = [state.integral] if state.cycle is None else [state.integral, state.cycle]
        bins = [it for it in items if it[1] == "h"]
        for dm in targets:
            if bins:
                dm.add(bins, src)
            for name, kind, obj in items:
                if kind != "h":
                    _merge_into(dm.merged, name, obj, f"source {src!r}")
        self.counters["merged_objects"] += len(items)

    def end_source(self, src: str) -> None:
        """A producer said END: it is no longer missing when it sends nothing."""
        source = self.sources.get(src)
        if source is not None:
            source.ended = True

    # --- lower-layer mergers -------------------------------------------------------------
    def accept_publication(self, src: str, pub: PublishedObject) -> str:
        """Keep a lower merger's integral as the latest full object of ``src``."""
        if pub.metadata.get("view", "integral") != "integral":
            return "ignored"
        if pub.metadata.get("resets") and (self.window_cycles or self.reset_every):
            self._warn(
                "lower_reset",
                src,
                f"merger {src!r} resets its integral: the window and the reset of this "
                "merger assume integrals that only grow (set window_cycles and "
                "reset_every on the top merger only)",
            )
        if not self._check_run(src, pub.run):
            return "dropped"
        source = self._source(src, pub.task)
        if source is None:
            return "dropped"
        state = self._task(pub.task)
        if pub.sequence < state.latest_seq.get(src, 0):
            self.counters["late"] += 1  # an older integral: the newer one holds it already
            return "late"
        # the objects of a new cycle of that merger replace its old ones one by one: until
        # all have come, the others stay those of its previous cycle (integrals that only
        # grow, never a source missing from a sum)
        _, objs = state.latest.get(src, (0, {}))
        mine = state.integral.merged.get(pub.name)
        if mine is not None:
            try:
                check_compatible(mine, pub.obj, pub.name, ("merged", f"merger {src!r}"))
            except (IncompatibleObjectsError, NotMergeableError) as exc:
                self._drop("incompatible", f"{pub.task}/{pub.name}/{src}", str(exc))
                return "dropped"
        objs[pub.name] = pub.obj
        state.latest[src] = (pub.event_count, objs)
        state.latest_seq[src] = pub.sequence
        source.upstream = pub.completeness
        source.last_cycle = max(source.last_cycle, pub.cycle)
        self.seen_this_cycle.add(src)
        self.counters["full_objects"] += 1
        return "merged"

    # --- publishing ----------------------------------------------------------------------
    def completeness(self) -> dict[str, Any]:
        """Which sources were seen this cycle, expected, missing, ended (and below a
        merger of mergers, its producers'), with the fraction complete."""
        ended = {s for s, st in self.sources.items() if st.ended}
        known = set(self.sources)
        if isinstance(self.expected, list):
            expected: list[str] | int = sorted(self.expected)
            n_expected = len(self.expected)
            known |= set(self.expected)
        else:
            expected = self.expected
            n_expected = self.expected
        missing = known - self.seen_this_cycle - ended
        record: dict[str, Any] = {
            "seen": sorted(self.seen_this_cycle),
            "expected": expected,
            "missing": sorted(missing),
            "ended": sorted(ended),
            "events_by_source": {s: st.events for s, st in self.sources.items() if st.events},
        }
        upstream = [st.upstream for st in self.sources.values() if st.upstream]
        if upstream:  # a merger of mergers: the producers' record, merged
            record["mergers"] = {k: record[k] for k in ("seen", "expected", "missing", "ended")}
            for key in ("seen", "missing", "ended"):
                record[key] = sorted({s for up in upstream for s in up.get(key, [])})
            record["missing"] = sorted(set(record["missing"]) | missing)
            exp: list[Any] = [up.get("expected") for up in upstream]
            if all(isinstance(e, list) for e in exp):
                expected = sorted({s for e in exp for s in e})
                n_expected = len(expected)
            else:
                n_expected = sum(e if isinstance(e, int) else len(e) for e in exp)
                expected = n_expected
            record["expected"] = expected
            record["events_by_source"] = {
                s: n for up in upstream for s, n in up.get("events_by_source", {}).items()
            }
        n_missing = len(record["missing"])
        everyone = set(record["seen"]) | set(record["missing"]) | set(record["ended"])
        total = max(n_expected, len(everyone))
        record["fraction"] = 1.0 if total == 0 else round((total - n_missing) / total, 4)
        return record

    def publish(self, final: bool = False, now: float | None = None) -> list[PublishedObject]:
        """Close a merger cycle: the objects to publish (copies: safe to keep)."""
        for state in self.tasks.values():
            state.flush()
        self.cycle += 1
        self.sequence += 1
        created = time.time() if now is None else now
        completeness = self.completeness()
        out: list[PublishedObject] = []
        for task_name, state in self.tasks.items():
            meta = {
                "merger": self.merger_id,
                "final": final,
                "late_deltas": self.counters["late"],
                "resets": self.resets,
            }
            integral, events = self._integral(state)
            for name, obj in integral.items():
                out.append(
                    self._pub(
                        task_name,
                        name,
                        obj,
                        events,
                        completeness,
                        created,
                        {**meta, "view": "integral"},
                    )
                )
            if state.cycle is not None:
                state.window.append((state.cycle.merged, state.cycle_events))
                state.cycle, state.cycle_events = DeltaMerger(current_limits()), 0
                window: dict[str, Any] = {}
                w_events = 0
                for objs, n in state.window:
                    w_events += n
                    for name, obj in objs.items():
                        _merge_into(window, name, obj, "window")
                if state.latest:
                    full = len(state.snapshots) == self.window_cycles
                    w_events += self._latest_since(
                        state, state.snapshots[0] if full else {}, window
                    )
                state.snapshots.append(snapshot(state.latest))
                for name, obj in window.items():
                    out.append(
                        self._pub(
                            task_name,
                            f"{name}/window",
                            obj,
                            w_events,
                            completeness,
                            created,
                            {**meta, "view": "window", "cycles": len(state.window)},
                        )
                    )
        for source in self.sources.values():
            source.published_cycle = source.last_cycle
        self.seen_this_cycle = set()
        if self.reset_every and self.cycle % self.reset_every == 0:
            self.resets += 1
            for state in self.tasks.values():
                state.integral, state.integral_events = DeltaMerger(current_limits()), 0
                state.checked.clear()
                state.reset_base = snapshot(state.latest)
        return out

    def _pub(
        self,
        task: str,
        name: str,
        obj: Any,
        events: int,
        completeness: dict[str, Any],
        created: float,
        meta: dict[str, Any],
    ) -> PublishedObject:
        return PublishedObject(
            path=qc_path(task, name),
            task=task,
            name=name,
            run=max(self.run, 0),
            cycle=self.cycle,
            obj=obj,
            completeness=completeness,
            created=created,
            sequence=self.sequence,
            event_count=events,
            metadata=meta,
        )

    def _integral(self, state: TaskState) -> tuple[dict[str, Any], int]:
        """Copies of the integral plus every source's latest full objects (since the
        last reset)."""
        out = {name: copy_object(obj) for name, obj in state.integral.merged.items()}
        events = state.integral_events + self._latest_since(state, state.reset_base, out)
        return out, events

    def _latest_since(self, state: TaskState, base: Latest, out: dict[str, Any]) -> int:
        """Add into ``out`` what every source's latest full objects hold beyond ``base``
        (its objects of an earlier cycle end: everything if none); returns the events."""
        events = 0
        for src, (n, objs) in state.latest.items():
            base_n, base_objs = base.get(src, (0, {}))
            events += n - base_n
            for name, obj in objs.items():
                try:
                    earlier = base_objs.get(name)
                    part = obj if earlier is None else subtract(obj, earlier, name)
                    _merge_into(out, name, part, f"source {src!r}")
                except (IncompatibleObjectsError, NotMergeableError) as exc:
                    self._drop("incompatible", f"{name}/{src}", str(exc))
        return events

    # --- checkpoint ----------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Everything a restarted merger needs to go on exactly where this one published."""

        def enc(objs: dict[str, Any]) -> dict[str, bytes]:
            return {n: encode_object(o) for n, o in objs.items()}

        def enc_latest(latest: Latest) -> dict[str, list[Any]]:
            return {s: [n, enc(objs)] for s, (n, objs) in latest.items()}

        tasks = {}
        for name, st in self.tasks.items():
            st.flush()
            tasks[name] = {
                "integral": enc(st.integral.merged),
                "events": st.integral_events,
                "window": [[enc(objs), n] for objs, n in st.window],
                "latest": enc_latest(st.latest),
                "latest_seq": st.latest_seq,
                "snapshots": [enc_latest(snap) for snap in st.snapshots],
                "reset_base": enc_latest(st.reset_base),
            }
        sources = {
            s: [
                st.task,
                st.upto,
                sorted(st.extra),
                st.events,
                st.last_cycle,
                st.published_cycle,
                st.ended,
                st.upstream,
            ]
            for s, st in self.sources.items()
        }
        return msgpack.packb(
            {
                "v": STATE_VERSION,
                "id": self.merger_id,
                "run": self.run,
                "cycle": self.cycle,
                "sequence": self.sequence,
                "resets": self.resets,
                "tasks": tasks,
                "sources": sources,
                "counters": self.counters,
                "dropped": self.dropped,
            }
        )

    def restore(self, data: bytes) -> None:
        """Load a checkpoint of ``to_bytes`` (CodecError if it is not one)."""
        try:
            d = msgpack.unpackb(data, strict_map_key=False)
            if d.get("v") != STATE_VERSION:
                raise CodecError(f"merger checkpoint of version {d.get('v')!r}")
            self.run, self.cycle, self.sequence = d["run"], d["cycle"], d["sequence"]
            self.resets = d["resets"]
            self.counters.update(d["counters"])
            self.dropped.update(d["dropped"])
            for name, t in d["tasks"].items():
                st = self._task(name)
                st.integral.merged.update({n: decode_object(b) for n, b in t["integral"].items()})
                st.integral_events = t["events"]
                for objs, n in t["window"]:
                    st.window.append(({k: decode_object(b) for k, b in objs.items()}, n))
                st.latest = dec_latest(t["latest"])
                # (checkpoints written before the window held across layers lack these)
                st.snapshots.extend(dec_latest(snap) for snap in t.get("snapshots", []))
                st.reset_base = dec_latest(t.get("reset_base", {}))
                st.latest_seq = dict(t["latest_seq"])
            for s, (task, upto, extra, events, last, pub, ended, up) in d["sources"].items():
                self.sources[s] = SourceState(task, upto, set(extra), events, last, pub, ended, up)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"not a merger checkpoint: {type(exc).__name__}: {exc}") from None

    def describe_objects(self) -> dict[str, str]:
        return {
            f"{t}/{n}": describe(o)
            for t, st in self.tasks.items()
            for n, o in st.integral.merged.items()
        }


#: the version of a merger checkpoint (``MergeState.to_bytes``)
STATE_VERSION = 1


def dec_latest(data: dict[str, Any]) -> Latest:
    return {
        s: (int(n), {str(k): decode_object(b) for k, b in objs.items()})
        for s, (n, objs) in data.items()
    }

"""The moving window and the periodic reset at the top of several merger layers.

In process and deterministic: p producers (the real ``QcTask`` objects and delta
codec) fill the events of each cycle and send them to the lower mergers, which publish
their plain integral; the top merger (window of k cycles, reset every n) takes those
publications. After each cycle the top's integral must equal the objects filled
sequentially with the events since the last reset, and its window those of the last k
cycles, bin by bin, also when every merger is restarted from its checkpoint mid-run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from evflow.processing.parallel.deltas import DeltaEncoder
from evflow.qc.layers import build_layers, merger_params
from evflow.qc.mergestate import MergeState
from evflow.qc.producer import take_payload
from evflow.qc.publication import PublishedObject
from evflow.qc.toy import ToyQc
from test_qc_layers import (
    RUN,
    assert_equal_objects,
    event,
    reference,
    run_topology,
)

#: events per cycle (all different, so that every window differs from its neighbours)
CYCLE_EVENTS = [40, 7, 25, 60, 3, 33, 18, 51]


class Producer:
    """A QcTask's objects and delta encoder, its messages handed over without a socket."""

    def __init__(self, j: int, mode: str, hists_only: bool = False) -> None:
        self.src, self.mode, self.seq = f"prod-{j}", mode, 0
        self.task = ToyQc(name="det", hists_only=hists_only)
        self.task.initialize()
        self.encoder = DeltaEncoder()
        self.events = 0

    def fill(self, i: int) -> None:
        self.task.event(event(i))
        self.events += 1

    def message(self, cycle: int) -> tuple[dict[str, Any], list[bytes]]:
        self.seq += 1
        payload = take_payload(self.task.objects, self.encoder, self.mode, set())
        header = {"qc": 1, "src": self.src, "task": "det", "run": RUN, "cycle": cycle,
                  "seq": self.seq, "events": self.events, "mode": self.mode}  # fmt: skip
        if self.mode == "delta":
            self.events = 0  # full mode: the whole objects, all events since the start
        return header, payload


def by_view(pubs: list[PublishedObject]) -> tuple[dict[str, Any], dict[str, Any]]:
    integral = {p.name: p for p in pubs if p.metadata["view"] == "integral"}
    window = {p.name.removesuffix("/window"): p for p in pubs if p.metadata["view"] == "window"}
    return integral, window


def restarted(state: MergeState) -> MergeState:
    again = MergeState(state.merger_id, state.run, state.expected, state.window_cycles,
                       state.reset_every)  # fmt: skip
    again.restore(state.to_bytes())
    return again


def check_cycles(
    layout: list[int],
    window: int,
    reset: int,
    mode: str = "delta",
    restart_at: int = 0,
    hists_only: bool = False,
) -> None:
    p = 4
    producers = [Producer(j, mode, hists_only) for j in range(p)]
    specs, routes = build_layers([pr.src for pr in producers], layout)
    common = {"window_cycles": window, "reset_every": reset}
    mergers: dict[str, MergeState] = {}
    for spec in specs:
        params = merger_params(spec, **common)
        mergers[spec.id] = MergeState(spec.id, RUN, len(spec.inputs),
                                      params.get("window_cycles", 0),
                                      params.get("reset_every", 0))  # fmt: skip
    lower = [s for s in specs if s.parent is not None]
    top = specs[-1]
    assert (mergers[top.id].window_cycles, mergers[top.id].reset_every) == (window, reset)
    assert all(mergers[s.id].window_cycles == mergers[s.id].reset_every == 0 for s in lower)
    address_of = {s.address: s.id for s in specs}
    cycle_of_event: list[int] = []
    start = 0
    for cycle, n in enumerate(CYCLE_EVENTS, start=1):
        for i in range(start, start + n):
            producers[i % p].fill(i)
            cycle_of_event.append(cycle)
        start += n
        for pr in producers:
            merger = mergers[address_of[routes[pr.src]]]
            assert merger.accept(*pr.message(cycle)) == "merged"
        for spec in specs[:-1]:  # bottom-up: each layer publishes into the one above
            parent = mergers[address_of[spec.parent]]  # type: ignore[index]
            for pub in mergers[spec.id].publish():
                parent.accept_publication(spec.id, pub)
        integral, win = by_view(mergers[top.id].publish())
        since_reset = (cycle - 1) // reset * reset + 1 if reset else 1
        want = [i for i, c in enumerate(cycle_of_event) if c >= since_reset]
        assert_equal_objects(integral, reference(want, hists_only))
        assert all(pub.event_count == len(want) for pub in integral.values())
        if window:
            want = [i for i, c in enumerate(cycle_of_event) if c > cycle - window]
            assert_equal_objects(win, reference(want, hists_only))
            assert all(pub.event_count == len(want) for pub in win.values())
        if cycle == restart_at:  # every merger killed after its publication
            mergers = {mid: restarted(state) for mid, state in mergers.items()}
    assert mergers[top.id].resets == (len(CYCLE_EVENTS) // reset if reset else 0)


@pytest.mark.parametrize("layout", [[1], [2, 1], [2, 2, 1]], ids=["1", "2-1", "2-2-1"])
@pytest.mark.parametrize(("window", "reset"), [(3, 0), (0, 3), (2, 3), (3, 2)])
def test_window_and_reset_at_the_top_equal_the_sequential_fill(
    layout: list[int], window: int, reset: int
) -> None:
    check_cycles(layout, window, reset)


@pytest.mark.parametrize("layout", [[1], [2, 1]], ids=["1", "2-1"])
def test_window_and_reset_survive_a_restart_of_every_merger(layout: list[int]) -> None:
    check_cycles(layout, window=3, reset=4, restart_at=5)


@pytest.mark.parametrize(("layout", "hists_only"), [([1], False), ([2, 1], True)], ids=str)
def test_window_and_reset_of_producers_in_full_object_mode(
    layout: list[int], hists_only: bool
) -> None:
    """A producer in full mode sends its whole objects: the merger subtracts its earlier
    ones. Above a lower merger only histograms, numbers and arrays can be (the lower
    merger's integral puts each full producer's rows together: not an append)."""
    check_cycles(layout, window=2, reset=3, mode="full", restart_at=4, hists_only=hists_only)


def test_rows_of_full_mode_producers_are_refused_above_a_lower_merger() -> None:
    top = MergeState("top", RUN, window_cycles=2)
    low = MergeState("low", RUN)
    producers = [Producer(j, "full") for j in range(2)]
    for cycle in (1, 2, 3):
        for j, pr in enumerate(producers):
            pr.fill(2 * cycle + j)
            low.accept(*pr.message(cycle))
        for pub in low.publish():
            top.accept_publication("low", pub)
        integral, window = by_view(top.publish())
        assert sorted(integral["rows"].obj.column("i")) == list(range(2, 2 * cycle + 2))
    assert "rows" not in window and "h1" in window
    assert top.dropped == {"incompatible": 1}
    assert any("rows not appended" in text for text in top.take_problems())


def test_a_lower_merger_that_resets_is_reported_once() -> None:
    top = MergeState("top", RUN, window_cycles=2)
    low = MergeState("low", RUN, reset_every=1)
    pr = Producer(0, "delta")
    for cycle in (1, 2, 3):
        pr.fill(cycle)
        low.accept(*pr.message(cycle))
        for pub in low.publish():
            top.accept_publication("low", pub)
    problems = top.take_problems()
    assert len(problems) == 1 and "'low' resets its integral" in problems[0]


def check_windows(pubs: list[PublishedObject], k: int) -> set[int]:
    """Check that the window of every cycle is the integral minus that of k cycles
    before, bin by bin; returns the cycles (sequence numbers) checked. A cycle published
    twice (the top merger killed after a publication and before its checkpoint
    publishes it again) is not compared, nor one whose cycle k before lacks an object
    (the lower mergers' first objects arrive one by one)."""
    by_cycle: dict[int, dict[str, PublishedObject]] = {}
    twice: set[int] = set()
    for pub in pubs:
        objs = by_cycle.setdefault(pub.sequence, {})
        if pub.name in objs:
            twice.add(pub.sequence)
        objs[pub.name] = pub
    checked: set[int] = set()
    for seq, objs in sorted(by_cycle.items()):
        before = by_cycle.get(seq - k)
        if before is None or "h1/window" not in objs or {seq, seq - k} & twice:
            continue
        names = ("h1", "h2", "h3", "hn")
        if not all(name in before and name in objs for name in names):
            continue  # a first cycle of the top: a lower merger's objects not all there yet
        for name in names:
            window = objs[f"{name}/window"]
            assert window.metadata["view"] == "window" and window.metadata["cycles"] == k
            want = objs[name].obj.view(flow=True).view(np.ndarray).copy()
            earlier = before[name].obj.view(flow=True).view(np.ndarray)
            for field in want.dtype.names or (None,):
                if field is None:
                    want -= earlier
                else:
                    want[field] -= earlier[field]
            got = window.obj.view(flow=True).view(np.ndarray)
            assert np.array_equal(got, want), (seq, name)
            assert window.event_count == objs[name].event_count - before[name].event_count
        checked.add(seq)
    return checked


@pytest.mark.parametrize("kill", [None, "top"], ids=["no-kill", "top-killed"])
def test_two_layers_of_merger_processes_publish_a_consistent_window(
    tmp_path: Path, kill: str | None
) -> None:
    """Real processes (producers -> 2 mergers -> 1): the top's window of every cycle is
    its integral minus its integral of k cycles before, bin by bin, also after a SIGKILL
    of the top merger (restarted from its checkpoint), and the final integral is the
    sequential fill of every event."""
    n_events, k = 12_000, 2
    pubs: list[PublishedObject] = []
    final, sup, _ = run_topology(
        tmp_path, 4, n_events, [2, 1], kill=kill, hists_only=True, keep=pubs, window_cycles=k
    )
    assert_equal_objects(final, reference(list(range(n_events)), hists_only=True))
    if kill:
        assert len(sup.processes["qc-merger-1-0"].pids) == 2
    checked = check_windows(pubs, k)
    assert len(checked) >= 3, f"only cycles {checked} with a window"
    # the last cycles too (the restarted merger's, if killed early; the final cycle's
    # window may come after the test stopped listening)
    assert max(checked) >= final["h1"].sequence - 1


def test_a_top_cycle_between_two_objects_of_a_lower_cycle_keeps_the_older_one() -> None:
    """Publications of one lower cycle arrive one object at a time; a top cycle that
    closes in between sums that merger's previous integral of the objects still to
    come, never nothing."""
    top = MergeState("top", RUN)
    low = MergeState("low", RUN)
    pr = Producer(0, "delta", hists_only=True)
    pr.fill(1)
    low.accept(*pr.message(1))
    for pub in low.publish():
        top.accept_publication("low", pub)
    pr.fill(2)
    low.accept(*pr.message(2))
    first, *rest = low.publish()
    top.accept_publication("low", first)
    integral, _ = by_view(top.publish())
    assert sorted(integral) == ["h1", "h2", "h3", "hn"]
    assert integral[first.name].obj == reference([1, 2], hists_only=True)[first.name]
    for name in {"h1", "h2", "h3", "hn"} - {first.name}:
        assert integral[name].obj == reference([1], hists_only=True)[name]
    for pub in rest:
        top.accept_publication("low", pub)
    integral, _ = by_view(top.publish())
    assert_equal_objects(integral, reference([1, 2], hists_only=True))

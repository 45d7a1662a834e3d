"""Producers and mergers as real processes: merged == sequential, through kills and layers.

Producers are forked from the supervisor's zygote and run ``evflow.qc.toy.ToyQc`` over
their share of the toy event stream (producer j takes events j, j+p, j+2p, ...), publishing
every 30 ms; mergers run as ``qc-merger`` devices; the top merger's publications arrive
on a PULL socket of the test. The reference is the same task filled sequentially with
every event (or, for a producer killed mid-run, with the events it published).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from evflow.event import DataStore, RunMeta
from evflow.qc.layers import build_layers, launch_layers, layer_layout
from evflow.qc.publication import PublishedObject, decode_publication
from evflow.qc.toy import ToyQc, toy_event
from evflow.runtime.supervisor import Supervisor
from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel
from evflow.wire.messages import BadMessageCounter, MsgType

RUN = 42
RESULTS = "ipc://qc-results"


def event(i: int) -> DataStore:
    """Event i of the toy stream (exact sums in any order: merged bins must equal the
    sequential ones, not merely be close)."""
    return toy_event(i, RUN)


def run_producer(
    j: int, p: int, n_events: int, address: str, session: str, hists_only: bool = False
) -> int:
    task = ToyQc(
        name="det",
        merger=address,
        session=session,
        cycle_s=0.03,
        source=f"prod-{j}",
        resend_after_s=0.4,
        finish_timeout_s=30.0,
        hists_only=hists_only,
    )
    task.initialize()
    task.begin_run(RunMeta(0, RUN))
    for k, i in enumerate(range(j, n_events, p)):
        task.event(event(i))
        if k % 50 == 49:
            time.sleep(0.01)
    task.end_run(RunMeta(0, RUN))
    ok = task.publisher is not None and not task.publisher.unacked and task.publisher.end_acked
    task.terminate()
    return 0 if ok else 3


def reference(events: list[int], hists_only: bool = False) -> dict[str, Any]:
    task = ToyQc(name="det", hists_only=hists_only)
    task.initialize()
    for i in events:
        task.event(event(i))
    return task.objects


def assert_equal_objects(got: dict[str, PublishedObject], ref: dict[str, Any]) -> None:
    assert sorted(got) == sorted(ref)
    for name in ("h1", "h2", "h3", "hn"):
        assert got[name].obj == ref[name], name  # every bin, flow bins included
        assert np.array_equal(got[name].obj.view(flow=True), ref[name].view(flow=True))
    if "count" not in ref:
        return
    assert got["count"].obj == ref["count"]
    assert np.array_equal(got["sums"].obj, ref["sums"])
    rows, want = got["rows"].obj.sorted_by("i"), ref["rows"].sorted_by("i")
    assert np.array_equal(rows["i"], want["i"]) and np.array_equal(rows["x"], want["x"])


class Results:
    """The test's end of the top merger's qc-out: a PULL socket collecting publications."""

    def __init__(
        self, context: zmq.Context[Any], session: str, keep: list[PublishedObject] | None = None
    ) -> None:
        (cfg,) = parse_channel_config(f"name=results,type=pull,method=bind,address={RESULTS}")
        self.channel = open_channel(context, cfg, session)
        self.bad = BadMessageCounter("test results")
        self.final: dict[str, PublishedObject] = {}
        self.count = 0
        self.keep = keep  # every publication, if asked

    def collect(self, sup: Supervisor, until: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not until() and time.monotonic() < deadline:
            sup.poll(0)
            if not self.channel.poll(50):
                continue
            msg = self.bad.decode(self.channel.recv())
            if msg is None or msg.type is not MsgType.RESULT:
                continue
            _, pub = decode_publication(msg)
            self.count += 1
            if self.keep is not None:
                self.keep.append(pub)
            if pub.metadata.get("final"):
                self.final[pub.name] = pub
        assert until(), f"timed out; {self.count} publications, final: {sorted(self.final)}"

    def close(self) -> None:
        self.channel.close(0)


def run_topology(
    tmp_path: Path,
    p: int,
    n_events: int,
    layout: list[int],
    kill: str | None = None,
    hists_only: bool = False,
    keep: list[PublishedObject] | None = None,
    **top: Any,
) -> tuple[dict[str, PublishedObject], Supervisor, list[str]]:
    """Run producers and merger layers; ``top``: more parameters (all layers get them;
    ``launch_layers`` gives the window and the reset to the top merger only);
    ``keep``: a list that receives every publication of the top merger."""
    producers = [f"prod-{j}" for j in range(p)]
    specs, routes = build_layers(producers, layout)
    context = zmq.Context()
    sup = Supervisor(bus=False).start()
    results = Results(context, sup.session, keep)
    try:
        inputs = {}
        if kill == "producer":  # the killed one never ends: it is gone after 1 s of silence
            inputs = {"source_timeout_s": 1.0}
        launch_layers(sup, specs[:-1], state_dir=tmp_path, cycle_s=0.1, run_number=RUN, **top)
        launch_layers(
            sup,
            specs[-1:],
            out_address=RESULTS,
            state_dir=tmp_path,
            cycle_s=0.1,
            run_number=RUN,
            **inputs,
            **top,
        )
        for j, src in enumerate(producers):
            sup.add_function(
                src, run_producer, j, p, n_events, routes[src], sup.session, hists_only
            )
        if kill is not None:
            results.collect(sup, lambda: results.count >= 8, 30)
            target = {"producer": "prod-0", "merger": specs[0].id, "top": specs[-1].id}[kill]
            sup.kill(target, signal.SIGKILL)
        names = ["h1", "h2", "h3", "hn"] + ([] if hists_only else ["count", "rows", "sums"])
        results.collect(sup, lambda: all(n in results.final for n in names), 90)
        return results.final, sup, producers
    finally:
        results.close()
        sup.shutdown()
        sup.close()
        context.term()


@pytest.mark.parametrize("hists_only", [False, True], ids=["all-kinds", "hists-only"])
@pytest.mark.parametrize("layout", [[1], [2, 1]], ids=["one-merger", "two-layers"])
def test_merged_objects_equal_the_sequential_fill(
    tmp_path: Path, layout: list[int], hists_only: bool
) -> None:
    n_events, p = 3000, 4
    final, _, _ = run_topology(tmp_path, p, n_events, layout, hists_only=hists_only)
    assert_equal_objects(final, reference(list(range(n_events)), hists_only))
    rec = final["h1"].completeness
    assert rec["ended"] == [f"prod-{j}" for j in range(p)] and rec["missing"] == []
    assert final["h1"].event_count == n_events
    assert final["h1"].path == "qc/det/h1" and final["h1"].run == RUN
    assert final["h1"].cycle >= 3  # several cycles were published before the end


@pytest.mark.parametrize("hists_only", [False, True], ids=["all-kinds", "hists-only"])
def test_merger_killed_mid_run_resumes_exactly_once(tmp_path: Path, hists_only: bool) -> None:
    n_events, p = 4000, 3
    final, sup, _ = run_topology(tmp_path, p, n_events, [1], kill="merger", hists_only=hists_only)
    merger = sup.processes["qc-merger"]
    assert len(merger.pids) == 2  # it was restarted once
    assert_equal_objects(final, reference(list(range(n_events)), hists_only))
    assert final["h1"].event_count == n_events


def test_top_merger_of_two_layers_killed_mid_run_resumes(tmp_path: Path) -> None:
    n_events, p = 4000, 4
    final, sup, _ = run_topology(tmp_path, p, n_events, [2, 1], kill="top", hists_only=True)
    assert len(sup.processes["qc-merger-1-0"].pids) == 2
    assert_equal_objects(final, reference(list(range(n_events)), hists_only=True))
    assert final["h1"].event_count == n_events
    assert final["h1"].completeness["ended"] == [f"prod-{j}" for j in range(p)]


def test_producer_killed_mid_run_counts_what_it_published(tmp_path: Path) -> None:
    n_events, p = 4000, 3
    final, _, _ = run_topology(tmp_path, p, n_events, [1], kill="producer")
    rec = final["h1"].completeness
    assert "prod-0" in rec["missing"] and "prod-0" not in rec["ended"]
    published = rec["events_by_source"].get("prod-0", 0)
    assert 0 < published < len(range(0, n_events, p))
    mine = list(range(0, n_events, p))[:published]
    others = [i for i in range(n_events) if i % p != 0]
    assert_equal_objects(final, reference(sorted(mine + others)))


def test_layer_layout_from_reduction_or_mergers_per_layer() -> None:
    assert layer_layout(500, reduction=50) == [10, 1]
    assert layer_layout(500, reduction=10) == [50, 5, 1]
    assert layer_layout(7) == [1]
    assert layer_layout(500, mergers_per_layer=[10, 1]) == [10, 1]
    with pytest.raises(Exception, match="must end with 1"):
        layer_layout(500, mergers_per_layer=[10, 2])
    with pytest.raises(Exception, match="cannot take"):
        layer_layout(3, mergers_per_layer=[5, 1])
    specs, routes = build_layers([f"p{i}" for i in range(5)], [2, 1])
    assert [s.inputs for s in specs] == [
        ("p0", "p1", "p2"),
        ("p3", "p4"),
        ("qc-merger-0-0", "qc-merger-0-1"),
    ]
    assert specs[0].parent == specs[2].address and specs[2].parent is None
    assert routes["p4"] == specs[1].address

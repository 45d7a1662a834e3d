"""The merger's logic without sockets: exactly once, late deltas, bad input, checkpoint."""

from __future__ import annotations

from typing import Any

import hist
import msgpack
import numpy as np

from evflow.processing.parallel.deltas import DeltaEncoder
from evflow.qc.mergestate import MergeState
from evflow.qc.producer import take_payload
from evflow.qc.recordbatch import RecordBatch


class Producer:
    """What a QcTask sends, without the socket."""

    def __init__(self, src: str, run: int = 5, bins: int = 10) -> None:
        self.src, self.run, self.seq, self.cycle = src, run, 0, 0
        self.objects: dict[str, Any] = {
            "h": hist.Hist.new.Reg(bins, 0, 1).Double(),
            "n": 0,
            "rb": RecordBatch({"x": "f8"}),
        }
        self.encoder = DeltaEncoder()
        self.events = 0

    def fill(self, xs: list[float]) -> None:
        for x in xs:
            self.objects["h"].fill(x)
            self.objects["n"] += 1
            self.objects["rb"].fill(x=x)
        self.events += len(xs)

    def message(self) -> tuple[dict[str, Any], list[bytes]]:
        self.seq += 1
        self.cycle += 1
        payload = take_payload(self.objects, self.encoder, "delta", set())
        header = {
            "qc": 1,
            "src": self.src,
            "task": "t",
            "run": self.run,
            "cycle": self.cycle,
            "seq": self.seq,
            "events": self.events,
            "mode": "delta",
            "ts": 0.0,
        }
        self.events = 0
        return header, payload


def _final(state: MergeState) -> dict[str, Any]:
    return {p.name: p for p in state.publish(final=True)}


def _ref(xs: list[float]) -> Any:
    h = hist.Hist.new.Reg(10, 0, 1).Double()
    h.fill(xs)
    return h


def test_a_resent_delta_is_merged_once() -> None:
    state = MergeState("m", run=5)
    p = Producer("p0")
    p.fill([0.1, 0.2])
    msg = p.message()
    assert state.accept(*msg) == "merged"
    assert state.accept(*msg) == "duplicate"
    p.fill([0.3])
    msg2 = p.message()
    assert state.accept(*msg2) == "merged"
    assert state.accept(*msg) == "duplicate"  # an old one re-sent after a newer one
    out = _final(state)
    assert out["h"].obj == _ref([0.1, 0.2, 0.3])
    assert out["n"].obj == 3 and out["h"].event_count == 3
    assert state.counters["duplicates"] == 2
    assert state.sources["p0"].ack() == {"upto": 2, "seqs": [], "ended": False}


def test_out_of_order_sequences_are_tracked_above_upto() -> None:
    state = MergeState("m", run=5)
    p = Producer("p0")
    msgs = []
    for x in (0.1, 0.2, 0.3):
        p.fill([x])
        msgs.append(p.message())
    assert state.accept(*msgs[2]) == "merged"
    assert state.sources["p0"].ack() == {"upto": 0, "seqs": [3], "ended": False}
    assert state.accept(*msgs[0]) == "merged"
    assert state.accept(*msgs[1]) == "merged"
    assert state.sources["p0"].ack()["upto"] == 3
    assert _final(state)["h"].obj == _ref([0.1, 0.2, 0.3])


def test_a_late_delta_goes_into_the_integral_and_is_counted() -> None:
    state = MergeState("m", run=5, window_cycles=1)
    p = Producer("p0")
    p.fill([0.1])
    old = p.message()
    p.fill([0.5])
    new = p.message()
    assert state.accept(*new) == "merged"
    first = {x.name: x for x in state.publish()}
    assert first["h"].obj == _ref([0.5])
    assert state.accept(*old) == "late"  # its cycle (1) was published already (cycle 2)
    second = {x.name: x for x in state.publish()}
    assert second["h"].obj == _ref([0.1, 0.5])
    assert second["h/window"].obj == _ref([0.1])  # the window of the last cycle has it
    assert state.counters["late"] == 1 and second["h"].metadata["late_deltas"] == 1


def test_garbage_wrong_binning_and_another_run_are_dropped_counted_and_named() -> None:
    state = MergeState("m", run=5)
    good = Producer("good")
    good.fill([0.1])
    state.accept(*good.message())
    header, payload = Producer("junk").message()
    assert state.accept(header, [b"\xc1garbage", b"\x00"]) == "dropped"
    assert state.accept({"qc": 1, "src": 7}, payload) == "dropped"
    wrong = Producer("wrong", bins=20)
    wrong.fill([0.2])
    assert state.accept(*wrong.message()) == "merged"  # its counter and rows do merge
    other = Producer("other", run=6)
    other.fill([0.3])
    assert state.accept(*other.message()) == "dropped"
    problems = "\n".join(state.take_problems())
    assert "junk" in problems and "undecodable" in problems
    assert "'wrong'" in problems and "Regular(20" in problems and "Regular(10" in problems
    assert "'other' is of run 6" in problems
    assert state.dropped == {"garbage": 1, "bad_header": 1, "incompatible": 1, "other_run": 1}
    out = _final(state)
    assert out["h"].obj == _ref([0.1])
    assert out["n"].obj == 2
    # reported once per source and object, counted every time
    state.accept(*wrong.message())
    assert state.take_problems() == [] and state.dropped["incompatible"] == 1  # nothing filled


def test_completeness_names_missing_ended_and_seen_sources() -> None:
    state = MergeState("m", run=5, expected=["a", "b", "c"])
    for src in ("a", "b"):
        p = Producer(src)
        p.fill([0.5])
        state.accept(*p.message())
    state.end_source("b")
    rec = state.publish()[0].completeness
    assert rec["seen"] == ["a", "b"] and rec["missing"] == ["c"] and rec["ended"] == ["b"]
    assert rec["expected"] == ["a", "b", "c"] and rec["fraction"] == round(2 / 3, 4)
    assert rec["events_by_source"] == {"a": 1, "b": 1}
    rec2 = state.publish()[0].completeness
    assert rec2["seen"] == [] and rec2["missing"] == ["a", "c"]


def test_reset_every_n_cycles_and_moving_window() -> None:
    state = MergeState("m", run=5, window_cycles=2, reset_every=3)
    p = Producer("p")
    seen = []
    for cycle in range(4):
        p.fill([0.05 + 0.1 * cycle])
        state.accept(*p.message())
        out = {x.name: x for x in state.publish()}
        seen.append((out["n"].obj, out["n/window"].obj))
    # integral 1,2,3 then reset after cycle 3; window = last 2 cycles
    assert seen == [(1, 1), (2, 2), (3, 2), (1, 2)]
    assert state.resets == 1


def test_checkpoint_restores_objects_dedup_and_counters() -> None:
    state = MergeState("m", run=5, expected=2, window_cycles=2)
    p = Producer("p")
    p.fill([0.1, 0.7])
    first = p.message()
    state.accept(*first)
    state.publish()
    blob = state.to_bytes()
    again = MergeState("m", run=5, expected=2, window_cycles=2)
    again.restore(blob)
    assert again.accept(*first) == "duplicate"
    p.fill([0.4])
    again.accept(*p.message())
    out = _final(again)
    assert out["h"].obj == _ref([0.1, 0.7, 0.4]) and out["rb"].obj.column("x").tolist() == [
        0.1,
        0.7,
        0.4,
    ]
    assert out["h"].sequence == 2 and out["h"].event_count == 3


def test_full_objects_keep_the_latest_per_source() -> None:
    state = MergeState("m", run=5)
    h = hist.Hist.new.Reg(10, 0, 1).Double()
    for seq, x in enumerate((0.1, 0.2), start=1):
        h.fill(x)
        enc = take_payload({"h": h}, DeltaEncoder(), "full", set())
        header = {
            "qc": 1,
            "src": "f",
            "task": "t",
            "run": 5,
            "cycle": seq,
            "seq": seq,
            "events": seq,
            "mode": "full",
        }
        state.accept(header, enc)
    delta = Producer("d")
    delta.fill([0.9])
    state.accept(*delta.message())
    out = _final(state)
    assert out["h"].obj == _ref([0.1, 0.2, 0.9]) and out["h"].event_count == 3


def test_a_non_mergeable_object_is_reported_once_and_skipped() -> None:
    skipped: set[str] = set()
    objects = {"label": "text", "n": 1}
    payload = take_payload(objects, DeltaEncoder(), "delta", skipped)
    take_payload(objects, DeltaEncoder(), "delta", skipped)
    assert skipped == {"label"}
    assert msgpack.unpackb(payload[0]) == []
    state = MergeState("m", run=1)
    header = {
        "qc": 1,
        "src": "s",
        "task": "t",
        "run": 1,
        "cycle": 1,
        "seq": 1,
        "events": 1,
        "mode": "delta",
    }
    assert state.accept(header, payload) == "merged"
    assert {p.name: p.obj for p in state.publish()} == {"n": 1}
    assert np.isfinite(state.counters["merged_objects"])


class HistProducer(Producer):
    """Histograms only, small and large, additive storages: the stacked fast path."""

    def __init__(self, src: str, bins: int = 10) -> None:
        super().__init__(src)
        self.objects = {
            "a": hist.Hist.new.Reg(bins, 0, 1).Double(),
            "b": hist.Hist.new.Reg(bins, 0, 1).Double(),
            "w": hist.Hist.new.Reg(4, 0, 1).Reg(3, 0, 1).Weight(),
            "i": hist.Hist.new.Reg(5, 0, 1).Int64(),
            "big": hist.Hist.new.Reg(20_000, 0, 1).Double(),  # 160 kB: added one by one
        }

    def fill(self, xs: list[float]) -> None:
        for x in xs:
            self.objects["a"].fill(x)
            self.objects["b"].fill(1 - x)
            self.objects["w"].fill(x, x, weight=0.5)
            self.objects["i"].fill(x)
            self.objects["big"].fill(x)
        self.events += len(xs)


def test_stacked_fast_path_equals_the_sequential_fill() -> None:
    state = MergeState("m", run=5, window_cycles=2)
    ref = HistProducer("ref")
    producers = [HistProducer(f"p{i}") for i in range(3)]
    rng = np.random.default_rng(3)
    for cycle in range(4):
        for p in producers:
            xs = list(np.round(rng.random(7) * 1024) / 1024)
            p.fill(xs)
            ref.fill(xs)
            msg = p.message()
            assert state.accept(*msg) == "merged"
            assert state.accept(*msg) == "duplicate"
        if cycle % 2:
            state.publish()
    blob = state.to_bytes()
    again = MergeState("m", run=5, window_cycles=2)
    again.restore(blob)
    out = _final(again)
    for name, obj in ref.objects.items():
        assert out[name].obj == obj, name
    assert again.sources["p0"].events == 28
    assert out["a"].event_count == 84
    assert state.tasks["t"].plans.count  # the fast path was taken


def test_stacked_fast_path_drops_bad_frames_and_other_binning() -> None:
    state = MergeState("m", run=5)
    p = HistProducer("p")
    p.fill([0.25])
    state.accept(*p.message())
    p.fill([0.75])
    header, payload = p.message()
    broken = [*payload[:-1], payload[-1][:-8]]  # the known head, one frame too short
    assert state.accept(header, broken) == "dropped"
    assert state.dropped == {"garbage": 1}
    wrong = HistProducer("wrong", bins=11)
    wrong.fill([0.5])
    state.accept(*wrong.message())
    assert state.dropped["incompatible"] == 2  # a and b of another binning
    out = _final(state)
    ref = HistProducer("ref")
    ref.fill([0.25])
    assert out["a"].obj == ref.objects["a"] and out["b"].obj == ref.objects["b"]
    # the wrong one's other histograms have the right binning: they are merged
    assert out["big"].obj.sum() == 2 and out["w"].obj.sum().value == 1.0


def test_joined_payloads_of_many_histograms_merge_exactly() -> None:
    from evflow.qc.producer import join_payload

    def message(p: Producer) -> tuple[dict[str, Any], list[Any]]:
        header, payload = p.message()
        joined, sizes = join_payload(payload)
        assert sizes is not None and len(joined) == 3
        return {**header, "sizes": sizes}, joined

    state = MergeState("m", run=5)
    ref = Producer("ref")
    ref.objects = {f"h{k}": hist.Hist.new.Reg(8, 0, 1).Double() for k in range(12)}
    producers = []
    for i in range(2):
        p = Producer(f"p{i}")
        p.objects = {f"h{k}": hist.Hist.new.Reg(8, 0, 1).Double() for k in range(12)}
        producers.append(p)
    for rnd in range(3):
        for i, p in enumerate(producers):
            for k, h in p.objects.items():
                x = (int(k[1:]) + rnd + i) / 16
                h.fill(x)
                ref.objects[k].fill(x)
            assert state.accept(*message(p)) == "merged"
    for h in producers[0].objects.values():
        h.fill(0.5)  # never merged: both messages below are broken
    header, joined = message(producers[0])
    assert state.accept(header, [*joined[:2], joined[2][:-8]]) == "dropped"  # short blob
    assert state.accept({**header, "seq": header["seq"] + 1, "sizes": [1]}, joined) == "dropped"
    out = _final(state)
    for k, h in ref.objects.items():
        assert out[k].obj == h, k
    assert state.dropped == {"garbage": 2}


def test_a_500_kB_delta_merges_from_its_frame_and_a_short_or_forged_one_is_dropped() -> None:
    """The fast path adds a large histogram straight from the received frame (no copy);
    a frame too short, or a head whose spec asks for another number of zero bins, is
    dropped and counted, and the integral stays what it was."""
    p = Producer("p")
    p.objects = {"h": hist.Hist.new.Reg(62_498, 0, 1).Double()}  # histograms only
    p.objects["h"].fill([0.25, 0.5])
    state = MergeState("m", run=5)
    header, payload = p.message()
    assert len(payload[1]) < 2000  # the head: the spec's empty bins travel as a length
    assert state.accept(header, payload) == "merged"
    assert state.tasks["t"].plans.count == 1  # the fast path
    p.objects["h"].fill([0.75])
    header, payload = p.message()
    frame = np.frombuffer(payload[2], dtype=np.uint8)
    assert state.accept(header, [*payload[:2], memoryview(frame[:-8])]) == "dropped"
    head = msgpack.unpackb(payload[1])
    spec = msgpack.unpackb(head["items"][0][2])
    spec[1] = 16  # 16 zero bytes where the histogram has 500 kB of bins
    head["items"][0][2] = msgpack.packb(spec)
    forged = {**header, "seq": header["seq"] + 1}
    assert state.accept(forged, [payload[0], msgpack.packb(head), payload[2]]) == "dropped"
    assert state.dropped == {"garbage": 2}
    out = _final(state)
    ref = hist.Hist.new.Reg(62_498, 0, 1).Double()
    ref.fill([0.25, 0.5])
    assert out["h"].obj == ref

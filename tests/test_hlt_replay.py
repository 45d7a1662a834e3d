"""Replay at a set rate: the timeline, the source, truncated files, the device."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from evflow.errors import InputError, ParameterError
from evflow.hlt.built import stores_from_batch
from evflow.hlt.eventbuilder import BuilderConfig, EventBuilder
from evflow.hlt.links import FragmentReceiver
from evflow.hlt.replay import ReplayInput, Timeline, join_fragments, split_event
from evflow.io import RecordWriter, ToyGenerator
from evflow.wire.codec import encode_event
from evflow.wire.raw import pack_frames

HZZ = pytest.importorskip("skhep_testdata").data_path("uproot-HZZ.root")


def write_records(path: Path, n: int, payload_bytes: int = 64) -> Path:
    with RecordWriter(str(path)) as w:
        for store in ToyGenerator(n_events=n, payload_bytes=payload_bytes).events():
            w.write_frames(store.meta.uid, 0, encode_event(store))
    return path


class FakeClock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_timeline_never_drifts() -> None:
    clock = FakeClock()
    tl = Timeline(1000.0, clock=clock)
    assert tl.ready(0) == 1
    clock.t += 0.0105  # a slow consumer: 10.5 ms late
    assert tl.ready(1) == 10  # events 1..10 are due at once, the schedule is unchanged
    tl.wait(11, sleep=clock.sleep)
    assert clock.t == pytest.approx(10.011)
    for k in range(12, 5000):
        clock.t += 0.0003  # work per event
        tl.wait(k, sleep=clock.sleep)
    assert clock.t == pytest.approx(10.0 + 4999 / 1000.0)  # still on the timeline
    with pytest.raises(ParameterError):
        Timeline(-1)


@pytest.mark.parametrize("rate_hz", [1_000.0, 10_000.0, 50_000.0])
def test_replay_rate_is_held_within_one_percent(tmp_path: Path, rate_hz: float) -> None:
    n_file = 500
    src = ReplayInput(
        file=str(write_records(tmp_path / "r.evr", n_file)),
        rate_hz=rate_hz,
        passes=max(1, int(rate_hz * 3.0) // n_file),  # 3 s each (the 5 s: benchmark)
    )
    uids = [store.meta.uid for store in src.events()]
    report = src.report
    assert uids == list(range(len(uids)))  # unique through the passes
    assert report.events == len(uids) == n_file * src.passes
    # over the whole run: the last event left on time, so no drift accumulated
    assert report.achieved_hz == pytest.approx(rate_hz, rel=0.01)
    assert "achieved" in report.line()


def test_replay_loops_over_a_root_file() -> None:
    src = ReplayInput(file=HZZ, passes=2, branches=["NMuon", "Muon_Px"])
    stores = list(src.events())
    assert len(stores) == 2 * 2421
    assert stores[2421].meta.event == 0 and stores[2421].meta.uid == 2421
    assert np.array_equal(stores[5]["Muon_Px"], stores[2421 + 5]["Muon_Px"])


def test_truncated_record_file_replays_its_complete_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_records(tmp_path / "t.evr", 100)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 30)  # the writer died in the middle of the last record
    src = ReplayInput(file=str(path), passes=2)
    assert [s.meta.event for s in src.events()][:99] == list(range(99))
    assert src.report.events == 2 * 99
    assert "torn tail" in caplog.text and "t.evr" in caplog.text


def test_truncated_root_file_is_one_clear_error(tmp_path: Path) -> None:
    cut = tmp_path / "cut.root"
    cut.write_bytes(Path(HZZ).read_bytes()[:50_000])
    with pytest.raises(InputError, match=r"cut\.root"):
        ReplayInput(file=str(cut))
    with pytest.raises(InputError, match="does not exist"):
        ReplayInput(file=str(tmp_path / "none.evr"))


def test_split_and_join_give_the_event_back() -> None:
    store = next(ToyGenerator(n_events=1, payload_bytes=100).events())
    data = pack_frames(encode_event(store))
    pieces = split_event(data, 7)
    assert b"".join(pieces) == data and len(pieces) == 7
    objects = join_fragments(0, {k: p for k, p in enumerate(pieces)})
    assert bytes(objects["payload"]) == bytes(store["payload"])
    assert join_fragments(0, {k: p for k, p in enumerate(pieces) if k != 3}) == {}


@pytest.fixture
def ctx() -> Iterator[zmq.Context[object]]:
    c: zmq.Context[object] = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_replay_device_as_fragment_streams_into_the_builder(
    tmp_path: Path, ctx: zmq.Context[object]
) -> None:
    """`evflow device replay --streams 6` (a real process) -> builder -> the HZZ events."""
    streams = 6
    b = EventBuilder(BuilderConfig(sources=range(streams), timeout_s=5.0))
    recv = FragmentReceiver(ctx, b, "tcp://127.0.0.1:0")
    stats = tmp_path / "replay.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "evflow",
            "device",
            "replay",
            "--id",
            "replay",
            "--file",
            HZZ,
            "--streams",
            str(streams),
            "--builder",
            recv.endpoints[0],
            "--event-rate",
            "5000",
            "--tick-ms",
            "5",  # ~25 events per message: the test's one-thread receiver keeps up
            "--events",
            "3000",
            "--stats-file",
            str(stats),
        ]
    )
    batches = []
    try:
        deadline = time.monotonic() + 60
        while not (recv.all_ended() and b.n_open == 0 and not recv.pending()):
            assert time.monotonic() < deadline, recv.metrics()
            recv.pump(10)
            batches.extend(b.take_built())  # checked after the run: keep up with the rate
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        recv.close()
    got = [s for bb in batches for s in stores_from_batch(bb, merge=join_fragments)]
    assert [s.meta.uid for s in got] == list(range(3000))
    assert all(s["hlt_state"] == 0 for s in got)
    ref = ReplayInput(file=HZZ, passes=2)
    for ours, theirs in zip(got, ref.events(), strict=False):
        assert ours["NMuon"] == theirs["NMuon"]
        assert np.array_equal(ours["Muon_Px"], theirs["Muon_Px"])
    rep = json.loads(stats.read_text())["replay"]
    assert rep["sent"] == 3000 and rep["passes"] == 2
    assert rep["achieved_hz"] == pytest.approx(5000, rel=0.05)

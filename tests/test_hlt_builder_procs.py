"""The event builder fed by real sender processes over real sockets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from evflow.hlt.eventbuilder import BuilderConfig, BuildState, EventBuilder
from evflow.hlt.fragments import encode_fragments
from evflow.hlt.links import FragmentReceiver, FragmentSender
from evflow.hlt.synthetic import check_built
from evflow.wire.messages import MsgType, encode_message

N_EVENTS = 100_000


@pytest.fixture
def ctx() -> Iterator[zmq.Context[object]]:
    c: zmq.Context[object] = zmq.Context()
    yield c
    c.destroy(linger=0)


def senders(
    address: str, groups: list[list[int]], n: int, rate: float = 0
) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "evflow.hlt.synthetic",
                address,
                "--sources",
                ",".join(map(str, g)),
                "--events",
                str(n),
                "--rate",
                str(rate),
            ]
        )
        for g in groups
    ]


class Collector:
    def __init__(self, n: int) -> None:
        self.seen = np.zeros(n, np.int64)
        self.states = np.full(n, -1, np.int8)
        self.missing = np.zeros(n, np.uint64)
        self.bad = 0

    def take(self, b: EventBuilder) -> None:
        for bb in b.take_built():
            np.add.at(self.seen, bb.ids, 1)
            self.bad += check_built(bb)
            self.states[bb.ids] = bb.states
            self.missing[bb.ids] = bb.missing


def stop(procs: list[subprocess.Popen[bytes]]) -> list[int | None]:
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait(10) for p in procs]


def test_12_inputs_100k_events_each_built_once_with_every_fragment(
    ctx: zmq.Context[object],
) -> None:
    b = EventBuilder(BuilderConfig(sources=range(12), timeout_s=5.0, max_events=4096))
    recv = FragmentReceiver(ctx, b, "tcp://127.0.0.1:0")
    procs = senders(recv.endpoints[0], [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], N_EVENTS)
    col = Collector(N_EVENTS)
    deadline = time.monotonic() + 90
    try:
        while not (recv.all_ended() and b.n_open == 0 and not recv.pending()):
            assert time.monotonic() < deadline, b.metrics()
            recv.pump(5)
            col.take(b)
        codes = [p.wait(20) for p in procs]
    finally:
        stop(procs)
        recv.close()
    assert codes == [0, 0, 0, 0]
    assert (col.seen == 1).all()  # every event exactly once
    assert (col.states == BuildState.COMPLETE).all()
    assert col.bad == 0  # every byte of every fragment where it belongs
    m = b.metrics()
    assert (m["fragments"], m["late"], m["duplicate"], m["far"]) == (12 * N_EVENTS, 0, 0, 0)
    assert m["max_in_construction"] <= 4096
    assert b.summary_line() == f"event builder: built {N_EVENTS}, incomplete 0, late 0, duplicate 0"


def test_a_killed_input_makes_its_events_incomplete_within_the_timeout(
    ctx: zmq.Context[object],
) -> None:
    timeout_s = 0.5
    b = EventBuilder(
        BuilderConfig(sources=range(12), timeout_s=timeout_s, max_events=2048, max_bytes=1 << 20)
    )
    recv = FragmentReceiver(ctx, b, "tcp://127.0.0.1:0")
    groups = [[0, 1, 2, 3], [4, 6, 7, 8], [9, 10, 11], [5]]
    procs = senders(recv.endpoints[0], groups, N_EVENTS, rate=50_000)
    col = Collector(N_EVENTS)
    killed_at = None
    first_flag = None
    deadline = time.monotonic() + 90
    try:
        while True:
            assert time.monotonic() < deadline, b.metrics()
            recv.pump(5)
            col.take(b)
            if killed_at is None and b.counters.built > 20_000:
                procs[3].kill()
                killed_at = time.monotonic()
            if first_flag is None and b.incomplete:
                first_flag = time.monotonic()
            others = [recv.by_source[s].ended for s in range(12) if s != 5 and s in recv.by_source]
            if len(others) == 11 and all(others) and b.n_open == 0 and not recv.pending():
                break
        codes = [p.wait(20) for p in procs]
    finally:
        stop(procs)
        recv.close()
    assert codes[:3] == [0, 0, 0] and codes[3] == -9
    assert (col.seen == 1).all()  # nothing lost silently, nothing twice
    assert col.bad == 0
    incomplete = np.flatnonzero(col.states != BuildState.COMPLETE)
    assert len(incomplete) > 0
    assert set(col.missing[incomplete].tolist()) == {1 << 5}  # flagged with the missing source
    # source 5 delivered in order until it died: the incomplete events are one tail
    assert incomplete.tolist() == list(range(int(incomplete[0]), N_EVENTS))
    assert b.incomplete_by_source[5] == len(incomplete)
    assert sum(v for k, v in b.incomplete_by_source.items() if k != 5) == 0
    assert killed_at is not None and first_flag is not None
    assert first_flag - killed_at < timeout_s + 2.0  # bounded, generous for a busy machine
    # memory bounded while one input was gone
    assert b.counters.max_in_construction <= 2048
    assert b.counters.max_bytes_in_construction <= 1 << 20


def test_garbage_unknown_sources_and_far_ids_over_a_socket(ctx: zmq.Context[object]) -> None:
    b = EventBuilder(BuilderConfig(sources=[0, 1], timeout_s=5.0))
    recv = FragmentReceiver(ctx, b, "tcp://127.0.0.1:0")
    addr = recv.endpoints[0]
    rogue = ctx.socket(zmq.DEALER)
    rogue.connect(addr)
    good = [FragmentSender(ctx, addr, s) for s in (0, 1)]
    try:
        rogue.send_multipart([os.urandom(50)])  # garbage bytes
        rogue.send_multipart([b"\x03", b"\x81\xa1s\x00"])  # a batch without HELLO
        rogue.send_multipart(encode_message(MsgType.HELLO, {"protocol": 1, "source": 9}))
        deadline = time.monotonic() + 60
        for sender in good:
            while not sender.wait_credit(time.monotonic() + 0.02):  # one thread: pump here
                assert time.monotonic() < deadline
                recv.pump(20)
            sender.send_batch([0, 1, 2], [b"ab", b"cd", b"ef"])
            sender.send_batch([2**62], [b"zz"])  # far in the future
        while b.counters.complete < 3:
            assert time.monotonic() < deadline, recv.metrics()
            recv.pump(20)
        good[0].channel.send([*encode_fragments(0, [3], [b"x"])[:2], b"too long payload"])
        assert all(s.end(10, waiting=lambda: recv.pump(5)) for s in good)
        assert recv.all_ended()
    finally:
        rogue.close(0)
        for s in good:
            s.close()
        recv.close()
    m = recv.metrics()
    assert m["complete"] == 3 and m["far"] == 2
    assert m["bad_messages"] >= 2 and m["refused"] == 2  # garbage/bad batch; no HELLO; source 9


def _device_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "evflow", "device", *args]


def test_eventbuilder_device_to_sink(tmp_path: Path) -> None:
    """Real processes: 4 senders -> `evflow device eventbuilder` -> `evflow device sink`."""
    stats_b, stats_s = tmp_path / "b.json", tmp_path / "s.json"
    builder = subprocess.Popen(
        _device_cmd(
            "eventbuilder",
            "--id",
            "eb",
            "--sources",
            "4",
            "--stats-file",
            str(stats_b),
            "--channel-config",
            "name=fragments,type=router,method=bind,address=ipc://frags",
            "--channel-config",
            "name=events,type=push,method=bind,address=ipc://built",
            "--channel-config",
            "name=events-ack,type=pull,method=bind,address=ipc://built-ack",
        )
    )
    sink = subprocess.Popen(
        _device_cmd(
            "sink",
            "--id",
            "sink",
            "--stats-file",
            str(stats_s),
            "--channel-config",
            "name=data,type=pull,method=connect,address=ipc://built",
            "--channel-config",
            "name=data-ack,type=push,method=connect,address=ipc://built-ack",
        )
    )
    from evflow.transport.paths import session_dir

    procs = [builder, sink]
    try:
        addr = f"ipc://{session_dir('default') / 'frags'}"
        deadline = time.monotonic() + 60
        while not (session_dir("default") / "frags").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        procs += senders(addr, [[0, 1], [2], [3]], 20_000)
        codes = [p.wait(60) for p in procs]
    finally:
        stop(procs)
    assert codes == [0, 0, 0, 0, 0]
    eb = json.loads(stats_b.read_text())["eventbuilder"]
    assert (eb["built"], eb["complete"], eb["incomplete"]) == (20_000, 20_000, 0)
    sk = json.loads(stats_s.read_text())["sink"]
    assert sk["received"] == sk["announced"] > 0


def test_builder_counters_on_the_bus() -> None:
    """`evflow ctl get-metrics eb` shows the builder's counters while it runs."""
    from evflow.runtime.supervisor import Supervisor
    from evflow.transport.paths import session_dir

    sup = Supervisor(bus=True).start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        common = ["--session", sup.session, "--bus", str(sup.bus_endpoints), "--severity", "warn"]
        sup.add_command(
            "eb",
            [
                *_device_cmd("eventbuilder", "--id", "eb", "--sources", "4", *common),
                *("--channel-config", "name=fragments,type=router,method=bind,address=ipc://f"),
                *("--channel-config", "name=events,type=push,method=bind,address=ipc://b"),
            ],
            device_id="eb",
        )
        sup.add_command(
            "sink",
            [
                *_device_cmd("sink", "--id", "sink", *common),
                *("--channel-config", "name=data,type=pull,method=connect,address=ipc://b"),
            ],
            device_id="sink",
        )
        frags = session_dir(sup.session) / "f"
        deadline = time.monotonic() + 30
        while not frags.exists():
            assert time.monotonic() < deadline
            sup.poll(0.05)
        procs = senders(f"ipc://{frags}", [[0, 1, 2, 3]], 1_000_000, rate=20_000)
        metrics: dict[str, object] = {}
        while not metrics.get("built"):
            assert time.monotonic() < deadline, metrics
            sup.poll(0.2)
            out = subprocess.run(
                [
                    *(sys.executable, "-m", "evflow", "ctl", "--bus", str(sup.bus_endpoints)),
                    *("get-metrics", "eb", "--timeout", "2"),
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if out.returncode == 0:
                metrics = json.loads(out.stdout)["eventbuilder"]
        assert {"built", "incomplete_by_source", "late", "duplicate", "in_construction"} <= set(
            metrics
        )
        assert metrics["bytes"] > 0 and metrics["incomplete"] == 0
    finally:
        stop(procs)
        sup.shutdown()
        sup.close()

"""ProcessMetrics: counters, rates over the injected clock, snapshot fields, socket pressure."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import zmq

from evflow.runtime.metrics import ProcessMetrics
from evflow.transport.channel import ChannelConfig
from evflow.transport.opening import open_channel


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_rates_are_deltas_over_the_clock_interval() -> None:
    clock = Clock()
    m = ProcessMetrics("n", clock=clock)
    assert m.update_rates() == {
        "messages_in_hz": 0.0, "messages_out_hz": 0.0, "bytes_in_per_s": 0.0,
        "bytes_out_per_s": 0.0, "events_in_hz": 0.0, "events_out_hz": 0.0,
    }  # fmt: skip
    m.events_in += 50
    m.events_out += 10
    m.bytes_in += 4000
    clock.now += 2.0
    rates = m.update_rates()
    assert rates["events_in_hz"] == 25.0
    assert rates["events_out_hz"] == 5.0
    assert rates["bytes_in_per_s"] == 2000.0
    clock.now += 1.0
    assert m.update_rates()["events_in_hz"] == 0.0  # nothing new in the last second


def test_snapshot_has_the_alice_fields_with_sane_values() -> None:
    clock = Clock()
    m = ProcessMetrics("worker-1", clock=clock, wall=lambda: 1_700_000_000.5)
    m.messages_in += 3
    snap = m.snapshot("RUNNING", request_timestamp=1_700_000_000.25)
    assert snap["node_id"] == "worker-1" and snap["node_state"] == "RUNNING"
    assert snap["pid"] == os.getpid()
    assert snap["request_timestamp"] == 1_700_000_000.25
    assert snap["response_timestamp"] == 1_700_000_000.5
    assert snap["VmRSS"] > 1000  # kB
    assert snap["cpu"] > 0 and isinstance(snap["cpu_percent"], float)
    assert snap["messages_in"] == 3
    assert snap["receive_buffer_overloaded"] is False
    assert set(snap["rates"]) >= {"events_in_hz", "messages_out_hz", "bytes_out_per_s"}


def test_cpu_percent_follows_a_busy_loop() -> None:
    m = ProcessMetrics("n")
    m.snapshot()
    t0, cpu0 = time.monotonic(), time.process_time()
    while time.process_time() - cpu0 < 0.2:  # 0.2 CPU seconds, however loaded the host is
        pass
    expected = 100 * (time.process_time() - cpu0) / (time.monotonic() - t0)
    assert m.snapshot()["cpu_percent"] == pytest.approx(expected, abs=15)
    assert expected > 10


def test_reported_queues_set_the_overloaded_flags() -> None:
    m = ProcessMetrics("n")
    m.set_queue("receive", 10, 10)
    m.set_queue("send", 3, 10)
    snap = m.snapshot()
    assert snap["receive_buffer_size"] == 10 and snap["receive_buffer_overloaded"] is True
    assert snap["send_buffer_size"] == 3 and snap["send_buffer_overloaded"] is False
    with pytest.raises(ValueError, match="'receive' or 'send'"):
        m.set_queue("inbox", 1)


def test_channels_are_counted_and_a_blocked_sender_is_overloaded() -> None:
    context: zmq.Context[Any] = zmq.Context()
    push = open_channel(
        context,
        ChannelConfig(
            "out", type="push", method="bind", address="tcp://127.0.0.1:0", sndBufSize=5, linger=0
        ),
        "metrics-test",
    )
    pull = None
    try:
        m = ProcessMetrics("n")
        m.add_channels([push])
        snap = m.snapshot()
        assert snap["send_buffer_capacity"] == 5
        assert snap["send_buffer_overloaded"] is True  # no peer: a send would block
        pull = open_channel(
            context,
            ChannelConfig("in", type="pull", method="connect", address=push.endpoints[0], linger=0),
            "metrics-test",
        )
        deadline = time.monotonic() + 30
        while m.snapshot()["send_buffer_overloaded"] and time.monotonic() < deadline:
            time.sleep(0.01)
        push.send([b"x" * 10])
        assert pull.recv() is not None
        snap = m.snapshot()
        assert snap["send_buffer_overloaded"] is False
        assert snap["messages_out"] == 1 and snap["bytes_out"] == 10
    finally:
        push.close(0)
        if pull is not None:
            pull.close(0)
        context.term()

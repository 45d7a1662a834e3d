"""``evflow ctl`` against a real topology: `evflow device` sampler -> sink on a session bus."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from _wait import wait_until
from evflow.runtime.bus import BusController
from evflow.runtime.supervisor import Supervisor

ALICE_FIELDS = {
    "node_id", "node_state", "pid", "request_timestamp", "response_timestamp",
    "receive_buffer_size", "receive_buffer_overloaded", "send_buffer_size",
    "send_buffer_overloaded", "VmRSS", "cpu", "rates",
}  # fmt: skip


def ctl(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evflow", "ctl", *args],
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def start_topology(sup: Supervisor, rate_hz: int = 200) -> None:
    """sampler -> sink over ipc, both on the session's bus, as `evflow device` processes."""
    common = ["--session", sup.session, "--bus", str(sup.bus_endpoints), "--severity", "warn"]
    evflow = [sys.executable, "-m", "evflow", "device"]
    sup.add_command(
        "sampler",
        [*evflow, "sampler", "--id", "sampler", "--rate", str(rate_hz), "--channel-config",
         "name=data,type=push,method=bind,address=ipc://data.ipc", *common],
        device_id="sampler",
    )  # fmt: skip
    sup.add_command(
        "sink",
        [*evflow, "sink", "--id", "sink", "--channel-config",
         "name=data,type=pull,method=connect,address=ipc://data.ipc", *common],
        device_id="sink",
    )  # fmt: skip


def wait_running(sup: Supervisor, ids: set[str], timeout_s: float = 60) -> None:
    """Until every device answers check-state with RUNNING (start-up takes ~1 s, far
    more on a loaded machine)."""
    context: zmq.Context[Any] = zmq.Context()
    controller = BusController(context, sup.bus_endpoints)
    try:
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            sup.poll(0)
            for r in controller.request("check-state", "*", timeout_s=1.2):
                states[r["from"]] = r["data"]["node_state"]
            if all(states.get(i) == "RUNNING" for i in ids):
                return
        raise AssertionError(f"devices not RUNNING within {timeout_s} s: {states}")
    finally:
        controller.close()
        context.term()


@pytest.fixture
def topology() -> Iterator[Supervisor]:
    sup = Supervisor(bus=True).start()
    try:
        start_topology(sup)
        wait_running(sup, {"sampler", "sink"})
        yield sup
    finally:
        sup.shutdown()
        sup.close()


def test_check_state_and_get_metrics_of_a_running_topology(topology: Supervisor) -> None:
    sup = topology
    everyone = ctl("check-state", "--timeout", "5")  # collects the answers for 5 s
    assert everyone.returncode == 0, everyone.stderr
    states = {d["node_id"]: d for d in json.loads(everyone.stdout)}
    assert {"bus", "sampler", "sink"} <= set(states)
    assert states["sampler"]["node_state"] == "RUNNING"
    assert states["sampler"]["pid"] == sup.processes["sampler"].pid

    one = ctl("check-state", "sink", "--timeout", "30")  # (returns with the answer)
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["node_state"] == "RUNNING"

    def receiving() -> dict[str, Any] | None:
        metrics = ctl("get-metrics", "sink", "--timeout", "30")
        assert metrics.returncode == 0, metrics.stderr
        data: dict[str, Any] = json.loads(metrics.stdout)
        return data if data["messages_in"] > 0 else None

    data = wait_until(receiving, 90, "the sink receiving")  # RUNNING before its first message
    assert set(data) >= ALICE_FIELDS
    assert data["node_id"] == "sink" and data["pid"] == sup.processes["sink"].pid
    assert data["receive_buffer_capacity"] == 1000  # the data channel's rcvBufSize


def test_transition_and_unknown_id(topology: Supervisor) -> None:
    sup = topology
    ghost = ctl("check-state", "ghost", "--timeout", "1")  # (a hang: ctl()'s time-out fails it)
    assert ghost.returncode == 1
    lines = ghost.stderr.strip().splitlines()
    assert len(lines) == 1, ghost.stderr
    assert "no node 'ghost' answered 'check-state' within 1.0 s" in lines[0]
    assert ghost.stdout == ""

    bad = ctl("transition", "sampler", "INIT_TASK", "--timeout", "30")  # not allowed from RUNNING
    assert bad.returncode == 1
    assert "no transition from RUNNING on INIT_TASK" in bad.stderr

    stop = ctl("transition", "sampler", "STOP", "--timeout", "30")
    assert stop.returncode == 0, stop.stderr
    assert json.loads(stop.stdout)["accepted"] is True

    # a static-control device leaves RUNNING and winds down by itself
    def ended() -> bool:
        sup.poll(0.1)  # reaps it
        return not sup.processes["sampler"].alive

    wait_until(ended, 60, "the sampler ending")
    assert sup.processes["sampler"].returncode == 0


def test_no_bus_is_a_clear_error() -> None:
    result = ctl("check-state")
    assert result.returncode == 1
    assert "no control bus found under" in result.stderr
    result = ctl("--session", "nope", "get-metrics")
    assert result.returncode == 1
    assert "session 'nope' has no control bus" in result.stderr
    result = ctl("--bus", "tcp://x", "check-state")
    assert result.returncode == 1
    assert "invalid bus address 'tcp://x'" in result.stderr

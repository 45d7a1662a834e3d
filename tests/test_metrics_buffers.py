"""get-metrics reports real queue fill and the ALICE QC prototype's fields, for the
roles of a parallel run and for the bus proxy; ``evflow ctl get-run`` exists.

A real parallel run in a subprocess (``test_parallel_bus``'s ``start_run``), asked
over its bus like ``evflow ctl`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import zmq

from evflow.runtime.bus import BusController, BusProxy
from evflow.runtime.metrics import ProcessMetrics
from test_parallel_bus import SRC, start_run  # noqa: F401  (the fixture)

PROTOTYPE_FIELDS = {
    "command",
    "node_id",
    "node_state",
    "pid",
    "request_timestamp",
    "response_timestamp",
    "receive_buffer_size",
    "receive_buffer_capacity",
    "receive_buffer_overloaded",
    "send_buffer_size",
    "send_buffer_capacity",
    "send_buffer_overloaded",
    "VmRSS",
    "cpu_clock",
}


def test_a_snapshot_says_which_command_it_answers_and_the_cpu_clock() -> None:
    m = ProcessMetrics("n")
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:
        pass
    snap = m.snapshot("RUNNING")
    assert set(snap) >= PROTOTYPE_FIELDS
    assert snap["command"] == "get-metrics" and snap["cpu_clock"] >= 0.05
    assert m.snapshot(command="metrics")["command"] == "metrics"


def test_the_bus_proxy_reports_rss_cpu_and_its_buffers(_runtime_dir: Any) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    proxy = BusProxy(ctx, "metrics-bus")
    proxy.start_thread()
    ctl = BusController(ctx, proxy.endpoints)
    try:
        ctl.request("ping", "bus", timeout_s=5.0)  # traffic through the proxy
        data = ctl.request("get-metrics", "bus", timeout_s=5.0)[0]["data"]
    finally:
        ctl.close()
        proxy.close()
        ctx.term()
    assert set(data) >= PROTOTYPE_FIELDS, PROTOTYPE_FIELDS - set(data)
    assert data["node_id"] == "bus" and data["command"] == "get-metrics"
    assert data["VmRSS"] > 1000 and data["cpu_clock"] > 0  # kB; this process's
    # its two sockets' high-water marks (10000 each); it holds nothing itself
    assert data["receive_buffer_capacity"] == data["send_buffer_capacity"] == 10000
    assert data["receive_buffer_size"] == 0 and data["send_buffer_overloaded"] is False
    assert data["messages_in"] >= 2 and data["messages_forwarded"] >= 2


def test_the_roles_report_what_they_hold_against_their_limits(start_run: Any) -> None:  # noqa: F811
    run = start_run(workers=2, work_ms=20.0)
    run.wait_all(dict.fromkeys(("input", "output", "worker-0", "worker-1"), "RUNNING"), 60.0)
    deadline = time.monotonic() + 60
    inp: dict[str, Any] = {}
    while time.monotonic() < deadline:  # (the first windows fill as the workers start)
        inp = run.metrics("input")
        if inp["in_flight"] > 0 and inp["cpu_clock"] > 0:  # (the CPU clock ticks by 10 ms)
            break
    assert set(inp) >= PROTOTYPE_FIELDS, PROTOTYPE_FIELDS - set(inp)
    # the events at the workers are the input's send buffer (one reading), against
    # the credit windows it keeps for them
    assert inp["send_buffer_size"] == inp["in_flight"] > 0
    # (the windows follow the measured time per event: the fill may pass a new one)
    assert inp["send_buffer_capacity"] > 0
    assert inp["send_buffer_overloaded"] == (inp["send_buffer_size"] >= inp["send_buffer_capacity"])
    assert inp["command"] == "get-metrics" and inp["cpu_clock"] > 0 and inp["VmRSS"] > 1000
    out = run.metrics("output")
    assert out["receive_buffer_size"] == out["written_not_confirmed"]
    assert out["receive_buffer_capacity"] >= 4096  # a CONFIRM goes at the latest then
    # `evflow ctl get-run`, as the docs show it: the caller's account of its processes
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-m", "evflow", "ctl", "get-run", "--session", run.session],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    progress = json.loads(done.stdout)
    assert progress["workers"] == 2 and len(progress["processes"]) >= 4
    assert progress["workers lost"] == 0
    code, err = run.stop()
    assert code == 143, err

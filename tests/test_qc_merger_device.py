"""``evflow device qc-merger`` as a real process: bus metrics, bad input, cycle changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from evflow.event import RunMeta
from evflow.qc.layers import build_layers, launch_layers
from evflow.qc.toy import ToyQc
from evflow.runtime.bus import BusController
from evflow.runtime.supervisor import Supervisor
from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel
from evflow.wire.messages import MsgType, encode_message

sys.path.insert(0, str(Path(__file__).parent))
from test_qc_layers import RUN, event

QC_FIELDS = {
    "average_merge_time", "merged_objects_per_second", "VmRSS", "cpu_clock",
    "receive_buffer_size", "receive_buffer_overloaded", "send_buffer_size",
    "send_buffer_overloaded", "qc",
}  # fmt: skip


def ctl_metrics(sup: Supervisor, node: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "evflow", "ctl", "get-metrics", node, "--session", sup.session],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_exec_merger_reports_qc_metrics_and_survives_garbage(tmp_path: Path) -> None:
    specs, routes = build_layers(["a", "b"], [1])
    context: zmq.Context[Any] = zmq.Context()
    sup = Supervisor(bus=True).start()
    task = None
    junk = None
    try:
        launch_layers(sup, specs, exec_devices=True, cycle_s=0.2, run_number=RUN,
                      state_dir=tmp_path)  # fmt: skip
        # garbage on the merger's socket: random frames, a QC header with junk payload,
        # a delta of another run
        (cfg,) = parse_channel_config(f"name=junk,type=dealer,method=connect,address={routes['a']}")
        junk = open_channel(context, cfg, sup.session)
        junk.send([os.urandom(40)])
        junk.send(encode_message(MsgType.EVENTS, {"qc": 1, "src": "x", "task": "det", "run": RUN,
                                                  "cycle": 1, "seq": 1, "events": 1,
                                                  "mode": "delta"}, [b"\xc1\xc1"]))  # fmt: skip
        junk.send(encode_message(MsgType.EVENTS, {"qc": 1, "src": "y", "task": "det", "run": 7,
                                                  "cycle": 1, "seq": 1, "events": 1,
                                                  "mode": "delta"}, [b"\x90"]))  # fmt: skip
        task = ToyQc(name="det", merger=routes["a"], session=sup.session, cycle_s=0.05,
                     source="a", resend_after_s=0.5)  # fmt: skip
        task.initialize()
        task.begin_run(RunMeta(0, RUN))
        deadline = time.monotonic() + 30
        metrics: dict[str, Any] = {}
        i = 0
        while time.monotonic() < deadline:
            sup.poll(0)
            for _ in range(20):
                task.event(event(i))
                i += 1
            time.sleep(0.01)
            if i % 400 == 0:
                metrics = ctl_metrics(sup, "qc-merger")
                if metrics["qc"]["merged_objects"] > 0 and metrics["qc"]["published"] > 0:
                    break
        assert set(metrics) >= QC_FIELDS, QC_FIELDS - set(metrics)
        qc = metrics["qc"]
        assert qc["dropped"].get("garbage") == 1 and qc["dropped"].get("other_run") == 1
        assert metrics["bad_messages"] >= 1  # the random frames
        assert metrics["VmRSS"] > 0 and metrics["cpu_clock"] > 0
        assert metrics["merged_objects_per_second"] >= 0 and metrics["average_merge_time"] >= 0
        # the cycle changes during the run, over the bus
        controller = BusController(context, sup.bus_endpoints)
        try:
            (reply,) = controller.request("qc-set-cycle", "qc-merger", {"seconds": 0.5},
                                          timeout_s=5)  # fmt: skip
        finally:
            controller.close()
        assert reply["ok"] and reply["data"] == {"cycle_s": 0.5}
        task.end_run(RunMeta(0, RUN))
        assert task.publisher is not None and task.publisher.end_acked
        assert task.publisher.stats["refused"] == 0
    finally:
        if task is not None:
            task.terminate()
        if junk is not None:
            junk.close(0)
        sup.shutdown()
        sup.close()
        context.term()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evflow", "device", "qc-merger", "--id", "m", "--session", "bad",
         "--severity", "error", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_bad_channel_type_and_corrupt_checkpoint_are_one_clear_error(tmp_path: Path) -> None:
    out = run_cli("--channel-config", "name=qc-in,type=pull,method=bind,address=ipc://m-in")
    assert out.returncode == 1
    assert "channel 'qc-in' must be a router" in out.stderr
    state = tmp_path / "m.state"
    state.write_bytes(b"\x00garbage")
    router = "name=qc-in,type=router,method=bind,address=ipc://m-in"
    out = run_cli("--state-file", str(state), "--channel-config", router)
    assert out.returncode == 1
    assert f"checkpoint {state} cannot be read" in out.stderr and "remove it" in out.stderr

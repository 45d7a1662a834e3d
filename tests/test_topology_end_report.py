"""The end report of a topology that lost a device names the cause once.

Paced samplers feed a merger; the merger is SIGKILLed (restart ``never``), which
breaks the desired state and stops the topology. The samplers, waiting for the ACK of
their END from the dead merger (60 s), are killed by their agent's shutdown: that is
the stop, not a loss of their own. The report names the merger as lost and the
samplers as stopped by the controller.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _topo import Lines

TOPOLOGY = """
name = "lose-merger"
[devices.sampler]
class = "sampler"
instances = 3
rate = 200
max_iterations = 6000
params = { msg_size = 100, ack_timeout_s = 60.0 }
channels = [{ name = "data", type = "dealer", connect = "merger.data-in" }]
[devices.merger]
class = "merger"
channels = [
  { name = "data-in", type = "router", bind = true },
  { name = "data-out", type = "dealer", connect = "sink.data" },
]
[devices.sink]
class = "sink"
channels = [{ name = "data", type = "router", bind = true }]
"""


def status(session: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "evflow", "status", "--session", session, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def test_a_lost_merger_is_the_cause_and_the_samplers_killed_at_shutdown_are_not_lost(
    tmp_path: Path,
) -> None:
    topo = tmp_path / "lose.toml"
    topo.write_text(TOPOLOGY)
    session = f"endrep{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "evflow", "up", "--quiet", "--grace", "1",
         "--session", session, str(topo)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines = Lines(proc)
    try:
        lines.wait_for("devices RUNNING", 60)
        pids = {d["id"]: d["pid"] for d in status(session)["devices"]}
        deadline = time.monotonic() + 30
        while not pids.get("merger") and time.monotonic() < deadline:
            pids = {d["id"]: d["pid"] for d in status(session)["devices"]}
        os.kill(pids["merger"], signal.SIGKILL)
    finally:
        code, text = lines.finish(120)
    assert code == 1, text
    assert "Traceback" not in text, text
    lost = [line for line in text.splitlines() if re.search(r"\blost\b", line)]
    assert not [line for line in lost if "sampler_" in line and "merger" not in line], text
    assert any("merger" in line and "SIGKILL" in line for line in lost), text
    stopped = [line for line in text.splitlines() if "stopped by the controller" in line]
    assert len(stopped) == 1 and "sampler_0" in stopped[0], text


SLOW_QC = """
name = "slow-qc"
[devices.source]
class = "evflow.qc.toy:ToyEvents"
params = { n_events = 600, batch = 10, ack_timeout_s = 0.5 }
channels = [{ name = "data", type = "dealer", connect = "producer.data-in" }]
[devices.producer]
class = "qc-producer"
channels = [{ name = "data-in", type = "router", bind = true }]
params = { task = "_topo_devices:SlowQc", cycle_s = 100.0 }
"""


def test_a_producer_far_behind_its_source_is_no_error(tmp_path: Path) -> None:
    """The source's END waits behind its whole stream in the producer's queue (3 s of
    work here, more than 30 s on a loaded machine): a late ACK from a producer that is
    still there is no failure, so nothing is logged as an ERROR."""
    topo = tmp_path / "slow.toml"
    topo.write_text(SLOW_QC)
    stats_dir = tmp_path / "stats"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "evflow", "up", "--quiet", "--stats-dir", str(stats_dir),
         str(topo)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "[ERROR]" not in proc.stderr, proc.stderr
    assert json.loads((stats_dir / "producer.json").read_text())["qc"]["events_in"] == 600

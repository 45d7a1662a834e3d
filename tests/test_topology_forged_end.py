"""ENDs count only from the senders a topology named, once each (issue 21, defect 3).

8 rate-limited toy sources -> 8 producers -> 2 QC mergers -> 1 -> a repository, real
processes. A DEALER of the test sends the repository forged ENDs (no sender, an
unknown one, the same one again): before, the first one counted as the top merger's
END, the repository stopped before the final objects came and the run still exited 0
with nothing stored. Now they are counted as bad messages and the repository stores
the sequential fill. And a top merger whose END the repository never acknowledges (it
was killed) makes the run fail with one line, instead of a logged error and exit 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import zmq

from _topo import Lines
from evflow.wire.messages import MsgType, encode_message
from test_topology_qclayers import assert_sequential_fill

N_EVENTS, RUN = 64_000, 7
LOWER = ["toy-merger-0-0", "toy-merger-0-1"]
TOP = "toy-merger-1-0"

TOPOLOGY = """
name = "qc-forged"

[devices.source]
class = "evflow.qc.toy:ToyEvents"
instances = 8
rate = 20
params = {{ n_events = {n_events}, copies = 8, run_number = {run} }}
channels = [{{ name = "data", type = "dealer", connect = "producer.data-in" }}]

[devices.producer]
class = "qc-producer"
instances = 8
channels = [{{ name = "data-in", type = "router", bind = true }}]

[devices.producer.params]
task = "evflow.qc.toy:ToyQc"
task_params = '{{"name": "toy"}}'
cycle_s = 0.2
run_number = {run}

[qc.toy]
producers = "producer"
mergers_per_layer = [2, 1]
repository = "repository"
params = {{ cycle_s = 0.3, run_number = {run}, ack_timeout_s = 4.0 }}

[devices.repository]
class = "qc-repository"
expendable = {expendable}
params = {{ repo = "{repo}" }}
channels = [{{ name = "qc-in", type = "router", bind = true }}]
"""


def evflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evflow", *args], capture_output=True, text=True, timeout=30
    )


def start(tmp_path: Path, session: str, expendable: bool) -> tuple[subprocess.Popen[str], Path]:
    repo = tmp_path / "qc.sqlite"
    topo = tmp_path / "qc.toml"
    flag = "true" if expendable else "false"
    topo.write_text(TOPOLOGY.format(n_events=N_EVENTS, run=RUN, repo=repo, expendable=flag))
    proc = subprocess.Popen(
        [sys.executable, "-m", "evflow", "up", "--quiet", "--session", session, str(topo)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return proc, repo


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:  # (a failed check): an orderly stop leaves nothing behind
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.communicate()


def repository_endpoint(session: str) -> str:
    out = evflow("ctl", "check-state", "repository", "--session", session)
    assert out.returncode == 0, out.stderr
    found = re.search(r'"repository\.qc-in":\s*\[\s*"(ipc://[^"]+)"', out.stdout)
    assert found is not None, out.stdout
    return found.group(1)


def test_forged_and_repeated_ends_do_not_stop_the_repository(tmp_path: Path) -> None:
    session = f"qf{os.getpid()}"
    proc, repo = start(tmp_path, session, expendable=False)
    lines = Lines(proc)
    ctx: zmq.Context[bytes] = zmq.Context()
    try:
        lines.wait_for("devices RUNNING", 60)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 1000)
        dealer.connect(repository_endpoint(session))
        for sender in (None, 7, "", "intruder", "intruder", "intruder"):
            dealer.send_multipart(encode_message(MsgType.END, {"from": sender, "count": 0}))
        dealer.close()
        ended = lines.wait_exit(90)
        code, text = lines.finish(60)
    finally:
        ctx.term()
        stop(proc)
    said = "\n".join(line for line in text.splitlines() if "msg/s" not in line)[-4000:]
    assert ended and code == 0, said
    assert_sequential_fill(repo, N_EVENTS, RUN, [f"producer_{k}" for k in range(8)], LOWER, TOP)
    assert "not a merger of this repository" in text, said  # counted, logged once


def test_an_unacknowledged_end_of_the_top_merger_fails_the_run(tmp_path: Path) -> None:
    session = f"qu{os.getpid()}"
    proc, _repo = start(tmp_path, session, expendable=True)
    lines = Lines(proc)
    try:
        lines.wait_for("devices RUNNING", 60)
        status = json.loads(evflow("status", "--session", session, "--json").stdout)
        pid = {d["id"]: d["pid"] for d in status["devices"]}["repository"]
        assert pid in {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        os.kill(pid, signal.SIGKILL)
        ended = lines.wait_exit(90)
        code, text = lines.finish(60)
    finally:
        stop(proc)
    said = "\n".join(line for line in text.splitlines() if "msg/s" not in line)[-4000:]
    assert ended, said
    errors = [line for line in text.splitlines() if line.startswith("evflow: error:")]
    assert code == 1 and len(errors) == 1, said
    assert f"qc-merger '{TOP}': END on qc-out[0] not acknowledged within 4 s" in errors[0], said

"""Every restart of a device is walked back to RUNNING: 20 SIGKILLs of one merger at
random moments of one ``evflow up`` run, each new process checked RUNNING.

``restart_backoff_s = 0`` makes the agent fork the new process in the same turn that
reaps the dead one: before the fix its heartbeat then named the new process with the
old restart count, the controller never walked it (IDLE, ``restarts`` 0 in ``evflow
status``), and its peers waited for ever (issue 21, defect 7: 1 of 22 runs under load,
where the 0.1 s backoff ran out between the reap and the restart). Some kills land
while the new process is still being walked (killed as soon as its pid is known).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from _topo import Lines

KILLS = 20
#: a restarted merger is RUNNING about 1.5 s after its death on an idle machine
BACK_BOUND_S = 20.0

TOPOLOGY = """
name = "rewalk"

[devices.sampler]
class = "sampler"
instances = 2
rate = 100
max_iterations = 0
params = { msg_size = 64 }
channels = [{ name = "data", type = "dealer", connect = "merger.data-in", sndBufSize = 50 }]

[devices.merger]
class = "merger"
restart = "on-failure"
max_restarts = 40
restart_backoff_s = 0
channels = [
  { name = "data-in", type = "router", bind = true, rcvBufSize = 50 },
  { name = "data-out", type = "dealer", connect = "sink.data", sndBufSize = 50 },
]

[devices.sink]
class = "sink"
channels = [{ name = "data", type = "router", bind = true, rcvBufSize = 50 }]
"""


def evflow(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evflow", *args], capture_output=True, text=True, timeout=timeout_s
    )


class Run:
    def __init__(self, proc: subprocess.Popen[str], session: str) -> None:
        self.proc = proc
        self.lines = Lines(proc)
        self.session = session
        self.dead: set[int] = set()
        self.log: list[str] = []

    def merger(self) -> dict[str, Any]:
        out = evflow("status", "--session", self.session, "--json")
        assert out.returncode == 0, out.stderr
        devices = {d["id"]: d for d in json.loads(out.stdout)["devices"]}
        row: dict[str, Any] = devices["merger"]
        return row

    def pause(self, seconds: float) -> None:
        assert not self.lines.wait_exit(seconds), "evflow up ended during the kills"

    def wait(self, what: str, ok: Any, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        row = self.merger()
        while not ok(row):
            assert time.monotonic() < deadline, (
                f"{what} not within {timeout_s} s: {row}\n" + "\n".join(self.log)
            )
            self.pause(0.05)
            row = self.merger()
        return row

    def kill(self, pid: int) -> None:
        mine = {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        assert pid in mine, f"pid {pid} is not a process of this topology"
        os.kill(pid, signal.SIGKILL)
        self.dead.add(pid)
        self.log.append(f"SIGKILL merger pid {pid}")


def test_twenty_merger_restarts_at_random_moments_are_each_walked_to_running(
    tmp_path: Path,
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    topo = tmp_path / "t.toml"
    topo.write_text(TOPOLOGY)
    session = f"rw{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "evflow", "up", "--quiet", "--session", session, str(topo)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    run = Run(proc, session)
    try:
        run.lines.wait_for("devices RUNNING", 60)
        restarts = 0
        row = run.merger()
        for k in range(KILLS):
            run.pause(rng.uniform(0.0, 0.8))  # a random moment of the flow
            run.kill(int(row["pid"]))
            if k % 4 == 3:  # the new process again, while it is being walked
                row = run.wait("a new merger process", lambda r: r["pid"] not in run.dead, 20)
                run.pause(rng.uniform(0.0, 0.3))
                run.kill(int(row["pid"]))
                restarts += 1
            restarts += 1
            want = restarts
            row = run.wait(
                f"kill {k + 1} (seed {seed}): merger RUNNING in its new process, restarts={want}",
                lambda r, want=want: (
                    r["pid"] not in run.dead and r["state"] == "RUNNING" and r["restarts"] == want
                ),
                BACK_BOUND_S,
            )
            run.log.append(f"restart {want}: pid {row['pid']} RUNNING")
        down = evflow("down", "--session", session, timeout_s=60)
        assert down.returncode == 0, down.stderr
        assert run.lines.wait_exit(60), "evflow up did not end after evflow down"
        code, text = run.lines.finish(30)
        assert code == 0, text[-3000:]
        assert "giving up" not in text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()

"""``evflow status``, ``down`` and ``ctl`` after ``kill -9`` of ``evflow up``.

The killed controller cannot remove its session directories; its devices and agents die
with it. The commands that look for a session skip the dead one (they used to pick it
and fail after 3 s: "the control bus ... does not answer"), remove what it left and say
so in one line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from evflow.transport.paths import runtime_base_dir, session_dir
from evflow.transport.sessions import OWNER_FILE, remove_stale_sessions

SLOW = """
name = "slow"

[devices.sampler]
class = "sampler"
max_iterations = 0
rate = 20
params = { msg_size = 100 }
channels = [{ name = "data", type = "dealer", connect = "sink.data" }]

[devices.sink]
class = "sink"
channels = [{ name = "data", type = "router", bind = true }]
"""


def evflow(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evflow", *args], capture_output=True, text=True, timeout=timeout_s
    )


def start(topo: Path, session: str) -> subprocess.Popen[str]:
    """``evflow up`` of ``topo``, returned once its devices are RUNNING."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "evflow", "up", "--quiet", "--severity", "warn",
         "--session", session, str(topo)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"evflow up of {session} ended early"
        if (runtime_base_dir() / session / "topology.json").exists():
            status = evflow("status", "--session", session, "--json")
            if status.returncode == 0 and json.loads(status.stdout)["phase"] == "running":
                return proc
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise AssertionError(f"topology {session} not RUNNING within 60 s")


def kill_9(proc: subprocess.Popen[str], session: str) -> None:
    """SIGKILL ``evflow up`` and wait until every process it started is gone."""
    tree = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait(timeout=10)
    _, alive = psutil.wait_procs(tree, timeout=20)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    left = sorted(p.name for p in runtime_base_dir().iterdir() if p.name.startswith(session))
    assert left == [session, f"{session}-localhost"], "kill -9 left nothing: this shows nothing"


def test_status_and_ctl_skip_and_remove_a_killed_topology(tmp_path: Path) -> None:
    topo = tmp_path / "slow.toml"
    topo.write_text(SLOW)
    live = start(topo, "live")
    try:
        kill_9(start(topo, "dead"), "dead")
        status = evflow("status", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["session"] == "live"
        assert status.stderr == (
            "evflow: removed what dead sessions dead, dead-localhost left (killed; no "
            "process of them runs)\n"
        )
        assert sorted(p.name for p in runtime_base_dir().iterdir()) == ["live", "live-localhost"]

        kill_9(start(topo, "dead2"), "dead2")
        ctl = evflow("ctl", "check-state", "sink")
        assert ctl.returncode == 0, ctl.stderr
        assert json.loads(ctl.stdout)["node_state"] == "RUNNING"
        assert "removed what dead sessions dead2, dead2-localhost left" in ctl.stderr
        assert sorted(p.name for p in runtime_base_dir().iterdir()) == ["live", "live-localhost"]

        down = evflow("down")
        assert down.returncode == 0, down.stderr
        assert down.stdout == "session live: down\n"
        assert live.wait(timeout=60) == 0
    finally:
        if live.poll() is None:  # the test failed: leave nothing behind all the same
            tree = psutil.Process(live.pid).children(recursive=True)
            live.kill()
            live.wait()
            psutil.wait_procs(tree, timeout=20)
            remove_stale_sessions()
    assert list(runtime_base_dir().iterdir()) == []


def _dead_topology_session(name: str) -> Path:
    """What ``kill -9`` of ``evflow up`` leaves: an owner file naming a dead process,
    the topology marker and the bus's ipc files, nobody listening."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    path = session_dir(name)
    owner = {"version": 1, "pid": proc.pid, "started_s": time.time() - 5,
             "host": socket.gethostname()}  # fmt: skip
    (path / OWNER_FILE).write_text(json.dumps(owner))
    (path / "topology.json").write_text(json.dumps({"version": 1, "topology": "t"}))
    for name in ("bus-in.ipc", "bus-out.ipc"):
        (path / name).write_text("")
    return path


def test_only_dead_sessions_say_no_running_session_and_down_of_one_cleans_it() -> None:
    first = _dead_topology_session("gone-1")
    _dead_topology_session("gone-2")
    shm = Path("/dev/shm/evflow-gone-1-region")
    shm.write_bytes(b"x")
    status = evflow("status")
    assert status.returncode == 1
    assert status.stderr.splitlines() == [
        "evflow: removed what dead sessions gone-1, gone-2 left (killed; no process of them runs)",
        f"evflow: error: no running session under {runtime_base_dir()} (start a topology "
        "with evflow up)",
    ]
    assert not first.exists() and not shm.exists()
    assert list(runtime_base_dir().iterdir()) == []

    _dead_topology_session("gone-3")
    down = evflow("down", "--session", "gone-3")
    assert down.returncode == 0, down.stderr
    assert (
        down.stdout == "session gone-3: down (its controller was killed; what it left is removed)\n"
    )
    assert down.stderr == ""
    _dead_topology_session("gone-4")
    status = evflow("status", "--session", "gone-4")
    assert status.returncode == 1
    assert status.stderr == (
        "evflow: error: session 'gone-4' is not running: its controller was killed (what it "
        "left is removed now)\n"
    )
    assert list(runtime_base_dir().iterdir()) == []
    assert os.environ["EVFLOW_RUNTIME_DIR"] == str(runtime_base_dir())

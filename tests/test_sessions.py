"""Stale session directories: a run killed with kill -9 leaves its own; the next removes it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

import evflow
from _wait import wait_until
from evflow.io.generators import BusyWork, ToyGenerator
from evflow.transport.paths import runtime_base_dir, session_dir
from evflow.transport.sessions import (
    OWNER_FILE,
    claim_session,
    read_owner,
    remove_stale_sessions,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _fake_session(name: str, pid: int, started_s: float, host: str | None = None) -> Path:
    path = session_dir(name)
    owner = {"version": 1, "pid": pid, "started_s": started_s, "host": host or socket.gethostname()}
    (path / OWNER_FILE).write_text(json.dumps(owner))
    (path / "ctl.ipc").write_text("")  # a leftover (not listening) ipc file
    return path


def test_only_the_session_of_a_dead_owner_is_removed(_runtime_dir: Path) -> None:
    me = psutil.Process()
    stale = _fake_session("par-dead", _dead_pid(), time.time() - 5)
    live = claim_session("par-live")
    assert read_owner(live) is not None and read_owner(live).pid == os.getpid()  # type: ignore[union-attr]
    reused = _fake_session("par-reused", me.pid, me.create_time() - 3600)  # pid reused
    foreign = _fake_session("par-foreign", _dead_pid(), time.time(), host="another-host")
    unowned = session_dir("device-session")  # no owner file: never touched
    (unowned / "data.ipc").write_text("")
    assert sorted(remove_stale_sessions()) == ["par-dead", "par-reused"]
    assert not stale.exists() and not reused.exists()
    assert live.exists() and foreign.exists() and unowned.exists()
    assert remove_stale_sessions() == []  # idempotent
    for path in (live, foreign, unowned):
        for f in path.iterdir():
            f.unlink()
        path.rmdir()


def test_a_dead_owners_session_with_a_listening_socket_is_kept(_runtime_dir: Path) -> None:
    path = _fake_session("par-orphan", _dead_pid(), time.time())
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path / "events.ipc"))
        server.listen(1)
        assert remove_stale_sessions() == []  # an orphaned child still serves it
        assert path.exists()
    finally:
        server.close()
    assert remove_stale_sessions() == ["par-orphan"]
    assert not path.exists()


def test_a_torn_or_missing_owner_file_leaves_the_directory_alone(_runtime_dir: Path) -> None:
    path = session_dir("par-torn")
    (path / OWNER_FILE).write_text('{"pid": 12')
    assert remove_stale_sessions() == []
    (path / OWNER_FILE).unlink()
    path.rmdir()


def test_no_runtime_directory_is_not_an_error(monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("EVFLOW_RUNTIME_DIR", str(tmp_path / "missing"))
    assert remove_stale_sessions() == []


_RUN = """
import evflow
from evflow.io.generators import BusyWork, ToyGenerator
path = evflow.Path([ToyGenerator(n_events=1_000_000, payload_bytes=100), BusyWork(work_ms=0.5)])
evflow.process(path, workers=2, quiet=True)
"""


def _workers_below(pid: int) -> int:
    """How many processes below ``pid`` are named worker-*."""
    n = 0
    for p in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            n += p.name().startswith("worker")
    return n


def test_the_next_run_removes_the_session_of_a_run_killed_with_kill_9(
    _runtime_dir: Path,
) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _RUN], start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        sessions: list[Path] = []
        while time.monotonic() < deadline:
            sessions = [p for p in runtime_base_dir().iterdir() if (p / OWNER_FILE).exists()]
            if sessions and {"events", "results"} <= {p.name for p in sessions[0].iterdir()}:
                break  # the input and the output are up
            time.sleep(0.05)
        # the workers run: both forked and named
        wait_until(lambda: _workers_below(proc.pid) >= 2, 30, "2 workers", proc=proc)
        tree = psutil.Process(proc.pid).children(recursive=True)  # zygote, roles
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the parent (the zygote has its own group)
        proc.wait(timeout=10)
    # the zygote and the roles die with their parent (PDEATHSIG): wait until they are gone
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert all(_zombie(p) for p in alive), alive  # (a zombie's sockets are closed)
    assert len(sessions) == 1, "the run never claimed its session directory"
    stale = sessions[0]
    assert read_owner(stale).pid == proc.pid  # type: ignore[union-attr]
    assert stale.exists(), "kill -9 left nothing behind: this test shows nothing"
    path = evflow.Path([ToyGenerator(n_events=50), BusyWork(work_ms=0.0)])
    summary = evflow.process(path, workers=1, quiet=True)
    assert summary.events_read == 50
    assert list(runtime_base_dir().iterdir()) == []  # the stale one and the new one are gone


def _zombie(p: psutil.Process) -> bool:
    try:
        return bool(p.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True

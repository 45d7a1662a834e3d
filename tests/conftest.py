"""Shared fixtures: every test runs in its own runtime dir and must leave nothing behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# A suite started in the background (`pytest &` in a script, nohup, a CI step without
# job control) inherits SIGINT (and SIGQUIT) ignored, and so does every process its tests start: the
# tests of Ctrl-C handling then fail for no fault of evflow (a run keeps an ignored
# SIGINT ignored, on purpose). Python's own handler, as in a terminal; exec'd children
# get the default disposition. SIGQUIT is ignored there too: back to the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Give each test a private EVFLOW_RUNTIME_DIR and fail it if ipc files or children remain."""
    base = Path(f"/tmp/evt-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    base.mkdir(mode=0o700)
    monkeypatch.setenv("EVFLOW_RUNTIME_DIR", str(base))
    shm_before = _evflow_shm()
    yield base
    leftovers = _reap_children()
    left_files = [str(p) for p in base.rglob("*")]
    # a segment some live process still maps belongs to a run outside this test (a
    # concurrent test session or a user's run): neither removed nor blamed here
    new_shm = _unmapped(_evflow_shm() - shm_before)
    for name in new_shm:
        Path("/dev/shm", name).unlink(missing_ok=True)
    for p in sorted(base.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    base.rmdir()
    problems = []
    if leftovers:
        problems.append(f"child processes outlived the test: {leftovers}")
    if left_files:
        problems.append(f"ipc files outlived the test: {left_files}")
    if new_shm:
        problems.append(f"shared-memory segments outlived the test: {sorted(new_shm)}")
    if problems:
        pytest.fail("; ".join(problems))


def _evflow_shm() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("evflow-")}
    except FileNotFoundError:
        return set()


def _unmapped(names: set[str]) -> set[str]:
    """The segments of ``names`` that no running process has mapped."""
    if not names:
        return names
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                text = maps.read()
        except OSError:
            continue
        mapped.update(n for n in names if f"/dev/shm/{n}" in text)
    return names - mapped


def _reap_children(grace_s: float = 2.0) -> list[str]:
    """Kill what is still running below this process; return descriptions of it."""
    me = psutil.Process()
    deadline = time.monotonic() + grace_s
    children = me.children(recursive=True)
    while children and time.monotonic() < deadline:
        # give processes that are exiting on their own a moment
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.05)
        children = me.children(recursive=True)
    described = []
    for child in me.children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
                continue
            described.append(f"{child.pid}:{' '.join(child.cmdline())[:80]}")
            os.kill(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
        except (psutil.NoSuchProcess, ChildProcessError, ProcessLookupError):
            pass
    return described


# several hosts in network namespaces (sshd) and a Slurm cluster: tests/conftest_farm.py
from conftest_farm import farm, farm_session, slurm, slurm_session  # noqa: E402, F401

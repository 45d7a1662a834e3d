"""The guard that runs an agent under ssh/srun, on this host: it reports the command's
pid, passes its exit code on, and ends the whole tree (escaped, SIGTERM-ignoring
descendants included) on stdin EOF, on a ``term`` line or on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from evflow.topology.launch._guard import READY_PREFIX
from farm_hosts import probe_argv, probe_env

GUARD = [sys.executable, "-m", "evflow.topology.launch._guard"]
# the guard with a default grace no test waits for: what ends within a test's waits
# came from a shorter grace given to it
LONG_DEFAULT_GUARD = [
    sys.executable, "-c",
    "import sys; from evflow.topology.launch import _guard; "
    "_guard.DEFAULT_GRACE_S = 3600.0; sys.exit(_guard.main(sys.argv[1:]))",
]  # fmt: skip


def _start(
    *args: str, detached: bool = False, long_default: bool = False
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """The guard running the probe with ``args``; (process, pids of its whole tree)."""
    mode = ["--detached"] if detached else []
    guard = subprocess.Popen(
        [*(LONG_DEFAULT_GUARD if long_default else GUARD), *mode, "--",
         *probe_argv(sys.executable, *args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, **probe_env()},
    )  # fmt: skip
    assert guard.stderr is not None and guard.stdout is not None
    line = guard.stderr.readline().decode()
    assert line.startswith(READY_PREFIX), line
    guard.stdout.readline()  # the probe's report: its children exist now
    tree = [p.pid for p in psutil.Process(guard.pid).children(recursive=True)]
    return guard, tree


def _gone(pids: list[int], timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]  # fmt: skip
        time.sleep(0.02)
    return alive


def _close(guard: subprocess.Popen[bytes]) -> None:
    for pipe in (guard.stdin, guard.stdout, guard.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()


@pytest.mark.parametrize("how", ["eof", "term line", "sigterm"])
def test_guard_ends_the_whole_tree(how: str) -> None:
    # the escapers ignore SIGTERM: SIGKILL ends them after a grace. With the term line's
    # 0.2 s, not the default: that one is an hour here, and the waits end long before
    guard, tree = _start("--children", "2", long_default=how == "term line")
    assert len(tree) >= 3  # the probe and its two orphaned escapers (re-parented to us)
    assert guard.stdin is not None
    if how == "eof":
        guard.stdin.close()
    elif how == "term line":
        guard.stdin.write(b"term 0.2\n")
        guard.stdin.flush()
    else:
        guard.send_signal(signal.SIGTERM)
    guard.wait(60)
    _close(guard)
    assert _gone(tree) == []


def test_guard_passes_the_exit_code_and_sweeps_orphans() -> None:
    guard, tree = _start("--children", "1", "--exit", "7")
    assert guard.wait(60) == 7
    _close(guard)
    assert _gone(tree) == []


def test_detached_guard_ignores_stdin_eof() -> None:
    guard, tree = _start(detached=True)
    assert guard.stdin is not None
    guard.stdin.close()
    # an absence: a window for a wrong reaction to show (a loaded machine can only make
    # this test pass without having shown it, never fail it)
    time.sleep(0.3)
    assert guard.poll() is None and _gone(tree, 0) == tree
    guard.send_signal(signal.SIGTERM)
    guard.wait(60)
    _close(guard)
    assert _gone(tree) == []


def test_guard_without_a_runnable_command_says_so() -> None:
    out = subprocess.run([*GUARD, "--", "/nonexistent/prog"], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=30)  # fmt: skip
    assert out.returncode == 127 and "cannot run '/nonexistent/prog'" in out.stderr


def test_guard_passes_stdin_lines_to_the_command() -> None:
    """``stdin TEXT`` reaches the command's stdin as TEXT (the ssh launcher sends an
    agent started with ``--bus -`` its bus address this way); other lines do not."""
    echo = "import sys; print('got', sys.stdin.readline().strip(), flush=True)"
    guard = subprocess.Popen(
        [*GUARD, "--", sys.executable, "-c", echo],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert guard.stdin is not None and guard.stdout is not None and guard.stderr is not None
    assert guard.stderr.readline().decode().startswith(READY_PREFIX)
    guard.stdin.write(b"hello there\nstdin tcp://10.0.0.1:5,tcp://10.0.0.1:6\n")
    guard.stdin.flush()
    assert guard.stdout.readline().decode().strip() == "got tcp://10.0.0.1:5,tcp://10.0.0.1:6"
    assert guard.wait(60) == 0  # the command ended by itself: so does the guard
    _close(guard)

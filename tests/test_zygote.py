"""Zygote: fork-server for workers; exit codes, signals, death notices, dying with the parent."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from _wait import signal_caught, signal_ignored, wait_until
from evflow.errors import ConfigurationError, PeerLostError
from evflow.runtime.zygote import Zygote, zmq_threads_running

# set before the zygote starts: children must see it (inherited at fork)
_INHERITED: dict[str, str] = {}


def _return(value: object) -> object:
    return value


def _raise() -> None:
    raise RuntimeError("deliberate failure in child")


def _system_exit(code: int) -> None:
    sys.exit(code)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _segfault() -> None:
    faulthandler.disable()  # the crash is the point; keep the test log quiet
    ctypes.string_at(0)


def _hard_exit(code: int) -> None:
    os._exit(code)


def _read_inherited(key: str) -> int:
    return 0 if _INHERITED.get(key) == "from-parent" else 9


def _term_politely(path: str) -> int:
    """Exit 0 on SIGTERM after writing a marker (graceful stop)."""

    def on_term(*_: object) -> None:
        with open(path, "w") as fh:
            fh.write("terminated")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    time.sleep(30)
    return 5


def _fork_grandchild(path: str) -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    with open(path, "w") as fh:
        fh.write(str(pid))
    return 0


def _wait_exits(zygote: Zygote, count: int, timeout_s: float = 30.0) -> dict[int, int]:
    """Wait on zygote.fileno() until ``count`` exits arrived."""
    got: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(zygote.fileno(), selectors.EVENT_READ)
        while len(got) < count and time.monotonic() < deadline:
            sel.select(max(0.0, deadline - time.monotonic()))
            got.update(zygote.exits())
    assert len(got) >= count, f"only {got} of {count} exits within {timeout_s} s"
    return got


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    _INHERITED["key"] = "from-parent"
    z = Zygote().start()
    try:
        yield z
    finally:
        z.stop(grace_s=0.5)
        _INHERITED.clear()


def test_return_value_is_exit_code(zygote: Zygote) -> None:
    pids = {
        zygote.spawn(_return, 0): 0,
        zygote.spawn(_return, None): 0,
        zygote.spawn(_return, 7): 7,
        zygote.spawn(_system_exit, 3): 3,
        zygote.spawn(_hard_exit, 42): 42,
    }
    assert _wait_exits(zygote, len(pids)) == pids


def _count_siblings(path: str, release: str) -> int:
    """A child of a batch: writes how many children its zygote has when it begins,
    then stays until ``release`` exists (so that none is reaped while others count)."""
    ppid = os.getppid()
    children = Path(f"/proc/{ppid}/task/{ppid}/children").read_text().split()
    with open(path, "a") as fh:
        fh.write(f"{len(children)}\n")
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
    return 0


def test_spawn_many_forks_every_item_then_lets_them_run(zygote: Zygote, tmp_path: Path) -> None:
    """Each item gets its own child (pid, name, exit code), in one request; no child
    runs before the last one is forked (the first ones do not slow the forks down)."""
    items = [(_return, (3,), "three"), (_system_exit, (4,), ""), (_return, (None,), "none")]
    pids = zygote.spawn_many(items)
    assert all(isinstance(p, int) for p in pids) and len(set(pids)) == 3
    assert [zygote.children[p] for p in pids] == ["three", "_system_exit", "none"]
    exits = _wait_exits(zygote, 3)
    assert [exits[p] for p in pids] == [3, 4, 0]

    counts, release = tmp_path / "counts", tmp_path / "release"
    batch = [(_count_siblings, (str(counts), str(release)), f"c{i}") for i in range(30)]
    pids = zygote.spawn_many(batch)
    deadline = time.monotonic() + 60
    while len(counts.read_text().split() if counts.exists() else []) < 30:
        assert time.monotonic() < deadline, "the batch's children did not all run"
        time.sleep(0.01)
    release.touch()
    assert [int(n) for n in counts.read_text().split()] == [30] * 30  # each saw all
    assert sorted(_wait_exits(zygote, 30).values()) == [0] * 30

    assert zygote.spawn_many([]) == []
    with pytest.raises(ConfigurationError, match="cannot send"):
        zygote.spawn_many([(lambda: 0, (), "lambda")])  # type: ignore[list-item]


def test_exception_exits_1_and_prints_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    # started inside the test, where capfd is active, so the zygote inherits its stderr
    with Zygote() as zygote:
        pid = zygote.spawn(_raise, name="raiser")
        assert _wait_exits(zygote, 1) == {pid: 1}
    err = capfd.readouterr().err
    assert "RuntimeError: deliberate failure in child" in err
    assert "Traceback" in err


def test_signal_deaths_are_negative(zygote: Zygote) -> None:
    sleeper = zygote.spawn(_sleep, 30)
    crasher = zygote.spawn(_segfault)
    assert zygote.kill(sleeper, signal.SIGKILL) is True
    got = _wait_exits(zygote, 2)
    assert got == {sleeper: -signal.SIGKILL, crasher: -signal.SIGSEGV}
    # already reaped: kill refuses instead of hitting a reused pid
    assert zygote.kill(sleeper, signal.SIGKILL) is False


def test_death_is_noticed_at_once_through_fileno(zygote: Zygote) -> None:
    pid = zygote.spawn(_sleep, 30)
    os.kill(pid, signal.SIGKILL)
    # the fileno wakes a caller that waits on nothing else (_wait_exits): no call of
    # ours looks at the children. How soon: a benchmark's question, not this test's
    assert _wait_exits(zygote, 1, timeout_s=60) == {pid: -signal.SIGKILL}


def test_children_inherit_state_set_before_start(zygote: Zygote) -> None:
    pid = zygote.spawn(_read_inherited, "key")
    assert _wait_exits(zygote, 1) == {pid: 0}


def test_children_are_out_of_the_terminal_group_and_ignore_sigint(zygote: Zygote) -> None:
    pid = zygote.spawn(_sleep, 30, name="sleepy")
    # the child sets its name, group and SIGINT disposition just after the fork
    wait_until(lambda: psutil.Process(pid).name() == "sleepy", 30, "the child's name")
    wait_until(lambda: signal_ignored(pid, signal.SIGINT), 30, "the child ignoring SIGINT")
    wait_until(lambda: os.getpgid(pid) != os.getpgrp(), 30, "the child in its own group")
    # an ignored signal is discarded when it is sent: the child cannot die of it later
    os.kill(pid, signal.SIGINT)
    assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    assert zygote.exits() == []
    assert pid in zygote.children


def test_stop_terminates_gracefully_then_kills(zygote: Zygote, tmp_path: os.PathLike[str]) -> None:
    marker = os.path.join(tmp_path, "marker")
    polite = zygote.spawn(_term_politely, marker)
    stubborn = zygote.spawn_exec(["sh", "-c", "trap '' TERM; sleep 3600"], name="stubborn")
    # both ready for the SIGTERM: a handler installed, the signal ignored
    wait_until(lambda: signal_caught(polite, signal.SIGTERM), 30, "the polite child's handler")
    wait_until(lambda: signal_ignored(stubborn, signal.SIGTERM), 30, "the stubborn child's trap")
    # the grace, then the kill: not the hour the stubborn child would sleep
    got = dict(zygote.stop(grace_s=0.5))
    assert got == {polite: 0, stubborn: -signal.SIGKILL}
    assert Path(marker).read_text() == "terminated"
    assert not zygote.alive


def test_stop_kills_reparented_grandchildren(zygote: Zygote, tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "grandchild")
    pid = zygote.spawn(_fork_grandchild, path)
    assert _wait_exits(zygote, 1) == {pid: 0}
    grandchild = int(Path(path).read_text())
    assert psutil.pid_exists(grandchild)
    zygote.stop(grace_s=0.2)
    deadline = time.monotonic() + 30
    while psutil.pid_exists(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not psutil.pid_exists(grandchild)


def test_unpicklable_function_is_refused_with_a_clear_error(zygote: Zygote) -> None:
    with pytest.raises(ConfigurationError, match="module-level function"):
        zygote.spawn(lambda: 0)


def test_exec_of_missing_program_is_a_clear_error(zygote: Zygote) -> None:
    with pytest.raises(ConfigurationError, match="no-such-program-xyz"):
        zygote.spawn_exec(["no-such-program-xyz"])
    pid = zygote.spawn_exec([sys.executable, "-c", "raise SystemExit(4)"])
    assert _wait_exits(zygote, 1) == {pid: 4}


def test_lost_zygote_reports_children_dead_and_refuses_spawn(zygote: Zygote) -> None:
    pids = [zygote.spawn(_sleep, 30) for _ in range(3)]
    assert zygote.pid is not None
    os.kill(zygote.pid, signal.SIGKILL)
    got = _wait_exits(zygote, 3)
    assert got == {pid: -signal.SIGKILL for pid in pids}
    with pytest.raises(PeerLostError, match="zygote"):
        zygote.spawn(_sleep, 1)
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(psutil.pid_exists(p) for p in pids)


_PARENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {here!r})
    from evflow.runtime.zygote import Zygote, zmq_threads_running
    from test_zygote import _sleep
    z = Zygote().start()
    pids = [z.spawn(_sleep, 60) for _ in range(3)]
    pids.append(z.spawn_exec(["sleep", "60"]))
    print(z.pid, *pids, flush=True)
    time.sleep(60)
    """
)


def test_children_die_when_the_parent_is_killed() -> None:
    here = os.path.dirname(__file__)
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT_SCRIPT.format(here=here)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 5
        assert all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()  # type: ignore[union-attr]

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [p for p in pids if alive(p)] == []


def test_exec_children_get_default_signal_dispositions(zygote: Zygote, tmp_path: Path) -> None:
    out = tmp_path / "sigs"
    # SigIgn of /proc/self/status: a bit mask of ignored signals (must be none)
    pid = zygote.spawn_exec(["sh", "-c", f"grep SigIgn /proc/self/status > {out}"])
    assert _wait_exits(zygote, 1) == {pid: 0}
    # what subprocess gives a program: Python's own ignores (SIGINT in the zygote,
    # SIGPIPE, SIGXFSZ) undone, what the test run inherited (SIGHUP under nohup) kept
    reference = subprocess.run(
        ["sh", "-c", "grep SigIgn /proc/self/status"], capture_output=True, text=True, check=True
    )
    assert int(out.read_text().split()[1], 16) == int(reference.stdout.split()[1], 16)


def test_starting_after_a_zmq_context_warns(caplog: pytest.LogCaptureFixture) -> None:
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.PUB)
    try:
        deadline = time.monotonic() + 30  # libzmq's threads name themselves once running
        while not zmq_threads_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        with Zygote():
            pass
    finally:
        sock.close(linger=0)
        context.term()
    assert "start the zygote first" in caplog.text

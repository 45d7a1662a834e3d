"""FaultInjector: each mode in a real forked process, and reproducible choices."""

from __future__ import annotations

import faulthandler
import os
import signal
import time

import psutil
import pytest

from evflow.errors import ParameterError
from evflow.event import DataStore, EventMeta
from evflow.processing import faults
from evflow.processing.faults import FaultInjector, InjectedFault, roll


def _run_in_fork(module: FaultInjector, uid: int, attempt: int = 1, wait_s: float = 60.0) -> int:
    """Run module.event in a forked child; return its returncode (negative = signal).

    Exit 0: the event passed; 97: it raised InjectedFault; None after wait_s: hung
    (the child is killed and -SIGKILL returned after a check that it was still alive).
    """
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        faulthandler.disable()  # pytest's traceback dump on SIGSEGV is noise here
        code = 0
        try:
            module.event(DataStore(EventMeta(uid=uid, attempt=attempt), {}))
        except InjectedFault:
            code = 97
        except BaseException:
            code = 98
        os._exit(code)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -999  # still running at the deadline: a hang


def test_raise_is_a_python_exception_the_process_survives() -> None:
    assert _run_in_fork(FaultInjector(mode="raise", uids=[5]), uid=5) == 97
    assert _run_in_fork(FaultInjector(mode="raise", uids=[5]), uid=6) == 0


@pytest.mark.parametrize("via", ["kill", "null"])
def test_segfault_kills_the_process_with_sigsegv(via: str) -> None:
    module = FaultInjector(mode="segfault", uids=[1], segfault_via=via)
    assert _run_in_fork(module, uid=1) == -signal.SIGSEGV


def test_exit_ends_the_process_with_the_exit_code() -> None:
    assert _run_in_fork(FaultInjector(mode="exit", uids=[9], exit_code=42), uid=9) == 42


class FakeTime:
    """The ``time`` of :mod:`evflow.processing.faults`, injected: its sleeps move a clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_hang_does_not_return(monkeypatch: pytest.MonkeyPatch) -> None:
    # a window, not a synchronisation: the child must not return within it (it sleeps
    # an hour); on a loaded machine it may not even have started, and still holds
    assert _run_in_fork(FaultInjector(mode="hang", uids=[3]), uid=3, wait_s=0.5) == -999
    with monkeypatch.context() as m:  # on an injected clock: it sleeps all of hang_s
        clock = FakeTime()
        m.setattr(faults, "time", clock)
        FaultInjector(mode="hang", uids=[3], hang_s=7200.0).event(DataStore(EventMeta(uid=3), {}))
        assert sum(clock.slept) == 7200.0 and max(clock.slept) == 1.0


def test_slow_returns_after_its_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeTime()
    monkeypatch.setattr(faults, "time", clock)
    module = FaultInjector(mode="slow", uids=[3], slow_s=2.5)
    assert module.event(DataStore(EventMeta(uid=3), {})) is None  # it goes on ...
    assert clock.slept == [1.0, 1.0, 0.5]  # ... after its delay (in steps of at most 1 s)
    assert module.event(DataStore(EventMeta(uid=4), {})) is None  # not listed: no delay
    assert clock.slept == [1.0, 1.0, 0.5]
    # and in a real process: it returns, the process goes on
    assert _run_in_fork(FaultInjector(mode="slow", uids=[3], slow_s=0.3), uid=3) == 0


def test_memory_mode_raises_rss_and_keeps_it() -> None:
    module = FaultInjector(mode="memory", probability=1.0, memory_mb=64)
    before = psutil.Process().memory_info().rss
    store = DataStore(EventMeta(uid=1), {})
    module.event(store)
    grown = psutil.Process().memory_info().rss - before
    module._hoard.clear()  # give it back: this runs in the test process
    assert grown > 60 * 1024 * 1024


def test_listed_uid_fails_first_attempt_only_unless_poison() -> None:
    once = FaultInjector(mode="segfault", uids=[11])
    assert _run_in_fork(once, uid=11, attempt=1) == -signal.SIGSEGV
    assert _run_in_fork(once, uid=11, attempt=2) == 0
    poison = FaultInjector(mode="segfault", uids=[11], poison=True)
    assert [poison.chosen(11, a) for a in (1, 2, 3, 10)] == [True] * 4
    twice = FaultInjector(uids=[11], fail_attempts=2)
    assert [twice.chosen(11, a) for a in (1, 2, 3)] == [True, True, False]


def test_probability_is_reproducible_per_seed_uid_and_attempt() -> None:
    a = FaultInjector(probability=0.1, seed=7)
    b = FaultInjector(probability=0.1, seed=7)
    c = FaultInjector(probability=0.1, seed=8)
    picks_a = [u for u in range(20000) if a.chosen(u, 1)]
    assert picks_a == [u for u in range(20000) if b.chosen(u, 1)]
    assert picks_a != [u for u in range(20000) if c.chosen(u, 1)]
    assert 1700 < len(picks_a) < 2300  # ~10 %
    # a retry rolls again: most chosen events pass on attempt 2
    again = [u for u in picks_a if a.chosen(u, 2)]
    assert len(again) < 0.2 * len(picks_a)
    poison = FaultInjector(probability=0.1, seed=7, poison=True)
    chosen = [u for u in range(2000) if poison.chosen(u, 1)]
    assert chosen and all(poison.chosen(u, 3) for u in chosen)
    assert roll(1, 2, 3) == roll(1, 2, 3) and 0 <= roll(1, 2, 3) < 1


def test_bad_parameters_are_refused_with_the_name() -> None:
    with pytest.raises(ParameterError, match="probability"):
        FaultInjector(probability=1.5)
    with pytest.raises(ParameterError, match="uids"):
        FaultInjector(uids=["a"])
    with pytest.raises(ParameterError, match="mode"):
        FaultInjector(mode="explode")
    assert FaultInjector.parallel is True


def test_once_dir_fails_each_listed_uid_once_across_processes_and_attempts(tmp_path) -> None:
    def injector() -> FaultInjector:  # one per process, sharing the marker directory
        return FaultInjector(mode="raise", uids=[7], once_dir=str(tmp_path))

    first, second = injector(), injector()
    with pytest.raises(InjectedFault, match="uid=7 attempt=2"):
        # attempt 2: it waited in a worker that died for another event, never processed
        first.event(DataStore(EventMeta(uid=7, attempt=2)))
    second.event(DataStore(EventMeta(uid=7, attempt=1)))  # done once: no more
    first.event(DataStore(EventMeta(uid=8, attempt=1)))  # not listed
    assert (first.injected, second.injected) == (1, 0)
    assert [p.name for p in tmp_path.iterdir()] == ["FaultInjector-7.injected"]

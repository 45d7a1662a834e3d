"""Supervisor decide hooks: a caller's policy per death, the supervisor's mechanics.

A path run (processing/parallel/run/engine.py) gives each role a ``decide`` hook; these
tests hold the supervisor to what that relies on: an immediate restart with new
arguments and a new name, a delayed one on the supervisor's clock, a restart budget
shared by a group (given back when a waiting restart is cancelled), an accepted death
that is no failure, and signal handlers that leave an ignored SIGINT ignored.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from evflow.runtime.supervisor import (
    Decision,
    ManagedProcess,
    ProcessSpec,
    RestartBudget,
    Supervisor,
)
from test_supervisor import _poll_until


def _exit_with(code: int) -> int:
    return code


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_restart_with_new_arguments_and_a_new_name_each_time() -> None:
    seen: list[tuple[str, int]] = []

    def decide(proc: ManagedProcess, code: int) -> Decision:
        seen.append((proc.label, code))
        if code == 3:
            return Decision.end()
        return Decision.restart(args=(code + 1,))

    def launching(proc: ManagedProcess) -> None:
        proc.label = f"w.{len(proc.pids)}"

    with Supervisor() as sup:
        sup.add(
            ProcessSpec("w", target=_exit_with, args=(1,), decide=decide, before_launch=launching)
        )
        events = _poll_until(sup, 3)
        proc = sup.processes["w"]
        assert seen == [("w.0", 1), ("w.1", 2), ("w.2", 3)]  # args replaced, renamed
        assert [e.outcome for e in events] == ["restarting", "restarting", "ended"]
        assert proc.state == "ended" and proc.restarts == 2 and len(set(proc.pids)) == 3
        assert not sup.failed and not sup.active


def test_a_delayed_restart_waits_on_the_supervisors_clock() -> None:
    clock = {"now": 100.0}
    with Supervisor(clock=lambda: clock["now"]) as sup:
        spec = ProcessSpec(
            "w",
            target=_exit_with,
            args=(5,),
            decide=lambda p, c: Decision.restart(delay_s=2.0, args=(0,)),
        )
        proc = sup.add(spec)
        events = _poll_until(sup, 1)
        assert events[0].outcome == "restarting" and proc.state == "backoff"
        assert not proc.alive and sup.active  # waiting counts as active, not as alive
        assert sup.next_restart_in_s() == 2.0
        assert sup.launch_due() == [] and len(proc.pids) == 1  # not due yet
        clock["now"] += 2.0
        sup.launch_due()
        assert len(proc.pids) == 2 and proc.args == (0,)


def test_a_group_shares_one_restart_budget_and_cancelled_restarts_give_it_back() -> None:
    budget = RestartBudget(2)
    clock = {"now": 0.0}
    delays = iter([0.0, 50.0])

    def decide(proc: ManagedProcess, code: int) -> Decision:
        return Decision.restart(delay_s=next(delays, 0.0), args=(0,))

    with Supervisor(clock=lambda: clock["now"]) as sup:
        for name in ("a", "b"):
            sup.add(ProcessSpec(name, target=_exit_with, args=(7,), decide=decide, budget=budget))
        _poll_until(sup, 2)  # the first restarts at once, the second waits 50 s
        assert budget.used == 2 and budget.left == 0
        assert len(sup.waiting()) == 1
        assert sup.cancel_restarts() == 1 and budget.used == 1  # given back
        assert sup.waiting() == [] and not sup.failed


def test_past_the_budget_a_restart_decision_fails_the_process() -> None:
    budget = RestartBudget(0)
    with Supervisor() as sup:
        sup.add(
            ProcessSpec(
                "w",
                target=_exit_with,
                args=(9,),
                budget=budget,
                decide=lambda p, c: Decision.restart(),
            )
        )
        (event,) = _poll_until(sup, 1)
        assert event.outcome == "failed" and "restarts are spent" in event.message
        assert sup.failed == [event] and budget.used == 0


def test_a_restart_that_does_not_count_leaves_the_budget_alone() -> None:
    budget = RestartBudget(0)
    codes = iter([Decision.restart(counts=False, args=(0,))])
    with Supervisor() as sup:
        proc = sup.add(
            ProcessSpec(
                "w",
                target=_exit_with,
                args=(4,),
                budget=budget,
                decide=lambda p, c: next(codes, Decision.end()),
            )
        )
        _poll_until(sup, 2)
        assert budget.used == 0 and proc.restarts == 1 and proc.state == "done"


def test_give_up_is_a_failure_with_the_callers_message() -> None:
    with Supervisor() as sup:
        sup.add(
            ProcessSpec(
                "w",
                target=_exit_with,
                args=(2,),
                decide=lambda p, c: Decision.give_up(f"w said {c}"),
            )
        )
        (event,) = _poll_until(sup, 1)
        assert event.outcome == "failed" and event.message == "w said 2 (failed)"


def test_after_launch_hears_every_fork_and_kill_by_pid_reaches_the_right_one() -> None:
    forks: list[int] = []
    with Supervisor() as sup:
        spec = ProcessSpec(
            "w",
            target=_sleep,
            args=(30.0,),
            decide=lambda p, c: Decision.restart() if c < 0 else Decision.end(),
            after_launch=lambda p: forks.append(p.pid or 0),
        )
        proc = sup.add(spec)
        first = proc.pid
        assert first is not None and sup.kill(first, signal.SIGKILL)
        _poll_until(sup, 1)
        assert forks == [first, proc.pid] and proc.pid != first and proc.alive


def test_keep_ignored_leaves_an_ignored_sigint_ignored() -> None:
    old: Any = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sup = Supervisor()
        restore = sup.install_signal_handlers(keep_ignored=True)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == sup._on_signal
        restore()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def test_after_stop_restarting_a_failure_is_final_and_waiting_restarts_are_dropped() -> None:
    """What a topology's agent does once its controller walks the devices down."""
    clock = {"now": 0.0}
    with Supervisor(clock=lambda: clock["now"]) as sup:
        waiting = sup.add(
            ProcessSpec("a", target=_exit_with, args=(1,), restart="on-failure", backoff_s=50.0)
        )
        _poll_until(sup, 1)
        assert waiting.state == "backoff"
        assert sup.stop_restarting() == 1 and waiting.state == "stopped"
        failing = sup.add(ProcessSpec("b", target=_exit_with, args=(1,), restart="on-failure"))
        (event,) = _poll_until(sup, 1)
        assert event.outcome == "stopped" and event.returncode == 1
        assert failing.state == "stopped" and len(failing.pids) == 1 and not sup.failed
        clock["now"] += 100.0
        assert sup.launch_due() == [] and len(waiting.pids) == 1 and not sup.active

"""Supervisor: restarts with limits and backoff, death events, orderly/fast shutdown, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from _wait import signal_caught, wait_until
from evflow.errors import ConfigurationError, StateTransitionError
from evflow.runtime.supervisor import ExitEvent, ManagedProcess, ProcessSpec, Supervisor
from evflow.transport.paths import runtime_base_dir, session_dir

HERE = os.path.dirname(__file__)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _exit_with(code: int) -> int:
    return code


def _record_term(path: str, name: str, linger_s: float) -> int:
    """On SIGTERM append ``name`` to ``path``, linger a bit (draining), exit 0."""

    def on_term(*_: object) -> None:
        with open(path, "a") as fh:
            fh.write(f"{name} {time.monotonic():.6f}\n")
        time.sleep(linger_s)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    while True:
        time.sleep(1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _poll_until(sup: Supervisor, count: int, timeout_s: float = 10.0) -> list[ExitEvent]:
    events: list[ExitEvent] = []
    deadline = time.monotonic() + timeout_s
    while len(events) < count and time.monotonic() < deadline:
        events += sup.poll(0.05)
    assert len(events) >= count, f"only {events} within {timeout_s} s"
    return events


def test_restarts_a_killed_process_up_to_its_limit_then_reports_it_failed() -> None:
    with Supervisor() as sup:
        proc = sup.add_function(
            "worker", _sleep, 30, restart="on-failure", max_restarts=2, backoff_s=0.0
        )
        outcomes = []
        pids = []
        for _ in range(3):
            pid = proc.pid
            assert pid is not None and proc.alive
            pids.append(pid)
            assert sup.kill("worker", signal.SIGKILL)
            event = _poll_until(sup, 1)[0]
            assert event.pid == pid and event.returncode == -signal.SIGKILL
            outcomes.append(event.outcome)
            sup.poll(0)  # backoff 0: the restart happens on this poll
        assert outcomes == ["restarting", "restarting", "failed"]
        assert len(set(pids)) == 3
        assert proc.state == "failed" and proc.restarts == 2
        assert len(sup.failed) == 1
        message = sup.failed[0].message
        assert "'worker'" in message and "SIGKILL" in message
        assert "max_restarts=2" in message and "giving up" in message
        assert not sup.active


def test_add_many_forks_a_batch_and_restarts_each_on_its_own() -> None:
    """add_many starts every process in one zygote request; before_launch sees each
    launch (a restart knows it is one); a restart is one fork of its own."""
    launches: list[tuple[str, int]] = []

    def hook(proc: ManagedProcess) -> None:
        launches.append((proc.name, len(proc.pids)))

    with Supervisor() as sup:
        specs = [ProcessSpec(f"w{i}", target=_sleep, args=(30,), restart="on-failure",
                             max_restarts=1, backoff_s=0.0, before_launch=hook)
                 for i in range(3)]  # fmt: skip
        procs = sup.add_many(specs)
        assert all(p.alive for p in procs) and len({p.pid for p in procs}) == 3
        assert launches == [("w0", 0), ("w1", 0), ("w2", 0)]
        old = procs[1].pid
        assert sup.kill("w1", signal.SIGKILL)
        assert _poll_until(sup, 1)[0].pid == old
        sup.poll(0)
        assert procs[1].alive and procs[1].pid not in (old, procs[0].pid, procs[2].pid)
        assert launches[3:] == [("w1", 1)]
        with pytest.raises(ConfigurationError, match="'w0' is already supervised"):
            sup.add_many([ProcessSpec("w0", target=_sleep, args=(1,))])
        with pytest.raises(ConfigurationError, match="'x' is already supervised"):
            sup.add_many([ProcessSpec(n, target=_sleep, args=(1,)) for n in ("x", "x")])
        assert "x" not in sup.processes


def test_backoff_doubles_and_follows_the_injected_clock() -> None:
    clock = FakeClock()
    with Supervisor(clock=clock) as sup:
        proc = sup.add_function(
            "w", _sleep, 30, restart="on-failure", max_restarts=5, backoff_s=1.0, backoff_max_s=3.0
        )
        delays = []
        for _ in range(3):
            old = proc.pid
            assert old is not None
            sup.kill("w")
            event = _poll_until(sup, 1)[0]
            assert event.outcome == "restarting"
            assert proc.state == "backoff" and proc.restart_at_s is not None
            delay = proc.restart_at_s - clock.now
            delays.append(delay)
            assert sup.next_restart_in_s() == pytest.approx(delay)
            clock.now += delay - 0.01
            sup.poll(0)
            assert proc.state == "backoff" and proc.pid == old  # not yet due
            clock.now += 0.01
            sup.poll(0)
            assert proc.alive and proc.pid != old
        assert delays == [1.0, 2.0, 3.0]  # doubled, capped by backoff_max_s


def test_clean_exit_is_done_and_never_policy_fails_at_once() -> None:
    with Supervisor() as sup:
        sup.add_function("ok", _exit_with, 0, restart="on-failure")
        sup.add_function("bad", _exit_with, 3)
        events = {e.name: e for e in _poll_until(sup, 2)}
        assert events["ok"].outcome == "done"
        assert events["bad"].outcome == "failed"
        assert "exited with code 3" in events["bad"].message
        assert "'never'" in events["bad"].message


def test_on_exit_callback_hears_a_death_at_once_and_restart_is_fast() -> None:
    heard: list[tuple[ExitEvent, float]] = []
    with Supervisor() as sup:
        sup.on_exit(lambda e: heard.append((e, time.monotonic())))
        proc = sup.add_function("w", _sleep, 30, restart="on-failure", backoff_s=0.0)
        old = proc.pid
        assert old is not None
        killed_at = time.monotonic()
        os.kill(old, signal.SIGKILL)
        while not heard and time.monotonic() - killed_at < 30:
            sup.poll(1.0)
        sup.poll(0)
        restarted_at = time.monotonic()
        assert heard and heard[0][0].pid == old
        # "at once" and "fast": no periodic look at the children, no backoff (seconds);
        # generous for a loaded machine, where 0.5 s did not always hold
        assert heard[0][1] - killed_at < 2.0
        assert proc.alive and proc.pid != old
        assert restarted_at - killed_at < 2.0


def test_spec_errors_are_clear() -> None:
    with pytest.raises(ConfigurationError, match="restart policy 'always'"):
        ProcessSpec("x", target=_sleep, restart="always")
    with pytest.raises(ConfigurationError, match="exactly one of target or argv"):
        ProcessSpec("x")
    sup = Supervisor()
    sup.add_function("x", _sleep, 1)
    with pytest.raises(ConfigurationError, match="already supervised"):
        sup.add_function("x", _sleep, 1)
    with pytest.raises(ConfigurationError, match="no supervised process named 'y'"):
        sup.kill("y")


def test_close_removes_the_session_ipc_files_and_shm() -> None:
    sup = Supervisor().start()
    ipc = session_dir(sup.session) / "data-0.ipc"
    ipc.write_bytes(b"")
    shm = Path("/dev/shm", f"evflow-{sup.session}-seg")
    shm.write_bytes(b"x")
    sup.add_function("w", _sleep, 30)
    sup.close()
    assert not (runtime_base_dir() / sup.session).exists()
    assert not shm.exists()
    assert not sup.zygote.alive


_RELAY_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {here!r})
    from evflow.runtime.supervisor import Supervisor
    from test_supervisor import _record_term
    sup = Supervisor()
    for name, grace in (("source", {grace}), ("worker", {grace}), ("sink", {grace})):
        sup.add_function(name, _record_term, {path!r}, name, {linger}, grace_s=grace)
    sup.start()
    print(" ".join(str(p.pid) for p in sup.processes.values()), flush=True)
    sys.exit(sup.run())
    """
)


def _start_supervisor_script(path: Path, grace_s: float, linger_s: float) -> tuple[Any, list[int]]:
    script = _RELAY_SCRIPT.format(here=HERE, path=str(path), grace=grace_s, linger=linger_s)
    # own session = own process group: killpg() below is what a terminal's Ctrl-C does
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3
    for pid in pids:
        wait_until(lambda: signal_caught(pid, signal.SIGTERM), 30, f"{pid}'s SIGTERM handler")  # noqa: B023
    # and the supervisor's own: run() installs SIGINT's, then SIGTERM's (Python's
    # default SIGINT handler is there from the start: a SIGINT before run() would be a
    # KeyboardInterrupt)
    wait_until(lambda: signal_caught(proc.pid, signal.SIGTERM), 30, "the supervisor's handlers")
    return proc, pids


def _reap(proc: subprocess.Popen[str]) -> None:
    """Kill the supervisor script if a check failed before it exited; close its pipe."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()  # type: ignore[union-attr]


def test_terminal_sigint_is_relayed_in_order_and_children_ignore_it(tmp_path: Path) -> None:
    record = tmp_path / "order.txt"
    proc, pids = _start_supervisor_script(record, grace_s=5.0, linger_s=0.2)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        assert proc.wait(timeout=20) == 0
    finally:
        _reap(proc)
    lines = record.read_text().split()
    names, stamps = lines[0::2], [float(t) for t in lines[1::2]]
    assert names == ["source", "worker", "sink"]
    # each group got SIGTERM only after the previous one had exited (0.2 s of draining)
    assert stamps[1] - stamps[0] >= 0.15 and stamps[2] - stamps[1] >= 0.15
    assert not any(psutil.pid_exists(p) for p in pids)


def test_second_sigint_ends_fast(tmp_path: Path) -> None:
    record = tmp_path / "order.txt"
    # processes that take an hour to drain (and as long a grace): only the second SIGINT
    # gets us out within the test's waits
    proc, pids = _start_supervisor_script(record, grace_s=3600.0, linger_s=3600.0)
    try:
        os.kill(proc.pid, signal.SIGINT)
        # the first one handled (two sent at once could merge): the first group drains
        wait_until(lambda: record.exists() and "source" in record.read_text(), 30, "a drain")
        assert proc.poll() is None  # still draining the first group
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        _reap(proc)
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(psutil.pid_exists(p) for p in pids)


def test_run_returns_1_when_a_process_failed(capfd: pytest.CaptureFixture[str]) -> None:
    sup = Supervisor()
    sup.add_function("ok", _exit_with, 0)
    sup.add_function("crashy", _exit_with, 2, restart="on-failure", max_restarts=1, backoff_s=0.0)
    assert sup.run(install_signals=False) == 1
    assert [e.name for e in sup.failed] == ["crashy"]
    assert sup.processes["crashy"].restarts == 1
    assert sup.processes["ok"].state == "done"


def _interactive_device(endpoints: str, node_id: str, record: str) -> int:
    """A bus node with FairMQ's state table that only moves when told (interactive control)."""
    import zmq

    from evflow.runtime.bus import BusClient
    from evflow.runtime.states import State, Transition, next_state

    context: zmq.Context[Any] = zmq.Context()
    state = {"s": State.RUNNING}
    settle = {State.RESETTING_TASK: State.DEVICE_READY, State.RESETTING_DEVICE: State.IDLE}

    def on_transition(name: str) -> None:
        new = next_state(state["s"], Transition[name])
        if new is None:
            raise StateTransitionError(f"no transition from {state['s']} on {name}")
        with open(record, "a") as fh:
            fh.write(f"{node_id} {name}\n")
        state["s"] = settle.get(new, new)

    client = BusClient(
        context, node_id, endpoints, state=lambda: str(state["s"]), on_transition=on_transition
    )
    try:
        while state["s"] is not State.EXITING:
            client.tick()
            time.sleep(0.01)
    finally:
        client.close()
        context.term()
    return 0


def _wait_on_bus(sup: Supervisor, names: list[str]) -> None:
    """Until each node of ``names`` answers on the supervisor's bus."""
    import zmq

    from evflow.errors import TimeoutError_
    from evflow.runtime.bus import BusController

    def answers(name: str) -> bool:
        try:
            return bool(ctl.request("check-state", name, timeout_s=0.5))
        except TimeoutError_:
            return False

    context: zmq.Context[Any] = zmq.Context()
    assert sup.bus_endpoints is not None
    ctl = BusController(context, sup.bus_endpoints)
    try:
        for name in names:
            wait_until(lambda: answers(name), 30, f"{name} on the bus")  # noqa: B023
    finally:
        ctl.close()
        context.term()


def test_devices_are_walked_down_fairmq_sequence_over_the_bus_in_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="evflow.supervisor")
    record = tmp_path / "transitions.txt"
    sup = Supervisor(bus=True).start()
    try:
        for name in ("first", "second"):
            sup.add_function(
                name,
                _interactive_device,
                str(sup.bus_endpoints),
                name,
                str(record),
                device_id=name,
                grace_s=3600.0,  # a shutdown after the grace: the test's time-out fails it
            )
        _wait_on_bus(sup, ["first", "second"])
        sup.shutdown()  # over the bus
    finally:
        sup.close()
    steps = ["STOP", "RESET_TASK", "RESET_DEVICE", "END"]
    expected = [f"first {s}" for s in steps] + [f"second {s}" for s in steps]
    assert record.read_text().splitlines() == expected
    assert {p.name: p.returncode for p in sup.processes.values()} == {
        "bus": 0, "first": 0, "second": 0,
    }  # fmt: skip
    assert "stopping device first: RUNNING -> STOP" in caplog.text
    assert "did not stop over the bus" not in caplog.text
    assert "SIGKILL" not in caplog.text


def test_real_devices_stop_over_the_bus_without_signals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from test_ctl import start_topology, wait_running

    caplog.set_level("INFO", logger="evflow.supervisor")
    sup = Supervisor(bus=True).start()
    try:
        start_topology(sup)
        wait_running(sup, {"sampler", "sink"})
        sup.shutdown()
    finally:
        sup.close()
    assert "stopping device sampler: RUNNING -> STOP" in caplog.text
    assert "did not stop over the bus" not in caplog.text
    assert "SIGKILL" not in caplog.text
    assert sup.processes["sampler"].returncode == 0
    assert sup.processes["sink"].returncode == 0


def test_children_spawned_on_the_shared_zygote_are_reported_as_unmanaged() -> None:
    with Supervisor() as sup:
        pid = sup.zygote.spawn(_exit_with, 4)
        event = _poll_until(sup, 1)[0]
        assert (event.pid, event.returncode, event.outcome) == (pid, 4, "unmanaged")
        assert not sup.failed

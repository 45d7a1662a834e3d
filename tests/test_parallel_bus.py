"""The roles of a parallel run (input, output, workers) are nodes on its control bus.

Each test starts a real parallel run in a subprocess (a steering script), talks to
it over its bus like ``evflow ctl`` does, and stops it with SIGTERM (exit 143, files
closed). conftest fails the test if a process or ipc file outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from _wait import poll_until, wait_until
from evflow.errors import TimeoutError_
from evflow.processing.parallel.rolebus import (
    FIRST_METRICS_S,
    IDLE_WAIT_MS,
    RoleBus,
    node_id_of,
    wait_ms,
)
from evflow.runtime.bus import BusController, BusEndpoints, BusProxy, find_bus_sessions
from evflow.runtime.busclient import open_bus_sockets
from evflow.wire.messages import MsgType, decode_message, encode_message

SRC = str(Path(__file__).resolve().parents[1] / "src")
PROBE = "test-listener"  # the node id of the listener's own STATE messages

STEERING = """
import os
import sys
import time

import evflow
from evflow import Module, Param
from evflow.io import BusyWork, ToyGenerator


def wait_for_file(path):
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


class FailsToStart(Module):
    "Parallel: initialize waits until the test listens to the bus, then fails."

    parallel = True
    fail = Param(bool, False, "raise in initialize")

    def initialize(self):
        if self.fail:
            wait_for_file({listening!r})  # the test's STATE listener hears the bus
            raise RuntimeError("detector geometry not found")


class HeldInput(Module):
    "Serial (input path): the first event waits for the test, the workers idle meanwhile."

    hold = Param(bool, False, "hold the first event until the test lets it go")

    def event(self, store):
        if self.hold:
            wait_for_file({go!r})


path = evflow.Path([
    ToyGenerator(n_events=1_000_000, payload_bytes=100),
    HeldInput(hold={hold}),
    BusyWork(work_ms={work_ms}),
    FailsToStart(fail={fail}),
])
evflow.process(path, workers={workers}, quiet=True)
"""


class Run:
    """A parallel run in a subprocess plus a controller and a STATE listener on its bus."""

    def __init__(self, tmp_path: Path, workers: int, work_ms: float, hold: bool, fail: bool):
        script = tmp_path / "steer.py"
        listening = tmp_path / "listening"
        self.go = tmp_path / "go"  # touched: a held input goes on
        steering = STEERING.format(
            workers=workers, work_ms=work_ms, hold=hold, fail=fail,
            listening=str(listening), go=str(self.go),
        )  # fmt: skip
        script.write_text(steering)
        env = {**os.environ, "PYTHONPATH": SRC}
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.ctx: zmq.Context[Any] = zmq.Context()
        # a bound, not a timing: under a load of 20+ the interpreter's start-up and the
        # imports alone take well over 10 s
        self.session = self._wait_for_bus(60.0)
        self.endpoints = BusEndpoints.for_session(self.session)
        self.ctl = BusController(self.ctx, self.endpoints)
        self.states: list[tuple[str, str]] = []  # (node, state) as published
        self._stop = threading.Event()
        self._listening = threading.Event()
        self._listener = threading.Thread(target=self._listen, daemon=True)
        self._listener.start()
        if not self._listening.wait(60):
            self.close()
            raise AssertionError("the test's STATE listener never heard the run's bus")
        listening.touch()

    def _wait_for_bus(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = find_bus_sessions()
            if found:
                return found[0]
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.proc.kill()
        _, err = self.proc.communicate(timeout=10)
        raise AssertionError(f"the run's bus did not appear: {err[-2000:]}")

    def _listen(self) -> None:
        pub, sub = open_bus_sockets(self.ctx, self.endpoints, "test", (MsgType.STATE,))
        # a STATE of our own, sent until it comes back: from then on the proxy forwards
        # the run's states to us (it drops what comes before our subscription)
        probe = encode_message(MsgType.STATE, {"from": PROBE, "state": "RUNNING"})
        next_probe = 0.0
        try:
            while not self._stop.is_set():
                if not self._listening.is_set() and time.monotonic() >= next_probe:
                    pub.socket.send_multipart(probe)
                    next_probe = time.monotonic() + 0.05
                if not sub.socket.poll(50):
                    continue
                msg = decode_message(sub.socket.recv_multipart())
                node = str(msg.header["from"])
                if node == PROBE:
                    self._listening.set()
                    continue
                self.states.append((node, str(msg.header["state"])))
        finally:
            pub.close(0)
            sub.close(0)

    def states_of(self) -> dict[str, str]:
        """Every node that answers check-state -> its state."""
        replies = self.ctl.request("check-state", "*", timeout_s=1.0)
        return {r["from"]: r["data"]["node_state"] for r in replies if r.get("ok")}

    def wait_all(self, expected: dict[str, str], timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        seen: dict[str, str] = {}
        while time.monotonic() < deadline:
            seen = self.states_of()
            if all(seen.get(k) == v for k, v in expected.items()):
                return seen
        raise AssertionError(f"expected {expected}, the bus has {seen}")

    def metrics(self, node: str) -> dict[str, Any]:
        reply = self.ctl.request("get-metrics", node, timeout_s=30.0)[0]
        assert reply["ok"], reply
        return dict(reply["data"])

    def stop(self, timeout_s: float = 60.0) -> tuple[int, str]:
        """SIGTERM the run (if still running); its exit code and stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            raise AssertionError(
                f"the run did not stop within {timeout_s} s: {err[-2000:]}"
            ) from None
        return self.proc.returncode, err

    def close(self) -> None:
        if self.proc.poll() is None:  # a failed test: stop the run, cleanly if it can
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate(timeout=10)
        self._stop.set()
        self._listener.join(timeout=5)
        self.ctl.close()
        self.ctx.term()


@pytest.fixture
def start_run(tmp_path: Path) -> Iterator[Any]:
    runs: list[Run] = []

    def start(
        workers: int = 2, work_ms: float = 20.0, hold: bool = False, fail: bool = False
    ) -> Run:
        runs.append(Run(tmp_path, workers, work_ms, hold, fail))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def _working(run: Run, node: str, events_in: int) -> dict[str, Any] | None:
    """``node``'s metrics once its events_in passed ``events_in``, else None."""
    got = run.metrics(node)
    return got if got["events_in"] > events_in else None


def _writing(run: Run) -> dict[str, Any] | None:
    """The output's metrics once it wrote something, else None."""
    got = run.metrics("output")
    return got if got["written"] > 0 else None


def _all_said(run: Run, nodes: tuple[str, ...], state: str) -> bool:
    """Whether the last state each of ``nodes`` published is ``state``."""
    last = dict(run.states)
    return all(last.get(n) == state for n in nodes)


@pytest.mark.timeout(240)
def test_every_role_answers_check_state_and_get_metrics_during_a_run(start_run):
    run = start_run(workers=2, work_ms=20.0)
    roles = {"input", "output", "worker-0", "worker-1", "parallel"}
    states = run.wait_all(dict.fromkeys(roles, "RUNNING"), timeout_s=60.0)
    assert roles | {"bus"} == set(states), states  # one node per role, no stray ids

    first = wait_until(lambda: _working(run, "worker-0", 0), 60, "worker-0 working")
    second = wait_until(
        lambda: _working(run, "worker-0", first["events_in"]), 60, "worker-0 working on"
    )
    assert second["role"] == "worker" and second["process_name"] == "worker-0"
    assert second["events_in"] > first["events_in"] > 0  # it works on events meanwhile
    assert second["pid"] == first["pid"] != os.getpid()
    assert second["cpu"] > 0

    inp = run.metrics("input")
    assert inp["role"] == "input" and inp["read"] >= inp["sent"] > 0
    assert inp["ledger"] > 0 and inp["in_flight"] > 0  # events out at the workers
    assert inp["workers"] == ["worker-0", "worker-1"]
    out = wait_until(lambda: _writing(run), 60, "the output writing")
    assert out["role"] == "output" and out["written"] > 0 and out["duplicates"] == 0
    assert out["events_out"] == out["written"]

    # `evflow ctl` finds the run's bus by itself and lists every role
    env = {**os.environ, "PYTHONPATH": SRC}
    cli = [sys.executable, "-m", "evflow", "ctl"]
    done = subprocess.run(
        [*cli, "check-state"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    listed = {d["node_id"]: d["node_state"] for d in json.loads(done.stdout)}
    assert listed == {**dict.fromkeys(roles, "RUNNING"), "bus": "RUNNING"}, listed
    done = subprocess.run(
        [*cli, "get-metrics", "output"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["written"] >= out["written"]

    code, err = run.stop()
    assert code == 143, err
    # the listener drains what the proxy forwarded last
    poll_until(lambda: _all_said(run, ("input", "output", "worker-0", "worker-1"), "EXITING"), 30)
    last: dict[str, str] = {}
    for node, state in run.states:
        last[node] = state
    # every role said goodbye on the bus before its process ended
    for role in ("input", "output", "worker-0", "worker-1"):
        assert last.get(role) == "EXITING", (role, run.states)
    assert find_bus_sessions() == []  # the run's bus went with it


@pytest.mark.timeout(240)  # bounds for a loaded machine (each wait ends on its condition)
def test_killed_worker_is_replaced_and_answers_under_the_same_name(start_run):
    run = start_run(workers=2, work_ms=20.0)
    run.wait_all({"worker-0": "RUNNING", "worker-1": "RUNNING"}, timeout_s=60.0)
    old = run.metrics("worker-1")
    os.kill(old["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60.0
    new: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            new = run.metrics("worker-1")
        except TimeoutError_:
            continue
        if new["pid"] != old["pid"] and new["node_state"] == "RUNNING" and new["events_in"]:
            break
        time.sleep(0.05)
    assert new.get("pid") != old["pid"], new
    assert new["process_name"] == "worker-1.1"  # the engine's name for the replacement
    assert new["node_state"] == "RUNNING" and new["events_in"] > 0
    parallel = run.ctl.request("get-run", "parallel", timeout_s=30.0)[0]["data"]
    assert parallel["workers restarted"] == 1
    code, err = run.stop()
    assert code == 143, err


@pytest.mark.timeout(240)
def test_idle_workers_answer_at_once_and_refuse_what_they_do_not_take(start_run):
    # the input holds its first event until the test lets it go: the workers get no
    # batch at all meanwhile, and wait for one in the bus-aware wait. Every answer
    # here comes from an idle worker (one that answered only after its next batch
    # would not answer before the input goes on)
    run = start_run(workers=2, work_ms=0.0, hold=True)
    run.wait_all({"worker-0": "RUNNING", "worker-1": "RUNNING"}, timeout_s=60.0)
    for _ in range(5):
        assert run.ctl.request("ping", "worker-0", timeout_s=30.0)[0]["ok"]
    # what a role does not take is one clear refusal, and the role goes on answering
    refused = run.ctl.request("transition", "worker-0", {"transition": "STOP"}, timeout_s=30)[0]
    assert not refused["ok"] and "does not take transitions" in refused["error"]
    unknown = run.ctl.request("frobnicate", "output", timeout_s=30)[0]
    assert not unknown["ok"] and "unknown command" in unknown["error"]
    state = run.ctl.request("check-state", "output", timeout_s=30)[0]["data"]["node_state"]
    assert state == "RUNNING"
    run.go.touch()  # the input goes on, and sees the stop
    code, err = run.stop()
    assert code == 143, err


@pytest.mark.timeout(240)
def test_a_worker_that_fails_to_start_publishes_error(start_run):
    run = start_run(workers=2, fail=True)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and run.proc.poll() is None:
        time.sleep(0.05)
    code, err = run.stop()
    assert code == 1 and "detector geometry not found" in err, err
    # the listener drains what the proxy forwarded last
    poll_until(lambda: any(n.startswith("worker") and st == "ERROR" for n, st in run.states), 30)
    worker_states = [(n, st) for n, st in run.states if n.startswith("worker")]
    assert ("worker-0", "ERROR") in worker_states or ("worker-1", "ERROR") in worker_states, (
        run.states
    )
    # a failed role stays ERROR on the bus: it never says EXITING after it
    for node in ("worker-0", "worker-1"):
        mine = [st for n, st in run.states if n == node]
        if "ERROR" in mine:
            assert mine[-1] == "ERROR", mine
    assert find_bus_sessions() == []


# --- RoleBus alone ------------------------------------------------------------------------
def test_node_id_of_keeps_a_worker_slot_name_across_replacements():
    assert node_id_of("worker-3") == "worker-3"
    assert node_id_of("worker-3.2") == "worker-3"
    assert node_id_of("input") == "input"


@pytest.mark.timeout(120)
def test_role_bus_survives_bad_commands_and_a_failing_counter():
    ctx: zmq.Context[Any] = zmq.Context()
    proxy = BusProxy(ctx, "rb-test")
    proxy.start_thread()
    bus = RoleBus(ctx, "rb-test", "worker-7.1")
    calls = {"n": 0}

    def counters() -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a bug in a role's counters")
        return {"events_in": 5 * calls["n"], "events_out": 3, "held": 1}

    bus.counters = counters
    bus.set_state("RUNNING")
    ctl = BusController(ctx, proxy.endpoints)
    stop = threading.Event()

    def serve() -> None:
        data = ctx.socket(zmq.PULL)  # never readable: the role is idle
        data.linger = 0
        try:
            while not stop.is_set():
                bus.wait(data, 20)
        finally:
            data.close()

    server = threading.Thread(target=serve, daemon=True)
    try:
        server.start()
        # wire-valid but nonsense commands: args not a map, no cmd at all
        raw, raw_sub = open_bus_sockets(ctx, proxy.endpoints, "raw", ())
        raw_sub.close(0)
        for header in ({"cmd": "ping", "to": "worker-7", "args": [1, 2]}, {"to": "*"}):
            raw.socket.send_multipart(encode_message(MsgType.COMMAND, header))
        raw.socket.send(b"\xff not a message")  # dropped by the proxy, counted there
        raw.close(0)
        reply = ctl.request("get-metrics", "worker-7", timeout_s=30.0)[0]
        assert reply["ok"] and reply["data"]["process_name"] == "worker-7.1"
        reply = ctl.request("get-metrics", "worker-7", timeout_s=30.0)[0]
        assert reply["ok"]
        data = reply["data"]
        assert data["bus_errors"] >= 1  # the failing counter was counted, not raised
        assert data["held"] == 1 and data["events_out"] == 3
        (state,) = ctl.request("check-state", "worker-7", timeout_s=30.0)
        assert state["data"]["node_state"] == "RUNNING"
    finally:
        stop.set()
        server.join(timeout=5)
        bus.close()
        ctl.close()
        proxy.close()
        ctx.term()
    assert bus.state == "EXITING" and bus.client is None


def test_role_bus_without_a_proxy_never_blocks_the_role():
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        bus = RoleBus(ctx, "no-such-session", "input")  # nobody listens
        bus.counters = lambda: {"events_in": 1}
        # a tick that blocked would block for ever (nobody will ever listen): the
        # test's time-out fails it
        t0 = time.monotonic()
        for i in range(2000):  # past the first-metrics delay, each call does the work
            bus.tick(t0 + FIRST_METRICS_S + i)
        bus.close()
        assert bus.errors == 0
    finally:
        ctx.term()


def test_wait_ms_rounds_up_stops_at_zero_and_caps_what_is_far_or_never_due() -> None:
    assert wait_ms(0.0101) == 11  # never wake before the deadline
    assert wait_ms(-3.0) == 0
    assert wait_ms(float("inf")) == wait_ms(10.0) == IDLE_WAIT_MS
    assert wait_ms(0.5, cap_ms=20) == 20

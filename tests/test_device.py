"""Device: hooks in order, ERROR on exceptions, loops, requests; real processes and signals."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from _proc import finish, start_device, wait_for_line, wait_for_stderr
from _wait import wait_until
from evflow.errors import ParameterError, StateTransitionError
from evflow.processing.module import Param
from evflow.runtime.device import Device, Origin
from evflow.runtime.states import State, Transition
from evflow.transport.channel import parse_channel_config
from evflow.wire.messages import Message, MsgType, encode_message


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


class Recorder(Device):
    fail_in = Param(str, "", "hook that raises")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.states: list[str] = []
        self.fsm.subscribe(lambda old, new, tr: self.states.append(str(new)))

    def _hook(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_in:
            raise RuntimeError(f"boom in {name}")

    def init(self) -> None:
        self._hook("init")

    def bind(self) -> None:
        self._hook("bind")

    def connect(self) -> None:
        self._hook("connect")

    def init_task(self) -> None:
        self._hook("init_task")

    def pre_run(self) -> None:
        self._hook("pre_run")

    def conditional_run(self) -> bool:
        self._hook("conditional_run")
        return True

    def post_run(self) -> None:
        self._hook("post_run")

    def reset_task(self) -> None:
        self._hook("reset_task")

    def reset(self) -> None:
        self._hook("reset")


FULL_RUN = [
    "INITIALIZING_DEVICE",
    "INITIALIZED",
    "BINDING",
    "BOUND",
    "CONNECTING",
    "DEVICE_READY",
    "INITIALIZING_TASK",
    "READY",
    "RUNNING",
    "READY",
    "RESETTING_TASK",
    "DEVICE_READY",
    "RESETTING_DEVICE",
    "IDLE",
    "EXITING",
]


def test_static_control_runs_every_hook_in_order(ctx: zmq.Context[Any]) -> None:
    dev = Recorder("rec", max_iterations=3, context=ctx)
    assert dev.run("static") == 0
    assert dev.calls == [
        "init",
        "bind",
        "connect",
        "init_task",
        "pre_run",
        "conditional_run",
        "conditional_run",
        "conditional_run",
        "post_run",
        "reset_task",
        "reset",
    ]
    assert dev.states == FULL_RUN
    assert dev.iterations == 3


@pytest.mark.parametrize(
    "hook",
    [
        "init",
        "bind",
        "connect",
        "init_task",
        "pre_run",
        "conditional_run",
        "post_run",
        "reset_task",
        "reset",
    ],
)
def test_an_exception_in_any_hook_ends_in_error(
    ctx: zmq.Context[Any], hook: str, caplog: pytest.LogCaptureFixture
) -> None:
    (cfg,) = parse_channel_config("name=data,type=pull,method=bind,address=ipc://")
    dev = Recorder("rec", [cfg], max_iterations=2, context=ctx, fail_in=hook)
    assert dev.run("static") == 1
    assert dev.state is State.ERROR and isinstance(dev.error, RuntimeError)
    assert f"{hook}() raised RuntimeError: boom in {hook}" in caplog.text
    assert all(ch.closed for subs in dev.channels.values() for ch in subs)
    if hook in ("conditional_run", "pre_run"):
        assert "post_run" in dev.calls or hook == "pre_run"


class Stamped(Recorder):
    """Notes when each ``conditional_run`` call began."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stamps: list[float] = []

    def conditional_run(self) -> bool:
        self.stamps.append(time.monotonic())
        return super().conditional_run()


def test_rate_limits_conditional_run(ctx: zmq.Context[Any]) -> None:
    dev = Stamped("rate", rate_hz=50, max_iterations=11, context=ctx)
    assert dev.run() == 0
    assert dev.iterations == 11
    # the rate is a limit: call k comes no earlier than k periods of 20 ms after the
    # first (a loaded machine can only make calls later, never earlier)
    late = [t - dev.stamps[0] - k * 0.02 for k, t in enumerate(dev.stamps)]
    assert min(late) > -0.002, late
    # and not periods of 20 s (a unit mix-up): bound 50 times the 0.2 s it takes idle
    assert dev.stamps[-1] - dev.stamps[0] < 10.0


class Collect(Device):
    def init_task(self) -> None:
        self.got: list[tuple[MsgType, bytes]] = []
        self.on_data("data", self.handle)

    def handle(self, msg: Message, origin: Origin) -> bool:
        if msg.type is MsgType.END:
            return False
        self.got.append((msg.type, bytes(msg.payload[0])))
        return True


def test_on_data_gets_messages_and_counts_bad_ones(ctx: zmq.Context[Any]) -> None:
    (cfg,) = parse_channel_config("name=data,type=pull,method=bind,address=inproc://od")
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://od")
    for i in range(5):
        push.send_multipart(encode_message(MsgType.EVENTS, None, (bytes([i]),)))
    push.send_multipart([b"garbage"])
    push.send_multipart([b"\xff", b"\x80"])
    push.send_multipart([b"\x03", b"\xc1"])
    push.send_multipart(encode_message(MsgType.END, {"count": 5}))
    dev = Collect("c", [cfg], context=ctx)
    assert dev.run() == 0
    push.close(0)
    assert dev.got == [(MsgType.EVENTS, bytes([i])) for i in range(5)]
    m = dev.metrics()
    assert m["bad_messages"] == 3
    assert set(m["bad_message_kinds"]) == {"short", "unknown-type", "bad-header"}
    assert m["channels"]["data[0]"]["messages_in"] == 9


def test_max_iterations_bounds_on_data(ctx: zmq.Context[Any]) -> None:
    (cfg,) = parse_channel_config("name=data,type=pull,method=bind,address=inproc://mi")
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://mi")
    for i in range(10):
        push.send_multipart(encode_message(MsgType.EVENTS, None, (bytes([i]),)))
    dev = Collect("c", [cfg], context=ctx, max_iterations=4)
    assert dev.run() == 0
    push.close(0)
    assert len(dev.got) == 4


def test_interactive_requests_drive_the_machine(
    ctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    dev = Recorder("i", context=ctx)
    states: list[State] = []
    seen = threading.Condition()

    def note(old: State, new: State, tr: Transition) -> None:
        with seen:
            states.append(new)
            seen.notify_all()

    dev.fsm.subscribe(note)

    def wait_for(state: State) -> None:
        with seen:
            assert seen.wait_for(lambda: state in states, timeout=10), (state, states)

    def control() -> None:
        dev.request(Transition.RUN)  # invalid in IDLE: refused and logged
        for tr in (
            Transition.INIT_DEVICE,
            Transition.COMPLETE_INIT,
            Transition.BIND,
            Transition.CONNECT,
            Transition.INIT_TASK,
            Transition.RUN,
        ):
            dev.request(tr)
        wait_for(State.RUNNING)
        wait_until(lambda: dev.iterations > 0, 10, "a RUNNING iteration")
        dev.request(Transition.STOP)
        wait_for(State.READY)
        dev.request(Transition.END)  # END outside IDLE = orderly shutdown

    thread = threading.Thread(target=control)
    thread.start()
    assert dev.run("interactive") == 0
    thread.join()
    assert "no transition from IDLE on RUN" in caplog.text
    assert dev.states[-1] == "EXITING" and dev.iterations > 0
    with pytest.raises(StateTransitionError, match="AUTO is internal"):
        dev.request(Transition.AUTO)


def test_unknown_device_parameter_is_refused(ctx: zmq.Context[Any]) -> None:
    with pytest.raises(ParameterError, match="has no parameter 'colour'"):
        Recorder("r", context=ctx, colour="red")
    with pytest.raises(ParameterError, match="expects str"):
        Recorder("r", context=ctx, fail_in=3)


# --- real processes -----------------------------------------------------------------------
PAUSE_CHANNELS = (
    "--max-iterations",
    "20",
    "--channel-config",
    "name=in,type=pull,method=bind,address=ipc://",
    "--channel-config",
    "name=in2,type=pull,method=bind,address=ipc://fixed-name",
    "--channel-config",
    "name=out,type=push,method=connect,address=ipc://nobody-there",
)


def start_pause_device(env: dict[str, str]) -> subprocess.Popen[str]:
    """``_pause_device`` as device 'p' on PAUSE_CHANNELS, paused as ``env`` asks."""
    return start_device("_pause_device:PauseDevice", "--id", "p", *PAUSE_CHANNELS, env=env)


def state_steps(out: str) -> list[str]:
    """The states a device printed (``STATE <name>`` lines), in order."""
    return [line.split()[1] for line in out.splitlines() if line.startswith("STATE")]


PAUSE_STATES = [
    "IDLE",
    "INITIALIZING_DEVICE",
    "INITIALIZED",
    "BINDING",
    "BOUND",
    "CONNECTING",
    "DEVICE_READY",
    "INITIALIZING_TASK",
    "READY",
    "RUNNING",
    "RESETTING_TASK",
    "RESETTING_DEVICE",
    "EXITING",
]


@pytest.mark.parametrize("state", PAUSE_STATES)
def test_sigint_in_each_state_shuts_down_cleanly(state: str, _runtime_dir: Path) -> None:
    proc = start_pause_device({"EVFLOW_TEST_PAUSE_STATE": state, "EVFLOW_TEST_PAUSE_S": "0.4"})
    wait_for_line(proc, f"PAUSED {state}")
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc, 30)
    assert code == 0, err
    steps = state_steps(out)
    assert steps[-1] == "EXITING", out
    if state not in ("IDLE", "RESETTING_DEVICE", "EXITING"):  # those leave by END at once
        assert "RESETTING_DEVICE" in steps[steps.index(state) if state in steps else 0 :]
    assert "Traceback" not in err
    assert not list(_runtime_dir.rglob("*")), "ipc files left"


def test_sigterm_while_running_shuts_down_cleanly(_runtime_dir: Path) -> None:
    proc = start_pause_device({"EVFLOW_TEST_PAUSE_STATE": "RUNNING", "EVFLOW_TEST_PAUSE_S": "0.2"})
    lines = wait_for_line(proc, "PAUSED RUNNING")
    assert lines[:3] == ["STATE INITIALIZING_DEVICE", "STATE INITIALIZED", "STATE BINDING"]
    wait_for_line(proc, "LOOP")  # now inside the RUNNING loop itself
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, 30)
    assert code == 0, err
    assert "SIGTERM received" in err
    steps = state_steps(out)
    assert steps[-6:] == [
        "READY",
        "RESETTING_TASK",
        "DEVICE_READY",
        "RESETTING_DEVICE",
        "IDLE",
        "EXITING",
    ]
    assert not list(_runtime_dir.rglob("*"))


def test_sigint_during_startup_leaves_nothing(_runtime_dir: Path) -> None:
    # the signal arrives while the device class is being imported, before the device
    # and its state machine exist
    proc = start_pause_device({"EVFLOW_TEST_PAUSE_IMPORT_S": "0.5"})
    wait_for_line(proc, "IMPORTING")
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc, 30)
    assert code == 0, err
    assert "SIGINT received" in err
    assert "STATE EXITING" in out and "STATE BINDING" not in out
    assert not list(_runtime_dir.rglob("*"))


def test_second_sigint_leaves_fast_and_still_cleans_up(_runtime_dir: Path) -> None:
    # paused for 60 s: leaving "fast" is leaving long before the pause ends
    proc = start_pause_device({"EVFLOW_TEST_PAUSE_STATE": "BOUND", "EVFLOW_TEST_PAUSE_S": "60"})
    wait_for_line(proc, "PAUSED BOUND")
    proc.send_signal(signal.SIGINT)
    # the first one handled (two signals sent at once could merge into one)
    wait_for_stderr(proc, "SIGINT received")
    proc.send_signal(signal.SIGINT)
    code, _, err = finish(proc, 40)  # past the pause: the second SIGINT was not heeded
    assert code == 130, err
    assert not list(_runtime_dir.rglob("*"))


def test_failing_hook_in_a_process_exits_1_with_the_error(_runtime_dir: Path) -> None:
    proc = start_pause_device({"EVFLOW_TEST_FAIL_HOOK": "init_task"})
    code, out, err = finish(proc, 30)
    assert code == 1
    assert "STATE ERROR" in out
    assert "evflow: error: device 'p': RuntimeError: test failure in init_task" in err
    assert not list(_runtime_dir.rglob("*"))


@pytest.mark.parametrize(
    ("cls", "args", "fragment"),
    [
        ("nosuch", (), "device class 'nosuch' not found: not a built-in device"),
        ("no_such_module:X", (), "no module 'no_such_module'"),
        ("_pause_device:Nope", (), "module '_pause_device' has no 'Nope'"),
        ("_pause_device:PAUSE_S", (), "is not a Device subclass"),
        ("sink", ("--channel-config", "name=data,type=pull"), "missing key 'address'"),
        (
            "sink",
            ("--channel-config", "name=data,type=pul,method=bind,address=ipc://"),
            "bad type 'pul'",
        ),
        (
            "sampler",
            (
                "--msg-size",
                "-3",
                "--channel-config",
                "name=data,type=push,method=bind,address=ipc://",
            ),
            "msg_size must be >= 0",
        ),
    ],
)
def test_bad_device_command_lines_get_one_clear_error(
    cls: str, args: tuple[str, ...], fragment: str
) -> None:
    code, _, err = finish(start_device(cls, *args), 30)
    assert code == 1
    assert fragment in err
    assert err.count("evflow: error:") == 1


def test_address_in_use_between_two_device_processes(_runtime_dir: Path) -> None:
    cfg = ("--channel-config", "name=data,type=pull,method=bind,address=ipc://taken")
    first = start_device("sink", "--id", "a", *cfg)
    try:
        deadline = time.monotonic() + 60
        while not (_runtime_dir / "default" / "taken").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code, _, err = finish(start_device("sink", "--id", "b", *cfg), 30)
        assert code == 1
        assert "already in use" in err and "taken" in err
    finally:
        first.send_signal(signal.SIGINT)
        assert finish(first, 30)[0] == 0


def test_interactive_control_over_stdin_with_fairmq_keys(_runtime_dir: Path) -> None:
    proc = start_device(
        "_pause_device:PauseDevice",
        "--id", "p", "--control", "interactive",
        "--channel-config", "name=in,type=pull,method=bind,address=ipc://",
        stdin=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write("i\nk\nb\nx\nj\nRUN\n")
    proc.stdin.flush()
    wait_for_line(proc, "LOOP")  # running: the next keys stop it
    proc.stdin.write("bogus\ns\nt\nreset-device\nq\n")
    proc.stdin.flush()
    code, out, err = finish(proc, 30)
    assert code == 0, err
    steps = state_steps(out)
    assert steps == FULL_RUN
    assert "unknown transition 'bogus'" in err
    assert not list(_runtime_dir.rglob("*"))

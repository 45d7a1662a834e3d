"""The endpoint exchange of one topology device, on a real bus proxy (in a thread)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from evflow.errors import PeerLostError
from evflow.runtime.bus import BusClient, BusProxy
from evflow.runtime.busclient import BusEndpoints
from evflow.runtime.devices.sink import Sink
from evflow.topology.intake import ControllerBus
from evflow.topology.knowledge import DeviceRecord
from evflow.topology.node import Exchange
from evflow.topology.resolve import ResolvedChannel, ResolvedDevice
from evflow.topology.startup import StartupSteps
from evflow.wire.messages import MsgType, encode_message

EXAMPLES = Path(__file__).parent.parent / "examples" / "topologies"


@pytest.fixture
def bus() -> Any:
    context: zmq.Context[Any] = zmq.Context()
    proxy = BusProxy(context, "xchg")
    proxy.start_thread()
    yield context, str(proxy.endpoints)
    proxy.close()
    context.term()


def launch(connect: list[tuple[str, bool]]) -> ResolvedDevice:
    channels = [ResolvedChannel("data", "pull", connect=connect)]
    return ResolvedDevice("sink", "sink", "sink", "localhost", 0, {}, channels)


def test_a_missing_peer_endpoint_is_one_error_naming_the_peer(bus: Any) -> None:
    context, endpoints = bus
    client = BusClient(context, "sink", endpoints)
    device = Sink("sink", context=context)
    exchange = Exchange(client, launch([("merger.data-out", True)]), timeout_s=0.5)
    try:
        with pytest.raises(PeerLostError) as info:  # after 0.5 s (a hang: the test's time-out)
            exchange.channel_configs(device, binding=False)
        message = str(info.value)
        assert "device 'sink'" in message and "merger.data-out" in message
        assert "peer merger did not bind" in message
    finally:
        client.close()


def test_pushed_endpoints_are_used_ipc_on_the_host_tcp_across(bus: Any) -> None:
    context, endpoints = bus
    client = BusClient(context, "sink", endpoints)
    device = Sink("sink", context=context)
    spec = launch([("merger_0.data-out", True), ("merger_1.data-out", False)])
    exchange = Exchange(client, spec, timeout_s=10)
    exchange.attach(device)
    props = {
        "merger_0.data-out": ["ipc:///tmp/x/a.ipc", "tcp://10.0.0.1:4000"],
        "merger_1.data-out": ["ipc:///tmp/y/b.ipc", "tcp://10.0.0.2:4001"],
    }
    pub = context.socket(zmq.PUB)
    pub.connect(endpoints.split(",")[0])
    stop = threading.Event()

    def controller() -> None:  # pushes until the device has them, like the real one
        while not stop.is_set():
            header = {"cmd": "set-properties", "to": ["sink"], "req": "", "from": "controller"}
            pub.send_multipart(
                encode_message(MsgType.COMMAND, {**header, "args": {"properties": props}})
            )
            time.sleep(0.05)

    thread = threading.Thread(target=controller, daemon=True)
    thread.start()
    try:
        configs = exchange.channel_configs(device, binding=False)
    finally:
        stop.set()
        thread.join()
        pub.close(0)
        client.close()
    (config,) = configs
    assert config.method == "connect"
    assert config.address == "ipc:///tmp/x/a.ipc;tcp://10.0.0.2:4001"


def test_endpoint_notices_reach_the_controller_and_wake_no_device(bus: Any) -> None:
    """A device's endpoints go to the controller as a reply: the controller learns them,
    while a socket subscribed like every device (to commands) hears nothing of them (a
    command would wake all 256 devices of a topology for each of the 256 notices)."""
    context, endpoints = bus
    channels = [ResolvedChannel("data-out", "push", bind="tcp://127.0.0.1:0")]
    spec = ResolvedDevice("merger", "merger", "merger", "localhost", 0, {}, channels)
    records = {"merger": DeviceRecord(spec)}
    controller = ControllerBus(context, BusEndpoints.parse(endpoints), records, {},
                               lambda cmd, args: {})  # fmt: skip
    device_sub = context.socket(zmq.SUB)
    device_sub.setsockopt(zmq.SUBSCRIBE, bytes([int(MsgType.COMMAND)]))
    device_sub.connect(endpoints.split(",")[1])
    client = BusClient(context, "merger", endpoints)
    exchange = Exchange(client, spec, timeout_s=5)
    bound = SimpleNamespace(endpoints=["tcp://127.0.0.1:4567"])
    try:
        deadline = time.monotonic() + 60
        while "merger.data-out" not in controller.properties and time.monotonic() < deadline:
            exchange.published(SimpleNamespace(channels={"data-out": [bound]}))
            controller.pump(0.1)  # notices sent before the subscriptions are lost: again
        assert controller.properties["merger.data-out"] == ["tcp://127.0.0.1:4567"]
        assert not device_sub.poll(300)  # no notice reached the command subscriber
        seen = False  # ...which is connected: a command does reach it
        while not seen and time.monotonic() < deadline:
            controller.send("check-state", ["merger"])
            seen = bool(device_sub.poll(100))
        assert seen
        assert MsgType(device_sub.recv_multipart()[0][0]) is MsgType.COMMAND
    finally:
        device_sub.close(0)
        client.close()
        controller.close()


def test_pre_flight_removes_leftovers_of_a_dead_session(tmp_path: Path, _runtime_dir: Path) -> None:
    """A session directory and shm segment of a dead owner are gone after evflow up."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = _runtime_dir / "old-topo-localhost"
    stale.mkdir()
    (stale / "data-0-1234.ipc").write_text("")
    import socket

    owner = {"version": 1, "pid": int(dead.stdout), "started_s": 1.0, "host": socket.gethostname()}
    (stale / "owner.json").write_text(json.dumps(owner))
    shm = Path("/dev/shm") / "evflow-old-topo-localhost-seg"
    shm.write_bytes(b"x")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "evflow", "up", str(EXAMPLES / "fan_in.toml"), "--quiet", "-v"],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert proc.returncode == 0, proc.stderr
        assert "removed leftovers of dead session(s) old-topo-localhost" in proc.stderr
        assert not stale.exists() and not shm.exists()
    finally:
        shm.unlink(missing_ok=True)


def test_commands_to_a_list_of_ids_a_regex_and_quiet_ones(bus: Any) -> None:
    """``to`` may be a list, ``select`` a regex; ``quiet`` commands run without a REPLY."""
    from evflow.runtime.bus import BusController

    context, endpoints = bus
    done: dict[str, list[str]] = {"a1": [], "a2": [], "b1": []}
    clients = {
        name: BusClient(context, name, endpoints, on_transition=done[name].append) for name in done
    }
    ctl = BusController(context, endpoints, name="ctl")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for client in clients.values():
                client.poll()
            time.sleep(0.005)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        ctl.connect()
        header = {"cmd": "transition", "to": ["a1", "b1"], "req": "l1", "from": "ctl"}
        ctl._pub.send(encode_message(MsgType.COMMAND, {**header, "args": {"transition": "RUN"}}))
        answered: set[str] = set()
        deadline = time.monotonic() + 30
        while answered != {"a1", "b1"} and time.monotonic() < deadline:
            msg = ctl._recv(0.05)
            if msg is not None and msg.type is MsgType.REPLY and msg.header["req"] == "l1":
                answered.add(msg.header["from"])
        assert answered == {"a1", "b1"}
        replies = ctl.request("transition", "*", {"transition": "STOP"}, timeout_s=1.0, select="a.")
        assert sorted(r["from"] for r in replies) == ["a1", "a2"]
        header = {"cmd": "transition", "to": ["a2"], "req": "q1", "from": "ctl", "quiet": True}
        ctl._pub.send(encode_message(MsgType.COMMAND, {**header, "args": {"transition": "END"}}))
        deadline = time.monotonic() + 30
        while not done["a2"][2:] and time.monotonic() < deadline:
            msg = ctl._recv(0.05)
            assert msg is None or msg.type is not MsgType.REPLY or msg.header["req"] != "q1"
    finally:
        stop.set()
        thread.join()
        ctl.close()
        for client in clients.values():
            client.close()
    assert done == {"a1": ["RUN", "STOP"], "a2": ["STOP", "END"], "b1": ["RUN"]}


def _wait_for(controller: ControllerBus, done: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        controller.pump(0.05)
    assert done()


def test_first_steps_are_taken_once_heard_and_each_step_of_the_walk_once(bus: Any) -> None:
    """A device spawned with first steps reaches BOUND by itself and the controller
    hears every step (it waits until the bus hears it); the walk's own send of that step
    is then not taken again, a sequence not allowed from its state is refused whole,
    and the next step's sequence takes it to READY."""
    from evflow.topology.protocol import walk_request

    context, endpoints = bus
    channels = [ResolvedChannel("data", "router", bind="tcp://127.0.0.1:0")]
    spec = ResolvedDevice("sink", "sink", "sink", "localhost", 0, {}, channels)
    records = {"sink": DeviceRecord(spec)}
    controller = ControllerBus(context, BusEndpoints.parse(endpoints), records, {},
                               lambda cmd, args: {})  # fmt: skip
    first = ("INIT_DEVICE", "COMPLETE_INIT", "BIND")
    code = (
        "import json, sys; from evflow.topology.node import run_node; "
        "sys.exit(run_node(json.loads(sys.argv[1]), sys.argv[2], 'firststeps', 5.0, '', "
        f"{first!r}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(spec.to_wire()), endpoints])
    rec = records["sink"]
    seen: list[str] = []
    original = rec.see_state

    def see_state(state: str) -> None:
        seen.append(state)
        original(state)

    rec.see_state = see_state  # type: ignore[method-assign]
    try:
        _wait_for(controller, lambda: rec.state == "BOUND" and "sink.data" in controller.properties)
        # heard from the start: no state of the walk was lost
        assert seen[:2] == ["IDLE", "INITIALIZING_DEVICE"] and "INITIALIZED" in seen
        again = {"transitions": list(first)}
        controller.send("transition", ["sink"], again, req=walk_request(first[0]))
        _wait_for(controller, lambda: bool(controller.replies[walk_request(first[0])]))
        reply = controller.replies[walk_request(first[0])]["sink"]
        assert reply["ok"] and reply["data"]["previous_state"] == "IDLE"  # the first answer
        bad = controller.send("transition", ["sink"], {"transitions": ["INIT_TASK", "RUN"]})
        _wait_for(controller, lambda: bool(controller.replies[bad]))
        assert not controller.replies[bad]["sink"]["ok"]
        assert "no transition from BOUND" in controller.replies[bad]["sink"]["error"]
        nxt = {"transitions": ["CONNECT", "INIT_TASK"]}
        controller.send("transition", ["sink"], nxt, req=walk_request("CONNECT"), quiet=True)
        _wait_for(controller, lambda: rec.state == "READY")
        assert rec.state == "READY" and seen.count("BOUND") == 1
        controller.send("transition", ["sink"], {"transition": "END"}, quiet=True)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        controller.close()


def test_a_restarted_binder_takes_its_old_endpoints_from_its_bind_step(bus: Any) -> None:
    """The controller has already heard the restarted device's first state, so it sends
    no set-properties (the one sent at the restart was lost while the new process was
    not subscribed): the BIND step alone gives it the endpoints its peers connect to."""
    context, endpoints = bus
    old = ["ipc:///tmp/x/qc-in-0-1234abcd.ipc", "tcp://10.0.0.1:4000"]
    channels = [ResolvedChannel("qc-in", "pull", bind="ipc://;tcp://10.0.0.1:0")]
    spec = ResolvedDevice("m", "m", "sink", "localhost", 0, {}, channels)
    records = {"m": DeviceRecord(spec, rank=2, process="running", rewalk=True)}  # INITIALIZED
    controller = ControllerBus(context, BusEndpoints.parse(endpoints), records, {},
                               lambda cmd, args: {})  # fmt: skip
    controller.properties.update({"m.qc-in": old, "other.qc-in": ["ipc:///tmp/x/o.ipc"]})
    steps = StartupSteps()
    steps.records, steps.bus = records, controller
    client = BusClient(context, "m", endpoints)
    device = Sink("m", context=context)
    exchange = Exchange(client, spec, timeout_s=5)
    exchange.attach(device)
    try:
        deadline = time.monotonic() + 60
        while "m.qc-in" not in exchange.properties and time.monotonic() < deadline:
            records["m"].next_step_s = 0.0
            steps._rewalk(time.monotonic())  # BIND (again, until the subscription is through)
            controller.pump(0.05)
            client.poll(device)
        (config,) = exchange.bind_configs()
    finally:
        client.close()
        controller.close()
    assert config.method == "bind" and config.address == ";".join(old)
    assert "other.qc-in" not in exchange.properties  # its own endpoints only

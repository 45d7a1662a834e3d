"""Control bus: proxy process, node clients answering commands, controller, bad bytes."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from _wait import wait_until
from evflow.errors import ConfigurationError, TimeoutError_
from evflow.runtime.bus import BUS_IN, BUS_OUT, BusClient, BusController, BusEndpoints, BusProxy
from evflow.runtime.supervisor import Supervisor
from evflow.transport.paths import runtime_base_dir

ALICE_FIELDS = {
    "node_id", "node_state", "pid", "request_timestamp", "response_timestamp",
    "receive_buffer_size", "receive_buffer_capacity", "receive_buffer_overloaded",
    "send_buffer_size", "send_buffer_capacity", "send_buffer_overloaded",
    "VmRSS", "cpu", "rates",
}  # fmt: skip


def _node(endpoints: str, node_id: str, record: str, tick_s: float, lifetime_s: float) -> int:
    """A bus node: counts an event per loop, records transitions, ends on END."""
    context: zmq.Context[Any] = zmq.Context()
    state = {"s": "RUNNING"}

    def on_transition(name: str) -> None:
        with open(record, "a") as fh:
            fh.write(f"{node_id} {name}\n")
        if name == "END":
            state["s"] = "EXITING"

    client = BusClient(
        context,
        node_id,
        endpoints,
        state=lambda: state["s"],
        on_transition=on_transition,
        metrics_interval_s=0.2,
    )
    deadline = time.monotonic() + lifetime_s
    try:
        client.publish_state(new="RUNNING")
        while state["s"] != "EXITING" and time.monotonic() < deadline:
            client.metrics.events_in += 1
            client.tick()
            time.sleep(tick_s)
        client.publish_state(old="RUNNING", new="EXITING")
    finally:
        client.close()
        context.term()
    return 0


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[tuple[Supervisor, BusController, Path]]:
    """A supervisor with a bus proxy process, two nodes, and a controller here."""
    record = tmp_path / "transitions.txt"
    sup = Supervisor(bus=True).start()  # before our zmq context: the zygote holds none
    endpoints = str(sup.bus_endpoints)
    for name in ("n1", "n2"):
        sup.add_function(name, _node, endpoints, name, str(record), 0.02, 60.0)
    context: zmq.Context[Any] = zmq.Context()
    controller = BusController(context, sup.bus_endpoints)
    try:
        yield sup, controller, record
    finally:
        controller.close()
        context.term()
        sup.shutdown()
        sup.close()


def _ask_all(controller: BusController, cmd: str, want: set[str]) -> dict[str, dict[str, Any]]:
    """Broadcast until every node in ``want`` answered (nodes start asynchronously)."""
    got: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 60
    while not want <= set(got) and time.monotonic() < deadline:
        for reply in controller.request(cmd, "*", timeout_s=0.5):
            got[reply["from"]] = reply
    assert want <= set(got), f"only {sorted(got)} answered"
    return got


def test_check_state_reaches_every_node_and_the_proxy(bus: Any) -> None:
    sup, controller, _ = bus
    got = _ask_all(controller, "check-state", {"bus", "n1", "n2"})
    for name in ("n1", "n2"):
        data = got[name]["data"]
        assert got[name]["ok"] is True
        assert data["node_id"] == name and data["node_state"] == "RUNNING"
        assert data["pid"] == sup.processes[name].pid
        assert data["response_timestamp"] >= data["request_timestamp"]
    assert got["bus"]["data"]["pid"] == sup.processes["bus"].pid


def test_get_metrics_has_the_alice_fields_and_live_counters(bus: Any) -> None:
    sup, controller, _ = bus
    _ask_all(controller, "check-state", {"n1"})
    first = controller.request("get-metrics", "n1")[0]["data"]
    second = wait_until(
        lambda: _later_metrics(controller, "n1", first["events_in"]), 30, "n1's counter moving"
    )
    assert set(second) >= ALICE_FIELDS
    assert second["pid"] == sup.processes["n1"].pid
    assert second["VmRSS"] > 1000  # kB: a Python process is at least a few MB
    assert second["events_in"] > first["events_in"] > 0
    assert second["rates"]["events_in_hz"] > 5  # ~50 Hz loop, rates over 0.2 s windows
    assert second["receive_buffer_overloaded"] is False


def _later_metrics(controller: BusController, node: str, events_in: int) -> dict[str, Any] | None:
    """``node``'s metrics once its events_in counter passed ``events_in``, else None."""
    data: dict[str, Any] = controller.request("get-metrics", node)[0]["data"]
    return data if data["events_in"] > events_in else None


def test_state_changes_and_metrics_are_published(bus: Any) -> None:
    _, controller, _ = bus
    _ask_all(controller, "check-state", {"n1", "n2"})
    controller.seen.clear()
    deadline = time.monotonic() + 30
    while not {"n1", "n2"} <= set(controller.seen) and time.monotonic() < deadline:
        controller._recv(0.1)  # METRICS every 0.2 s from each node
    assert controller.seen.get("n1") == "RUNNING" and controller.seen.get("n2") == "RUNNING"


def test_unknown_id_is_one_clear_error_after_the_timeout(bus: Any) -> None:
    _, controller, _ = bus
    _ask_all(controller, "check-state", {"n1", "n2"})
    start = time.monotonic()
    with pytest.raises(TimeoutError_, match=r"no node 'ghost' answered 'check-state' within 0\.7"):
        controller.request("check-state", "ghost", timeout_s=0.7)
    # not before its timeout (a loaded machine only makes it later); the upper bound
    # is generous: it only says that the request does not wait on past its timeout
    assert 0.6 < time.monotonic() - start < 0.7 + 10


def test_transition_is_executed_once_even_when_the_command_is_resent(bus: Any) -> None:
    _, controller, record = bus
    _ask_all(controller, "check-state", {"n1"})
    # resent every 10 ms while the node looks every 20 ms: it sees copies, runs it once
    reply = controller.request("transition", "n1", {"transition": "STOP"}, resend_s=0.01)[0]
    assert reply["ok"] is True and reply["data"]["transition"] == "STOP"
    # a round trip behind every copy: the controller sent them all before this request,
    # on the same socket, so n1 has handled each of them when it answers
    controller.request("check-state", "n1")
    assert record.read_text().splitlines() == ["n1 STOP"]


def test_unknown_command_gets_an_error_reply(bus: Any) -> None:
    _, controller, _ = bus
    _ask_all(controller, "check-state", {"n2"})
    reply = controller.request("explode", "n2")[0]
    assert reply["ok"] is False
    assert "unknown command 'explode'" in reply["error"]


def _bad_at_least(controller: BusController, n: float) -> dict[str, Any] | None:
    """The bus proxy's metrics once it counted at least ``n`` bad messages, else None."""
    data: dict[str, Any] = controller.request("get-metrics", "bus")[0]["data"]
    return data if data["bad_messages"] >= n else None


def _counted_probe(controller: BusController, pub: zmq.Socket[Any]) -> int | None:
    """Send one bad message on ``pub``; the bus's bad-message count once it went up."""
    start = controller.request("get-metrics", "bus")[0]["data"]["bad_messages"]
    pub.send_multipart([bytes([10]), b"not a header"])
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        now = controller.request("get-metrics", "bus")[0]["data"]["bad_messages"]
        if now > start:
            return int(now)
        time.sleep(0.02)
    return None


def test_random_bytes_to_the_proxy_are_counted_and_dropped(bus: Any) -> None:
    sup, controller, _ = bus
    _ask_all(controller, "check-state", {"bus", "n1"})
    rng = random.Random(1234)
    junk_pub = controller._pub.socket.context.socket(zmq.PUB)
    junk_xsub = controller._pub.socket.context.socket(zmq.XSUB)
    try:
        junk_pub.connect(sup.bus_endpoints.publish)
        junk_xsub.connect(sup.bus_endpoints.subscribe)
        # PUB drops until the proxy's subscriptions arrive: probe until one is counted;
        # what is counted from here on is this test's junk
        before = wait_until(lambda: _counted_probe(controller, junk_pub), 30, "a probe")
        sent = 0
        for i in range(300):
            frames = [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(1, 4))]
            # PUB filters by the subscribed prefixes (the type bytes), so start with one
            # of those: a too-long type frame, or a valid type byte with a garbage header
            topic = bytes([rng.choice([10, 11, 12, 13])])
            frames[0] = topic + frames[0] if i % 2 else topic
            junk_pub.send_multipart(frames)
            sent += 1
        for _ in range(50):  # garbage "subscriptions" from the subscriber side
            junk_xsub.send(b"\x07" + rng.randbytes(8))
        # raw bytes on the unix socket itself: not even a ZMTP greeting
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(sup.bus_endpoints.publish[len("ipc://") :])
        raw.sendall(rng.randbytes(4096))
        raw.close()
        # every junk message is dropped and counted (a few random ones may happen to be
        # valid): wait for the counts (the proxy takes them in its own time)
        metrics = wait_until(
            lambda: _bad_at_least(controller, before + 0.9 * sent + 50), 30, "the junk counted"
        )
    finally:
        junk_pub.close(linger=0)
        junk_xsub.close(linger=0)
    assert "bad-subscription" in metrics["bad_message_kinds"]
    # and the bus still works for everybody
    assert controller.request("check-state", "n1")[0]["data"]["node_state"] == "RUNNING"
    assert sup.processes["bus"].alive


def test_proxy_removes_its_ipc_files_when_stopped(bus: Any) -> None:
    sup, controller, _ = bus
    _ask_all(controller, "check-state", {"bus"})
    session = runtime_base_dir() / sup.session
    assert (session / BUS_IN).exists() and (session / BUS_OUT).exists()
    sup.kill("bus", 15)
    deadline = time.monotonic() + 30
    while sup.processes["bus"].alive and time.monotonic() < deadline:
        sup.poll(0.05)
    assert sup.processes["bus"].returncode == 0
    assert not (session / BUS_IN).exists() and not (session / BUS_OUT).exists()


def test_bus_endpoint_errors_are_clear() -> None:
    with pytest.raises(ConfigurationError, match="expected 'PUBLISH_ENDPOINT,SUBSCRIBE"):
        BusEndpoints.parse("tcp://a:1")
    with pytest.raises(ConfigurationError, match="invalid bus endpoint 'http://x'"):
        BusEndpoints.parse("http://x,tcp://a:2")
    assert BusEndpoints.parse("tcp://a:1;tcp://a:2") == BusEndpoints("tcp://a:1", "tcp://a:2")


def test_controller_without_a_proxy_fails_clearly() -> None:
    context: zmq.Context[Any] = zmq.Context()
    controller = BusController(context, BusEndpoints.for_session("nobody"))
    try:
        with pytest.raises(Exception, match=r"does not answer within 0\.3 s"):
            controller.request("check-state", "x", timeout_s=0.3)
    finally:
        controller.close()
        context.term()


def test_a_killed_proxy_is_restarted_and_nodes_are_reached_again(bus: Any) -> None:
    sup, controller, _ = bus
    _ask_all(controller, "check-state", {"bus", "n1"})
    old = sup.processes["bus"].pid
    sup.kill("bus", 9)  # stale ipc files stay behind; the new proxy must rebind them
    deadline = time.monotonic() + 60
    while sup.processes["bus"].pid == old and time.monotonic() < deadline:
        sup.poll(0.05)
    assert sup.processes["bus"].alive and sup.processes["bus"].restarts == 1
    # PUB/SUB sockets reconnect by themselves to the same ipc paths
    got = _ask_all(controller, "check-state", {"bus", "n1", "n2"})
    assert got["bus"]["data"]["pid"] == sup.processes["bus"].pid != old


def _thread_node(context: zmq.Context[Any], endpoints: BusEndpoints, stop: Any) -> None:
    client = BusClient(context, "t1", endpoints)
    try:
        while not stop.is_set():
            client.tick()
            time.sleep(0.01)
    finally:
        client.close()


def test_proxy_in_a_thread_over_tcp() -> None:
    import threading

    context: zmq.Context[Any] = zmq.Context()
    proxy = BusProxy(
        context,
        "tcp-bus",
        publish_address="tcp://127.0.0.1:0",
        subscribe_address="tcp://127.0.0.1:0",
    )
    proxy.start_thread()
    stop = threading.Event()
    node = threading.Thread(target=_thread_node, args=(context, proxy.endpoints, stop))
    node.start()
    controller = BusController(context, str(proxy.endpoints))
    try:
        assert proxy.endpoints.publish.startswith("tcp://127.0.0.1:")
        reply = controller.request("check-state", "t1", timeout_s=5)[0]
        assert reply["data"]["node_state"] == "RUNNING"
    finally:
        stop.set()
        node.join(timeout=5)
        controller.close()
        proxy.close()
        context.term()


def test_supervised_proxy_can_listen_on_tcp_as_well() -> None:
    with socket.socket() as s:  # a free port for the XSUB and one for the XPUB side
        s.bind(("127.0.0.1", 0))
        port_in = s.getsockname()[1]
        with socket.socket() as t:
            t.bind(("127.0.0.1", 0))
            port_out = t.getsockname()[1]
    addresses = (
        f"ipc://{BUS_IN};tcp://127.0.0.1:{port_in}",
        f"ipc://{BUS_OUT};tcp://127.0.0.1:{port_out}",
    )
    sup = Supervisor(bus=True, bus_addresses=addresses).start()
    context: zmq.Context[Any] = zmq.Context()
    remote = BusController(context, f"tcp://127.0.0.1:{port_in},tcp://127.0.0.1:{port_out}")
    local = BusController(context, sup.bus_endpoints)
    try:
        for controller in (remote, local):
            reply = controller.request("check-state", "bus", timeout_s=5)[0]
            assert reply["data"]["pid"] == sup.processes["bus"].pid
    finally:
        remote.close()
        local.close()
        context.term()
        sup.shutdown()
        sup.close()

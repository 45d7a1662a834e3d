"""The node side of the control bus: :class:`BusClient`, endpoints and discovery.

A **node** (device, worker, input, output) owns one ``BusClient``. It publishes its state
changes and, about once a second, its metrics, and answers commands addressed to its
id or to ``"*"``. No thread: the node's loop calls :meth:`BusClient.tick` (or puts
``client.socket`` in its poller and calls :meth:`BusClient.poll` when it is readable).
A :class:`~evflow.runtime.device.Device` plugs one in with ``device.attach_bus(client)``.

The controller side (``evflow ctl``, the supervisor) is
:class:`evflow.runtime.buscontrol.BusController`.

Message layouts are described in :mod:`evflow.runtime.bus`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import zmq

from evflow.errors import ConfigurationError, EvflowError, ProtocolError
from evflow.runtime.metrics import ProcessMetrics
from evflow.transport.channel import Channel, ChannelConfig
from evflow.transport.opening import open_channel
from evflow.transport.paths import runtime_base_dir
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message

#: ipc file names of a session's bus (relative: placed in the session directory)
BUS_IN = "bus-in.ipc"
BUS_OUT = "bus-out.ipc"
#: the proxy's node id on the bus
PROXY_ID = "bus"
#: the longest an idle node with a ``wake_fd`` sleeps between commands (ms)
IDLE_WAIT_MS = 1000
#: commands every node answers
COMMANDS = ("check-state", "get-metrics", "transition", "ping")

_TYPE = {t: bytes([int(t)]) for t in MsgType}


@functools.lru_cache(maxsize=64)
def _pattern(select: str) -> re.Pattern[str] | None:
    try:
        return re.compile(select)
    except re.error:
        return None


def _matches(select: str, node_id: str) -> bool:
    pattern = _pattern(select)
    return pattern is not None and pattern.fullmatch(node_id) is not None


@dataclass(frozen=True)
class BusEndpoints:
    """Where clients connect: ``publish`` (the proxy's XSUB) and ``subscribe`` (XPUB)."""

    publish: str
    subscribe: str

    def __str__(self) -> str:
        return f"{self.publish},{self.subscribe}"

    @classmethod
    def parse(cls, text: str) -> BusEndpoints:
        """``"IN,OUT"`` or ``"IN;OUT"`` (publish endpoint, subscribe endpoint)."""
        parts = [p.strip() for p in text.replace(";", ",").split(",")]
        if len(parts) != 2 or not all(parts):
            raise ConfigurationError(
                f"invalid bus address {text!r}: expected 'PUBLISH_ENDPOINT,SUBSCRIBE_ENDPOINT' "
                "(the proxy's XSUB and XPUB), e.g. tcp://host:5555,tcp://host:5556"
            )
        for p in parts:
            if not p.startswith(("tcp://", "ipc://")):
                raise ConfigurationError(f"invalid bus endpoint {p!r} (expected tcp:// or ipc://)")
        return cls(parts[0], parts[1])

    @classmethod
    def for_session(cls, session: str) -> BusEndpoints:
        """The local ipc endpoints of ``session``'s bus."""
        base = runtime_base_dir() / session
        return cls(f"ipc://{base / BUS_IN}", f"ipc://{base / BUS_OUT}")


def find_bus_sessions() -> list[str]:
    """Sessions under the runtime base directory that have a bus (oldest first)."""
    base = runtime_base_dir()
    if not base.is_dir():
        return []
    found = [d for d in base.iterdir() if (d / BUS_IN).exists() and (d / BUS_OUT).exists()]
    found.sort(key=lambda d: d.stat().st_mtime)
    return [d.name for d in found]


def open_bus_sockets(
    context: zmq.Context[Any],
    endpoints: BusEndpoints,
    label: str,
    topics: tuple[MsgType, ...],
    pub_type: str = "pub",
) -> tuple[Channel, Channel]:
    """The publishing and the subscribing socket of a bus node. ``pub_type`` "xpub":
    the publisher also hears the proxy's subscriptions (see ``BusClient.wait_heard``)."""
    pub = open_channel(
        context,
        ChannelConfig(
            name=f"{label}-pub", type=pub_type, method="connect", address=endpoints.publish,
            linger=200,
        ),
        "bus",
    )  # fmt: skip
    try:
        sub = open_channel(
            context,
            ChannelConfig(
                name=f"{label}-sub",
                type="sub",
                method="connect",
                address=endpoints.subscribe,
                linger=0,
            ),
            "bus",
        )
    except BaseException:
        pub.close(0)
        raise
    sub.socket.setsockopt(zmq.UNSUBSCRIBE, b"")
    for topic in topics:
        sub.socket.setsockopt(zmq.SUBSCRIBE, _TYPE[topic])
    return pub, sub


class BusClient:
    """A node on the bus: publishes state and metrics, answers commands.

    ``state`` returns the node's state name and ``on_transition(name)`` handles a
    ``transition`` command (raise to refuse) when no device is passed to the methods;
    with a :class:`~evflow.runtime.device.Device` (``node``) they use its state machine.
    The methods ``publish_state(node, old, new)``, ``publish_metrics(node)`` and
    ``poll(node)`` are the interface ``Device.attach_bus`` expects.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        node_id: str,
        endpoints: BusEndpoints | str,
        *,
        metrics: ProcessMetrics | None = None,
        state: Callable[[], str] | None = None,
        on_transition: Callable[[str], Any] | None = None,
        metrics_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        confirm: bool = False,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = BusEndpoints.parse(endpoints)
        self.node_id = node_id
        self.endpoints = endpoints
        self.metrics = metrics if metrics is not None else ProcessMetrics(node_id)
        self._state_fn = state
        self._on_transition = on_transition
        self.metrics_interval_s = metrics_interval_s
        self._clock = clock
        self._next_metrics_s = 0.0
        # confirm: an XPUB, which hears the proxy's subscriptions (wait_heard)
        pub_type = "xpub" if confirm else "pub"
        self._pub, self._sub = open_bus_sockets(
            context, endpoints, "bus", (MsgType.COMMAND,), pub_type
        )
        self.bad = BadMessageCounter(f"bus client {node_id}")
        self._handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}
        # replies by request id: a re-sent command is answered again, never re-executed
        self._answered: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
        self.commands_handled = 0
        self.closed = False
        self._heard_now: set[bytes] = set()  # subscriptions the XPUB heard (confirm)
        #: readable when a signal arrived (``signal.set_wakeup_fd``): wait_command()
        #: then wakes on signals too and can wait long between commands
        self.wake_fd: int | None = None
        self._poller: zmq.Poller | None = None

    def __repr__(self) -> str:
        return f"<BusClient {self.node_id!r} handled={self.commands_handled} bad={self.bad.total}>"

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The SUB socket; readable when a command may be pending (for a zmq.Poller)."""
        return self._sub.socket

    def wait_command(self, timeout_ms: int) -> bool:
        """Wait for a command (True) or ``timeout_ms``. With ``wake_fd`` a signal wakes
        us too, so an idle node waits up to IDLE_WAIT_MS (or its next metrics) instead:
        hundreds of devices waiting for their next transition stay asleep."""
        if self.wake_fd is None:
            return bool(self._sub.socket.poll(timeout_ms))
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(self._sub.socket, zmq.POLLIN)
            self._poller.register(self.wake_fd, zmq.POLLIN)
        until_metrics_ms = (self._next_metrics_s - self._clock()) * 1000
        wait_ms = int(max(timeout_ms, min(IDLE_WAIT_MS, until_metrics_ms)))
        ready = dict(self._poller.poll(wait_ms))
        if self.wake_fd in ready:
            with contextlib.suppress(OSError):
                os.read(self.wake_fd, 512)
        return self._sub.socket in ready

    def wait_heard(self, topics: tuple[MsgType, ...], timeout_s: float) -> bool:
        """Wait until what we publish on ``topics`` reaches the proxy (BusClient made
        with ``confirm=True``); False after ``timeout_s`` (call again to wait on). A
        publisher drops what it sends before the proxy's subscriptions arrive over the
        new connection: a node that speaks first (its state right after its start)
        waits for them here."""
        if self._pub.socket.socket_type != zmq.XPUB:
            return True
        wanted = {b"\x01" + _TYPE[t] for t in topics}
        deadline = self._clock() + timeout_s
        # (b"\x01" alone: a subscription to every topic)
        while not (wanted <= self._heard_now or b"\x01" in self._heard_now):
            left_s = deadline - self._clock()
            if left_s <= 0 or not self._pub.socket.poll(max(1, int(left_s * 1000))):
                return False
            frames = self._pub.socket.recv_multipart(zmq.NOBLOCK)
            if frames:
                self._heard_now.add(bytes(frames[0]))
        return True

    def mark_answered(self, req: str, cmd: str, data: dict[str, Any], to: str) -> None:
        """Take request ``req`` as done (``data`` its answer): the node did on its own
        what the request asks, and a later send of it is answered, not executed."""
        reply = {"req": req, "cmd": cmd, "from": self.node_id, "to": to, "ok": True, "data": data}
        self._answered[req] = encode_message(MsgType.REPLY, reply)

    def handle(self, command: str, handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Answer ``command`` with ``handler(args) -> data`` (raise EvflowError to refuse)."""
        self._handlers[command] = handler

    # --- publishing ----------------------------------------------------------------
    def _state(self, node: Any) -> str:
        if node is not None and hasattr(node, "fsm"):
            return str(node.fsm.state)
        return self._state_fn() if self._state_fn is not None else "RUNNING"

    def publish_state(self, node: Any = None, old: Any = None, new: Any = None) -> None:
        """Announce a state change (``new``, or the node's current state)."""
        header = {
            "from": self.node_id,
            "state": str(new) if new is not None else self._state(node),
            "previous": None if old is None else str(old),
            "ts": time.time(),
            "pid": os.getpid(),  # the controller tells a new process from its dead one
        }
        self._send(MsgType.STATE, header)

    def snapshot(
        self, node: Any = None, request_timestamp: float | None = None, command: str = "get-metrics"
    ) -> dict[str, Any]:
        """Metrics of this node (ALICE QC fields; see :mod:`evflow.runtime.metrics`)."""
        extra: dict[str, Any] = {}
        if node is not None and hasattr(node, "channels"):
            self.metrics.channels = [ch for subs in node.channels.values() for ch in subs]
        if node is not None and hasattr(node, "metrics"):
            extra = dict(node.metrics())
            extra.pop("pid", None)
        extra["bus_bad_messages"] = self.bad.total
        snap = self.metrics.snapshot(self._state(node), request_timestamp, extra, command)
        snap["node_id"] = self.node_id
        return snap

    def publish_metrics(self, node: Any = None) -> None:
        """Publish a metrics snapshot now (rates over the interval since the last one)."""
        self.metrics.update_rates()
        snap = self.snapshot(node, command="metrics")
        self._send(MsgType.METRICS, {"from": self.node_id, "metrics": snap})

    def tick(self, node: Any = None, now_s: float | None = None) -> int:
        """Call from the node's loop: metrics every ``metrics_interval_s``, then commands."""
        now_s = self._clock() if now_s is None else now_s
        if now_s >= self._next_metrics_s:
            self._next_metrics_s = now_s + self.metrics_interval_s
            self.publish_metrics(node)
        return self.poll(node)

    def publish(self, mtype: MsgType, header: dict[str, Any]) -> None:
        """Publish any bus message (best effort, like states and metrics)."""
        self._send(mtype, header)

    def _send(self, mtype: MsgType, header: dict[str, Any]) -> None:
        if self.closed:
            return
        # bus congested: state/metrics are best effort, the next one follows
        with contextlib.suppress(zmq.Again):
            self._pub.send(encode_message(mtype, header), zmq.NOBLOCK)

    # --- commands ------------------------------------------------------------------
    def poll(self, node: Any = None) -> int:
        """Answer every pending command; returns how many were for us. Never blocks."""
        handled = 0
        sub = self._sub.socket
        # EVENTS, not a NOBLOCK recv's zmq.Again, says "nothing more" (the raise costs
        # about three times the check, at every tick of every node)
        while not self.closed and cast(int, sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = self._sub.recv(zmq.NOBLOCK)
            except zmq.Again:  # (not expected: this thread is the only reader)
                break
            msg = self.bad.decode(frames)
            if msg is None or msg.type is not MsgType.COMMAND:
                continue
            header = msg.header
            if not self.addressed(header):
                continue
            req = str(header.get("req", ""))
            # "quiet": the sender wants no REPLY (hundreds of devices told one thing)
            quiet = header.get("quiet") is True
            if req and req in self._answered:
                if not quiet:
                    self._pub.send(self._answered[req])
                continue
            reply = encode_message(MsgType.REPLY, self._answer(node, header))
            if req:
                self._answered[req] = reply
                while len(self._answered) > 64:
                    self._answered.popitem(last=False)
            if not quiet:
                self._pub.send(reply)
            handled += 1
        self.commands_handled += handled
        return handled

    def addressed(self, header: dict[Any, Any]) -> bool:
        """True if a command is for us: ``to`` is our id, ``"*"`` or a list holding our id,
        and ``select`` (a regular expression, optional) matches our whole id."""
        to = header.get("to")
        if not (to == self.node_id or to == "*" or (isinstance(to, list) and self.node_id in to)):
            return False
        select = header.get("select")
        if select is None:
            return True
        return isinstance(select, str) and _matches(select, self.node_id)

    def _answer(self, node: Any, header: dict[Any, Any]) -> dict[str, Any]:
        cmd = header.get("cmd")
        args = header.get("args") or {}
        reply: dict[str, Any] = {
            "req": header.get("req"),
            "cmd": cmd,
            "from": self.node_id,
            "to": header.get("from"),
        }
        try:
            if not isinstance(args, dict):
                raise ConfigurationError(f"command args must be a map, got {type(args).__name__}")
            data = self._dispatch(node, str(cmd), args, header.get("ts"))
        except ProtocolError as exc:  # a handler refused a malformed command: counted
            self.bad.record_error(exc)
            return {**reply, "ok": False, "error": str(exc)}
        except EvflowError as exc:
            return {**reply, "ok": False, "error": str(exc)}
        except Exception as exc:  # a bad handler must not kill the node's loop
            return {**reply, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {**reply, "ok": True, "data": data}

    def _dispatch(self, node: Any, cmd: str, args: dict[str, Any], ts: Any) -> dict[str, Any]:
        request_ts = float(ts) if isinstance(ts, int | float) else None
        if cmd in self._handlers:
            return self._handlers[cmd](args)
        if cmd in ("check-state", "ping"):
            now = time.time()
            return {
                "node_id": self.node_id,
                "node_state": self._state(node),
                "pid": os.getpid(),
                "request_timestamp": now if request_ts is None else request_ts,
                "response_timestamp": now,
            }
        if cmd == "get-metrics":
            return self.snapshot(node, request_ts)
        if cmd == "transition":
            return self._transition(node, str(args.get("transition", "")))
        raise ConfigurationError(
            f"unknown command {cmd!r}; expected one of "
            f"{', '.join(COMMANDS + tuple(self._handlers))}"
        )

    def _transition(self, node: Any, name: str) -> dict[str, Any]:
        before = self._state(node)
        if node is not None and hasattr(node, "request"):
            from evflow.errors import StateTransitionError
            from evflow.runtime.states import State, Transition, next_state, parse_transition

            transition = parse_transition(name)
            state = node.fsm.state
            if transition is not Transition.END and next_state(state, transition) is None:
                raise StateTransitionError(
                    f"{self.node_id}: no transition from {state} on {transition}"
                )
            if transition is Transition.END and state is State.EXITING:
                raise StateTransitionError(f"{self.node_id}: already {state}")
            node.request(transition)
        elif self._on_transition is not None:
            self._on_transition(name)
        else:
            raise ConfigurationError(f"node {self.node_id!r} does not take transitions")
        return {
            "node_id": self.node_id,
            "transition": name.upper(),
            "previous_state": before,
            "accepted": True,
        }

    def close(self) -> None:
        """Close both sockets (pending state messages get ``linger`` 200 ms to leave)."""
        if self.closed:
            return
        self.closed = True
        self._sub.close(0)
        self._pub.close()

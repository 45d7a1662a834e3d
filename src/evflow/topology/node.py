"""One device of a topology, forked by its host's agent: the device process's main.

The device is the ordinary :class:`~evflow.runtime.device.Device` class with a bus
client. The controller walks it through FairMQ's sequence over the bus; the
:class:`Exchange` plugged into the device does the endpoint exchange:

- after BINDING opened the bind channels, their real endpoints (``ipc://`` file,
  ``tcp://<host address>:<port>``) are published to the controller (``set-property``)
  and shown in ``check-state`` replies;
- before CONNECTING opens the connect channels, each peer's endpoint is taken from the
  properties the controller pushes (``set-properties``); a missing one is asked for
  (``get-properties``) and waited for, up to ``connect_timeout_s``, then the device
  ends in ERROR with one message naming the peer.

A device whose RUNNING loop ends by itself (a sampler's last message, a sink's last
END) walks on down to EXITING; after a STOP from the bus it waits in READY, FairMQ's way.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import zmq

from evflow.errors import EvflowError, IncompleteStreamError, PeerLostError
from evflow.runtime.busclient import BusClient
from evflow.runtime.states import STARTUP_SEQUENCE, State
from evflow.topology.busfields import endpoint_map, opt_str, str_list
from evflow.topology.protocol import CONTROLLER_ID, walk_request
from evflow.topology.resolve import ResolvedChannel, ResolvedDevice
from evflow.transport.channel_config import ChannelConfig
from evflow.wire.messages import MsgType

log = logging.getLogger("evflow.topology")

_ASK_EVERY_S = 0.5
#: the exit code of a device that ended with an IncompleteStreamError (a count that
#: does not hold): its agent does not restart it (a new process cannot mend it)
FINAL_EXIT = 3
#: a device taking its first steps by itself waits at most this long to be heard
HEARD_TIMEOUT_S = 2.0
#: socket types that share what they send among their peers: a channel of these types
#: connected to several peers (``peers = "all"``) is one sub-channel per peer, so that
#: its device knows what went to each and ends each peer's stream with its own END (one
#: socket connected to all would pick the peer of every message, END included: one
#: peer would get the END with everybody's count, the others none)
PER_PEER_TYPES = frozenset({"push", "dealer"})


class Exchange:
    """Endpoint exchange of one device over the bus (see the module docstring)."""

    def __init__(self, client: BusClient, launch: ResolvedDevice, timeout_s: float) -> None:
        self.client = client
        self.launch = launch
        self.timeout_s = timeout_s
        self.properties: dict[str, list[str]] = {}
        self.endpoints: dict[str, list[str]] = {}
        self.stop_requested = False

    # --- configs ---------------------------------------------------------------------
    def _config(self, ch: ResolvedChannel, method: str, address: str) -> ChannelConfig:
        return ChannelConfig(
            name=ch.name, type=ch.type, method=method, address=address, **ch.options
        )

    def bind_configs(self) -> list[ChannelConfig]:
        """Bind channels; a restarted device binds the endpoints it had before (the
        controller pushed them), so that its peers' connections find it again."""
        out = []
        for ch in self.launch.channels:
            if ch.bind:
                before = self.properties.get(f"{self.launch.id}.{ch.name}")
                out.append(self._config(ch, "bind", ";".join(before) if before else ch.bind))
            elif ch.address and ch.address.startswith("@"):
                out.append(self._config(ch, "", ch.address))
        return out

    def channel_configs(self, device: Any, binding: bool) -> list[ChannelConfig]:
        """Bind configs, plus (``binding`` False) connect configs with the peers'
        published endpoints."""
        out = self.bind_configs()
        if binding:
            return out
        wanted = [key for ch in self.launch.channels for key, _ in ch.connect]
        self._wait_for(wanted, device)
        for ch in self.launch.channels:
            if ch.connect:
                urls = [self._pick(self.properties[key], same) for key, same in ch.connect]
                if ch.type in PER_PEER_TYPES:  # one sub-channel per peer (see PER_PEER_TYPES)
                    out.extend(self._config(ch, "connect", url) for url in urls)
                else:
                    out.append(self._config(ch, "connect", ";".join(urls)))
            elif ch.address and not ch.address.startswith("@"):
                address = ch.address[1:] if ch.address.startswith(">") else ch.address
                out.append(self._config(ch, "connect", address))
        return out

    @staticmethod
    def _pick(urls: list[str], same_host: bool) -> str:
        scheme = "ipc://" if same_host else "tcp://"
        return next((u for u in urls if u.startswith(scheme)), urls[0])

    def _wait_for(self, keys: list[str], device: Any) -> None:
        deadline = time.monotonic() + self.timeout_s
        next_ask = 0.0
        while missing := [k for k in keys if not self.properties.get(k)]:
            now = time.monotonic()
            if device.shutdown_requested:
                raise PeerLostError(
                    f"device {self.launch.id!r}: shut down while waiting for {', '.join(missing)}"
                )
            if now >= deadline:
                peers = ", ".join(sorted({k.split(".")[0] for k in missing}))
                raise PeerLostError(
                    f"device {self.launch.id!r}: no endpoint for {', '.join(missing)} within "
                    f"{self.timeout_s:g} s: peer {peers} did not bind (did it start? see "
                    "`evflow status`)"
                )
            if now >= next_ask:
                next_ask = now + _ASK_EVERY_S
                self._tell("get-properties", {"keys": missing})
            if self.client.socket.poll(50):
                self.client.poll(device)

    def published(self, device: Any) -> None:
        """After binding: remember and announce the real endpoints of bound channels."""
        for name, subs in device.channels.items():
            urls = [u for ch in subs for u in ch.endpoints]
            self.endpoints[f"{self.launch.id}.{name}"] = urls
        self._tell("set-property", {"endpoints": self.endpoints})

    def _tell(self, cmd: str, args: dict[str, Any]) -> None:
        """A notice for the controller alone: a REPLY without request id. (A COMMAND
        would reach every node: every device subscribes to commands and decodes them,
        256 devices' endpoints would be 65536 deliveries; only the controller
        subscribes to replies.)"""
        header = {
            "req": "",
            "cmd": cmd,
            "from": self.launch.id,
            "to": CONTROLLER_ID,
            "ok": True,
            "data": {"node_id": self.launch.id, **args},
        }
        self.client.publish(MsgType.REPLY, header)

    # --- bus handlers ---------------------------------------------------------------
    def attach(self, device: Any) -> None:
        client = self.client

        def check_state(args: dict[str, Any]) -> dict[str, Any]:
            now = time.time()
            return {
                "node_id": self.launch.id,
                "node_state": str(device.fsm.state),
                "pid": os.getpid(),
                "request_timestamp": now,
                "response_timestamp": now,
                "endpoints": self.endpoints,
            }

        def take(props: Any, what: str) -> None:
            if props is not None:  # checked whole first: a bad map changes nothing
                self.properties.update(endpoint_map(props, what))

        def set_properties(args: dict[str, Any]) -> dict[str, Any]:
            take(args.get("properties"), "set-properties.properties")
            return {"node_id": self.launch.id, "known": len(self.properties)}

        def transition(args: dict[str, Any]) -> dict[str, Any]:
            names = args.get("transitions")
            if names is not None:
                str_list(names, "transition.transitions", 8, 32)
            name = opt_str(args, "transition", "transition", 32) or ""
            # a restarted device's BIND carries the endpoints it bound before (startup.py)
            take(args.get("properties"), "transition.properties")
            if names is not None:  # the start-up walk: a sequence, taken in order
                return take_sequence(device, self.launch.id, names)
            if name.upper() == "STOP":
                self.stop_requested = True
            return client._transition(device, name)

        def peer_lost(args: dict[str, Any]) -> dict[str, Any]:
            peer = opt_str(args, "peer", "peer-lost", 200) or ""
            handler = getattr(device, "peer_lost", None)
            if handler is not None and peer:
                handler(peer)
            return {"node_id": self.launch.id, "peer": peer, "handled": handler is not None}

        client.handle("check-state", check_state)
        client.handle("ping", check_state)
        client.handle("set-properties", set_properties)
        client.handle("transition", transition)

        def peer_ended(args: dict[str, Any]) -> dict[str, Any]:
            peers = args.get("peers")
            handler = getattr(device, "peer_ended", None)
            if handler is not None and isinstance(peers, list):
                for peer in peers:
                    if isinstance(peer, str) and peer:
                        handler(peer)
            return {"node_id": self.launch.id, "handled": handler is not None}

        client.handle("peer-lost", peer_lost)
        client.handle("peer-ended", peer_ended)

        def on_change(old: State, new: State, _: Any) -> None:
            if new is State.RUNNING and self.client._next_metrics_s == math.inf:
                self.client._next_metrics_s = time.monotonic() + random.random()
            # the loop ended by itself (not on a STOP from the bus): walk on down
            if old is State.RUNNING and new is State.READY and not self.stop_requested:
                device.request_shutdown()

        device.fsm.subscribe(on_change)


def take_sequence(device: Any, node_id: str, names: list[Any]) -> dict[str, Any]:
    """Queue a start-up sequence (e.g. INIT_DEVICE, COMPLETE_INIT, BIND) for the device's
    loop, after checking that each one is allowed from the state the one before leads
    to (an -ING state's AUTO move included); nothing is queued if one is not."""
    from evflow.errors import StateTransitionError
    from evflow.runtime.states import AUTO_STATES, Transition, next_state, parse_transition

    if not names or len(names) > len(STARTUP_SEQUENCE):
        raise StateTransitionError(f"{node_id}: a sequence of 1 to 6 transitions expected")
    state: State | None = device.fsm.state
    before = str(state)
    plan = []
    for name in names:
        transition = parse_transition(str(name))
        if transition not in STARTUP_SEQUENCE:
            raise StateTransitionError(f"{node_id}: {transition} is not a start-up transition")
        state = next_state(state, transition) if state is not None else None
        while state in AUTO_STATES:
            state = next_state(state, Transition.AUTO)
        if state is None:
            raise StateTransitionError(f"{node_id}: no transition from {before} on {names}")
        plan.append(transition)
    for transition in plan:
        device.request(transition)
    return {
        "node_id": node_id,
        "transition": ",".join(str(t) for t in plan),
        "previous_state": before,
        "accepted": True,
    }


def run_node(
    launch_data: dict[str, Any],
    bus: str,
    session: str,
    connect_timeout_s: float,
    stats_dir: str,
    first_steps: tuple[str, ...] = (),
) -> int:
    """Process entry point (forked by the agent's zygote): run one device to EXITING.

    ``first_steps``: transitions the device takes at once (the start-up walk's first
    step, sent with the spawn), as soon as what it publishes reaches the bus."""
    from evflow.runtime.runner import load_device_class

    launch = ResolvedDevice.from_wire(launch_data)
    state: dict[str, Any] = {"device": None, "signals": 0}

    def on_term(signum: int, frame: Any) -> None:
        state["signals"] += 1
        if state["signals"] > 1:
            os._exit(130)
        if state["device"] is not None:
            state["device"].request_shutdown()

    signal.signal(signal.SIGTERM, on_term)
    # a SIGTERM wakes the device's wait for its next command (so that wait can be long)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    cls = load_device_class(launch.cls)
    context: zmq.Context[Any] = zmq.Context()
    client = BusClient(context, launch.id, bus, confirm=bool(first_steps))
    client.wake_fd = wake_r
    # no metrics before RUNNING (the states tell the controller all it needs during the
    # start-up walk); then hundreds of devices spread their once-a-second metrics over
    # the second instead of every one taking a psutil snapshot at the same moment
    client._next_metrics_s = math.inf
    device = None
    code = 1
    try:
        exchange = Exchange(client, launch, connect_timeout_s)
        device = cls(
            launch.id,
            exchange.bind_configs(),
            session=session,
            rate_hz=launch.rate,
            max_iterations=launch.max_iterations,
            context=context,
            **launch.params,
        )
        device.exchange = exchange
        if launch.restart != "never":  # its counts and ENDs outlive a killed process
            from evflow.transport.paths import session_dir

            device.stream_dir = session_dir(session)
        exchange.attach(device)
        device.attach_bus(client)
        state["device"] = device
        if state["signals"]:
            device.request_shutdown()
        if first_steps:
            _wait_heard(client, device)
        client.publish_state(device)
        if first_steps and not device.shutdown_requested:
            try:
                data = take_sequence(device, launch.id, list(first_steps))
            except EvflowError as exc:  # a bad spawn request: the controller walks us
                log.error("device %s: first steps %s refused: %s", launch.id, first_steps, exc)
            else:  # the controller's send of this step (a fallback) is not taken twice
                req = walk_request(first_steps[0])
                client.mark_answered(req, "transition", data, CONTROLLER_ID)
        code = device.run("interactive")
        if isinstance(device.error, IncompleteStreamError):
            code = FINAL_EXIT
    finally:
        _report(client, launch, device, stats_dir)
        client.close()
        context.destroy(linger=200)  # the last report gets 200 ms to leave
    return code


def _wait_heard(client: BusClient, device: Any) -> None:
    """Until the controller hears our states (what a publisher sends before the bus
    proxy's subscriptions arrive is dropped), a shutdown, or HEARD_TIMEOUT_S (then the
    controller's own fallbacks find us: it asks silent devices for their state)."""
    deadline = time.monotonic() + HEARD_TIMEOUT_S
    while not device.shutdown_requested and time.monotonic() < deadline:
        if client.wait_heard((MsgType.STATE, MsgType.REPLY), 0.05):
            return


def _report(client: BusClient, launch: ResolvedDevice, device: Any, stats_dir: str) -> None:
    """The last word of a device: its summary and error on the bus (and in stats_dir)."""
    summary: dict[str, Any] = {}
    error = None
    if device is not None:
        try:
            summary = json.loads(json.dumps(device.summary(), default=str))
        except Exception as exc:  # a broken summary() must not hide the exit
            summary = {"summary_error": str(exc)}
        if device.error is not None:
            error = f"{type(device.error).__name__}: {device.error}"
    summary["host"] = launch.host
    if stats_dir:
        path = Path(stats_dir) / f"{launch.id}.json"
        try:
            path.write_text(json.dumps(summary))
        except OSError as exc:
            log.error("device %s: cannot write %s: %s", launch.id, path, exc)
    final_state = str(device.fsm.state) if device is not None else "ERROR"
    header: dict[str, Any] = {
        "from": launch.id,
        "metrics": {"node_id": launch.id, "node_state": final_state},
    }
    header.update(summary=summary, error=error, final=True)
    client.publish(MsgType.METRICS, header)

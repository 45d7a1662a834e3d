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
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import zmq

from evflow.errors import PeerLostError
from evflow.runtime.busclient import BusClient
from evflow.runtime.states import State
from evflow.topology.protocol import CONTROLLER_ID
from evflow.topology.resolve import ResolvedChannel, ResolvedDevice
from evflow.transport.channel_config import ChannelConfig
from evflow.wire.messages import MsgType

log = logging.getLogger("evflow.topology")

_ASK_EVERY_S = 0.5


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

        def take(props: Any) -> None:
            if isinstance(props, dict):
                for key, urls in props.items():
                    if isinstance(key, str) and isinstance(urls, list):
                        self.properties[key] = [str(u) for u in urls]

        def set_properties(args: dict[str, Any]) -> dict[str, Any]:
            take(args.get("properties"))
            return {"node_id": self.launch.id, "known": len(self.properties)}

        def transition(args: dict[str, Any]) -> dict[str, Any]:
            # a restarted device's BIND carries the endpoints it bound before (startup.py)
            take(args.get("properties"))
            name = str(args.get("transition", ""))
            if name.upper() == "STOP":
                self.stop_requested = True
            return client._transition(device, name)

        def peer_lost(args: dict[str, Any]) -> dict[str, Any]:
            peer = str(args.get("peer", ""))
            handler = getattr(device, "peer_lost", None)
            if handler is not None and peer:
                handler(peer)
            return {"node_id": self.launch.id, "peer": peer, "handled": handler is not None}

        client.handle("check-state", check_state)
        client.handle("ping", check_state)
        client.handle("set-properties", set_properties)
        client.handle("transition", transition)
        client.handle("peer-lost", peer_lost)

        def on_change(old: State, new: State, _: Any) -> None:
            # the loop ended by itself (not on a STOP from the bus): walk on down
            if old is State.RUNNING and new is State.READY and not self.stop_requested:
                device.request_shutdown()

        device.fsm.subscribe(on_change)


def run_node(
    launch_data: dict[str, Any],
    bus: str,
    session: str,
    connect_timeout_s: float,
    stats_dir: str,
) -> int:
    """Process entry point (forked by the agent's zygote): run one device to EXITING."""
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
    cls = load_device_class(launch.cls)
    context: zmq.Context[Any] = zmq.Context()
    client = BusClient(context, launch.id, bus)
    # hundreds of devices start together: spread their once-a-second metrics over the
    # second instead of every one taking a psutil snapshot at the same moment
    client._next_metrics_s = time.monotonic() + random.random()
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
        exchange.attach(device)
        device.attach_bus(client)
        state["device"] = device
        if state["signals"]:
            device.request_shutdown()
        client.publish_state(device)
        code = device.run("interactive")
    finally:
        _report(client, launch, device, stats_dir)
        client.close()
        context.destroy(linger=200)  # the last report gets 200 ms to leave
    return code


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
    header = {"from": launch.id, "metrics": {"node_id": launch.id, "node_state": final_state}}
    header.update(summary=summary, error=error, final=True)
    client.publish(MsgType.METRICS, header)

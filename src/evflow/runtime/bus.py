"""The control bus: an XPUB/XSUB proxy every process publishes to and subscribes from.

::

    node PUB --connect--> [XSUB  bus-in.ipc]  proxy  [XPUB bus-out.ipc] <--connect-- SUB
                                               |
                      validates every message, drops and counts bad bytes

Every message is a wire-protocol message (:mod:`evflow.wire.messages`); its first frame
is the type byte, so subscribers filter by type (nodes subscribe to COMMAND, the
controller to REPLY/STATE/METRICS). Headers (msgpack maps):

- COMMAND ``{cmd, to, req, from, ts, args}``: ``to`` is a node id, a list of ids or
  ``"*"`` (all); an optional ``select`` regular expression must match the whole id;
  ``quiet: true`` asks for no REPLY (the command is still executed once);
  ``cmd`` is ``check-state``, ``get-metrics``, ``transition`` (``args.transition``) or
  ``ping``.
- REPLY ``{req, cmd, from, to, ok, data | error}``.
- STATE ``{from, state, previous, ts}`` on every state change.
- METRICS ``{from, metrics}`` about once a second.

The proxy binds ``ipc://bus-in.ipc`` and ``ipc://bus-out.ipc`` in the session
directory, so ``evflow ctl`` finds a local bus without being told; pass tcp addresses
to reach it from other hosts. The proxy answers commands itself as node ``"bus"``.
Node clients live in :mod:`evflow.runtime.busclient`, the controller in
:mod:`evflow.runtime.buscontrol`; all are importable from here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import zmq

from evflow.runtime.busclient import (
    BUS_IN,
    BUS_OUT,
    PROXY_ID,
    BusClient,
    BusEndpoints,
    find_bus_sessions,
)
from evflow.runtime.buscontrol import BusController
from evflow.runtime.metrics import ProcessMetrics
from evflow.transport.channel import Channel, ChannelConfig
from evflow.transport.opening import open_channel
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message

__all__ = [
    "BUS_IN",
    "BUS_OUT",
    "PROXY_ID",
    "BusClient",
    "BusController",
    "BusEndpoints",
    "BusProxy",
    "find_bus_sessions",
    "run_bus_proxy",
]

POLL_MS = 100


def _open_bound(
    context: zmq.Context[Any], session: str, name: str, type: str, address: str
) -> Channel:
    """One side of the proxy: bound, linger 0, high-water marks of 10000 messages."""
    return open_channel(
        context,
        ChannelConfig(
            name=name,
            type=type,
            method="bind",
            address=address,
            linger=0,
            rcvBufSize=10000,
            sndBufSize=10000,
        ),
        session,
    )


class BusProxy:
    """Forward bus traffic between XSUB (publishers) and XPUB (subscribers).

    Runs in the caller's thread (:meth:`run`), in a thread (:meth:`start_thread`) or as
    its own process (:func:`run_bus_proxy`). Messages that fail wire-protocol decoding
    are counted in ``bad`` and dropped, so no subscriber ever sees them.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        session: str,
        *,
        publish_address: str = f"ipc://{BUS_IN}",
        subscribe_address: str = f"ipc://{BUS_OUT}",
    ) -> None:
        self.session = session
        # ipc and tcp on separate sockets: with farm CURVE keys the tcp side is a CURVE
        # server, while local clients (the controller, evflow status) stay on plain ipc
        self._xsubs: list[Channel] = []
        self._xpubs: list[Channel] = []
        try:
            for part in _by_scheme(publish_address):
                self._xsubs.append(_open_bound(context, session, "bus-in", "xsub", part))
            for part in _by_scheme(subscribe_address):
                self._xpubs.append(_open_bound(context, session, "bus-out", "xpub", part))
        except BaseException:
            for ch in self._xsubs + self._xpubs:
                ch.close(0)
            raise
        self._xsub, self._xpub = self._xsubs[0], self._xpubs[0]
        # topic -> the XPUB sockets with a subscriber to it (an unsubscribe goes upstream
        # only when no XPUB has one left)
        self._topics: dict[bytes, set[int]] = {}
        self.endpoints = BusEndpoints(self._xsub.endpoints[0], self._xpub.endpoints[0])
        self.bad = BadMessageCounter(f"bus proxy {session}")
        self.forwarded = 0
        self.started_s = time.time()
        # get-metrics: the proxy's own traffic, buffers, RSS and CPU (of the process it
        # runs in: its own, or the supervisor's when it runs as a thread there)
        self._metrics = ProcessMetrics(PROXY_ID)
        self._metrics.add_channels([*self._xsubs, *self._xpubs])
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.closed = False

    def __repr__(self) -> str:
        return f"<BusProxy {self.endpoints} forwarded={self.forwarded} bad={self.bad.total}>"

    def stop(self) -> None:
        """Ask the loop to end (safe from a signal handler or another thread)."""
        self._stop.set()

    def run(self) -> None:
        """Forward until :meth:`stop`; then return (sockets stay open until close())."""
        poller = zmq.Poller()
        sides: dict[Any, tuple[bool, Channel]] = {}
        for ch in self._xsubs:
            poller.register(ch.socket, zmq.POLLIN)
            sides[ch.socket] = (True, ch)
        for ch in self._xpubs:
            poller.register(ch.socket, zmq.POLLIN)
            sides[ch.socket] = (False, ch)
        while not self._stop.is_set():
            for sock, _ in poller.poll(POLL_MS):
                inbound, ch = sides[sock]
                if inbound:
                    self._forward_messages(ch)
                else:
                    self._forward_subscriptions(ch)

    def _forward_messages(self, xsub: Channel) -> None:
        for _ in range(1000):
            try:
                frames = xsub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.bad.decode(frames)
            if msg is None:
                continue
            for xpub in self._xpubs:
                xpub.send(frames)
            self.forwarded += 1
            if msg.type is MsgType.COMMAND:
                self._answer(msg.header)

    def _forward_subscriptions(self, xpub: Channel) -> None:
        side = self._xpubs.index(xpub)
        for _ in range(1000):
            try:
                frames = xpub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            first = bytes(frames[0]) if frames else b""
            if len(frames) != 1 or not first or first[0] not in (0, 1):
                self.bad.record("bad-subscription", f"{len(frames)} frame(s), {first[:16]!r}")
                continue
            holders = self._topics.setdefault(first[1:], set())
            before = bool(holders)
            (holders.add if first[0] == 1 else holders.discard)(side)
            if bool(holders) == before and len(self._xpubs) > 1:
                continue  # another XPUB still (or already) has a subscriber to it
            for xsub in self._xsubs:
                xsub.send([first])

    def _answer(self, header: dict[Any, Any]) -> None:
        """Reply to commands addressed to the proxy itself (or to all)."""
        if header.get("to") not in (PROXY_ID, "*"):
            return
        cmd = header.get("cmd")
        if cmd not in ("check-state", "get-metrics", "ping"):
            return
        now = time.time()
        data: dict[str, Any] = {
            "node_id": PROXY_ID,
            "node_state": "RUNNING",
            "pid": os.getpid(),
            "request_timestamp": header.get("ts", now),
            "response_timestamp": now,
        }
        if cmd == "get-metrics":
            data = self._metrics.snapshot(
                "RUNNING",
                data["request_timestamp"],
                {
                    "messages_forwarded": self.forwarded,
                    "bad_messages": self.bad.total,
                    "bad_message_kinds": dict(self.bad.counts),
                    "uptime_s": round(now - self.started_s, 3),
                    "endpoints": str(self.endpoints),
                    # every endpoint (e.g. ipc and a tcp port picked at bind), for other hosts
                    "publish_endpoints": [e for ch in self._xsubs for e in ch.endpoints],
                    "subscribe_endpoints": [e for ch in self._xpubs for e in ch.endpoints],
                    # CURVE refusals on the tcp side (a farm's agents with a wrong key)
                    "refusals": [
                        {"peer": peer, "reason": reason} for peer, reason in self.refusals()
                    ],
                },
            )
        reply = {
            "req": header.get("req"),
            "cmd": cmd,
            "from": PROXY_ID,
            "to": header.get("from"),
            "ok": True,
            "data": data,
        }
        for xpub in self._xpubs:
            xpub.send(encode_message(MsgType.REPLY, reply))

    def refusals(self) -> list[tuple[str, str]]:
        """The first CURVE refusals (peer, reason) on the tcp side (bad keys, plaintext)."""
        return [
            refusal
            for ch in self._xsubs + self._xpubs
            if ch.security is not None
            for refusal in list(ch.security.refused_peers)
        ]

    def winding_down(self) -> None:
        """The run is ending: a peer that leaves in the middle of its CURVE handshake
        is a process ending with it, not a refusal (``transport/curve.py``)."""
        for ch in self._xsubs + self._xpubs:
            if ch.security is not None:
                ch.security.winding_down()

    def start_thread(self) -> threading.Thread:
        """Run the proxy in a daemon thread; :meth:`close` stops and joins it."""
        self._thread = threading.Thread(target=self.run, name="evflow-bus-proxy", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Stop the loop, close both sockets and remove the ipc files."""
        if self.closed:
            return
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.closed = True
        for ch in self._xsubs + self._xpubs:
            ch.close(0)

    def __enter__(self) -> BusProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _by_scheme(address: str) -> list[str]:
    """``ipc://a;tcp://*:0`` -> ``["ipc://a", "tcp://*:0"]`` (local endpoints first)."""
    parts = [p for p in address.split(";") if p]
    local = ";".join(p for p in parts if not p.startswith("tcp://"))
    remote = ";".join(p for p in parts if p.startswith("tcp://"))
    return [a for a in (local, remote) if a] or [address]


def run_bus_proxy(
    session: str,
    publish_address: str = f"ipc://{BUS_IN}",
    subscribe_address: str = f"ipc://{BUS_OUT}",
) -> int:
    """Process entry point (e.g. ``zygote.spawn(run_bus_proxy, session)``).

    Runs until SIGTERM or SIGINT, then closes its sockets and removes its ipc files.
    """
    context: zmq.Context[Any] = zmq.Context()
    try:
        proxy = BusProxy(
            context, session, publish_address=publish_address, subscribe_address=subscribe_address
        )
    except BaseException:
        context.term()
        raise
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: proxy.stop())
    try:
        proxy.run()
    finally:
        proxy.close()
        with contextlib.suppress(zmq.ZMQError):
            context.term()
    return 0

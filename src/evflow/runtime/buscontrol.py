"""The controller side of the control bus: send a command, collect the replies.

Used by ``evflow ctl`` and the supervisor. A node that does not answer within the
timeout is one clear :class:`~evflow.errors.TimeoutError_`, never a hang.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from evflow.errors import PeerLostError, TimeoutError_
from evflow.runtime.busclient import BusEndpoints, open_bus_sockets
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message

__all__ = ["BusController"]


class BusController:
    """Sends commands on the bus and collects replies (``evflow ctl``, the supervisor)."""

    def __init__(
        self, context: zmq.Context[Any], endpoints: BusEndpoints | str, *, name: str = ""
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = BusEndpoints.parse(endpoints)
        self.endpoints = endpoints
        self.name = name or f"ctl-{os.getpid()}-{id(self) % 100000}"
        topics = (MsgType.COMMAND, MsgType.REPLY, MsgType.STATE, MsgType.METRICS)
        self._pub, self._sub = open_bus_sockets(context, endpoints, "ctl", topics)
        self._seq = itertools.count(1)
        self._connected = False
        self.bad = BadMessageCounter(f"bus controller {self.name}")
        #: node ids seen on the bus (replies, states, metrics) -> last state
        self.seen: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"<BusController {self.name!r} {self.endpoints}>"

    def _recv(self, timeout_s: float) -> Any:
        if not self._sub.poll(max(0, int(timeout_s * 1000))):
            return None
        msg = self.bad.decode(self._sub.recv())
        if msg is None:
            return None
        sender = msg.header.get("from")
        if isinstance(sender, str):
            if msg.type is MsgType.STATE:
                self.seen[sender] = str(msg.header.get("state"))
            elif msg.type is MsgType.METRICS:
                state = (msg.header.get("metrics") or {}).get("node_state")
                self.seen[sender] = str(state) if state is not None else self.seen.get(sender, "")
            elif msg.type is MsgType.REPLY:
                self.seen.setdefault(sender, "")
        return msg

    def connect(self, timeout_s: float = 2.0) -> None:
        """Wait until our own message comes back through the proxy (both paths work)."""
        if self._connected:
            return
        deadline = time.monotonic() + timeout_s
        req = f"{self.name}-ping"
        while time.monotonic() < deadline:
            self._pub.send(
                encode_message(
                    MsgType.COMMAND, {"cmd": "ping", "to": self.name, "req": req, "from": self.name}
                )
            )
            until = min(deadline, time.monotonic() + 0.05)
            while (left := until - time.monotonic()) > 0:
                msg = self._recv(left)
                if msg is not None and msg.type is MsgType.COMMAND and msg.header.get("req") == req:
                    self._connected = True
                    return
        raise PeerLostError(
            f"the control bus at {self.endpoints} does not answer within {timeout_s} s "
            "(is the proxy running? see `evflow up` / the supervisor)"
        )

    def request(
        self,
        cmd: str,
        to: str = "*",
        args: dict[str, Any] | None = None,
        *,
        timeout_s: float = 2.0,
        resend_s: float = 0.5,
        abort: Callable[[], bool] | None = None,
        select: str | None = None,
    ) -> list[dict[str, Any]]:
        """Send ``cmd`` and return the reply headers.

        ``to`` a node id: returns as soon as it answered (the command is re-sent every
        ``resend_s``; nodes answer a repeated request id from a cache, never twice);
        raises TimeoutError_ naming the node and the nodes seen if none answered.
        ``to="*"``: collects every reply that arrives within ``timeout_s``.
        ``abort()`` is checked every 0.1 s; when True the call returns what it has.
        ``select`` (a regular expression) limits ``to="*"`` to the nodes whose whole id
        matches it.
        """
        self.connect(timeout_s)
        req = f"{self.name}-{next(self._seq)}"
        header = {
            "cmd": cmd,
            "to": to,
            "req": req,
            "from": self.name,
            "ts": time.time(),
            "args": args or {},
        }
        if select is not None:
            header["select"] = select
        frames = encode_message(MsgType.COMMAND, header)
        replies: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        next_send = 0.0
        while (now := time.monotonic()) < deadline:
            if now >= next_send and (to == "*" or not replies):
                self._pub.send(frames)
                next_send = now + resend_s
            if abort is not None and abort():
                return list(replies.values())
            wait_s = min(deadline, next_send) - now
            msg = self._recv(wait_s if abort is None else min(wait_s, 0.1))
            if msg is None or msg.type is not MsgType.REPLY or msg.header.get("req") != req:
                continue
            sender = str(msg.header.get("from"))
            if to != "*":
                return [dict(msg.header)]
            replies.setdefault(sender, dict(msg.header))  # the first answer; repeats are echoes
        if to != "*":
            seen = ", ".join(sorted(self.seen)) or "none"
            raise TimeoutError_(
                f"no node {to!r} answered {cmd!r} within {timeout_s} s "
                f"(nodes seen on the bus: {seen}; is the id right?)"
            )
        return [replies[k] for k in sorted(replies)]

    def wait_state(self, node_id: str, states: set[str], timeout_s: float) -> str | None:
        """Ask ``node_id`` for its state until it is in ``states``; None on timeout."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = self.request("check-state", node_id, timeout_s=min(left, 1.5))[0]
            except TimeoutError_:
                continue
            state = str((reply.get("data") or {}).get("node_state"))
            if state in states:
                return state
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return None

    def close(self) -> None:
        self._sub.close(0)
        self._pub.close(0)

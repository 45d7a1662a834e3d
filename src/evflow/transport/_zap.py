"""The ZAP handler of :mod:`evflow.transport.curve`, imported only when a CURVE server
socket needs it: pyzmq's auth thread pulls in asyncio (~17 ms of every process start
that never serves CURVE: the controller, agents, devices without keys)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import zmq
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

if TYPE_CHECKING:
    from evflow.transport.curve import CurveSecurity


class _Zap(ThreadAuthenticator):
    """pyzmq's ZAP thread, which also reports each refusal with the peer's address."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        super().__init__(context, log=logging.getLogger("evflow.curve.zap"))
        self.users = 0
        self.guards: dict[str, CurveSecurity] = {}
        self._request: tuple[str, str, bytes] = ("", "", b"")

    def handle_zap_message(self, msg: list[bytes]) -> Any:
        domain = msg[2].decode(errors="replace") if len(msg) > 2 else ""
        address = msg[3].decode(errors="replace") if len(msg) > 3 else ""
        self._request = (domain, address, msg[6] if len(msg) > 6 else b"")
        return super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:  # fmt: skip
        if status_code != b"200":
            domain, address, key = self._request
            guard = self.guards.get(domain)
            if guard is not None:
                z85 = zmq.utils.z85.encode(key).decode() if len(key) == 32 else "none"
                guard.refused(address, f"client key {z85} not in the allow-list")
        super()._send_zap_reply(request_id, status_code, status_text, user_id)

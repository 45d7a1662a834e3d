"""Server-sent events: one producer per topic, any number of listeners.

A :class:`Topic` recomputes its payload at most every ``interval_s`` (only when the
source says something changed), serialises it once, and wakes every waiting client;
a client that connects late gets the latest payload at once. So 100 browsers cost one
JSON encoding per update, not 100, and a client that goes away only ends its own
generator (starlette cancels it on ``http.disconnect``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

log = logging.getLogger("evflow.monitor.web")

#: a comment line this often keeps proxies from closing an idle stream
KEEPALIVE_S = 15.0


class Topic:
    """One stream (``run`` or ``qc``): ``build()`` gives the payload, ``changed()`` a token
    that differs when a new payload is due (e.g. the store's version)."""

    def __init__(
        self,
        name: str,
        build: Callable[[], Any],
        changed: Callable[[], Any],
        interval_s: float = 0.5,
    ) -> None:
        self.name = name
        self.build = build
        self.changed = changed
        self.interval_s = interval_s
        self.seq = 0
        self.payload = b""
        self.clients = 0
        self.errors = 0
        self._cond: asyncio.Condition | None = None
        self._last_token: Any = object()
        self.closing = False

    async def run(self) -> None:
        """The producer loop (one task per topic, started by the app's lifespan)."""
        self._cond = asyncio.Condition()
        while not self.closing:
            try:
                token = self.changed()
                if token != self._last_token:
                    self._last_token = token
                    data = json.dumps(self.build(), separators=(",", ":"), allow_nan=False)
                    async with self._cond:
                        self.payload = data.encode()
                        self.seq += 1
                        self._cond.notify_all()
            except Exception as exc:  # a bad figure must not end the stream for everyone
                self.errors += 1
                if self.errors == 1:
                    log.warning(
                        "dashboard topic %s failed: %s: %s", self.name, type(exc).__name__, exc
                    )
            await asyncio.sleep(self.interval_s)
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()

    async def stream(self) -> AsyncIterator[bytes]:
        """One client's events: the latest payload now, then each new one."""
        self.clients += 1
        seen = 0
        try:
            yield b"retry: 2000\n\n"
            while not self.closing:
                if self.seq != seen and self.payload:
                    seen = self.seq
                    yield b"event: " + self.name.encode() + b"\ndata: " + self.payload + b"\n\n"
                    continue
                cond = self._cond
                if cond is None:
                    await asyncio.sleep(0.1)
                    continue
                async with cond:
                    try:
                        await asyncio.wait_for(cond.wait(), KEEPALIVE_S)
                    except TimeoutError:
                        yield b": keepalive\n\n"
        finally:
            self.clients -= 1

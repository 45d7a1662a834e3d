"""The roles of a parallel run as nodes on the run's control bus.

Every role process (``input``, ``output``, each worker) owns one :class:`RoleBus`:
a :class:`~evflow.runtime.busclient.BusClient` on the run's bus
(``BusEndpoints.for_session(session)``, the proxy the caller started) with the role's
name as node id. A worker's replacements (``worker-3.1``, ``worker-3.2``) answer as
``worker-3``, so ``evflow ctl get-metrics worker-3`` works across restarts; the
process name is in the metrics (``process_name``).

States published (FairMQ names, :mod:`evflow.runtime.states`): INITIALIZING_TASK
while the role's modules initialise, RUNNING in its loop, EXITING when it closes,
ERROR when it fails. Commands: ``check-state``, ``ping``, ``get-metrics`` (the
ProcessMetrics snapshot plus the role's own counters); metrics are published about
once a second.

Nothing per event: the role's loop calls :meth:`RoleBus.tick` once per iteration; it
returns after one clock read unless ``TICK_S`` has passed. An idle worker waits in
:meth:`RoleBus.wait` (a poll over its data socket and the bus socket), so it answers
while no event comes. The bus never blocks or crashes a role: the PUB socket drops
when congested, bad command bytes are counted and dropped (BusClient), and any other
failure in the bus code is counted in ``errors`` and logged once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import zmq

from evflow.runtime.busclient import BusClient, BusEndpoints
from evflow.runtime.states import State

log = logging.getLogger("evflow.parallel.bus")

#: a busy role looks at the bus at most this often (s): the latency of an answer
TICK_S = 0.05
#: an idle worker wakes at least this often (ms) to publish its metrics
IDLE_WAIT_MS = 250


def wait_ms(seconds: float, cap_ms: int = IDLE_WAIT_MS) -> int:
    """A poll timeout: ``seconds`` from now rounded up to milliseconds, 0 when past,
    at most ``cap_ms`` (``seconds`` may be infinite: nothing is due)."""
    if seconds * 1000 >= cap_ms:
        return cap_ms
    return max(0, math.ceil(seconds * 1000))


#: the first metrics (a psutil snapshot, ~1.5 ms of CPU in a fresh fork) wait this
#: long (s), so that 32 workers starting on 2 cores do not pay it while they start
FIRST_METRICS_S = 1.0


#: counters whose rates ProcessMetrics publishes (the rest goes to the reply as is)
_RATED = ("events_in", "events_out", "messages_in", "messages_out")


def node_id_of(name: str) -> str:
    """The bus node id of the role process ``name``: ``worker-3.2`` -> ``worker-3``."""
    if name.startswith("worker-"):
        return name.split(".", 1)[0]
    return name


class RoleBus:
    """One role's node on the run's control bus (see the module docstring).

    ``counters`` (set by the role) returns the role's counters as a dict; its
    ``events_in``, ``events_out``, ``messages_in`` and ``messages_out`` feed the
    published rates, ``receive_queue`` and ``send_queue`` (``(size, capacity)`` of what
    the role holds) the buffer fields, everything else is added to the ``get-metrics``
    reply as is.
    It is called at most once per tick and per command, never per event.
    """

    def __init__(self, ctx: zmq.Context[Any], session: str, name: str) -> None:
        self.name = name
        self.node_id = node_id_of(name)
        self.state = str(State.INITIALIZING_TASK)
        self.counters: Callable[[], dict[str, Any]] | None = None
        self.errors = 0
        self._extra: dict[str, Any] = {}
        self._next_s = 0.0
        self._metrics_from_s = time.monotonic() + FIRST_METRICS_S
        self._poller: zmq.Poller | None = None
        self._polled: Any = None
        self.client: BusClient | None = None
        try:
            self.client = BusClient(
                ctx, self.node_id, BusEndpoints.for_session(session), state=self._get_state
            )
        except Exception as exc:  # no bus: the role runs without one
            self._failed("open", exc)
            return
        self._publish_state(None)

    def __repr__(self) -> str:
        return f"<RoleBus {self.node_id!r} {self.state} errors={self.errors}>"

    def _get_state(self) -> str:
        return self.state

    @property
    def socket(self) -> zmq.Socket[Any] | None:
        """The bus client's SUB socket (readable when a command may be pending)."""
        return self.client.socket if self.client is not None else None

    def set_state(self, state: State | str) -> None:
        """Change the published state (sent on the bus at once)."""
        new = str(state)
        if new == self.state:
            return
        old, self.state = self.state, new
        self._publish_state(old)

    def running(self) -> None:
        """The role's modules are initialised and its loop starts: RUNNING."""
        self.set_state(State.RUNNING)

    def _publish_state(self, old: str | None) -> None:
        if self.client is None:
            return
        try:
            self.client.publish_state(old=old, new=self.state)
        except Exception as exc:
            self._failed("publish", exc)

    # --- the loop's side ------------------------------------------------------------
    def tick(self, now_s: float | None = None) -> None:
        """Once per loop iteration: answer commands, publish metrics when due.

        Costs one clock read (none when the caller passes ``now_s``) unless ``TICK_S``
        passed since the last time it did the work.
        """
        now = time.monotonic() if now_s is None else now_s
        if now < self._next_s:
            return
        self._next_s = now + TICK_S
        self._serve(now)

    def wait(self, sock: zmq.Socket[Any], timeout_ms: int = IDLE_WAIT_MS) -> bool:
        """Wait up to ``timeout_ms`` for ``sock`` to be readable, serving the bus
        meanwhile; True when ``sock`` is readable. A worker calls it before every
        receive: one poll over two sockets and, if no command came, one clock read."""
        if self.client is None:
            return bool(sock.poll(timeout_ms))
        if self._poller is None or self._polled is not sock:
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(self.client.socket, zmq.POLLIN)
            self._polled = sock
        readable = command = False
        for s, _ in self._poller.poll(timeout_ms):
            if s is sock:
                readable = True
            else:
                command = True
        if command:
            self.serve_now()
        else:
            self.tick()
        return readable

    def serve_now(self) -> None:
        """The bus socket was readable (a command may wait): answer now, not at the
        next tick. Roles that poll several sockets register :attr:`socket` too."""
        now = time.monotonic()
        self._next_s = now + TICK_S
        self._serve(now)

    def _serve(self, now_s: float) -> None:
        client = self.client
        if client is None:
            return
        try:
            self._refresh()
        except Exception as exc:  # a bug in the role's counters: answer without them
            self._failed("counters", exc)
        try:
            if now_s >= self._metrics_from_s:
                client.tick(self, now_s)  # metrics when due, then commands
            else:
                client.poll(self)  # commands only (start-up)
        except Exception as exc:  # the bus must never take a role down
            self._failed("tick", exc)

    def _refresh(self) -> None:
        """The role's counters into the client's ProcessMetrics (for rates) and extra."""
        if self.counters is None or self.client is None:
            return
        extra = dict(self.counters())
        m = self.client.metrics
        for key in _RATED:
            if key in extra:
                setattr(m, key, int(extra.pop(key)))
        for which in ("receive", "send"):  # (size, capacity) of what the role holds
            queue = extra.pop(f"{which}_queue", None)
            if queue is not None:
                m.set_queue(which, *queue)
        self._extra = extra

    def metrics(self) -> dict[str, Any]:
        """What BusClient adds to a snapshot (``node.metrics()``): the role's counters."""
        return {
            "role": self.node_id.split("-", 1)[0],
            "process_name": self.name,
            "bus_errors": self.errors,
            **self._extra,
        }

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning(
                "%s: control bus %s failed (%s: %s); counted from now on",
                self.node_id,
                what,
                type(exc).__name__,
                exc,
            )

    # --- the end --------------------------------------------------------------------
    def close(self, state: State | str = State.EXITING) -> None:
        """Publish the final metrics, then ``state`` (EXITING, or ERROR when failing),
        and close the client."""
        if self.client is None:
            return
        try:  # the final counters: a collector's totals must match what the role did
            self._refresh()
            self.client.publish_metrics(self)
        except Exception as exc:
            self._failed("final metrics", exc)
        if self.state != str(State.ERROR):
            self.set_state(state)
        client, self.client = self.client, None
        try:
            client.close()
        except Exception as exc:
            self._failed("close", exc)

"""The controller's start-up steps: bus, agents, spawn, FairMQ's sequence, restarts.

A part of :class:`evflow.topology.controller.Controller` (it inherits these), kept
apart so that each file has one job: this one brings devices *to* RUNNING (at start-up
for all of them, later for a device its agent restarted); the controller watches and
stops them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from evflow.errors import PeerLostError, TimeoutError_
from evflow.runtime.busclient import BusEndpoints
from evflow.topology.intake import ControllerBus
from evflow.topology.launch.base import AgentHandle
from evflow.topology.protocol import CONTROLLER_ID
from evflow.topology.records import RANK, DeviceRecord, HostRecord
from evflow.topology.resolve import ResolvedTopology
from evflow.topology.security import BusRefusals, FarmSecurity
from evflow.topology.walk import STAGES
from evflow.transport.address import connectable

__all__ = ["STAGES", "StartupSteps", "route_source"]

log = logging.getLogger("evflow.topology")

_RESEND_S = 0.4


class StartupSteps:
    """Start-up steps of the controller (see the module docstring)."""

    topology: ResolvedTopology
    records: dict[str, DeviceRecord]
    hosts: dict[str, HostRecord]
    handles: dict[str, AgentHandle]
    bus: ControllerBus | None
    local: bool
    stats_dir: str
    connect_timeout_s: float
    start_timeout_s: float
    started_s: float
    security: FarmSecurity | None
    launcher: Any
    preload: tuple[str, ...]
    session: str

    def _agent_env(self, host: str) -> dict[str, str]:
        raise NotImplementedError

    def _tick(self, timeout_s: float) -> None:
        raise NotImplementedError

    def _check_interrupt(self) -> None:
        raise NotImplementedError

    def _wait_bus(self) -> None:
        assert self.bus is not None
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            req = self.bus.send("ping", CONTROLLER_ID)
            self.bus.pump(0.05)
            self._check_interrupt()
            if self.bus.replies.pop(req, None) is not None or self._bus_heard():
                return
        raise PeerLostError(f"session {self.session}: the control bus proxy does not answer")

    def _bus_heard(self) -> bool:
        assert self.bus is not None
        req = self.bus.send("ping", "bus")
        self.bus.pump(0.05)
        return bool(self.bus.replies.pop(req, None))

    def _agent_bus(self, endpoints: BusEndpoints) -> Any:
        if self.local:
            return lambda address: str(endpoints)
        assert self.bus is not None
        req = self.bus.send("get-metrics", "bus")
        deadline = time.monotonic() + 5.0
        next_send = time.monotonic() + 0.5
        while not self.bus.replies.get(req) and time.monotonic() < deadline:
            self.bus.pump(0.05)
            if time.monotonic() >= next_send and not self.bus.replies.get(req):
                next_send = time.monotonic() + 0.5  # a request lost on a young bus
                self.bus.forget(req)
                req = self.bus.send("get-metrics", "bus")
        data = next(iter(self.bus.replies.pop(req, {}).values()), {}).get("data") or {}
        pubs = [e for e in data.get("publish_endpoints", []) if e.startswith("tcp://")]
        subs = [e for e in data.get("subscribe_endpoints", []) if e.startswith("tcp://")]
        if not pubs or not subs:
            raise PeerLostError("the bus proxy did not report its tcp endpoints")

        def for_host(address: str) -> str:
            mine = route_source(address)
            return f"{connectable(pubs[0], mine)},{connectable(subs[0], mine)}"

        return for_host

    def _start_agents(self, agent_bus: Any) -> None:
        """One agent per host; over ssh/Slurm all hosts at once (each start waits for
        its remote side: about a second per host over ssh)."""
        from concurrent.futures import ThreadPoolExecutor

        self._check_interrupt()
        launches = {}
        for name in self.hosts:
            host = self.topology.hosts[name]
            args = ["--bus", agent_bus(host.address), "--session", self.session, "--host", name]
            for module in self.preload:
                args += ["--preload", module]
            launches[name] = (host, args, self._agent_env(name))
        if self.local:  # a fork each: quick, and preexec_fn is no friend of threads
            for name, (host, args, env) in launches.items():
                self._check_interrupt()
                self.handles[name] = self.launcher.start_agent(host, args, env)
            return
        error: BaseException | None = None
        with ThreadPoolExecutor(max_workers=min(32, len(launches))) as pool:
            futures = {n: pool.submit(self.launcher.start_agent, *a) for n, a in launches.items()}
            for name, future in futures.items():
                try:
                    self.handles[name] = future.result()
                except Exception as exc:  # every started agent is in handles for close()
                    error = error or exc
        if error is not None:
            raise error
        self._check_interrupt()

    def _wait_agents(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        refusals = BusRefusals(self) if self.security is not None else None
        while missing := [h for h, r in self.hosts.items() if r.last_beat_s is None]:
            self._tick(0.05)
            if refusals is not None:
                refusals.check(missing)
            for name in missing:
                code = self.handles[name].poll()
                if code is not None:
                    tail = self.handles[name].error_output().strip().splitlines()
                    why = tail[-1] if tail else "no output"
                    raise PeerLostError(
                        f"host {name!r}: the agent exited with code {code} before it reached "
                        f"the control bus: {why}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError_(
                    f"host(s) {', '.join(missing)}: no agent reached the control bus within "
                    f"{self.start_timeout_s:g} s"
                )
        for name, rec in self.hosts.items():
            pre = rec.preflight or {}
            if pre.get("removed"):
                log.info("host %s: removed leftovers of dead session(s) %s", name, pre["removed"])
            for live in pre.get("live") or []:
                log.warning(
                    "host %s: session %s of live process %s is still running there",
                    name,
                    live.get("session"),
                    live.get("pid"),
                )

    # --- watching --------------------------------------------------------------------
    def _rewalk(self, now: float) -> None:
        """Walk devices that their agent restarted back to RUNNING, one step at a time
        (their own endpoints first, so that a binder binds where its peers look)."""
        assert self.bus is not None
        for rec in self.records.values():
            if not rec.rewalk or rec.process != "running" or now < rec.next_step_s:
                continue
            if rec.rank >= RANK["RUNNING"]:
                rec.rewalk = False
                log.info("device %s restarted and RUNNING again", rec.id)
                continue
            rec.next_step_s = now + _RESEND_S
            if rec.rank < 0:
                self.bus.tell("set-properties", [rec.id], {"properties": self.bus.properties})
            for transition, target, moved in STAGES:
                if rec.rank < RANK[target]:
                    if rec.rank < RANK[moved]:
                        self.bus.tell("transition", [rec.id], {"transition": transition})
                    break
            self.bus.tell("check-state", [rec.id])


def route_source(address: str) -> str:
    """This machine's address on the route to ``address`` (where an agent there reaches
    the controller's bus): the kernel picks it for a UDP 'connection', no packet sent."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))
            return str(sock.getsockname()[0])
        except OSError:
            return "127.0.0.1"

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

from evflow.errors import ConfigurationError, PeerLostError, TimeoutError_
from evflow.runtime.busclient import BusEndpoints
from evflow.topology.intake import ControllerBus
from evflow.topology.launch.base import AgentHandle
from evflow.topology.protocol import CONTROLLER_ID, agent_id
from evflow.topology.records import RANK, DeviceRecord, HostRecord
from evflow.topology.resolve import ResolvedTopology
from evflow.topology.security import BusRefusals, FarmSecurity
from evflow.transport.address import connectable

__all__ = ["STAGES", "StartupSteps", "route_source"]

log = logging.getLogger("evflow.topology")

STAGES = (
    ("INIT_DEVICE", "INITIALIZING_DEVICE", "INITIALIZING_DEVICE"),
    ("COMPLETE_INIT", "INITIALIZED", "INITIALIZED"),
    ("BIND", "BOUND", "BINDING"),
    ("CONNECT", "DEVICE_READY", "CONNECTING"),
    ("INIT_TASK", "READY", "INITIALIZING_TASK"),
    ("RUN", "RUNNING", "RUNNING"),
)
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

    def _spawn(self) -> None:
        assert self.bus is not None
        pending = {}
        for name in self.hosts:
            args = {
                "devices": [d.to_wire() for d in self.topology.on_host(name)],
                "connect_timeout_s": self.connect_timeout_s,
                "stats_dir": self.stats_dir,
            }
            pending[name] = (self.bus.send("spawn", agent_id(name), args), args)
        deadline = time.monotonic() + self.start_timeout_s
        next_send = time.monotonic() + 2.0
        while pending:
            self._tick(0.05)
            for name, (req, _args) in list(pending.items()):
                reply = self.bus.replies.get(req, {}).get(agent_id(name))
                if reply is None:
                    continue
                self.bus.forget(req)
                del pending[name]
                if not reply.get("ok"):
                    raise ConfigurationError(f"host {name!r}: spawn failed: {reply.get('error')}")
            if time.monotonic() > next_send:  # same req: an agent never spawns twice
                next_send = time.monotonic() + 2.0
                for name, (req, args) in pending.items():
                    self.bus.send("spawn", agent_id(name), args, req=req)
            if pending and time.monotonic() > deadline:
                raise TimeoutError_(f"host(s) {', '.join(pending)}: spawn not answered")

    def _stage(self, transition: str, target: str, moved: str) -> None:
        assert self.bus is not None
        goal, moved_rank = RANK[target], RANK[moved]
        deadline = self.started_s + self.start_timeout_s + self.connect_timeout_s

        def laggards(rank: int) -> list[str]:
            return [r.id for r in self.records.values() if not r.ended and r.rank < rank]

        todo = laggards(goal)
        if todo:
            self.bus.tell("transition", todo, {"transition": transition}, quiet=True)
        next_send = time.monotonic() + _RESEND_S
        while todo := laggards(goal):
            self._tick(0.02)
            now = time.monotonic()
            if now >= next_send:
                next_send = now + _RESEND_S
                unmoved = laggards(moved_rank)
                if unmoved:
                    self.bus.tell("transition", unmoved, {"transition": transition}, quiet=True)
                self.bus.tell("check-state", todo)
            if now > deadline:
                states = ", ".join(f"{d} {self.records[d].state}" for d in todo[:10])
                raise TimeoutError_(
                    f"device(s) did not reach {target} within {self.start_timeout_s:g} s: {states}"
                )

    def _push_properties(self) -> None:
        """All binders' endpoints known (asked for if missed), then sent to everyone."""
        assert self.bus is not None
        wanted = {
            f"{d.id}.{c.name}"
            for d in self.topology.devices.values()
            for c in d.channels
            if c.bind and not self.records[d.id].ended
        }
        deadline = time.monotonic() + 5.0
        while missing := sorted(wanted - set(self.bus.properties)):
            owners = sorted({k.split(".")[0] for k in missing})
            self.bus.tell("check-state", owners)
            self._tick(0.1)
            if time.monotonic() > deadline:
                raise TimeoutError_(f"no endpoints published by {', '.join(owners)}")
        targets = [r.id for r in self.records.values() if not r.ended]
        if targets:
            args = {"properties": self.bus.properties}
            self.bus.tell("set-properties", targets, args, quiet=True)

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

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
from evflow.runtime.busclient import PROXY_ID, BusEndpoints
from evflow.topology.intake import ControllerBus
from evflow.topology.keypolicy import BusRefusals, FarmSecurity
from evflow.topology.knowledge import RANK, DeviceRecord, HostRecord
from evflow.topology.launch.base import AgentHandle
from evflow.topology.resolve import ResolvedTopology
from evflow.topology.walk import STAGES
from evflow.transport.address import connectable

__all__ = ["STAGES", "StartupSteps", "route_source"]

log = logging.getLogger("evflow.topology")

_RESEND_S = 0.4
#: a request to the young bus proxy is sent again after this (s)
ASK_BUS_S = 0.1


class StartupSteps:
    """Start-up steps of the controller (see the module docstring)."""

    topology: ResolvedTopology
    records: dict[str, DeviceRecord]
    hosts: dict[str, HostRecord]
    handles: dict[str, AgentHandle]
    _launching: dict[str, Any]
    _pool: Any
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
    severity: str

    def _agent_env(self, host: str) -> dict[str, str]:
        raise NotImplementedError

    def _tick(self, timeout_s: float) -> None:
        raise NotImplementedError

    def _check_interrupt(self) -> None:
        raise NotImplementedError

    def _wait_bus(self) -> None:
        """Until the bus proxy answers (its get-metrics reply, kept for _agent_bus)."""
        self._bus_metrics = self._ask_bus("get-metrics", 10.0)
        if self._bus_metrics is None:
            raise PeerLostError(f"session {self.session}: the control bus proxy does not answer")

    def _ask_bus(self, cmd: str, timeout_s: float) -> dict[str, Any] | None:
        """The bus proxy's answer to ``cmd``, or None. Asked again every ASK_BUS_S: on a
        young bus a request or its reply is dropped until the subscriptions are through
        (and waiting in short slices: the start-up waits for this)."""
        assert self.bus is not None
        deadline = time.monotonic() + timeout_s
        req, next_send = "", 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= next_send:
                if req:
                    self.bus.forget(req)
                req = self.bus.send(cmd, "bus")
                next_send = time.monotonic() + ASK_BUS_S
            self.bus.pump(0.005)
            self._check_interrupt()
            answer = self.bus.replies.get(req, {}).get(PROXY_ID)  # (not a stranger's)
            if answer is not None:
                self.bus.forget(req)
                data = answer.get("data")
                return data if isinstance(data, dict) else {}
        return None

    def _agent_bus(self, endpoints: BusEndpoints) -> Any:
        if self.local:
            return lambda address: str(endpoints)
        data = getattr(self, "_bus_metrics", None) or {}
        pubs = _tcp(data.get("publish_endpoints"))
        subs = _tcp(data.get("subscribe_endpoints"))
        if not pubs or not subs:
            raise PeerLostError("the bus proxy did not report its tcp endpoints")

        def for_host(address: str) -> str:
            mine = route_source(address)
            return f"{connectable(pubs[0], mine)},{connectable(subs[0], mine)}"

        return for_host

    def _agent_launches(self, agent_bus: Any) -> dict[str, tuple[Any, list[str], dict[str, str]]]:
        """(host, agent args, env) per host; ``agent_bus`` None: ``--bus -`` (the bus
        address follows on the agent's stdin, see _launch_in_threads)."""
        launches = {}
        for name in self.hosts:
            host = self.topology.hosts[name]
            bus = agent_bus(host.address) if agent_bus is not None else "-"
            args = ["--bus", bus, "--session", self.session, "--host", name]
            args += ["--severity", self.severity]
            for module in self.preload:
                args += ["--preload", module]
            launches[name] = (host, args, self._agent_env(name))
        return launches

    def _start_agents(self, agent_bus: Any) -> None:
        """One agent per host; over ssh/Slurm all hosts at once (each start waits for
        its remote side: about a second per host over ssh)."""
        self._check_interrupt()
        launches = self._agent_launches(agent_bus)
        if self.local:  # a fork each: quick, and preexec_fn is no friend of threads
            for name, (host, args, env) in launches.items():
                self._check_interrupt()
                self.handles[name] = self.launcher.start_agent(host, args, env)
            return
        self._launch_in_threads(launches)
        self._collect_launches(None)

    def _launch_in_threads(self, launches: dict[str, Any]) -> None:
        """Start the launches, one thread each; _collect_launches() takes the handles.
        The ssh launcher starts agents this way before the bus exists (``--bus -``):
        ssh, the remote shell and the agent's imports take most of a second, which
        the controller spends bringing up its bus meanwhile."""
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=min(32, len(launches)))
        self._launching = {
            n: self._pool.submit(self.launcher.start_agent, *a) for n, a in launches.items()
        }

    def _collect_launches(self, agent_bus: Any) -> None:
        """Every started agent into ``handles`` (close() ends them); with ``agent_bus``,
        each is sent its bus address (``--bus -``). The first launch error is raised."""
        error: BaseException | None = None
        launching, self._launching = self._launching, {}
        for name, future in launching.items():
            try:
                handle = future.result()
            except Exception as exc:
                error = error or exc
                continue
            self.handles[name] = handle
            if agent_bus is not None:
                handle.send_line(agent_bus(self.topology.hosts[name].address))
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if error is not None:
            raise error
        self._check_interrupt()

    def _wait_agents(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        refusals = BusRefusals(self) if self.security is not None else None
        while missing := [h for h, r in self.hosts.items() if r.last_beat_s is None]:
            self._tick(0.01)  # the spawn goes out as soon as the last agent is heard
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
        (their own endpoints first, so that a binder binds where its peers look). The
        next step goes as soon as the device reports the last one done; a step with no
        answer is sent again after ``_RESEND_S`` (the new process may not have been
        subscribed to the bus yet)."""
        assert self.bus is not None
        for rec in self.records.values():
            if not rec.rewalk or rec.process != "running":
                continue
            if now < rec.next_step_s and rec.rank == rec.step_rank:
                continue  # no word since the last step: wait for it, or resend
            if rec.rank >= RANK["RUNNING"]:
                rec.rewalk = False
                log.info("device %s restarted and RUNNING again", rec.id)
                continue
            rec.next_step_s = now + _RESEND_S
            rec.step_rank = rec.rank
            if rec.rank < 0:
                self.bus.tell("set-properties", [rec.id], {"properties": self.bus.properties})
            for transition, target, moved in STAGES:
                if rec.rank < RANK[target]:
                    if rec.rank < RANK[moved]:
                        args: dict[str, Any] = {"transition": transition}
                        if transition == "BIND":
                            args["properties"] = self._own_endpoints(rec.id)
                        self.bus.tell("transition", [rec.id], args)
                    break
            self.bus.tell("check-state", [rec.id])

    def _own_endpoints(self, dev_id: str) -> dict[str, list[str]]:
        """What ``dev_id`` bound before its restart. They ride with its BIND: the
        set-properties sent when the agent reports the restart is lost when the new
        process is not subscribed yet (its bus subscription races its first STATE, and
        none is sent after it), and bare ``ipc://`` or port 0 would then bind afresh
        where none of its peers, connected to the old endpoints, ever looks."""
        assert self.bus is not None
        props = self.bus.properties
        return {k: v for k, v in props.items() if k.rpartition(".")[0] == dev_id}


def _tcp(endpoints: Any) -> list[str]:
    """The tcp endpoints in what the bus proxy reported (a list of strings)."""
    if not isinstance(endpoints, list):
        return []
    return [e for e in endpoints if isinstance(e, str) and e.startswith("tcp://")]


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

"""The topology controller (``evflow up``): start the hosts, walk the devices, watch them.

1. **Start**: pre-flight (leftovers of dead sessions removed), the bus proxy (a zygote
   child, ipc and, for other hosts, tcp), one agent per host through the launcher,
   wait for each agent's first heartbeat, ``spawn`` the devices placed there.
2. **Walk** every device through FairMQ's sequence over the bus, one step for all at a
   time (INIT_DEVICE, COMPLETE_INIT, BIND, CONNECT, INIT_TASK, RUN); before CONNECT
   the endpoints the binders published are pushed to everyone.
3. **Watch**: agent heartbeats (a host silent for HOST_LOST_S that does not answer a
   ping within PROBE_S is lost), device exits,
   the desired state (``n_min``/``expendable``): a tolerated loss is shown and the
   consumers of a lost device stop waiting for its END; any other loss stops the
   topology with one message naming the host or device.
4. **Shut down** (end, Ctrl-C, ``evflow down``, a loss): END over the bus in stop order
   (sources first; each device walks STOP, RESET_TASK, RESET_DEVICE, END), then each
   agent's ``shutdown`` (SIGKILL after the grace), then the launchers' handles;
   session directories and shm segments of every host of this machine are removed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import time
from typing import Any

import zmq

from evflow.errors import ConfigurationError, EvflowError, PeerLostError
from evflow.runtime.supervisor import Supervisor
from evflow.topology.intake import ControllerBus
from evflow.topology.keypolicy import FarmSecurity, tcp_only_binds
from evflow.topology.knowledge import DeviceRecord, HostRecord, violations
from evflow.topology.launch.base import AgentHandle, get_launcher
from evflow.topology.protocol import (
    CONNECT_TIMEOUT_S,
    CONTROLLER_BEAT_S,
    CONTROLLER_ID,
    CURVE_PRELOAD,
    HOST_LOST_S,
    PROBE_S,
    agent_id,
    host_session,
)
from evflow.topology.resolve import ResolvedTopology
from evflow.topology.startup import StartupSteps, route_source
from evflow.topology.walk import StartupWalk

log = logging.getLogger("evflow.topology")

#: a lost host that keeps beating after it was told to shut down is told again after
FENCE_AGAIN_S = 0.5
#: a restarted receiver is told this often which of its senders exited (peer-ended)
ENDED_AGAIN_S = 2.0


#: (transition, state reached once it is done, first state after the transition)
class Interrupted(EvflowError):
    """Ctrl-C / SIGTERM / ``evflow down`` while starting."""


class Controller(StartupSteps):
    """See the module docstring. ``run()`` does it all and returns the exit code;
    ``failure`` then holds the one error message (if any)."""

    def __init__(
        self,
        topology: ResolvedTopology,
        *,
        session: str,
        launcher: str = "local",
        stats_dir: str = "",
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        start_timeout_s: float = 60.0,
        grace_s: float = 3.0,
        preload: tuple[str, ...] = (),
        view: Any = None,
        on_up: Any = None,
        on_end: Any = None,
        security: FarmSecurity | None = None,
        severity: str = "info",
    ) -> None:
        self.topology = topology
        self.session = session
        try:
            self.launcher = get_launcher(launcher)
        except ImportError as exc:
            raise ConfigurationError(
                f"launcher {launcher!r} is not available here ({exc}); use --launcher local"
            ) from None
        self.local = launcher == "local"
        self.stats_dir = stats_dir
        self.connect_timeout_s = connect_timeout_s
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.preload = preload
        self.view = view
        self.on_up = on_up
        #: called with the controller once every device ended, before the session goes
        self.on_end = on_end
        self.security = security
        #: the agents' (and so the devices') log level: debug, info, warn or error
        self.severity = severity
        if security is not None:
            tcp_only_binds(topology)
        self.records = {d.id: DeviceRecord(d) for d in topology.devices.values()}
        self.hosts = {h: HostRecord(h) for h in sorted({d.host for d in topology.devices.values()})}
        self.handles: dict[str, AgentHandle] = {}
        self._launching: dict[str, Any] = {}  # host -> future of an agent's launch
        self._pool: Any = None
        self.phase = "starting"
        self.failure: str | None = None
        self.signals = 0
        self.down_requested = False
        self._reported: set[str] = set()
        self._next_beat = 0.0
        self._next_ended_s = 0.0
        self._last_tick_s = time.monotonic()
        self.sup = Supervisor(session, bus=True, bus_addresses=self._bus_addresses())
        self._context: zmq.Context[Any] | None = None
        self.bus: ControllerBus | None = None
        self.started_s = time.monotonic()
        self.running_after_s: float | None = None

    def _bus_addresses(self) -> tuple[str, str] | None:
        if self.local:
            return None
        return ("ipc://bus-in.ipc;tcp://*:0", "ipc://bus-out.ipc;tcp://*:0")

    # --- the whole life ------------------------------------------------------------
    def request_stop(self) -> None:
        """Signal handler side: first call = orderly, second = fast."""
        self.signals += 1

    @property
    def stopping(self) -> bool:
        return self.signals > 0 or self.down_requested

    def run(self) -> int:
        code = 1
        try:
            self.start()
            if self.on_up is not None:
                self.on_up(self)
            code = self.watch()
        except Interrupted:
            code = 0 if self.down_requested and not self.signals else 130
        except EvflowError as exc:
            if self.failure is not None and self.bus is not None:
                self._collect_errors()  # the failed devices' own words
            self.failure = self.failure or str(exc)
            code = 1
        finally:
            try:
                self.shutdown(fast=self.signals > 1)
                if self.on_end is not None:
                    self.on_end(self)
            finally:
                self.close()
        return code

    # --- start ---------------------------------------------------------------------
    def _preflight_devices(self) -> None:
        """Each device class's own pre-flight check (``Device.preflight``: a QC repository
        that already has a writer), for the devices on this machine, before anything
        starts: one line now instead of a device's traceback at INIT_TASK."""
        from evflow.runtime.runner import load_device_class

        for dev in self.topology.devices.values():
            host = self.topology.hosts.get(dev.host)
            if self.launcher.name != "local" and not (host is not None and host.is_local):
                continue  # its files are on another host
            try:
                load_device_class(dev.cls).preflight(dev.params)
            except ConfigurationError as exc:
                raise ConfigurationError(f"device {dev.id!r}: {exc}") from None

    def start(self) -> None:
        from evflow.transport.sessions import claim_session, remove_stale_sessions

        if self.security is not None:
            # before the bus proxy is forked: it binds tcp as a CURVE server
            self.security.controller_addresses = sorted(
                {route_source(self.topology.hosts[h].address) for h in self.hosts}
            )
            self.security.apply_to_controller()
            for module in CURVE_PRELOAD:  # into the zygote: the bus proxy serves CURVE
                importlib.import_module(module)
        removed = remove_stale_sessions()
        if removed:
            log.info("pre-flight: removed leftovers of dead session(s) %s", ", ".join(removed))
        self._preflight_devices()
        self.sup.start()  # zygote and bus proxy, before our own zmq context
        early = self.launcher.name == "ssh"  # agents start while the bus comes up
        if early:
            self._check_interrupt()
            self._launch_in_threads(self._agent_launches(None))
        claim_session(self.session)
        (self._session_dir() / "topology.json").write_text(
            json.dumps({"version": 1, "topology": self.topology.name, "pid": os.getpid()})
        )
        self._context = zmq.Context()
        endpoints = self.sup.bus_endpoints
        self.bus = ControllerBus(self._context, endpoints, self.records, self.hosts, self._answer)
        self._wait_bus()
        self._lap("bus up")
        if early:
            self._collect_launches(self._agent_bus(endpoints))
        else:
            self._start_agents(self._agent_bus(endpoints))
        self._lap("agents started")
        self._wait_agents()
        self._lap("agents up")
        StartupWalk(self).run()  # spawns, then each device to RUNNING as it gets ready
        self.phase = "running"
        self.running_after_s = time.monotonic() - self.started_s
        log.info(
            "topology %s: %d devices RUNNING on %d host(s) after %.2f s",
            self.topology.name,
            len(self.records),
            len(self.hosts),
            self.running_after_s,
        )

    def _lap(self, what: str) -> None:
        log.debug("start-up: %s after %.3f s", what, time.monotonic() - self.started_s)

    def _session_dir(self) -> Any:
        from evflow.transport.paths import session_dir

        return session_dir(self.session)

    def _agent_env(self, host: str) -> dict[str, str]:
        env = {k: os.environ[k] for k in ("EVFLOW_RUNTIME_DIR", "PYTHONPATH") if k in os.environ}
        if self.security is not None:
            env.update(self.security.agent_env(host))
        return env

    def _check_interrupt(self) -> None:
        if self.stopping:
            raise Interrupted("interrupted")
        if self.failure is not None:
            raise PeerLostError(self.failure)

    def _tick(self, timeout_s: float) -> None:
        """One turn of the loop: bus traffic, heartbeats, hosts, losses, the view."""
        assert self.bus is not None
        self.bus.pump(timeout_s)
        now = time.monotonic()
        # were we starved (a loaded machine)? then silence says nothing about the hosts
        starved = now - self._last_tick_s > HOST_LOST_S / 2
        self._last_tick_s = now
        if now >= self._next_beat:
            self._next_beat = now + CONTROLLER_BEAT_S
            live = [agent_id(h) for h, r in self.hosts.items() if not r.lost]
            if live:
                self.bus.tell("heartbeat", live)
        if not starved:
            self._check_hosts(now)
        self._fence_returned(now)
        self._check_losses()
        if self.phase == "running":
            self._rewalk(now)
            self._tell_ended_senders(now)
        if self.view is not None:
            self.view.update(self)
        if self.phase == "starting":
            self._check_interrupt()

    def _check_hosts(self, now: float) -> None:
        for name, rec in self.hosts.items():
            if rec.lost or rec.exited or rec.last_beat_s is None:
                continue  # an agent not heard yet is _wait_agents' business
            handle = self.handles.get(name)
            code = handle.poll() if handle is not None else None
            silent_s = now - rec.last_beat_s if rec.last_beat_s is not None else 0.0
            if code is None and silent_s <= HOST_LOST_S:
                rec.probe_until_s = None
                continue
            if code is None and rec.probe_until_s is None:
                rec.probe_until_s = now + PROBE_S
                assert self.bus is not None
                self.bus.tell("ping", [agent_id(name)])
                continue
            if code is None and rec.probe_until_s is not None and now < rec.probe_until_s:
                continue
            if self.phase == "stopping" and code is not None:
                rec.exited = True
                continue
            rec.lost, rec.lost_at_s = True, now
            why = (
                f"its agent exited with code {code}"
                if code is not None
                else f"no heartbeat for {silent_s:.1f} s"
            )
            gone = [d for d in self.records.values() if d.host == name and not d.ended]
            for dev in gone:
                dev.process, dev.message = "lost", f"host {name!r} lost ({why})"
            log.error(
                "host %r lost (%s): device(s) %s lost",
                name,
                why,
                ", ".join(d.id for d in gone) or "none",
            )

    def _fence_returned(self, now: float) -> None:
        """A lost host heard again (its link came back) must not run on: its devices
        were given up, their consumers told ``peer-lost``, and data they still sent would
        count where it no longer belongs. Its agent is told to kill them (no orderly
        END) and exit; told again while it keeps beating."""
        for name, rec in self.hosts.items():
            if not rec.lost or rec.lost_at_s is None or rec.last_beat_s is None:
                continue
            if rec.last_beat_s <= (rec.fenced_at_s or rec.lost_at_s):
                continue  # silent since the loss (or since it was told)
            if rec.fenced_at_s is not None and now - rec.fenced_at_s < FENCE_AGAIN_S:
                continue
            handle = self.handles.get(name)
            if handle is not None and handle.poll() is not None:
                continue  # its agent is gone already
            if rec.fenced_at_s is None:
                gone = [d.id for d in self.records.values() if d.host == name and d.lost]
                log.warning(
                    "host %r came back %.1f s after it was lost: device(s) %s stay lost; "
                    "its agent is told to kill them and exit",
                    name,
                    rec.last_beat_s - rec.lost_at_s,
                    ", ".join(gone) or "none",
                )
            rec.fenced_at_s = now
            assert self.bus is not None
            self.bus.tell("shutdown", [agent_id(name)], {"grace_s": 0.0, "kill": True})

    def _check_losses(self) -> None:
        assert self.bus is not None
        fresh = [r for r in self.records.values() if r.lost and r.id not in self._reported]
        if not fresh or self.phase == "stopping":
            return
        self._reported.update(r.id for r in fresh)
        for rec in fresh:
            if rec.process != "lost":
                log.error("device %s on host %s lost: %s", rec.id, rec.host, rec.message)
        broken = violations(self.topology.groups, self.records)
        if broken:
            hosts = sorted({r.host for r in fresh if self.hosts[r.host].lost})
            cause = (
                f"host{'s' if len(hosts) > 1 else ''} {', '.join(map(repr, hosts))} lost"
                if hosts
                else f"device(s) {', '.join(r.id for r in fresh)} lost"
            )
            self.failure = f"{cause}: {'; '.join(broken)}; stopping the topology"
            return
        for rec in fresh:
            log.warning("lost %s: tolerated (n_min/expendable); the rest goes on", rec.id)
            for consumer, _channel in self.topology.consumers.get(rec.id, []):
                if not self.records[consumer].ended:
                    self.bus.tell("peer-lost", [consumer], {"peer": rec.id})

    def _tell_ended_senders(self, now: float) -> None:
        """A restarted receiver may wait for the END of a sender that exited while it was
        dead (its END sent again and again, never acknowledged in time): tell it, every
        ENDED_AGAIN_S, which of its senders exited cleanly, so that every run ends. (The
        receiver counts a sender's END it already has; one still missing at the second
        notice never comes, and its count check says so.)"""
        if now < self._next_ended_s:
            return
        self._next_ended_s = now + ENDED_AGAIN_S
        assert self.bus is not None
        told: dict[str, list[str]] = {}
        for rec in self.records.values():
            if rec.process != "done" or rec.lost:
                continue
            for consumer, _channel in self.topology.consumers.get(rec.id, []):
                crec = self.records[consumer]
                if crec.restarts and not crec.ended and not crec.rewalk:
                    told.setdefault(consumer, []).append(rec.id)
        for consumer, peers in told.items():
            self.bus.tell("peer-ended", [consumer], {"peers": sorted(set(peers))}, quiet=True)

    def watch(self) -> int:
        """Until every device ended, a loss breaks the desired state, or a stop request."""
        while not all(r.ended for r in self.records.values()):
            self._tick(0.1)
            if self.failure is not None:
                self._collect_errors()
                return 1
            if self.stopping:
                return 0 if self.down_requested and not self.signals else 130
        self._collect_errors()
        failed = [r for r in self.records.values() if r.lost]
        if violations(self.topology.groups, self.records):
            self.failure = "device(s) failed: " + "; ".join(
                f"{r.id} on {r.host}: {r.error or r.message}" for r in failed
            )
            return 1
        return 0

    def _collect_errors(self, wait_s: float = 0.3) -> None:
        """Give the final reports (errors, summaries) of ended devices a moment to arrive."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            assert self.bus is not None
            self.bus.pump(0.05)
        errors = [f"{r.id}: {r.error}" for r in self.records.values() if r.lost and r.error]
        if self.failure and errors:
            self.failure += " (" + "; ".join(errors[:5]) + ")"

    # --- CLI commands over the bus ------------------------------------------------------
    def _answer(self, cmd: str, args: dict[str, Any]) -> dict[str, Any]:
        if cmd == "status":
            return self.status()
        if cmd == "down":
            self.down_requested = True
            return {"node_id": CONTROLLER_ID, "stopping": True}
        if cmd in ("check-state", "get-metrics"):
            now = time.time()
            return {
                "node_id": CONTROLLER_ID,
                "node_state": self.phase.upper(),
                "pid": os.getpid(),
                "request_timestamp": now,
                "response_timestamp": now,
            }
        raise ConfigurationError(f"unknown command {cmd!r}; the controller knows status, down")

    def status(self) -> dict[str, Any]:
        return {
            "topology": self.topology.name,
            "session": self.session,
            "phase": self.phase,
            "pid": os.getpid(),
            "hosts": [
                {"name": h, "lost": r.lost, "agent_pid": r.pid} for h, r in self.hosts.items()
            ],
            "devices": [r.row() for r in self.records.values()],
            # bus messages refused, by kind (malformed, wrong types, strangers)
            "bad_messages": dict(self.bus.bad.counts) if self.bus is not None else {},
        }

    # --- shutdown ----------------------------------------------------------------------
    def shutdown(self, fast: bool = False) -> None:
        if self.bus is None:
            return
        self.phase = "stopping"
        if not fast:
            self._stop_restarts()
        levels = sorted({r.spec.stop_order for r in self.records.values()})
        for level in levels if not fast else ():
            # devices no agent reported yet are left to the agents' shutdown below
            group = [r for r in self.records.values() if r.spec.stop_order == level]
            deadline = time.monotonic() + self.grace_s
            next_send = 0.0
            while (alive := [r.id for r in group if r.process in ("running", "restarting")]) and (
                time.monotonic() < deadline
            ):
                if self.signals > 1:
                    break
                if time.monotonic() >= next_send:
                    next_send = time.monotonic() + 0.5
                    self.bus.tell("transition", alive, {"transition": "END"}, quiet=True)
                self._tick(0.05)
        # an agent never heard on the bus (still starting, or refused) cannot hear the
        # shutdown either: close() ends it through its launcher, without waiting here
        live = [
            h for h, r in self.hosts.items()
            if not r.lost and not r.exited and r.last_beat_s is not None
        ]  # fmt: skip
        if live:
            grace = 0.0 if fast or self.signals > 1 else 1.0
            self.bus.tell("shutdown", [agent_id(h) for h in live], {"grace_s": grace})
        waiting = [self.handles[h] for h in live if h in self.handles]
        deadline = time.monotonic() + 3.0 + self.grace_s
        while any(h.poll() is None for h in waiting) and time.monotonic() < deadline:
            self.bus.pump(0.05)
        self.bus.pump(0.05)

    def _stop_restarts(self, wait_s: float = 1.0) -> None:
        """Tell the agents to restart nothing from now on, and wait (a little) for their
        word before the first END goes out: a device that fails on its way down is then
        reported as it ended, not restarted, walked down again and reported by its new
        process (which never ran)."""
        assert self.bus is not None
        live = [
            agent_id(h) for h, r in self.hosts.items()
            if not r.lost and not r.exited and r.last_beat_s is not None
        ]  # fmt: skip
        if not live:
            return
        req = self.bus.send("stopping", live)
        deadline = time.monotonic() + wait_s
        while len(self.bus.replies.get(req, {})) < len(live) and time.monotonic() < deadline:
            self.bus.pump(0.02)
        self.bus.forget(req)

    def close(self) -> None:
        from evflow.transport.paths import remove_session_files
        from evflow.transport.sessions import remove_stale_sessions

        with contextlib.suppress(Exception):
            self._collect_launches(None)  # agents still starting: their handles too
        for handle in self.handles.values():
            handle.terminate(grace_s=1.0)
        if self.bus is not None:
            self.bus.close()
            self.bus = None
        if self._context is not None:
            self._context.term()
            self._context = None
        if self.sup.zygote.pid is not None:
            self.sup.shutdown(fast=self.signals > 1)  # the bus proxy: SIGTERM, then SIGKILL
        self.sup.close()
        if self.local:  # every agent ran here and is gone: its session files go too
            for name in self.hosts:
                remove_session_files(host_session(self.session, name))
        remove_stale_sessions()

"""The host agent (``evflow agent``): one per host, a zygote + supervisor for its devices.

Started by a launcher (local fork, ssh, srun) with everything it needs to reach the
controller: ``evflow agent --bus PUB,SUB --session S --host NAME``. The rest comes over
the bus (:mod:`evflow.topology.protocol`):

1. pre-flight: session directories of dead owners on this host are removed (with their
   shm segments); live sessions are reported;
2. the zygote is forked before any zmq context (devices are copy-on-write forks of it,
   with the device modules already imported);
3. ``spawn`` forks the devices placed here (restart policy per device, from the spec);
4. a heartbeat (METRICS with every device process's state) goes out every 0.25 s and at
   once when a device exits; the controller's own heartbeat is watched: silence for
   CONTROLLER_LOST_S stops everything here;
5. ``shutdown`` / SIGTERM / SIGINT: devices get SIGTERM (their orderly FairMQ walk) in
   stop order, SIGKILL after the grace; the host session's ipc files and shm go too.
   ``shutdown`` with ``kill`` (this host was declared lost and came back): SIGKILL at
   once, no walk.

The agent dies -> its zygote and devices die (PDEATHSIG), and the controller notices
the missing heartbeat.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from evflow.errors import ConfigurationError
from evflow.runtime.busclient import BusClient
from evflow.runtime.supervisor import RESTART_POLICIES, ExitEvent, Supervisor
from evflow.topology.busfields import node_name, opt_bool, opt_number, opt_str, str_list
from evflow.topology.protocol import (
    CONTROLLER_LOST_S,
    CURVE_PRELOAD,
    HEARTBEAT_S,
    PROTOCOL_VERSION,
    agent_id,
    host_session,
)
from evflow.wire.messages import MsgType, refuse

log = logging.getLogger("evflow.agent")

#: the agent waits at most this long for the bus to hear it before its first heartbeat
HEARD_TIMEOUT_S = 2.0
#: devices forked per zygote request (the agent's heartbeat goes out between batches)
SPAWN_BATCH = 16
#: most devices one spawn request may name
MAX_SPAWN = 100_000

#: imported before the zygote forks, so that every device starts with them loaded
PRELOAD = (
    "evflow.runtime.device",
    "evflow.runtime.busclient",
    "evflow.runtime.devices.sampler",
    "evflow.runtime.devices.sink",
    "evflow.runtime.devices.forward",
    "evflow.runtime.runner",
    "evflow.topology.node",
)


def preflight(topology_session: str) -> dict[str, Any]:
    """Remove leftovers of dead sessions on this host; list the live ones (other than
    this topology's own: the controller's and its agents' sessions)."""
    from evflow.transport.paths import runtime_base_dir
    from evflow.transport.sessions import read_owner, remove_stale_sessions

    removed = remove_stale_sessions()
    live = []
    base = runtime_base_dir()
    try:
        entries = sorted(base.iterdir())
    except OSError:
        entries = []
    for path in entries:
        owner = read_owner(path) if path.is_dir() else None
        ours = path.name == topology_session or path.name.startswith(f"{topology_session}-")
        if owner is not None and not ours and owner.alive():
            live.append({"session": path.name, "pid": owner.pid})
    return {"removed": removed, "live": live}


class AgentExtension(Protocol):
    """What a caller adds to an agent: work before its zygote forks (so that forks share
    it) and bus commands of its own. A path run's is ``PathRunShare``
    (processing/parallel/run/pathworkers.py), handed in by ``evflow agent --steering``."""

    def before_fork(self) -> None: ...

    def handlers(self, agent: Agent) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]: ...


class Agent:
    """See the module docstring. ``run()`` returns the exit code."""

    def __init__(
        self,
        bus: str,
        session: str,
        host: str,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        controller_lost_s: float = CONTROLLER_LOST_S,
        grace_s: float = 3.0,
        extension: AgentExtension | None = None,
    ) -> None:
        self.bus = bus
        self.session = session
        self.host = host
        self.node_id = agent_id(host)
        self.local_session = host_session(session, host)
        self.heartbeat_s = heartbeat_s
        self.controller_lost_s = controller_lost_s
        self.grace_s = grace_s
        self.sup = Supervisor(self.local_session, bus=False)
        self.devices: dict[str, dict[str, Any]] = {}
        self.preflight: dict[str, Any] = {}
        self._stop = False
        self._kill = False  # shutdown with kill: SIGKILL the devices, no orderly walk
        self._signals = 0
        self._last_controller = time.monotonic()
        self._next_beat = 0.0
        self.client: BusClient | None = None
        #: what the caller adds (a path run's workers: processing/parallel/run/pathworkers.py)
        self.extension = extension

    # --- commands ------------------------------------------------------------------
    def _spawn(self, args: dict[str, Any]) -> dict[str, Any]:
        from evflow.runtime.processes import ProcessSpec
        from evflow.topology.node import FINAL_EXIT, run_node

        launches = args.get("devices")
        if type(launches) is not list or len(launches) > MAX_SPAWN:
            raise refuse("bad-spawn", f"spawn: 'devices' is not a list of at most {MAX_SPAWN}")
        timeout_s = opt_number(args, "connect_timeout_s", "spawn", 0.0, 86400.0)
        timeout_s = 20.0 if timeout_s is None else timeout_s
        stats_dir = opt_str(args, "stats_dir", "spawn") or ""
        first = tuple(str_list(args.get("first_steps") or [], "spawn.first_steps", 8, 32))
        for launch in launches:  # each one whole before anything is forked
            _check_launch(launch)
        pids = {}
        started = time.monotonic()
        specs = []
        for launch in launches:
            dev_id = str(launch["id"])
            if dev_id in self.sup.processes:
                pids[dev_id] = self.sup.processes[dev_id].pid
                continue  # a re-sent spawn: answered, not repeated
            specs.append(ProcessSpec(
                dev_id,
                target=run_node,
                args=(launch, self.bus, self.local_session, timeout_s, stats_dir, first),
                before_launch=_restart_walked,
                restart=str(launch.get("restart", "never")),
                max_restarts=int(launch.get("max_restarts", 3)),
                backoff_s=float(launch.get("restart_backoff_s", 0.1)),
                final_codes=(FINAL_EXIT,),
                stop_order=int(launch.get("stop_order", 0)),
                grace_s=self.grace_s,
            ))  # fmt: skip
        # one zygote request per batch (a fork each, no round trip per device); batches
        # small enough that the heartbeat goes out between them
        for i in range(0, len(specs), SPAWN_BATCH):
            for proc in self.sup.add_many(specs[i : i + SPAWN_BATCH]):
                if proc.pid is None:  # its fork failed: reported as a failed device
                    failure = next((e.message for e in reversed(self.sup.failed)
                                    if e.name == proc.name), "not started")  # fmt: skip
                    self.devices[proc.name] = {"pid": None, "state": "failed", "restarts": 0,
                                               "returncode": 1, "message": failure}  # fmt: skip
                    continue
                pids[proc.name] = proc.pid
                self.devices[proc.name] = {"pid": proc.pid, "state": "running", "restarts": 0}
            self._maybe_beat()  # hundreds of forks must not look like a lost host
        log.debug("agent %s: %d device(s) forked in %.3f s", self.host, len(pids),
                  time.monotonic() - started)  # fmt: skip
        return {"node_id": self.node_id, "pids": pids}

    def _shutdown(self, args: dict[str, Any]) -> dict[str, Any]:
        grace_s = opt_number(args, "grace_s", "shutdown", 0.0, 3600.0)
        kill = opt_bool(args, "kill", "shutdown")
        self.grace_s = self.grace_s if grace_s is None else grace_s
        if kill and not self._kill:
            # this host was declared lost (a cut link that came back): its devices must
            # not finish their streams as if nothing happened, not even with an END
            log.error("agent %s: the controller declared this host lost; killing its "
                      "devices", self.host)  # fmt: skip
            self._kill = True
        self._stop = True
        return {"node_id": self.node_id, "stopping": True}

    def _stopping(self, args: dict[str, Any]) -> dict[str, Any]:
        # the controller walks the devices down: one failing on its way out (a sink
        # whose counts do not add up) is reported as it ended, not restarted into IDLE
        waiting = [p.name for p in self.sup.waiting()]
        self.sup.stop_restarting()
        for name in waiting:  # no process left: the controller must not wait for its END
            self.devices.setdefault(name, {}).update(state="stopped")
        self._next_beat = 0.0
        return {"node_id": self.node_id, "restarts_dropped": waiting}

    def _heartbeat(self, args: dict[str, Any]) -> dict[str, Any]:
        self._last_controller = time.monotonic()
        return {"node_id": self.node_id}

    # --- heartbeat -----------------------------------------------------------------
    def _on_exit(self, event: ExitEvent) -> None:
        entry = self.devices.setdefault(event.name, {})
        entry.update(
            pid=event.pid,
            state=event.outcome,
            returncode=event.returncode,
            message=event.message,
            restarts=event.restarts,
            # ended while we shut down (the controller's stop): not a loss of its own
            shutdown=self._stop,
        )
        proc = self.sup.processes.get(event.name)
        if proc is not None and proc.state == "running":
            # restarted at once (a backoff that ran out before the callbacks): the new
            # process and its restart count, or the controller never walks it
            entry.update(state="running", pid=proc.pid, restarts=proc.restarts)
        self._next_beat = 0.0

    def _maybe_beat(self, agent_state: str = "RUNNING") -> None:
        now = time.monotonic()
        if now < self._next_beat or self.client is None:
            return
        self._next_beat = now + self.heartbeat_s
        for name, proc in self.sup.processes.items():  # restarts started by poll()
            entry = self.devices.setdefault(name, {})
            if proc.state == "running" and (
                entry.get("pid") != proc.pid or entry.get("restarts", 0) != proc.restarts
            ):
                entry.update(state="running", pid=proc.pid, restarts=proc.restarts)
        header = {
            "from": self.node_id,
            "metrics": {
                "node_id": self.node_id,
                "node_state": agent_state,
                "pid": os.getpid(),
                "agent": {
                    "version": PROTOCOL_VERSION,
                    "host": self.host,
                    "session": self.local_session,
                    "pid": os.getpid(),
                    "preflight": self.preflight,
                    "devices": self.devices,
                },
            },
        }
        self.client.publish(MsgType.METRICS, header)

    # --- main loop -----------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        self._stop = True
        if self._signals > 1:
            self.sup._fast = True

    def run(self) -> int:
        from evflow.transport.sessions import claim_session

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        _lap("imports done")
        self.preflight = preflight(self.session)
        if self.extension is not None:  # e.g. a path run's modules, before the fork
            self.extension.before_fork()
        # what is loaded now stays out of the collector's way: forked devices then share
        # these pages instead of copying them when the collector walks them
        gc.collect()
        gc.freeze()
        self.sup.start()  # the zygote forks now: before any zmq context
        self.sup.on_exit(self._on_exit)
        _lap("zygote forked")
        claim_session(self.local_session)
        context: zmq.Context[Any] = zmq.Context()
        try:
            if self.bus == "-":  # started before the controller's bus was up
                self.bus = read_bus_line(self.host)
            _lap("bus known")
            # confirm: the first heartbeat waits until the bus hears us (one sent before
            # the proxy's subscriptions arrive is dropped: the controller would wait
            # for the next one, a quarter of a second later)
            self.client = BusClient(context, self.node_id, self.bus, confirm=True)
            deadline = time.monotonic() + HEARD_TIMEOUT_S
            while not self._stop and time.monotonic() < deadline:
                if self.client.wait_heard((MsgType.METRICS, MsgType.REPLY), 0.05):
                    break
            self.client.handle("spawn", self._spawn)
            self.client.handle("shutdown", self._shutdown)
            self.client.handle("stopping", self._stopping)
            self.client.handle("heartbeat", self._heartbeat)
            if self.extension is not None:
                for command, handler in self.extension.handlers(self).items():
                    self.client.handle(command, handler)
            self._loop()
        finally:
            self.sup.shutdown(fast=self._signals > 1 or self._kill)
            self.sup.close()
            if self.client is not None:
                self._next_beat = 0.0
                self._maybe_beat("EXITING")
                self.client.close()
            context.destroy(linger=200)
        return 0

    def _loop(self) -> None:
        assert self.client is not None
        poller = zmq.Poller()
        poller.register(self.client.socket, zmq.POLLIN)
        poller.register(self.sup.fileno(), zmq.POLLIN)
        self._last_controller = time.monotonic()
        while not self._stop:
            poller.poll(int(self.heartbeat_s * 1000 / 2))
            self.sup.poll(0)
            self.client.poll()
            self._maybe_beat()
            silent_s = time.monotonic() - self._last_controller
            if silent_s > self.controller_lost_s:
                log.error(
                    "agent %s: no heartbeat from the controller for %.1f s; stopping",
                    self.host,
                    silent_s,
                )
                return


def _check_launch(launch: Any) -> None:
    """Refuse (ProtocolError) a spawn entry that is not a resolved device."""
    from evflow.topology.resolve import ResolvedDevice

    try:
        dev = ResolvedDevice.from_wire(launch)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise refuse("bad-spawn", f"spawn: a device entry is not one ({exc!r})") from None
    node_name(dev.id, "spawn: a device id")
    if dev.restart not in RESTART_POLICIES:
        raise refuse("bad-spawn", f"spawn: device {dev.id!r}: restart {dev.restart!r}")


def _restart_walked(proc: Any) -> None:
    """A restarted device waits for the controller's walk (which first gives it the
    endpoints it had, so that it binds them again): no first steps of its own."""
    if proc.pids:
        proc.args = (*proc.args[:5], ())


def _lap(what: str) -> None:
    """Debug: seconds since this agent's process started (``--severity debug``)."""
    if log.isEnabledFor(logging.DEBUG):
        import psutil

        since = time.time() - psutil.Process().create_time()
        log.debug("agent start-up: %s %.3f s after exec", what, since)


def read_bus_line(host: str, timeout_s: float = 60.0) -> str:
    """``--bus -``: the bus endpoints from the first line of stdin."""
    import select
    import sys

    from evflow.runtime.busclient import BusEndpoints

    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    line = sys.stdin.readline().strip() if ready else ""
    if not line:
        why = "no line" if ready else f"nothing within {timeout_s:g} s"
        raise ConfigurationError(f"agent {host!r}: --bus -: {why} on stdin")
    BusEndpoints.parse(line)
    return line


def run_agent(
    bus: str,
    session: str,
    host: str,
    preload: list[str] | tuple[str, ...] = (),
    controller_lost_s: float = CONTROLLER_LOST_S,
    extension: AgentExtension | None = None,
) -> int:
    """``evflow agent``: import the device modules, then run the agent until told to stop."""
    from evflow.transport.farmkeys import ENV_KEYS

    # with farm keys every device opens CURVE sockets: what those import (pyzmq's auth
    # and socket monitor, and through them asyncio: ~20 ms) is loaded once, here
    curve = CURVE_PRELOAD if os.environ.get(ENV_KEYS) else ()
    for name in (*PRELOAD, *curve, *preload):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigurationError(
                f"agent {host!r}: cannot import {name!r} ({exc}); is it on PYTHONPATH there?"
            ) from None
    if curve:
        from evflow.transport.farmkeys import preload_farm_keys

        preload_farm_keys()  # before the zygote forks: each device inherits the keys
    agent = Agent(bus, session, host, controller_lost_s=controller_lost_s, extension=extension)
    return agent.run()

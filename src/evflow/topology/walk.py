"""The start-up walk: spawn every device and take them through FairMQ's sequence.

Three steps (``GROUPS``), each one broadcast (the ids of the devices in ``to``) of a
``transition`` command naming the transitions a device takes one after the other:
every command on the bus wakes every device (each decodes it to see whether it is
addressed), so the walk sends as few as it can. INIT_DEVICE, COMPLETE_INIT, BIND need
no other device: the spawn carries them (``first_steps``) and each device takes them
as soon as the bus hears it; the controller sends them only to a device that has not
moved FIRST_STEPS_S after its host's spawn was answered. CONNECT, INIT_TASK go out
once every device is BOUND and the endpoints of every binder are known (pushed
first, ``set-properties``, on the same ordered pipe); RUN once every device is READY.

Every send of a step uses the same request id (``walk-<step>``): a device that already
took the step ignores a re-send (the bus client answers a request id once), so the
devices that have not moved ``RESEND_S`` after a send (a broadcast missed while their
bus subscription was not through yet) are told again without duplicate steps or
warnings. A device whose state does not change for ``ASK_S`` is asked for it
(``check-state``: a lost STATE message); so is a binder that is BOUND while its
endpoints are unknown (a lost notice).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from evflow.errors import ConfigurationError, TimeoutError_
from evflow.topology.knowledge import RANK, DeviceRecord
from evflow.topology.protocol import agent_id, walk_request

__all__ = ["GROUPS", "STAGES", "StartupWalk"]

log = logging.getLogger("evflow.topology")

#: (transition, state reached once it is done, first state after the transition)
STAGES = (
    ("INIT_DEVICE", "INITIALIZING_DEVICE", "INITIALIZING_DEVICE"),
    ("COMPLETE_INIT", "INITIALIZED", "INITIALIZED"),
    ("BIND", "BOUND", "BINDING"),
    ("CONNECT", "DEVICE_READY", "CONNECTING"),
    ("INIT_TASK", "READY", "INITIALIZING_TASK"),
    ("RUN", "RUNNING", "RUNNING"),
)
#: the start-up walk's steps: transitions a device takes one after the other, the
#: state all devices must reach before the next group goes out, and the first state
#: after the group's first transition. Only the peers' endpoints (CONNECT needs every
#: binder BOUND) and the start of the data (RUN once every device is READY) need all
#: devices to wait for each other: a group is one command and one wait for all.
GROUPS = (
    (("INIT_DEVICE", "COMPLETE_INIT", "BIND"), "BOUND", "INITIALIZING_DEVICE"),
    (("CONNECT", "INIT_TASK"), "READY", "CONNECTING"),
    (("RUN",), "RUNNING", "RUNNING"),
)
TICK_S = 0.02
#: a device that has not moved this long after a step was sent gets it again
RESEND_S = 0.3
#: INIT_DEVICE, the first command a device hears: re-sent sooner (a device forked a
#: moment ago is often not subscribed yet, and its IDLE is often lost for the same
#: reason: a PUB socket drops what it sends before the proxy's subscription arrives)
RESEND_FIRST_S = 0.2
#: a device whose state did not change this long is asked for it
ASK_S = 0.4
#: a device that has not taken the first step by itself this long after its host's
#: spawn was answered is sent it (it may have missed being heard, or be a slow start)
FIRST_STEPS_S = 1.0
#: spawn requests not answered are sent again (same request: never spawned twice)
SPAWN_RESEND_S = 2.0


class StartupWalk:
    """One start-up of the controller's devices (``run()``); see the module docstring."""

    def __init__(self, controller: Any) -> None:
        self.c = controller
        self.bus = controller.bus
        self.records: dict[str, DeviceRecord] = controller.records
        self.sent: dict[tuple[str, str], float] = {}
        self.seen: dict[str, tuple[int, float]] = {}  # id -> (rank, since)
        self.asked_s = 0.0
        self.spawns: dict[str, tuple[str, dict[str, Any]]] = {}
        self.spawn_sent_s = 0.0
        self.answered_s: dict[str, float] = {}  # host -> when its spawn was answered
        self.reached: set[str] = set()
        self.resent: set[tuple[str, str]] = set()
        self.broadcasts = 0
        self.needs = {
            d.id: sorted({key for ch in d.channels for key, _same in ch.connect})
            for d in controller.topology.devices.values()
        }
        self.binds = {
            d.id: [f"{d.id}.{ch.name}" for ch in d.channels if ch.bind]
            for d in controller.topology.devices.values()
        }

    # --- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        self._send_spawns()
        deadline = self.c.started_s + self.c.start_timeout_s + self.c.connect_timeout_s
        while True:
            live = [r for r in self.records.values() if not r.ended]
            self._laps(live)
            if not self.spawns and all(r.rank >= RANK["RUNNING"] for r in live):
                log.debug("start-up: %d transition broadcast(s)", self.broadcasts)
                return
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError_(self._timeout_message(live))
            self._step(live, now)
            self.c._tick(TICK_S)
            self._check_spawns()

    def _laps(self, live: list[DeviceRecord]) -> None:
        if not live:
            return
        lowest = min(r.rank for r in live)
        for _transition, target, _moved in STAGES:
            if lowest >= RANK[target] and target not in self.reached and not self.spawns:
                self.reached.add(target)
                self.c._lap(f"all {target}")

    def _step(self, live: list[DeviceRecord], now: float) -> None:
        lowest = min((r.rank for r in live), default=RANK["RUNNING"])
        group = next((i for i, g in enumerate(GROUPS) if lowest < RANK[g[1]]), None)
        if group is None or (group > 0 and self.spawns):
            self._ask(live, now)
            return
        transitions, _target, moved = GROUPS[group]
        if group == 1 and not all(self._peers_published(r) for r in live):
            self._ask(live, now)
            return
        ids = []
        for rec in live:
            if rec.rank >= RANK[moved]:
                continue  # taking the step, or past it
            if group == 0:  # the devices take it by themselves (the spawn's first_steps)
                answered = self.answered_s.get(rec.host)
                if answered is None or now - answered < FIRST_STEPS_S:
                    continue  # not forked yet, or maybe not heard yet
            last = self.sent.get((rec.id, transitions[0]))
            if last is not None and now - last < (RESEND_FIRST_S if group == 0 else RESEND_S):
                continue
            self.sent[(rec.id, transitions[0])] = now
            ids.append(rec.id)
        if ids:
            if group == 1:  # the endpoints first, on the same ordered pipe
                self.bus.tell("set-properties", ids, {"properties": self.bus.properties},
                              quiet=True)  # fmt: skip
            req = walk_request(transitions[0])
            args = {"transition": transitions[0], "transitions": list(transitions)}
            self.bus.send("transition", ids, args, req=req, quiet=True)
            self.bus.forget(req)
            self.broadcasts += 1
            if any((r, transitions[0]) in self.resent for r in ids):
                log.debug("start-up: %s sent again to %d device(s)", transitions[0], len(ids))
            self.resent.update((r, transitions[0]) for r in ids)
        self._ask(live, now)

    def _peers_published(self, rec: DeviceRecord) -> bool:
        """Every endpoint ``rec`` connects to is known (peers that ended are not waited
        for: the device then waits for them itself and ends with an error naming them)."""
        props = self.bus.properties
        return all(key in props or self.records[key.split(".")[0]].ended
                   for key in self.needs.get(rec.id, ()))  # fmt: skip

    def _ask(self, live: list[DeviceRecord], now: float) -> None:
        """check-state to devices that hold the walk up (not yet at the state the
        slowest one is heading for) and whose state has not changed for ASK_S, and to
        binders that are BOUND without their endpoints known (a lost notice). Devices
        waiting for the others are not asked: each answer is a message."""
        lowest = min((r.rank for r in live), default=RANK["RUNNING"])
        goal = next((RANK[t] for _, t, _ in GROUPS if lowest < RANK[t]), RANK["RUNNING"])
        stuck = []
        for rec in live:
            rank, since = self.seen.get(rec.id, (None, now))
            if rec.rank < 0 and rec.host in self.spawns:
                continue  # its agent is still forking
            if rank != rec.rank:
                self.seen[rec.id] = (rec.rank, now)
                continue
            waiting = rec.rank < goal and now - since >= ASK_S
            unpublished = rec.rank >= RANK["BOUND"] and any(
                k not in self.bus.properties for k in self.binds.get(rec.id, ())
            )
            if waiting or unpublished:
                stuck.append(rec.id)
        if stuck and now - self.asked_s >= ASK_S:
            self.asked_s = now
            self.bus.tell("check-state", stuck)

    def _timeout_message(self, live: list[DeviceRecord]) -> str:
        if self.spawns:
            return f"host(s) {', '.join(self.spawns)}: spawn not answered"
        todo = [r for r in live if r.rank < RANK["RUNNING"]]
        unpublished = sorted(
            {k.split(".")[0] for r in todo for k in self.needs.get(r.id, ())
             if k not in self.bus.properties}
        )  # fmt: skip
        if unpublished:
            return f"no endpoints published by {', '.join(unpublished)}"
        states = ", ".join(f"{r.id} {r.state}" for r in todo[:10])
        return f"device(s) did not reach RUNNING within {self.c.start_timeout_s:g} s: {states}"

    # --- spawns ------------------------------------------------------------------------
    def _send_spawns(self) -> None:
        for name in self.c.hosts:
            args = {
                "devices": [d.to_wire() for d in self.c.topology.on_host(name)],
                "connect_timeout_s": self.c.connect_timeout_s,
                "stats_dir": self.c.stats_dir,
                # the first step needs no other device: each takes it once it is heard
                "first_steps": list(GROUPS[0][0]),
            }
            self.spawns[name] = (self.bus.send("spawn", agent_id(name), args), args)
        self.spawn_sent_s = time.monotonic()

    def _take_pids(self, data: Any) -> None:
        # the reply names every forked pid: a device may report RUNNING before its
        # agent's next heartbeat, and `evflow status` right after `up --detach` shows it
        pids = data.get("pids") if isinstance(data, dict) else None
        for dev_id, pid in (pids if isinstance(pids, dict) else {}).items():
            rec = self.c.records.get(dev_id)
            if rec is not None and isinstance(pid, int) and rec.pid is None:
                rec.pid = pid

    def _check_spawns(self) -> None:
        if not self.spawns:
            return
        for name, (req, _args) in list(self.spawns.items()):
            reply = self.bus.replies.get(req, {}).get(agent_id(name))
            if reply is None:
                continue
            self.bus.forget(req)
            del self.spawns[name]
            self.answered_s[name] = time.monotonic()
            if not reply.get("ok"):
                raise ConfigurationError(f"host {name!r}: spawn failed: {reply.get('error')}")
            self._take_pids(reply.get("data"))
        if not self.spawns:
            self.c._lap("devices spawned")
        elif time.monotonic() - self.spawn_sent_s > SPAWN_RESEND_S:
            self.spawn_sent_s = time.monotonic()
            for name, (req, args) in self.spawns.items():
                self.bus.send("spawn", agent_id(name), args, req=req)

"""The controller's side of the bus: send commands, take in everything that comes back.

One SUB socket hears every REPLY, STATE, METRICS and the COMMANDs addressed to the
controller; :meth:`ControllerBus.pump` reads them and updates the device and host
records, the endpoint properties and the replies waited for. Nothing is dropped while
the controller waits for something else (unlike ``BusController.request``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import zmq

from evflow.runtime.busclient import BusEndpoints, open_bus_sockets
from evflow.topology.protocol import AGENT_PREFIX, CONTROLLER_ID
from evflow.topology.records import DeviceRecord, HostRecord
from evflow.wire.messages import BadMessageCounter, Message, MsgType, encode_message

__all__ = ["ControllerBus"]

#: agent outcome -> device record process state
_OUTCOMES = {
    "running": "running",
    "restarting": "restarting",
    "done": "done",
    "failed": "failed",
    "stopped": "stopped",
}


class ControllerBus:
    """Bus I/O of the controller; ``answer(cmd, header) -> data`` serves CLI commands."""

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoints: BusEndpoints,
        records: dict[str, DeviceRecord],
        hosts: dict[str, HostRecord],
        answer: Callable[[str, dict[str, Any]], dict[str, Any]],
    ) -> None:
        topics = (MsgType.COMMAND, MsgType.REPLY, MsgType.STATE, MsgType.METRICS)
        self._pub, self._sub = open_bus_sockets(context, endpoints, "controller", topics)
        self.records = records
        self.hosts = hosts
        self._answer = answer
        self._seq = itertools.count(1)
        self.properties: dict[str, list[str]] = {}
        self.replies: dict[str, dict[str, dict[str, Any]]] = {}  # req -> from -> header
        self.bad = BadMessageCounter("topology controller")
        self.changed = False  # a device or host record changed since the last look

    def close(self) -> None:
        self._sub.close(0)
        self._pub.close(0)

    # --- sending -------------------------------------------------------------------
    def send(
        self,
        cmd: str,
        to: str | list[str],
        args: dict[str, Any] | None = None,
        req: str = "",
        quiet: bool = False,
    ) -> str:
        """Publish a command; returns its request id (replies collect in ``replies``).
        ``quiet``: the nodes send no REPLY (their STATE messages tell what happened)."""
        req = req or f"{CONTROLLER_ID}-{next(self._seq)}"
        header = {
            "cmd": cmd,
            "to": to,
            "req": req,
            "from": CONTROLLER_ID,
            "ts": time.time(),
            "args": args or {},
        }
        if quiet:
            header["quiet"] = True
        self.replies.setdefault(req, {})
        self._pub.send(encode_message(MsgType.COMMAND, header))
        return req

    def tell(
        self,
        cmd: str,
        to: str | list[str],
        args: dict[str, Any] | None = None,
        quiet: bool = False,
    ) -> None:
        """Publish a command whose replies nobody waits for (``quiet``: none are sent)."""
        self.forget(self.send(cmd, to, args, quiet=quiet))

    def forget(self, req: str) -> None:
        self.replies.pop(req, None)

    # --- receiving -----------------------------------------------------------------
    def pump(self, timeout_s: float) -> None:
        """Handle every message that arrives within ``timeout_s`` (at least one poll)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(left_ms):
                return
            # drain what is queued: a heartbeat left unread must not look like a lost host
            for _ in range(100_000):
                try:
                    frames = self._sub.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = self.bad.decode(frames)
                if msg is not None:
                    self._handle(msg)
            if time.monotonic() >= deadline:
                return

    def _handle(self, msg: Message) -> None:
        header = msg.header
        sender = header.get("from")
        if not isinstance(sender, str):
            return
        if msg.type is MsgType.STATE:
            rec = self.records.get(sender)
            if rec is not None and not rec.from_old_process(header.get("pid")):
                rec.see_state(str(header.get("state")))
                self.changed = True
        elif msg.type is MsgType.METRICS:
            self._metrics(sender, header)
        elif msg.type is MsgType.REPLY:
            self._reply(sender, header)
        elif msg.type is MsgType.COMMAND and header.get("to") == CONTROLLER_ID:
            self._command(sender, header)

    def _metrics(self, sender: str, header: dict[str, Any]) -> None:
        metrics = header.get("metrics")
        if not isinstance(metrics, dict):
            return
        if sender.startswith(AGENT_PREFIX):
            self._agent_beat(sender[len(AGENT_PREFIX) :], metrics.get("agent"))
            return
        rec = self.records.get(sender)
        if rec is None or rec.from_old_process(metrics.get("pid")):
            return
        if header.get("final"):
            summary = header.get("summary")
            rec.summary = summary if isinstance(summary, dict) else {}
            error = header.get("error")
            rec.error = str(error) if error else rec.error
        state = metrics.get("node_state")
        if isinstance(state, str):
            rec.see_state(state)
        rates = metrics.get("rates")
        if isinstance(rates, dict):
            rec.msg_in_hz = float(rates.get("messages_in_hz") or 0.0)
            rec.msg_out_hz = float(rates.get("messages_out_hz") or 0.0)
        self.changed = True

    def _agent_beat(self, host: str, agent: Any) -> None:
        rec = self.hosts.get(host)
        if rec is None or not isinstance(agent, dict):
            return
        rec.last_beat_s = time.monotonic()
        rec.pid = agent.get("pid") if isinstance(agent.get("pid"), int) else rec.pid
        if isinstance(agent.get("preflight"), dict):
            rec.preflight = agent["preflight"]
        devices = agent.get("devices")
        if not isinstance(devices, dict):
            return
        for dev_id, entry in devices.items():
            dev = self.records.get(dev_id)
            if dev is None or not isinstance(entry, dict) or dev.process == "lost":
                continue
            process = _OUTCOMES.get(str(entry.get("state")))
            if process is None:
                continue
            if process != dev.process:
                self.changed = True
            dev.process = process
            pid = entry.get("pid")
            # a new process: a higher restart count, or (should a beat carry a stale
            # count) a new pid of a running device; either way it is walked again
            restarts = int(entry.get("restarts") or 0)
            renewed = isinstance(pid, int) and dev.pid is not None and pid != dev.pid
            if process == "running" and (restarts > dev.restarts or renewed):
                if dev.pid is not None and pid != dev.pid:
                    dev.old_pids.add(dev.pid)
                dev.rewalk, dev.rank, dev.state = True, -1, "RESTARTED"
                dev.next_step_s = 0.0  # walked at once (its first step may be resent)
                dev.step_rank = -2
            dev.pid = pid if isinstance(pid, int) else dev.pid
            rc = entry.get("returncode")
            dev.returncode = rc if isinstance(rc, int) else dev.returncode
            dev.message = str(entry.get("message") or dev.message)
            dev.restarts = max(restarts, dev.restarts)

    def _reply(self, sender: str, header: dict[str, Any]) -> None:
        if sender.startswith(AGENT_PREFIX) and sender[len(AGENT_PREFIX) :] in self.hosts:
            self.hosts[sender[len(AGENT_PREFIX) :]].last_beat_s = time.monotonic()  # alive
        req = header.get("req")
        if isinstance(req, str) and req in self.replies:
            self.replies[req].setdefault(sender, dict(header))
        data = header.get("data")
        if not header.get("ok") or not isinstance(data, dict):
            return
        rec = self.records.get(sender)
        if rec is None:
            return
        cmd = header.get("cmd")
        if cmd == "set-property" and not header.get("req"):  # a device's notice
            self._endpoints(data.get("endpoints"))
            return
        if cmd == "get-properties" and not header.get("req"):
            self._get_properties(sender, data)
            return
        if cmd in ("check-state", "ping"):
            state = data.get("node_state")
            if isinstance(state, str) and not rec.from_old_process(data.get("pid")):
                rec.see_state(state)
                self.changed = True
            self._endpoints(data.get("endpoints"))

    def _endpoints(self, endpoints: Any) -> None:
        if not isinstance(endpoints, dict):
            return
        for key, urls in endpoints.items():
            if isinstance(key, str) and isinstance(urls, list) and urls:
                self.properties[key] = [str(u) for u in urls]

    def _get_properties(self, sender: str, args: dict[str, Any]) -> None:
        keys = [k for k in args.get("keys") or [] if isinstance(k, str)]
        known = {k: self.properties[k] for k in keys if k in self.properties}
        if known:
            self.send("set-properties", [sender], {"properties": known})

    def _command(self, sender: str, header: dict[str, Any]) -> None:
        cmd = str(header.get("cmd"))
        raw_args = header.get("args")
        args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
        if cmd == "set-property":
            self._endpoints(args.get("endpoints"))
            return
        if cmd == "get-properties":
            self._get_properties(sender, args)
            return
        if cmd == "ping" and sender == CONTROLLER_ID:
            return
        reply: dict[str, Any] = {
            "req": header.get("req"),
            "cmd": cmd,
            "from": CONTROLLER_ID,
            "to": sender,
        }
        try:
            reply.update(ok=True, data=self._answer(cmd, args))
        except Exception as exc:
            reply.update(ok=False, error=str(exc))
        self._pub.send(encode_message(MsgType.REPLY, reply))

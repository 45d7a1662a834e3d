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

from evflow.errors import ProtocolError
from evflow.runtime.busclient import BusEndpoints, open_bus_sockets
from evflow.topology.busfields import (
    endpoint_map,
    opt_bool,
    opt_number,
    opt_str,
    parse_beat,
    parse_summary,
    state_name,
    str_list,
    str_map,
)
from evflow.topology.knowledge import DeviceRecord, HostRecord
from evflow.topology.protocol import AGENT_PREFIX, CONTROLLER_ID
from evflow.wire.messages import BadMessageCounter, Message, MsgType, encode_message, refuse

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
        """One message; a bad one is refused whole (counted, logged once per kind)
        before it changed anything: no bus message may stop the controller."""
        try:
            self._dispatch(msg)
        except ProtocolError as exc:
            self.bad.record_error(exc)
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError) as exc:
            # a value no check above foresaw: refused all the same
            self.bad.record("unchecked-value", f"{msg.type.name}: {type(exc).__name__}: {exc}")

    def _dispatch(self, msg: Message) -> None:
        header = msg.header
        sender = header.get("from")
        if type(sender) is not str:
            raise refuse("bad-sender", f"{msg.type.name} whose 'from' is {sender!r}")
        if msg.type is MsgType.STATE:
            rec = self.records.get(sender)
            if rec is not None and not rec.from_old_process(header.get("pid")):
                rec.see_state(state_name(header.get("state"), "STATE.state"))
                self.changed = True
        elif msg.type is MsgType.METRICS:
            self._metrics(sender, header)
        elif msg.type is MsgType.REPLY:
            self._reply(sender, header)
        elif msg.type is MsgType.COMMAND and header.get("to") == CONTROLLER_ID:
            self._command(sender, header)

    def _metrics(self, sender: str, header: dict[str, Any]) -> None:
        metrics = str_map(header.get("metrics"), "METRICS.metrics")
        if sender.startswith(AGENT_PREFIX):
            self._agent_beat(sender[len(AGENT_PREFIX) :], metrics.get("agent"))
            return
        rec = self.records.get(sender)
        if rec is None or rec.from_old_process(metrics.get("pid")):
            return
        # everything is read and checked first: a refused message changes nothing
        final = opt_bool(header, "final", "METRICS")
        summary = parse_summary(header.get("summary") or {}) if final else {}
        error = opt_str(header, "error", "METRICS") if final else None
        state = metrics.get("node_state")
        state = state_name(state, "METRICS.node_state") if state is not None else None
        raw_rates = metrics.get("rates")
        rates = str_map(raw_rates, "METRICS.rates") if raw_rates is not None else {}
        in_hz = opt_number(rates, "messages_in_hz", "METRICS.rates")
        out_hz = opt_number(rates, "messages_out_hz", "METRICS.rates")
        if final:
            rec.summary = summary
            rec.error = error or rec.error
        if state is not None:
            rec.see_state(state)
        if raw_rates is not None:
            rec.msg_in_hz, rec.msg_out_hz = in_hz or 0.0, out_hz or 0.0
        self.changed = True

    def _agent_beat(self, host: str, agent: Any) -> None:
        rec = self.hosts.get(host)
        if rec is None:
            return
        beat = parse_beat(agent)
        rec.last_beat_s = time.monotonic()
        rec.pid = beat.pid if beat.pid is not None else rec.pid
        if beat.preflight is not None:
            rec.preflight = beat.preflight
        for dev_id, entry in beat.devices.items():
            dev = self.records.get(dev_id)
            if dev is None or dev.process == "lost":
                continue
            process = _OUTCOMES.get(entry.state)
            if process is None:
                continue
            if process != dev.process:
                self.changed = True
            dev.process = process
            pid = entry.pid
            # a new process: a higher restart count, or (should a beat carry a stale
            # count) a new pid of a running device; either way it is walked again
            renewed = pid is not None and dev.pid is not None and pid != dev.pid
            if process == "running" and (entry.restarts > dev.restarts or renewed):
                if dev.pid is not None and pid != dev.pid:
                    dev.old_pids.add(dev.pid)
                dev.rewalk, dev.rank, dev.state = True, -1, "RESTARTED"
                dev.next_step_s = 0.0  # walked at once (its first step may be resent)
                dev.step_rank = -2
            dev.pid = pid if pid is not None else dev.pid
            dev.returncode = entry.returncode if entry.returncode is not None else dev.returncode
            dev.message = entry.message or dev.message
            dev.stopped_at_shutdown = entry.shutdown
            dev.restarts = max(entry.restarts, dev.restarts)

    def _reply(self, sender: str, header: dict[str, Any]) -> None:
        if sender.startswith(AGENT_PREFIX) and sender[len(AGENT_PREFIX) :] in self.hosts:
            self.hosts[sender[len(AGENT_PREFIX) :]].last_beat_s = time.monotonic()  # alive
        req = header.get("req")
        ok = header.get("ok")
        if type(ok) is not bool:
            raise refuse("bad-field", f"REPLY of {sender!r}: 'ok' is {ok!r}; expected a bool")
        if isinstance(req, str) and req in self.replies:
            self.replies[req].setdefault(sender, dict(header))
        data = header.get("data")
        if not ok or not isinstance(data, dict):
            return
        rec = self.records.get(sender)
        if rec is None:
            return
        cmd = header.get("cmd")
        if cmd == "set-property" and not req:  # a device's notice
            self._endpoints(data.get("endpoints"), "set-property")
            return
        if cmd == "get-properties" and not req:
            self._get_properties(sender, data)
            return
        if cmd in ("check-state", "ping"):
            state = data.get("node_state")
            endpoints = data.get("endpoints")
            checked = endpoint_map(endpoints, f"{cmd}.endpoints") if endpoints else {}
            if state is not None and not rec.from_old_process(data.get("pid")):
                rec.see_state(state_name(state, f"{cmd}.node_state"))
                self.changed = True
            self.properties.update(checked)

    def _endpoints(self, endpoints: Any, what: str) -> None:
        for key, urls in endpoint_map(endpoints, f"{what}.endpoints").items():
            if urls:
                self.properties[key] = urls

    def _get_properties(self, sender: str, args: dict[str, Any]) -> None:
        keys = str_list(args.get("keys") or [], "get-properties.keys")
        known = {k: self.properties[k] for k in keys if k in self.properties}
        if known:
            self.send("set-properties", [sender], {"properties": known})

    def _command(self, sender: str, header: dict[str, Any]) -> None:
        cmd = str(header.get("cmd"))
        raw_args = header.get("args")
        args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
        if cmd == "set-property":
            self._endpoints(args.get("endpoints"), cmd)
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

"""The ``ctl`` ROUTER of a parallel run: who may report there, what their reports mean.

A mixin of ``engine.Parent``. Every role says HELLO on ctl (its name and pid: accepted
only from a live child of the run with that pid, and over ipc from the pid the kernel
names); after that, only the connection that said HELLO may speak for the name.
RESULT carries a role's counts and statistics for the summary, STATE ERROR fails the
run with the role's error rebuilt (module, hook, uid), STATE TIMEOUT from the input
has a worker killed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, cast

import zmq

from evflow import errors
from evflow.errors import ConfigurationError, EvflowError, ModuleError, ProtocolError
from evflow.runtime.supervisor import Supervisor
from evflow.transport.security import peer_pid
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message, field_int, refuse


class ControlMixin:
    """The ctl side of ``engine.Parent`` (the attributes are the parent's)."""

    ctl: zmq.Socket[Any]
    bad: BadMessageCounter
    ids: dict[str, bytes]
    results: dict[str, tuple[dict[str, Any], list[Any]]]
    signals: list[int]
    hard: bool
    stop_sent: bool
    n_workers: int
    worker_hellos: int
    all_ready_at: float
    sup: Supervisor
    _fail: Callable[[EvflowError], None]  # (exitpolicy.py: stop the run with this error)
    _kill_worker: Callable[[str], None]  # (exitpolicy.py: a timeout's kill)

    def _drain_ctl(self) -> None:
        # ask EVENTS first: on an empty socket a NOBLOCK recv raises zmq.Again, which
        # costs about three times the check (and this runs at every wake-up)
        while cast(int, self.ctl.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = self.ctl.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # (only this thread reads ctl: not expected)
                return
            msg = self.bad.decode(frames[1:])
            if msg is None:
                continue
            try:
                name = self._sender(frames[0], msg)
            except ProtocolError as exc:
                self.bad.record_error(exc)
                continue
            if msg.type == MsgType.HELLO:
                if name.startswith("worker"):
                    self.worker_hellos += 1
                    if self.worker_hellos == self.n_workers:
                        self.all_ready_at = time.time()
                if name == "input" and self.signals and not self.hard:
                    self._send("input", MsgType.STOP)
                    self.stop_sent = True
            elif msg.type == MsgType.RESULT:
                self.results[name] = (msg.header, [f.bytes for f in msg.payload])
            elif msg.type == MsgType.STATE and msg.header.get("state") == "ERROR":
                self._fail(_rebuild_error(msg.header))
            elif msg.type == MsgType.STATE and msg.header.get("state") == "TIMEOUT":
                if name == "input":  # only the input watches for timeouts
                    self._kill_worker(str(msg.header.get("worker")))
                else:
                    self.bad.record("unknown-peer", f"TIMEOUT from {name}, not the input")

    def _sender(self, ident_frame: Any, msg: Any) -> str:
        """The role that sent ``msg`` on ctl; raises ProtocolError for anyone else.

        A HELLO registers the sender under its name if that name is a live child of
        this run with the pid it says (and, over ipc, the pid the kernel says sent it);
        every other message must come from the connection that said HELLO for its name.
        """
        ident = ident_frame.bytes
        name = msg.header.get("name")
        if type(name) is not str or len(name) > 64:
            raise refuse("unknown-peer", f"{msg.type.name} on ctl without a role name")
        if msg.type == MsgType.HELLO:
            pid = field_int(msg.header, "pid", 1, 2**31)
            sender = peer_pid(ident_frame)
            if not self._is_role(name, pid) or (sender is not None and sender != pid):
                raise refuse("unknown-peer", f"HELLO of {name!r} pid {pid}: not a role of the run")
            self.ids[name] = ident
            return name
        if self.ids.get(name) != ident:
            raise refuse("unknown-peer", f"{msg.type.name} of {name!r} from another connection")
        return name

    def _is_role(self, name: str, pid: int) -> bool:
        """``name`` with ``pid`` is a role this run forked (a hosts run adds its remote
        workers, whose pids live on other hosts)."""
        proc = self.sup.live.get(pid)
        return proc is not None and proc.label == name

    def _send(self, role: str, kind: MsgType, header: dict[str, Any] | None = None) -> None:
        ident = self.ids.get(role)
        if ident is not None:
            self.ctl.send_multipart([ident, *encode_message(kind, header)])


def _rebuild_error(header: dict[str, Any]) -> EvflowError:
    """The error a role reported, as one clear exception naming module and process."""
    where = str(header.get("name", "?"))
    if "module" in header:
        cause_type = type(str(header.get("cause", "Exception")), (Exception,), {})
        exc = ModuleError(
            str(header["module"]),
            str(header.get("hook", "?")),
            header.get("uid"),
            cause_type(str(header.get("cause_text", ""))),
            str(header.get("traceback", "")),
        )
        exc.args = (f"{exc} (in the {where} process)",)
        return exc
    text = str(header.get("error", "unknown error"))
    kind = getattr(errors, str(header.get("kind", "")), None)
    if isinstance(kind, type) and issubclass(kind, EvflowError) and kind is not ModuleError:
        with contextlib.suppress(Exception):
            return kind(f"{text} (in the {where} process)")
    return ConfigurationError(f"{text} (in the {where} process)")

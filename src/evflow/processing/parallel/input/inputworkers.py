"""The input's workers: their messages, their losses, their failures.

A mixin of ``input._Input`` (the attributes are the input's; ``_quarantine`` and
``_end_message`` are ``inputback.BackMixin``'s). On the ``events`` ROUTER a worker says
HELLO (a sibling process with a worker's name), READY (credit returned, work time,
events its modules failed on) and GOODBYE; on ``ctl`` the parent reports a lost worker
(WORKER_LOST: its unconfirmed events are taken back) or asks to STOP or KILL. The
input asks the parent to kill a worker without progress (STATE TIMEOUT). Separate
from feeding: this is the bookkeeping of who holds what, not the sending.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

import zmq

from evflow.errors import ModuleError
from evflow.processing.failures import FailureLog
from evflow.processing.parallel.batching import BatchSizer
from evflow.processing.parallel.input.inputfeed import WorkerSlot
from evflow.processing.parallel.input.ledger import Failure, Ledger, LedgerEntry
from evflow.processing.parallel.input.resend import ResendQueue
from evflow.processing.parallel.input.roster import Roster
from evflow.transport.security import is_sibling, parent_of
from evflow.wire.messages import (
    U64_MAX,
    BadMessageCounter,
    MsgType,
    check_hello,
    decode_message,
    encode_message,
    field_float,
    field_int,
    field_str,
    refuse,
)

RECYCLED = Failure("recycled", "worker ended early (worker_memory_limit_mb)")
#: the most credit a worker may announce (events it can hold)
MAX_CREDIT = 1 << 24
_WORKER_NAME = re.compile(r"^worker-\d{1,6}(\.\d{1,6})?$")


class WorkersMixin:
    """Worker and parent messages, for ``input._Input``."""

    router: zmq.Socket[Any]
    ctl: zmq.Socket[Any]
    bad: BadMessageCounter
    ledger: Ledger
    resend: ResendQueue
    roster: Roster
    sizer: BatchSizer
    workers: dict[bytes, WorkerSlot]
    goodbye: list[str]
    requeued_lost: dict[str, int]
    timeouts_asked: set[Any]
    remote_workers: bool
    on_event_error: str
    last_error: ModuleError | None
    failure_log: FailureLog
    check_ms: int
    next_check_s: float
    end_sent: bool
    stopping: bool
    abort: bool

    if TYPE_CHECKING:  # the input's own (inputback.BackMixin)

        def _end_message(self) -> list[Any]: ...
        def _quarantine(self, entries: list[LedgerEntry]) -> None: ...

    def _on_worker(self, frames: list[bytes]) -> None:
        ident = frames[0]
        msg = decode_message(frames[1:])
        slot = self.workers.get(ident)
        header = msg.header
        if msg.type == MsgType.READY:
            if slot is None:  # (a worker taken off the roster: its last READY is void)
                return
            done = field_int(header, "credit", 0, MAX_CREDIT)
            if "t" in header:
                if done > slot.inflight:  # never more credit than it holds: clamped, counted
                    self.bad.record("bad-credit", f"{slot.name} returned {done}, held fewer")
                    done = slot.inflight
                t = header["t"]
                if t is not None:  # None: skipped (an obsolete shm message)
                    t = field_float(header, "t", 0.0, 1e6)
                failures = header.get("f", ())
                if type(failures) not in (list, tuple):
                    raise refuse("bad-field", f"READY of {slot.name}: 'f' is not a list")
                slot.inflight -= done
                if t is not None:
                    self.sizer.observe_work(t)
                # workers go through their messages in order: the ledger then knows
                # which one a worker works on (blame on death, timeouts)
                self.ledger.progress(slot.name, n_events=done)
                for failure in failures:
                    self._event_failed(slot.name, failure)
            else:
                slot.buffer = max(done, 1)
        elif msg.type == MsgType.HELLO:
            check_hello(header)
            name = field_str(header, "name", 32)
            pid = field_int(header, "pid", 1, 2**31)
            if not _WORKER_NAME.match(name):
                raise refuse("bad-hello", f"HELLO on the events socket from {name!r}, not a worker")
            if any(s.name == name for s in self.workers.values()) or slot is not None:
                raise refuse("bad-hello", f"second HELLO of {name!r}")
            if not self.remote_workers and not is_sibling(pid):
                if parent_of(pid) is None:
                    # it said HELLO and ended (the run aborts at start-up and its workers
                    # go): no intruder, and the parent reports the loss. Counted, not shown.
                    self.bad.record(
                        "hello-of-ended", f"HELLO of {name!r}: pid {pid} has ended", quiet=True
                    )
                    return
                raise refuse(
                    "bad-hello", f"HELLO of {name!r}: pid {pid} is not a process of the run"
                )
            self.workers[ident] = WorkerSlot(name, pid)
            self.roster.hello(name)
            if self.end_sent:
                self.router.send_multipart([ident, *self._end_message()])
        elif msg.type == MsgType.GOODBYE:
            if slot is None:
                return
            self.goodbye.append(slot.name)
            del self.workers[ident]
            # a worker recycled early (memory limit) may leave messages it never read;
            # the results of those it finished are on their way to the output
            entries = self.ledger.requeue_unfinished(slot.name, RECYCLED)
            self.resend.extend(e for e in entries if not e.poisoned)
            if msg.header.get("recycled"):  # (at the end of the run nothing is left)
                self.roster.recycled(slot.name, time.monotonic())
        else:
            raise refuse("unexpected", f"{msg.type.name} on the events socket")

    def _on_ctl(self, frames: list[bytes]) -> None:
        msg = decode_message(frames)
        if msg.type == MsgType.STOP:
            self.stopping = True
        elif msg.type == MsgType.KILL:
            self.abort = True
        elif msg.type == MsgType.WORKER_LOST:
            header = msg.header
            name = field_str(header, "name", 32)
            if header.get("reason") == "timeout":
                failure = Failure.timeout(float(self.ledger.event_timeout_s or 0))
            else:
                failure = Failure.from_returncode(field_int(header, "code", -255, 255))
            # the parent read the worker's scoreboard slot: busy on one event (charged
            # alone), idle (nobody charged, -1), or unknown (the ledger's READY guess)
            blame = header.get("blame")
            culprit = (
                field_int(header, "uid", 0, U64_MAX)
                if blame == "busy"
                else -1
                if blame == "idle"
                else None
            )
            replacement = header.get("replacement")
            if replacement is not None:
                replacement = field_str(header, "replacement", 32)
            n = self.requeue(name, failure, culprit)
            self.sizer.observe_loss()  # smaller batches while workers keep dying
            self.requeued_lost[name] = n  # the summary's "events re-sent"
            # a replacement forked at once: the run does not end before it said HELLO
            self.roster.lost(name, replacement or None)

    def requeue(self, name: str, failure: Failure, culprit_uid: int | None = None) -> int:
        """Take back every unconfirmed event of the lost worker ``name``.

        Pending events are sent again (to other workers) with ``attempt + 1``;
        poisoned ones (``max_attempts`` failures) go to the output to be written raw,
        flagged quarantined. Returns how many events came back. The output drops any
        uid it already wrote.
        """
        for ident, slot in list(self.workers.items()):
            if slot.name == name:
                del self.workers[ident]
        entries = self.ledger.requeue_worker(name, failure, culprit_uid)
        poisoned = [e for e in entries if e.poisoned]
        # (those of messages it finished wait a moment for their CONFIRM: resend.py)
        self.resend.add_after_death((e for e in entries if not e.poisoned), time.monotonic())
        if poisoned:
            self._quarantine(poisoned)
        return len(entries)

    def _event_failed(self, worker: str, f: dict[str, Any]) -> None:
        """A module raised in ``event()`` on one event; its worker lives on.

        By default (``on_event_error="retry"``) the event counts a failed attempt and
        is sent again, or quarantined after ``max_attempts``; ``"stop"`` stops the run
        with the module's error. More than ``max_quarantined`` quarantined events stop
        the run too (a path that fails on every event must not grind through them all).
        """
        if type(f) is not dict:
            raise refuse("bad-field", f"failure report of {worker} is not a map")
        uid = field_int(f, "uid", 0, U64_MAX)
        cause_name = field_str(f, "cause", 200)
        if not cause_name.isidentifier():
            raise refuse("bad-field", f"failure report of {worker}: cause {cause_name!r}")
        cause = type(cause_name, (Exception,), {})(str(f.get("text", ""))[:10_000])
        error = ModuleError(field_str(f, "module", 200), "event", uid, cause, str(f.get("tb", "")))
        if self.on_event_error == "stop":
            raise error
        self.last_error = error
        self.failure_log.add(
            error.module, str(f["cause"]), str(f["text"]), uid, str(f.get("tb", ""))
        )
        entry = self.ledger.fail(uid, Failure.exception(f"{error} (in {worker})"))
        if entry is None:
            return
        if entry.poisoned:
            self._quarantine([entry])
        else:
            self.resend.append(entry)

    def _check_leavers(self) -> None:
        for name in self.roster.overdue(time.monotonic(), self.ledger.in_flight):
            entries = self.ledger.requeue_worker(name, RECYCLED, culprit_uid=-1)
            self.resend.extend(e for e in entries if not e.poisoned)

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        if now < self.next_check_s:
            return
        self.next_check_s = now + self.check_ms / 1000
        for entry in self.ledger.expired(now):
            if entry.worker not in self.timeouts_asked:
                self.timeouts_asked.add(entry.worker)
                header = {"state": "TIMEOUT", "name": "input", "worker": entry.worker}
                header["uid"] = entry.uid
                self.ctl.send_multipart(encode_message(MsgType.STATE, header))

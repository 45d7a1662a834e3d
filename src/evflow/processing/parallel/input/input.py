"""The input role: read the source, run the input path, hand out batches by credit.

Sockets: ROUTER ``events`` (worker DEALERs: HELLO, READY, GOODBYE in; EVENTS, END
out), ROUTER ``back`` (the output's DEALER: HELLO, CONFIRM, DONE in; END, ORDER out)
and a DEALER to the parent's ``ctl`` (STOP, WORKER_LOST, KILL in; HELLO, RESULT,
STATE out).

Every event sent is added to the ``Ledger`` (uid, source position, worker, the
encoded frames by reference) and stays there until the output CONFIRMs its uid
written and flushed. A WORKER_LOST from the parent hands that worker's unconfirmed
events back (``Ledger.requeue_worker``): pending ones are sent again, alone when the
ledger asks for isolation; poisoned ones go to the output raw, to be written
quarantined. With ``event_timeout_s`` the input asks the parent to kill a worker that
made no progress (STATE TIMEOUT). END goes to the workers only when the ledger is
empty, then to the output with the counts; the input exits after the output's
GOODBYE. With --ordered every output that says HELLO first gets ORDER: the seq where
its order goes on (``reorder.py``).

This module holds the role's state and main loop; its parts are mixins of ``_Input``:
``inputfeed.py`` (reading and sending batches by credit, the hot path),
``inputworkers.py`` (the workers' and the parent's messages) and ``inputback.py``
(the output's messages, quarantine and END).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import zmq

from evflow.errors import ModuleError, ProtocolError
from evflow.processing.chain import ModuleChain
from evflow.processing.failures import FailureLog
from evflow.processing.parallel.batching import SHM_TARGET_BATCH_B, TARGET_BATCH_B, BatchSizer
from evflow.processing.parallel.common import RoleBus, channel, current_split, run_role
from evflow.processing.parallel.input.checkpoint import CheckpointFile, CheckpointWriter
from evflow.processing.parallel.input.fastpath import encoded_source
from evflow.processing.parallel.input.inputback import BackMixin
from evflow.processing.parallel.input.inputfeed import FeedMixin, WorkerSlot
from evflow.processing.parallel.input.inputworkers import WorkersMixin
from evflow.processing.parallel.input.ledger import Ledger, LedgerEntry
from evflow.processing.parallel.input.resend import ResendQueue
from evflow.processing.parallel.input.roster import Roster
from evflow.processing.parallel.rolebus import IDLE_WAIT_MS, wait_ms
from evflow.transport.security import refused_total
from evflow.transport.shm import ShmArena
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message

#: with event_timeout_s, the input looks for workers without progress this often (ms):
#: a hundredth of the timeout, from TIMEOUT_CHECK_MS up to IDLE_WAIT_MS (the default
#: timeout of minutes must not wake an idle input 20 times a second)
TIMEOUT_CHECK_MS = 50
#: a restarted input checks this often for its first progress to checkpoint (s)
RESTART_CHECKPOINT_S = 0.1


def input_main(session: str, options: dict[str, Any]) -> int:
    """Entry point in the forked input process; returns the exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent relays interrupts

    def body(ctx: zmq.Context[Any], channels: list[Any], bus: RoleBus) -> int:
        role = _Input(ctx, session, options, channels)
        signal.signal(signal.SIGTERM, role.on_term)
        bus.counters = role.bus_counters
        return role.run(bus)

    return run_role("input", session, body, auth=options.get("auth"))


class _Input(FeedMixin, WorkersMixin, BackMixin):
    """The input role: its state, its main loop and its result."""

    def __init__(
        self, ctx: zmq.Context[Any], session: str, options: dict[str, Any], channels: list[Any]
    ) -> None:
        channels.append(channel(ctx, session, "ctl", "dealer", "connect", user="input"))
        self.ctl = channels[0].socket
        self.ctl.send_multipart(
            encode_message(MsgType.HELLO, {"role": "input", "name": "input", "pid": os.getpid()})
        )
        channels.append(channel(ctx, session, "events", "router", "bind"))
        channels.append(channel(ctx, session, "back", "router", "bind"))
        self.router = channels[1].socket
        self.back = channels[2].socket
        self.max_events = int(options.get("max_events") or 0)
        self.ordered = bool(options.get("ordered"))
        self.reorder_window = int(options.get("reorder_window") or 8192)
        self.chain = ModuleChain(current_split().input, process="input")
        self.source: Any = self.chain.modules[0]
        shm = options.get("transport") == "shm"
        self.sizer = BatchSizer(
            SHM_TARGET_BATCH_B if shm else TARGET_BATCH_B, options.get("event_timeout_s")
        )
        # a stream (events arrive over time): its chunks are what has arrived
        self.sizer.stream = getattr(self.source, "streaming", False) is True
        self.n_workers = int(options.get("workers") or 1)
        self.to_read: int | None = None  # events this run reads, when the source knows
        self.workers: dict[bytes, WorkerSlot] = {}
        self.goodbye: list[str] = []
        # reliability: --resume starts at the checkpoint; the input checkpoints as it goes
        self.start_position = int(options.get("start_position") or 0)
        # --ordered: the seq of the event at start_position (a restart numbers as before)
        self.start_seq = int(options.get("start_seq") or 0)
        self.ledger = Ledger(
            max_attempts=int(options.get("max_attempts") or 3),
            event_timeout_s=options.get("event_timeout_s"),
            start_position=self.start_position,
        )
        self.checkpoint: CheckpointWriter | None = None
        if options.get("checkpoint"):
            self.checkpoint = CheckpointWriter(
                CheckpointFile(str(options["checkpoint"])),
                run_id=os.path.basename(str(options["checkpoint"])),
                interval_s=float(options.get("checkpoint_interval_s") or 2.0),
                # restarted: checkpoint at the first progress, not a whole interval later
                first_interval_s=RESTART_CHECKPOINT_S if options.get("input_restart") else None,
                start_position=self.start_position if options.get("input_restart") else None,
            )
            self.checkpoint.file.remove_stale_temps()
        self.resend = ResendQueue()  # events to send again, grouped by resend.py
        # --ordered only: uid -> input sequence number, of the events not yet confirmed
        self.seq_of: dict[int, int] = {}
        self.timeouts_asked: set[Any] = set()
        # replacements on their way, recycled workers whose results are due (roster.py)
        self.roster = Roster()
        self.requeued_lost: dict[str, int] = {}  # lost worker -> events it held, re-sent
        # hosts runs: workers are forked on other hosts, not siblings of this process
        self.remote_workers = bool(options.get("remote_workers", False))
        self.next_check_s = 0.0
        timeout_s = self.ledger.event_timeout_s or 0.0
        self.check_ms = int(min(IDLE_WAIT_MS, max(TIMEOUT_CHECK_MS, timeout_s * 10)))
        self.quarantined = 0
        self.on_event_error = str(options.get("on_event_error") or "retry")
        self.max_quarantined = int(options.get("max_quarantined") or 1000)
        self.last_error: ModuleError | None = None
        self.failure_log = FailureLog()  # module exceptions, grouped for the user
        self.unsent_quarantine: list[LedgerEntry] = []
        self.end_for_output: list[Any] | None = None
        self.next_bid = 0
        self.next_seq = self.start_seq
        self.read = 0
        self.dropped = 0
        self.exhausted = False
        self.stopping = False
        self.abort = False
        self.end_sent = False
        self.output_id: bytes | None = None
        self.output_pid = 0
        self.drain_sent = False  # DRAIN: the source is read out (the output confirms at once)
        self.output_end_sent = False
        self.done = False
        self.bad = BadMessageCounter("input")
        self.messages_in = 0  # READY, CONFIRM, HELLO... (the dashboard's msg/s in)
        self.it: Any = None
        self.encoded = False  # the source yields encoded events (fastpath.py)
        # transport "shm": unpacked (large) batches are copied into this arena once
        self.shm: ShmArena | None = None
        if shm:
            self.shm = ShmArena(session, int(options.get("shm_mb") or 256) * 2**20)

    def on_term(self, signum: int, frame: Any) -> None:
        self.abort = True

    # --- main loop ----------------------------------------------------------------------
    def run(self, bus: RoleBus) -> int:
        self.chain.initialize()
        self.to_read = self._events_to_read()
        bus.running()
        try:
            fast = encoded_source(self.chain, self.start_position)
            self.encoded = fast is not None
            self.it = fast if fast is not None else iter(self.source.events(self.start_position))
            poller = zmq.Poller()
            for s in (self.router, self.back, self.ctl):
                poller.register(s, zmq.POLLIN)
            handlers = {
                self.router: self._on_worker,
                self.back: self._on_output,
                self.ctl: self._on_ctl,
            }
            if bus.socket is not None:  # commands wake the loop (it may sleep 250 ms)
                poller.register(bus.socket, zmq.POLLIN)
            while not self.done:
                busy = self._can_feed()
                for sock, _ in poller.poll(0 if busy else self._idle_ms()):
                    handler = handlers.get(sock)
                    if handler is None:
                        bus.serve_now()
                    else:
                        self._drain(sock, handler, copy=sock is not self.back)
                if self.abort:
                    break  # killed (a second Ctrl-C): still report what was read
                if busy:
                    self._feed()
                if self.ledger.event_timeout_s is not None:
                    self._check_timeouts()
                if self.roster.leavers:
                    self._check_leavers()
                if self.checkpoint is not None and self.checkpoint.due():
                    self.checkpoint.maybe_write(*self._checkpoint_point())
                if self.exhausted and not self.drain_sent and self.output_id is not None:
                    self.drain_sent = True  # the last CONFIRMs should not wait: tell the output
                    self.back.send_multipart([self.output_id, *encode_message(MsgType.DRAIN)])
                self._maybe_end()
                bus.tick()  # time-gated: the control bus (rolebus.py)
            if self.checkpoint is not None and not self.abort:  # all confirmed: resume here
                self.checkpoint.write_now(*self._checkpoint_point())
        finally:
            close = getattr(self.it, "close", None)
            if close is not None:
                close()  # a generator source closes its files now
            if self.shm is not None:
                self.shm.close()  # readers that mapped it keep their mapping
        stats = [s.as_dict() for s in self.chain.statistics()]
        result = {
            "role": "input",
            "name": "input",
            "stats": stats,
            "read": self.read,
            "dropped": self.dropped,
            "sent": self.next_seq - self.start_seq,
            "bad": self.bad.total,
            "refused": refused_total(),  # connections the ZAP handler refused
            "batches": self.next_bid,
            "quarantined": self.quarantined,
            "shm_full": self.shm.full if self.shm is not None else 0,
            "shm_events": self.shm.events if self.shm is not None else 0,
            "cpu_s": time.process_time(),
            "ledger": _ledger_counts(self.ledger),
            "failures": self.failure_log.as_list(),
            "requeued": self.requeued_lost,
        }
        if self.abort:
            result["aborted"] = True
        self.ctl.send_multipart(encode_message(MsgType.RESULT, result))
        self.ctl.linger = 2000
        return 1 if self.abort else 0

    def bus_counters(self) -> dict[str, Any]:
        """The input's counters for the control bus (rolebus.py), at most per tick."""
        sent = self.next_seq - self.start_seq
        return {
            "events_in": self.read,
            "events_out": sent,
            "messages_in": self.messages_in,
            "messages_out": self.next_bid,
            "read": self.read,
            "dropped": self.dropped,
            "sent": sent,
            "batches": self.next_bid,
            "ledger": len(self.ledger),
            "in_flight": sum(s.inflight for s in self.workers.values()),
            # the events at the workers (queued in their sockets or in work) against
            # the credit windows the input keeps: its send buffer, as far as it knows
            "send_queue": self._send_queue(),
            "resend_queue": len(self.resend),
            "quarantined": self.quarantined,
            "workers": sorted(s.name for s in self.workers.values()),
            "exhausted": self.exhausted,
            "stopping": self.stopping,
            "bad_messages": self.bad.total,
        }

    def _send_queue(self) -> tuple[int, int]:
        window = self.sizer.window
        slots = self.workers.values()
        return sum(s.inflight for s in slots), sum(window(s.buffer) for s in slots if s.buffer)

    def _drain(self, sock: zmq.Socket[Any], handler: Any, copy: bool = True) -> None:
        # ``back`` is read without copy: its frames carry the sender's pid (metadata)
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return
            self.messages_in += 1
            try:
                handler(frames)
            except ProtocolError as exc:
                self.bad.record_error(exc)
            except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
                self.bad.record("bad-header", f"{type(exc).__name__}: {exc}")

    def _counts(self) -> dict[str, int]:
        return {"read": self.read, "dropped": self.dropped, "quarantined": self.quarantined}

    def _checkpoint_point(self) -> tuple[int, dict[str, int]]:
        """Where a restarted input would start, and the counts; --ordered adds its seq.

        --ordered: the exact lowest unconfirmed event and its seq, so that an input
        started there numbers every event as this one did.
        """
        counts = self._counts()
        if not self.ordered:
            return self.ledger.checkpoint_position(), counts
        first = self.ledger.first_unconfirmed()
        if first is None:
            position, seq = self.ledger.checkpoint_position(), self.next_seq
        else:
            position, seq = first[1], self.seq_of[first[0]]
        counts["seq"] = seq
        return position, counts

    def _idle_ms(self) -> int:
        """How long the loop may sleep with nothing to send: every wake-up costs the
        busy workers CPU, so only as often as a timeout check or checkpoint needs."""
        due = self.resend.next_due_s()  # held re-sends (resend.py)
        if due is not None:
            return max(1, wait_ms(due - time.monotonic(), TIMEOUT_CHECK_MS))
        if self.roster.leavers:
            return TIMEOUT_CHECK_MS
        wait = self.check_ms if self.ledger.event_timeout_s is not None else IDLE_WAIT_MS
        if self.checkpoint is not None:
            return max(1, min(wait, wait_ms(self.checkpoint.due_in_s())))
        return wait


def _ledger_counts(ledger: Ledger) -> dict[str, int]:
    """The reliability counters of the run's ledger, for the parent's summary."""
    st = ledger.statistics()
    return {
        "confirmed": st.confirmed,
        "unconfirmed": st.unconfirmed,
        "retries": st.resent,  # events sent again (held ones confirmed meanwhile are not)
        "failures": st.failures,
        "poisoned": st.poisoned,
    }

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

``_Input`` holds the role's state and main loop, and its three sides:

- *Feeding* (the hot path: what costs the input CPU per event is all there). Each
  worker announces its credit (``WorkerSlot.buffer``); the input keeps at most a
  credit window of events in flight per worker and fills it with re-sends first
  (``resend.py``), then with new batches read through the input path or cut from
  encoded chunks (``fastpath.py``), placed in shared memory or packed into one frame.
- *The workers and the parent*: the bookkeeping of who holds what, not the sending.
  On the ``events`` ROUTER a worker says HELLO (a sibling process with a worker's
  name), READY (credit returned, work time, events its modules failed on) and
  GOODBYE; on ``ctl`` the parent reports a lost worker (WORKER_LOST: its unconfirmed
  events are taken back) or asks to STOP or KILL. The input asks the parent to kill a
  worker without progress (STATE TIMEOUT).
- *The output* (the ``back`` socket), the other end of the ledger, with its own
  restart rules. Only the run's output may say HELLO here (a restarted one gets every
  unconfirmed event again); with --ordered it first gets ORDER. CONFIRM takes events
  off the ledger; poisoned events go to the output raw, to be written quarantined; END
  goes to the workers when the ledger is empty, then to the output with the counts.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import zmq

from evflow.errors import EvflowError, ModuleError, PeerLostError, ProtocolError
from evflow.event import DataStore
from evflow.processing.chain import ModuleChain, user_traceback
from evflow.processing.failures import FailureLog
from evflow.processing.module import Source
from evflow.processing.parallel.batching import (
    SHM_TARGET_BATCH_B,
    TARGET_BATCH_B,
    BatchSizer,
    PackedEvents,
    frames_nbytes,
    from_u64,
    pack_batch,
    u64,
)
from evflow.processing.parallel.common import RoleBus, channel, current_split, run_role
from evflow.processing.parallel.input.checkpoint import CheckpointFile, CheckpointWriter
from evflow.processing.parallel.input.fastpath import encoded_source, read_encoded
from evflow.processing.parallel.input.ledger import Failure, Ledger, LedgerEntry
from evflow.processing.parallel.input.resend import ResendQueue
from evflow.processing.parallel.input.roster import Roster
from evflow.processing.parallel.persist import encode_persistent
from evflow.processing.parallel.rolebus import IDLE_WAIT_MS, wait_ms
from evflow.transport.security import (
    is_alive,
    is_sibling,
    parent_of,
    peer_pid,
    refused_total,
)
from evflow.transport.shm import ShmArena
from evflow.wire.codec import encode_event
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

#: with event_timeout_s, the input looks for workers without progress this often (ms):
#: a hundredth of the timeout, from TIMEOUT_CHECK_MS up to IDLE_WAIT_MS (the default
#: timeout of minutes must not wake an idle input 20 times a second)
TIMEOUT_CHECK_MS = 50
#: a restarted input checks this often for its first progress to checkpoint (s)
RESTART_CHECKPOINT_S = 0.1

RECYCLED = Failure("recycled", "worker ended early (worker_memory_limit_mb)")
#: the most credit a worker may announce (events it can hold)
MAX_CREDIT = 1 << 24
_WORKER_NAME = re.compile(r"^worker-\d{1,6}(\.\d{1,6})?$")


def input_main(session: str, options: dict[str, Any]) -> int:
    """Entry point in the forked input process; returns the exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent relays interrupts

    def body(ctx: zmq.Context[Any], channels: list[Any], bus: RoleBus) -> int:
        role = _Input(ctx, session, options, channels)
        signal.signal(signal.SIGTERM, role.on_term)
        bus.counters = role.bus_counters
        return role.run(bus)

    return run_role("input", session, body, auth=options.get("auth"))


class Batch:
    """Events about to be sent in one EVENTS message."""

    __slots__ = ("attempt", "enc", "n", "packed", "positions", "seqs", "uids")

    def __init__(
        self,
        enc: Sequence[Any],
        uids: list[int],
        positions: list[int],
        seqs: bytes,
        packed: bool,
    ) -> None:
        self.enc = enc
        self.uids = uids
        self.positions = positions
        self.seqs = seqs
        self.n = len(enc)
        self.packed = packed
        self.attempt = 1


class WorkerSlot:
    """The input's view of one worker: its credit and the events it holds."""

    __slots__ = ("buffer", "inflight", "name", "pid")

    def __init__(self, name: str, pid: int) -> None:
        self.name = name
        self.pid = pid
        self.buffer = 0  # credit the worker announced (0 until its first READY)
        self.inflight = 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Input:
    """The input role: its state, its main loop and its result."""

    # (the types of what ``__init__`` sets from untyped values, for the type checker)
    router: zmq.Socket[Any]
    chain: ModuleChain
    encoded: bool
    sizer: BatchSizer
    ledger: Ledger
    resend: ResendQueue
    ordered: bool
    reorder_window: int
    max_events: int
    n_workers: int
    start_position: int
    next_bid: int
    next_seq: int
    read: int
    dropped: int
    exhausted: bool
    stopping: bool
    ctl: zmq.Socket[Any]
    bad: BadMessageCounter
    roster: Roster
    remote_workers: bool
    on_event_error: str
    failure_log: FailureLog
    check_ms: int
    next_check_s: float
    end_sent: bool
    abort: bool
    back: zmq.Socket[Any]
    output_pid: int
    quarantined: int
    max_quarantined: int
    start_seq: int
    drain_sent: bool
    output_end_sent: bool
    done: bool

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

    # --- feeding: reading and sending batches by credit (the hot path) ------------------
    def _can_feed(self) -> bool:
        """True when ``_feed`` has something for a worker with room (no busy loop: an
        isolated event waits for a worker with nothing in flight)."""
        workers = self.workers.values()
        if self.resend:
            due = self.resend.next_due_s()
            if due is not None and due <= time.monotonic():
                self.resend.release(time.monotonic())
        if self.resend.only_isolated() and (
            self.exhausted or self.stopping or self._ordered_full()
        ):  # (a full --ordered window waits for CONFIRMs, not in a busy loop)
            return bool(self.resend.isolated) and any(s.buffer and not s.inflight for s in workers)
        window = self.sizer.window
        return any(s.buffer and s.inflight < window(s.buffer) for s in workers)

    def _feed(self) -> None:
        for ident, slot in self.workers.items():
            if not slot.buffer:
                continue
            window = self.sizer.window(slot.buffer)
            while slot.inflight < window:
                if self.resend:
                    room = window - slot.inflight
                    group = self.resend.pick(not slot.inflight, room, self.sizer.size())
                    if group is not None:
                        self._resend_live(ident, slot, group)
                        continue
                if self.exhausted or self.stopping or self._ordered_full():
                    if self.resend.isolated:
                        break  # isolated events left: another worker may be idle
                    return
                batch = self._read_batch(min(window - slot.inflight, self.sizer.size()))
                if batch is None:
                    return
                self._send(ident, slot, batch)
                now = time.monotonic() if self.ledger.event_timeout_s is not None else 0.0
                self.ledger.add_lists(batch.uids, batch.positions, batch.enc, slot.name, now)

    def _resend_live(self, ident: bytes, slot: WorkerSlot, picked: list[LedgerEntry]) -> None:
        """Send ``picked`` (one attempt number) again in one message, but those confirmed
        meanwhile (their first result arrived after all)."""
        live = [e for e in picked if e.state.value != "confirmed"]
        if not live:
            return
        uids = [e.uid for e in live]
        self.ledger.resend_many(uids, slot.name)
        batch = Batch(
            [e.frames for e in live],
            uids,
            [e.position for e in live],
            u64([self.seq_of.get(uid, 0) for uid in uids]),
            packed=False,
        )
        batch.attempt = live[0].attempt
        self._send(ident, slot, batch)
        # transport shm: events from several extents were copied into a new one, which
        # must live until they are confirmed: the entries hold it, not the old ones
        for entry, frames in zip(live, batch.enc, strict=True):
            entry.frames = frames

    def _ordered_full(self) -> bool:
        """--ordered: stay within ``reorder_window`` events of the oldest unconfirmed one."""
        if not self.ordered:
            return False
        first = self.ledger.first_unconfirmed()
        if first is None:
            return False
        return self.next_seq - self.seq_of.get(first[0], self.next_seq) >= self.reorder_window

    def _events_to_read(self) -> int | None:
        total = self.source.total() if isinstance(self.source, Source) else None
        left = None if total is None else max(total - self.start_position, 0)
        if self.max_events:
            left = self.max_events if left is None else min(left, self.max_events)
        return left

    def _read_batch(self, n: int) -> Batch | None:
        # guided batch sizes: the work left, shared by the workers (batching.BatchSizer)
        if self.to_read is not None:
            self.sizer.remaining = max(self.to_read - self.read, 0)
        self.sizer.workers = max(len(self.workers), self.n_workers)
        if self.encoded:
            enc, uids, positions = read_encoded(self, self.it, n)
        else:
            enc, uids, positions = self._read_stores(n)
        if not enc:
            return None
        seq0 = self.next_seq
        self.next_seq += len(enc)
        if self.ordered:
            self.seq_of.update(zip(uids, range(seq0, self.next_seq), strict=True))
        seqs = u64(range(seq0, self.next_seq))
        return Batch(enc, uids, positions, seqs, self.sizer.packed)

    def _read_stores(self, n: int) -> tuple[list[Any], list[int], list[int]]:
        """Up to ``n`` events from the source, through the input path, encoded."""
        enc: list[Any] = []
        uids: list[int] = []
        positions: list[int] = []
        chain, it, clock = self.chain, self.it, time.perf_counter
        current = chain.run
        while len(enc) < n:
            if self.max_events and self.read >= self.max_events:
                self.exhausted = True
                break
            t0 = clock()
            try:
                store: DataStore = next(it)
            except StopIteration:
                self.exhausted = True
                break
            except EvflowError:
                raise
            except Exception as exc:
                raise ModuleError(
                    self.source.name, "events", None, exc, user_traceback(exc)
                ) from exc
            chain.add_source_time(clock() - t0)
            self.read += 1
            meta = store.meta
            if current is None or current.run != meta.run or current.experiment != meta.experiment:
                chain.switch_run(meta.experiment, meta.run)
                current = chain.run
            if not chain.event(store):
                self.dropped += 1
                continue
            frames = encode_event(store)
            if not enc:
                self.sizer.observe_size(frames_nbytes(frames))
                n = min(n, self.sizer.size())
            enc.append(frames)
            uids.append(meta.uid)
            positions.append(self.start_position + self.read - 1)
        return enc, uids, positions

    def _send(self, ident: bytes, slot: WorkerSlot, batch: Batch) -> None:
        bid = self.next_bid
        self.next_bid += 1
        header = {"b": bid, "a": batch.attempt, "u": u64(batch.uids), "s": batch.seqs}
        placed = None
        if self.shm is not None and not batch.packed and batch.enc:
            placed = self.shm.place(batch.enc)  # None: the arena is full, use the socket
        if placed is not None:
            header["n"] = np.array([len(e) for e in placed], dtype=np.uint16).tobytes()
            header["p"] = False
            header.update(placed.where)
            payload: list[Any] = []
            batch.enc = placed  # the ledger holds the extent until every event is confirmed
        else:
            payload = pack_batch(batch.enc, header, batch.packed)
        if batch.packed and payload:  # the ledger keeps the sent bytes, not the chunks
            batch.enc = PackedEvents(payload[0], cast(bytes, header["n"]), cast(bytes, header["l"]))
        self.router.send_multipart(
            [ident, *encode_message(MsgType.EVENTS, header, payload)],
            copy=placed is not None or not self.sizer.zero_copy,  # (shm: small frames only)
        )
        slot.inflight += batch.n

    # --- the workers (events) and the parent (ctl): who holds what ----------------------
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

    # --- the output (back): HELLO, CONFIRMs, quarantine and END -------------------------
    def _on_output(self, frames: list[Any]) -> None:
        ident = frames[0].bytes
        msg = decode_message(frames[1:])
        if msg.type == MsgType.HELLO:
            self._output_hello(ident, frames[0], msg.header)
            return
        if ident != self.output_id:  # only the output the input knows may confirm or end
            raise refuse("unknown-peer", f"{msg.type.name} on the back socket from a stranger")
        if msg.type == MsgType.CONFIRM:
            if len(msg.payload) != 1 or len(msg.payload[0]) % 8:
                raise refuse("bad-confirm", "CONFIRM payload is not one frame of uint64 uids")
            uids = from_u64(msg.payload[0].buffer).tolist()
            self.ledger.confirm(uids)
            if self.ordered:
                pop = self.seq_of.pop
                for uid in uids:
                    pop(uid, None)
        elif msg.type == MsgType.GOODBYE:
            if not self.output_end_sent:
                raise refuse("early-goodbye", "GOODBYE from the output before END was sent")
            self.done = True
        else:
            raise refuse("unexpected", f"{msg.type.name} on the back socket")

    def _output_hello(self, ident: bytes, frame: Any, header: dict[Any, Any]) -> None:
        """An output introduces itself: the first one, or a restarted one (the previous
        output is dead). Anything else saying HELLO here is refused: taken for a new
        output, it would make the input send every unconfirmed event to nowhere."""
        if header.get("role") != "output" or header.get("name") != "output":
            raise refuse("bad-hello", f"HELLO on the back socket from {_short(header)}")
        pid = field_int(header, "pid", 1, 2**31)
        sender = peer_pid(frame)
        if sender is not None and sender != pid:
            raise refuse("bad-hello", f"HELLO of output pid {pid} sent by process {sender}")
        if not is_sibling(pid) or any(s.pid == pid for s in self.workers.values()):
            raise refuse("bad-hello", f"HELLO of output pid {pid}: not the run's output")
        if self.output_id is not None and pid != self.output_pid and is_alive(self.output_pid):
            raise refuse("bad-hello", f"HELLO of output pid {pid}: output {self.output_pid} lives")
        restarted = self.output_id is not None
        self.output_id = ident
        self.output_pid = pid
        self.drain_sent = False  # (a new output must hear it too)
        if self.ordered:  # before anything else: where the output's order goes on
            order = encode_message(MsgType.ORDER, self._order_start())
            self.back.send_multipart([self.output_id, *order])
        if restarted:
            self._output_restarted()
        if self.unsent_quarantine:
            self._send_quarantine(self.unsent_quarantine)
            self.unsent_quarantine = []

    def _output_restarted(self) -> None:
        """A new output (the old one died): whatever it had not confirmed may be lost.

        Every unconfirmed event goes out again (workers may still deliver the first
        copies; the new output drops the uids its reopened files already hold).
        """
        entries = self.ledger.requeue_all("output restarted")
        self.resend.replace(e for e in entries if not e.poisoned)
        self.unsent_quarantine += [e for e in entries if e.poisoned]
        if self.end_for_output is not None:  # it died after END: the new one needs it
            assert self.output_id is not None  # (set by the HELLO that told us)
            self.back.send_multipart([self.output_id, *self.end_for_output])

    def _order_start(self) -> dict[str, Any]:
        """--ordered: the ORDER header for an output that said HELLO.

        ``seq``: the lowest unconfirmed seq (the output confirms in order: everything
        below is written); ``done``: seqs above it confirmed already (only while a
        restarted input catches up, when confirms of re-read events come out of order).
        """
        unconfirmed = set(self.seq_of.values())
        first = min(unconfirmed) if unconfirmed else self.next_seq
        done = [s for s in range(first, self.next_seq) if s not in unconfirmed]
        return {"seq": first, "done": done}

    def _quarantine(self, entries: list[LedgerEntry]) -> None:
        self.quarantined += len(entries)
        if self.quarantined > self.max_quarantined:
            last = self.last_error
            raise PeerLostError(
                f"{self.quarantined} events were quarantined (limit max_quarantined="
                f"{self.max_quarantined}); the run is stopped. Last failure: "
                f"{last if last is not None else entries[-1].reason}"
            )
        if self.output_id is None:  # the output has not said HELLO yet: send it then
            self.unsent_quarantine += entries
            return
        self._send_quarantine(entries)

    def _send_quarantine(self, entries: list[LedgerEntry]) -> None:
        header = {
            "b": -1,
            "a": max(e.attempt for e in entries),
            "u": u64([e.uid for e in entries]),
            "s": u64([self.seq_of.get(e.uid, 0) for e in entries]),
            "k": bytes([1] * len(entries)),
            "w": "input",
            "q": [e.reason for e in entries],
        }
        payload = pack_batch([e.frames for e in entries], header, packed=False)
        message = encode_message(MsgType.EVENTS, header, payload)
        assert self.output_id is not None
        self.back.send_multipart([self.output_id, *message])

    def _end_message(self) -> list[Any]:
        run = self.chain.run
        return encode_message(MsgType.END, {"run": [run.experiment, run.run] if run else None})

    def _maybe_end(self) -> None:
        if not (self.exhausted or self.stopping) or len(self.ledger) or self.resend:
            return
        if not self.end_sent:
            self.end_sent = True
            for ident in self.workers:
                self.router.send_multipart([ident, *self._end_message()])
        if self.workers or self.roster.coming or self.output_end_sent or self.output_id is None:
            return  # (a replacement still on its way gets END at its HELLO, then ends too)
        self.output_end_sent = True
        last = self.chain.run
        self.chain.end_run()
        self.chain.terminate()
        head, frames, skipped = encode_persistent(self.chain.persistent)
        header = {
            "workers": self.goodbye,
            "read": self.read,
            "dropped": self.dropped,
            "sent": self.next_seq - self.start_seq,
            "run": [last.experiment, last.run] if last else None,
            "skipped": skipped,
            "stopped": self.stopping,
        }
        message = encode_message(MsgType.END, header, [head, *frames])
        self.end_for_output = message
        self.back.send_multipart([self.output_id, *message])


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

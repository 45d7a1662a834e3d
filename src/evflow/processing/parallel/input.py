"""The input role: read the source, run the input path, hand out batches by credit.

Sockets: ROUTER ``events`` (worker DEALERs: HELLO, READY, GOODBYE in; EVENTS, END
out), ROUTER ``back`` (the output's DEALER: HELLO, CONFIRM, DONE in; END out) and a
DEALER to the parent's ``ctl`` (STOP, WORKER_LOST, KILL in; HELLO, RESULT, STATE
out).

Every batch sent stays in the in-flight table (keyed by batch id, holding the
encoded frames by reference) until the output CONFIRMs it written and flushed; a
WORKER_LOST from the parent puts that worker's unconfirmed batches back in the
queue with ``attempt + 1``. END goes to the workers only when nothing is in flight,
then to the output with the counts; the input exits after the output's DONE.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from typing import Any

import zmq

from evflow.errors import EvflowError, ModuleError, ProtocolError
from evflow.processing.chain import ModuleChain, user_traceback
from evflow.processing.datastore import DataStore
from evflow.processing.parallel.batching import BatchSizer, frames_nbytes, pack_batch, u64
from evflow.processing.parallel.common import channel, current_split, error_message
from evflow.processing.parallel.persist import encode_persistent
from evflow.wire.codec import encode_event
from evflow.wire.messages import (
    BadMessageCounter,
    MsgType,
    check_hello,
    decode_message,
    encode_message,
)

EXIT_ERROR = 3


class Batch:
    """One batch in flight: its events' encoded frames (by reference), uids and seqs."""

    __slots__ = ("attempt", "enc", "n", "packed", "seq0", "seqs", "uids", "worker")

    def __init__(self, enc: list[Any], uids: bytes, seqs: bytes, seq0: int, packed: bool):
        self.enc = enc
        self.uids = uids
        self.seqs = seqs
        self.seq0 = seq0
        self.n = len(enc)
        self.packed = packed
        self.worker = ""  # name of the worker it was last sent to
        self.attempt = 1


class _Slot:
    __slots__ = ("buffer", "inflight", "name", "pid")

    def __init__(self, name: str, pid: int) -> None:
        self.name = name
        self.pid = pid
        self.buffer = 0  # credit the worker announced (0 until its first READY)
        self.inflight = 0


def input_main(session: str, options: dict[str, Any]) -> int:
    """Entry point in the forked input process; returns the exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent relays interrupts
    ctx = zmq.Context()
    channels: list[Any] = []
    try:
        role = _Input(ctx, session, options, channels)
        signal.signal(signal.SIGTERM, role.on_term)
        return role.run()
    except EvflowError as exc:
        ctl = channels[0].socket
        ctl.send_multipart(error_message("input", exc))
        ctl.linger = 2000
        return EXIT_ERROR
    finally:
        for ch in channels:
            ch.close(linger_ms=ch.socket.linger)
        ctx.term()


class _Input:
    def __init__(
        self, ctx: zmq.Context[Any], session: str, options: dict[str, Any], channels: list[Any]
    ) -> None:
        channels.append(channel(ctx, session, "ctl", "dealer", "connect"))
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
        self.sizer = BatchSizer()
        self.workers: dict[bytes, _Slot] = {}
        self.goodbye: list[str] = []
        self.inflight: dict[int, Batch] = {}
        self.resend: collections.deque[Batch] = collections.deque()
        self.next_bid = 0
        self.next_seq = 0
        self.read = 0
        self.dropped = 0
        self.exhausted = False
        self.stopping = False
        self.abort = False
        self.end_sent = False
        self.output_id: bytes | None = None
        self.output_end_sent = False
        self.done = False
        self.bad = BadMessageCounter("input")
        self.it: Any = None

    def on_term(self, signum: int, frame: Any) -> None:
        self.abort = True

    # --- main loop ----------------------------------------------------------------------
    def run(self) -> int:
        self.chain.initialize()
        try:
            self.it = iter(self.source.events(0))
            poller = zmq.Poller()
            for s in (self.router, self.back, self.ctl):
                poller.register(s, zmq.POLLIN)
            handlers = {
                self.router: self._on_worker,
                self.back: self._on_output,
                self.ctl: self._on_ctl,
            }
            while not self.done:
                busy = self._can_feed()
                for sock, _ in poller.poll(0 if busy else 50):
                    self._drain(sock, handlers[sock])
                if self.abort:
                    return 1
                if busy:
                    self._feed()
                self._maybe_end()
        finally:
            close = getattr(self.it, "close", None)
            if close is not None:
                close()  # a generator source closes its files now
        stats = [s.as_dict() for s in self.chain.statistics()]
        result = {
            "role": "input",
            "name": "input",
            "stats": stats,
            "read": self.read,
            "dropped": self.dropped,
            "sent": self.next_seq,
            "bad": self.bad.total,
            "batches": self.next_bid,
        }
        self.ctl.send_multipart(encode_message(MsgType.RESULT, result))
        self.ctl.linger = 2000
        return 0

    def _drain(self, sock: zmq.Socket[Any], handler: Any) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handler(frames)
            except ProtocolError as exc:
                self.bad.record_error(exc)
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                self.bad.record("bad-header", f"{type(exc).__name__}: {exc}")

    def _on_worker(self, frames: list[bytes]) -> None:
        ident = frames[0]
        msg = decode_message(frames[1:])
        slot = self.workers.get(ident)
        if msg.type == MsgType.READY:
            if slot is None:
                return
            done = int(msg.header["credit"])
            if "t" in msg.header:
                slot.inflight -= done
                self.sizer.observe_work(float(msg.header["t"]))
            else:
                slot.buffer = max(done, 1)
        elif msg.type == MsgType.HELLO:
            check_hello(msg.header)
            self.workers[ident] = _Slot(str(msg.header["name"]), int(msg.header["pid"]))
            if self.end_sent:
                self.router.send_multipart([ident, *self._end_message()])
        elif msg.type == MsgType.GOODBYE and slot is not None:
            self.goodbye.append(slot.name)
            del self.workers[ident]

    def _on_output(self, frames: list[bytes]) -> None:
        msg = decode_message(frames[1:])
        if msg.type == MsgType.CONFIRM:
            pop = self.inflight.pop
            for bid in msg.header["b"]:
                pop(bid, None)
        elif msg.type == MsgType.HELLO:
            self.output_id = frames[0]
        elif msg.type == MsgType.GOODBYE:
            self.done = True

    def _on_ctl(self, frames: list[bytes]) -> None:
        msg = decode_message(frames)
        if msg.type == MsgType.STOP:
            self.stopping = True
        elif msg.type == MsgType.KILL:
            self.abort = True
        elif msg.type == MsgType.WORKER_LOST:
            self.requeue(str(msg.header["name"]))

    def requeue(self, name: str) -> int:
        """Put every unconfirmed batch of the lost worker ``name`` back in the queue.

        Each goes out again (to another worker) with ``attempt + 1``; returns how many
        events were re-queued. The output drops any uid it already wrote.
        """
        for ident, slot in list(self.workers.items()):
            if slot.name == name:
                del self.workers[ident]
        n = 0
        for bid in [b for b, batch in self.inflight.items() if batch.worker == name]:
            batch = self.inflight.pop(bid)
            batch.attempt += 1
            self.resend.append(batch)
            n += batch.n
        return n

    # --- feeding --------------------------------------------------------------------------
    def _can_feed(self) -> bool:
        if not self.resend and (self.exhausted or self.stopping):
            return False
        window = self.sizer.window
        return any(s.buffer and s.inflight < window(s.buffer) for s in self.workers.values())

    def _feed(self) -> None:
        for ident, slot in self.workers.items():
            if not slot.buffer:
                continue
            window = self.sizer.window(slot.buffer)
            while slot.inflight < window:
                if self.resend:
                    batch = self.resend.popleft()
                elif self.exhausted or self.stopping or self._ordered_full():
                    return
                else:
                    batch = self._read_batch(min(window - slot.inflight, self.sizer.size()))
                    if batch is None:
                        return
                self._send(ident, slot, batch)

    def _ordered_full(self) -> bool:
        """--ordered: stay within ``reorder_window`` events of the oldest unconfirmed one."""
        if not self.ordered or not (self.inflight or self.resend):
            return False
        oldest = min(b.seq0 for b in (*self.inflight.values(), *self.resend))
        return self.next_seq - oldest >= self.reorder_window

    def _read_batch(self, n: int) -> Batch | None:
        enc: list[Any] = []
        uids: list[int] = []
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
                if not self.sizer.packed:
                    n = 1
            enc.append(frames)
            uids.append(meta.uid)
        if not enc:
            return None
        seq0 = self.next_seq
        self.next_seq += len(enc)
        return Batch(enc, u64(uids), u64(range(seq0, self.next_seq)), seq0, self.sizer.packed)

    def _send(self, ident: bytes, slot: _Slot, batch: Batch) -> None:
        bid = self.next_bid
        self.next_bid += 1
        header = {"b": bid, "a": batch.attempt, "u": batch.uids, "s": batch.seqs}
        payload = pack_batch(batch.enc, header, batch.packed)
        self.router.send_multipart(
            [ident, *encode_message(MsgType.EVENTS, header, payload)], copy=False
        )
        batch.worker = slot.name
        self.inflight[bid] = batch
        slot.inflight += batch.n

    # --- the end ------------------------------------------------------------------------
    def _end_message(self) -> list[Any]:
        run = self.chain.run
        return encode_message(MsgType.END, {"run": [run.experiment, run.run] if run else None})

    def _maybe_end(self) -> None:
        if not (self.exhausted or self.stopping) or self.inflight or self.resend:
            return
        if not self.end_sent:
            self.end_sent = True
            for ident in self.workers:
                self.router.send_multipart([ident, *self._end_message()])
        if self.workers or self.output_end_sent or self.output_id is None:
            return
        self.output_end_sent = True
        last = self.chain.run
        self.chain.end_run()
        self.chain.terminate()
        head, frames, skipped = encode_persistent(self.chain.persistent)
        header = {
            "workers": self.goodbye,
            "read": self.read,
            "dropped": self.dropped,
            "sent": self.next_seq,
            "run": [last.experiment, last.run] if last else None,
            "skipped": skipped,
            "stopped": self.stopping,
        }
        message = encode_message(MsgType.END, header, [head, *frames])
        self.back.send_multipart([self.output_id, *message])

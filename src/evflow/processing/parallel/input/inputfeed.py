"""The input's feeding: read events from the source and send them by credit.

A mixin of ``input._Input`` (the attributes are the input's). Each worker announces
its credit (``WorkerSlot.buffer``); the input keeps at most a credit window of events
in flight per worker and fills it with re-sends first (``resend.py``), then with new
batches read through the input path or cut from encoded chunks (``fastpath.py``),
placed in shared memory or packed into one frame. Separate from the message handlers
because this is the hot path: what costs the input CPU per event is all here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import zmq

from evflow.errors import EvflowError, ModuleError
from evflow.event import DataStore
from evflow.processing.chain import ModuleChain, user_traceback
from evflow.processing.module import Source
from evflow.processing.parallel.batching import (
    BatchSizer,
    PackedEvents,
    frames_nbytes,
    pack_batch,
    u64,
)
from evflow.processing.parallel.input.fastpath import read_encoded
from evflow.processing.parallel.input.ledger import Ledger, LedgerEntry
from evflow.processing.parallel.input.resend import ResendQueue
from evflow.transport.shm import ShmArena
from evflow.wire.codec import encode_event
from evflow.wire.messages import MsgType, encode_message


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


class FeedMixin:
    """Reading and sending batches, for ``input._Input``."""

    router: zmq.Socket[Any]
    chain: ModuleChain
    source: Any
    it: Any
    encoded: bool
    sizer: BatchSizer
    ledger: Ledger
    resend: ResendQueue
    shm: ShmArena | None
    workers: dict[bytes, WorkerSlot]
    seq_of: dict[int, int]
    ordered: bool
    reorder_window: int
    max_events: int
    n_workers: int
    to_read: int | None
    start_position: int
    next_bid: int
    next_seq: int
    read: int
    dropped: int
    exhausted: bool
    stopping: bool

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

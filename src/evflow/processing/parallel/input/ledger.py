"""The input's ledger: every event sent and not yet confirmed written by the output.

The ledger, not the transport, decides that an event is safe (docs/architecture.md,
"End of stream is a message"). The input ``add``s an event when it first sends it and
keeps a reference to its encoded frames (no copy); the output ``confirm``s uids in batches
after it has written and flushed them. What is still in the ledger when a worker dies,
times out or the output restarts is sent again with ``attempt + 1``.
The rules of blame (which failure is charged to which event) are in
``_ledger_blame.py``, a mixin of ``Ledger``.

Cost per event: one dict insert and one delete by uid, one append to the per-worker
dict, and an amortised O(1) pop from a deque of send order for the checkpoint
position (positions are added in increasing order; no sorting).
"""

from __future__ import annotations

import collections
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from evflow.errors import ConfigurationError, InternalError
from evflow.processing.parallel.input._ledger_blame import LedgerBlame
from evflow.processing.parallel.input._ledger_records import (
    _CONFIRMED,
    _IN_FLIGHT,
    _PENDING,
    _POISONED,
    EntryState,
    Failure,
    LedgerEntry,
    LedgerStatistics,
    _Batch,
)

__all__ = ["EntryState", "Failure", "Ledger", "LedgerEntry", "LedgerStatistics"]

Clock = Callable[[], float]


class Ledger(LedgerBlame):
    """Events sent and not yet confirmed, keyed by uid.

    ``event_timeout_s`` is how long a worker may go without progress while holding an
    event (progress = one of its events confirmed, or ``progress(worker)``); ``None``
    disables timeouts. ``clock`` returns seconds (``time.monotonic`` by default).
    """

    # confirmed uids remembered (1 to 2 times this) to tell duplicate from unknown confirms
    RECENT_CONFIRMS = 65536

    def __init__(
        self,
        *,
        max_attempts: int = 3,
        event_timeout_s: float | None = None,
        start_position: int = 0,
        clock: Clock = time.monotonic,
    ) -> None:
        if max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be >= 1, got {max_attempts}")
        if event_timeout_s is not None and not event_timeout_s > 0:
            raise ConfigurationError(f"event_timeout_s must be > 0 or None, got {event_timeout_s}")
        self.max_attempts = max_attempts
        self.event_timeout_s = event_timeout_s
        self._clock = clock
        self._entries: dict[int, Any] = {}  # uid -> LedgerEntry, or its _Batch
        self._by_worker: dict[Hashable, dict[int, LedgerEntry]] = {}
        self._progress_s: dict[Hashable, float] = {}
        # per worker, its messages not yet finished, in order: [send number, events,
        # when sent]
        self._unfinished: dict[Hashable, deque[list[Any]]] = {}
        self._tracking = False  # progress() has been told event counts (READY)
        self._next_send = 1
        self._wbatches: dict[Hashable, dict[int, _Batch]] = {}  # worker -> send -> batch
        self._order: deque[Any] = deque()  # entries and batches, increasing position
        self._next_position = start_position
        # recently confirmed uids, two generations: tells duplicate confirms from unknown
        self._recent: set[int] = set()
        self._recent_old: set[int] = set()
        self._pending = 0
        self._poisoned_pending = 0
        self._max_unconfirmed = 0
        self._added = 0
        self._confirmed = 0
        self._duplicate_confirms = 0
        self._unknown_confirms = 0
        self._requeued = 0
        self._resent = 0
        self._failures = 0
        self._timeouts = 0
        self._poisoned = 0

    # --- the hot path -------------------------------------------------------------------
    def add(
        self,
        uid: int,
        position: int,
        worker: Hashable,
        frames: Sequence[Any],
        attempt: int = 1,
        now: float | None = None,
    ) -> LedgerEntry:
        """Record an event just sent to ``worker``. Positions must not decrease.

        ``now`` (clock seconds) saves a clock call per event when the caller adds a
        batch sent at one moment.
        """
        entry = LedgerEntry(
            uid, position, worker, self._clock() if now is None else now, attempt, frames
        )
        self._insert(entry, self._worker_dict(worker))
        entry.send = self._new_send(worker, 1)
        n = len(self._entries)
        if n > self._max_unconfirmed:
            self._max_unconfirmed = n
        return entry

    def add_batch(
        self,
        events: Iterable[tuple[int, int, Sequence[Any]]],
        worker: Hashable,
        now: float | None = None,
    ) -> int:
        """Record ``(uid, position, frames)`` events sent to ``worker`` in one message."""
        uids, positions, frames = [], [], []
        for uid, position, f in events:
            uids.append(uid)
            positions.append(position)
            frames.append(f)
        return self.add_lists(uids, positions, frames, worker, now)

    def add_lists(
        self,
        uids: Sequence[int],
        positions: Sequence[int],
        frames: Sequence[Any],
        worker: Hashable,
        now: float | None = None,
    ) -> int:
        """Record the events of one message to ``worker``: the fast path for batches.

        One record for the whole message and one dict insert per uid; the lists are
        kept by reference (the caller must not change them). Returns how many events.
        """
        n = len(uids)
        if not n:
            return 0
        if positions[0] < self._next_position or positions[-1] < positions[0]:
            raise InternalError(
                f"ledger: positions {positions[0]}..{positions[-1]} of a batch are below the "
                f"next expected position {self._next_position} or not increasing"
            )
        send = self._new_send(worker, n)
        batch = _Batch(uids, positions, frames, worker, self._clock() if now is None else now, send)
        entries = self._entries
        setdefault = entries.setdefault
        for uid in uids:
            if setdefault(uid, batch) is not batch:
                for u in uids:  # undo, then refuse
                    if entries.get(u) is batch:
                        del entries[u]
                raise InternalError(f"ledger: uid {uid} added twice (use resend() for a retry)")
        wb = self._wbatches.get(worker)
        if wb is None:
            wb = self._wbatches[worker] = {}
        wb[send] = batch
        self._order.append(batch)
        self._next_position = positions[-1] + 1
        self._added += n
        if len(entries) > self._max_unconfirmed:
            self._max_unconfirmed = len(entries)
        return n

    def _materialize(self, batch: _Batch) -> list[LedgerEntry]:
        """Give each still-unconfirmed event of ``batch`` its own entry (rare path)."""
        entries = self._entries
        made = []
        wdict = self._worker_dict(batch.worker)
        for i, uid in enumerate(batch.uids):
            if entries.get(uid) is batch:
                e = LedgerEntry(
                    uid, batch.positions[i], batch.worker, batch.sent_at_s, 1, batch.frames[i]
                )
                e.send = batch.send
                e.origin = batch
                entries[uid] = e
                wdict[uid] = e
                made.append(e)
        batch.open = 0
        batch.live += len(made)
        wb = self._wbatches.get(batch.worker)
        if wb is not None:
            wb.pop(batch.send, None)
        return made

    def _materialize_worker(self, worker: Hashable) -> None:
        """Every batch ``worker`` holds becomes entries, oldest first."""
        wb = self._wbatches.pop(worker, None)
        if not wb:
            return
        old = self._by_worker.pop(worker, {})
        for batch in sorted(wb.values(), key=lambda b: b.send):
            self._materialize(batch)
        merged = self._worker_dict(worker)
        merged.update(old)  # entries sent later (resends) after the batches
        ordered = sorted(merged.values(), key=lambda e: e.send)
        self._by_worker[worker] = {e.uid: e for e in ordered}

    def _entry(self, uid: int) -> LedgerEntry | None:
        obj = self._entries.get(uid)
        if type(obj) is _Batch:
            self._materialize(obj)
            obj = self._entries.get(uid)
        return obj

    def _insert(self, entry: LedgerEntry, wdict: dict[int, LedgerEntry]) -> None:
        uid, position = entry.uid, entry.position
        if self._entries.setdefault(uid, entry) is not entry:
            raise InternalError(f"ledger: uid {uid} added twice (use resend() for a retry)")
        if position < self._next_position:
            del self._entries[uid]
            raise InternalError(
                f"ledger: position {position} of uid {uid} is below the next expected "
                f"position {self._next_position} (positions must increase)"
            )
        self._next_position = position + 1
        self._order.append(entry)
        wdict[uid] = entry
        self._added += 1

    def confirm(self, uids: Iterable[int]) -> int:
        """The output wrote and flushed ``uids``; forget them. Returns how many were ours.

        A uid confirmed twice or never added is counted, not an error.
        """
        if not isinstance(uids, list):
            uids = list(uids)  # iterated twice below
        entries = self._entries
        pop = entries.pop
        recent = self._recent
        done = 0
        now: float | None = None
        last: _Batch | None = None  # consecutive uids mostly come from one batch
        touched: list[_Batch] = []
        missed: list[int] = []
        for uid in uids:
            entry = pop(uid, None)
            if entry is None:
                missed.append(uid)  # (rare path) told apart after the loop
                continue
            done += 1
            if type(entry) is _Batch:  # the hot path: an event of a batch, never failed
                entry.open -= 1
                if entry is not last:
                    last = entry
                    touched.append(entry)
                continue
            origin = entry.origin
            if origin is not None:
                origin.live -= 1
                if not origin.live and not origin.open:
                    origin.frames = ()  # done: its buffers (or shm extent) go now
            state = entry.state
            if state is _IN_FLIGHT:
                wdict = self._by_worker.get(entry.worker)
                if wdict is not None:
                    wdict.pop(uid, None)
                    if now is None:
                        now = self._clock()
                    self._progress_s[entry.worker] = now
            elif state is _PENDING:
                self._pending -= 1
            elif state is _POISONED:
                self._poisoned_pending -= 1
            entry.state = _CONFIRMED
            entry.frames = ()  # let the buffers go even if someone keeps the entry
        if missed:
            self._count_missed(uids, missed)
        # a uid not ours (counted above) in ``recent`` only makes a later repeat of it
        # count as a duplicate rather than unknown: both are only counted
        recent.update(uids)
        if touched:
            if now is None:
                now = self._clock()
            for batch in touched:  # once per batch, not per event
                self._progress_s[batch.worker] = now
                if not batch.open and not batch.live:
                    batch.frames = ()  # done: its buffers (or shm extent) go now
                    wb = self._wbatches.get(batch.worker)
                    if wb is not None:
                        wb.pop(batch.send, None)
        self._confirmed += done
        if len(self._recent) > self.RECENT_CONFIRMS:
            self._recent_old, self._recent = self._recent, set()
        self._trim_order()  # without it a run with no checkpoint kept every batch record
        return done

    def _count_missed(self, uids: list[int], missed: list[int]) -> None:
        """Count confirmed uids that were not ours: a duplicate if confirmed recently
        or listed twice in this confirm, else unknown. One pass over ``uids`` (a
        CONFIRM after worker churn or an input restart may hold thousands of them)."""
        recent, recent_old = self._recent, self._recent_old
        listed: collections.Counter[int] | None = None
        duplicates = 0
        for uid in missed:
            if uid in recent or uid in recent_old:
                duplicates += 1
                continue
            if listed is None:
                listed = collections.Counter(uids)
            if listed[uid] > 1:
                duplicates += 1
        self._duplicate_confirms += duplicates
        self._unknown_confirms += len(missed) - duplicates

    def checkpoint_position(self) -> int:
        """The lowest unconfirmed source position: every position below it is confirmed."""
        order = self._trim_order()
        return order[0].position if order else self._next_position

    def _trim_order(self) -> deque[Any]:
        """Drop the confirmed records at the head of the send order; the rest."""
        order = self._order
        while order:
            head = order[0]
            if type(head) is _Batch:
                if head.open or head.live:
                    break
            elif head.state is not _CONFIRMED:
                break
            order.popleft()
        return order

    # --- introspection ------------------------------------------------------------------
    def get(self, uid: int) -> LedgerEntry | None:
        return self._entry(uid)

    def __contains__(self, uid: object) -> bool:
        return uid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def in_flight(self, worker: Hashable) -> int:
        """How many unconfirmed events ``worker`` holds."""
        wdict = self._by_worker.get(worker)
        wb = self._wbatches.get(worker)
        return (len(wdict) if wdict else 0) + (sum(b.open for b in wb.values()) if wb else 0)

    def entries(self) -> list[LedgerEntry]:
        """All unconfirmed entries in position order (materializes every batch: slow)."""
        for worker in list(self._wbatches):
            self._materialize_worker(worker)
        return sorted(self._entries.values(), key=lambda e: (e.position, e.send))

    def first_unconfirmed(self) -> tuple[int, int] | None:
        """``(uid, position)`` of the unconfirmed event with the lowest position, or None.

        Exact, unlike ``checkpoint_position``, which may stop at the start of a batch
        whose first events are confirmed (--ordered needs the exact point: its seq is
        where the output's order continues). Cost: amortised O(1), plus the confirmed
        events at the head of a partly confirmed batch.
        """
        self.checkpoint_position()
        if not self._order:
            return None
        head = self._order[0]
        if type(head) is not _Batch:
            return head.uid, head.position
        entries = self._entries
        for uid, position in zip(head.uids, head.positions, strict=True):
            if uid in entries:
                return uid, position
        return None  # not reached: checkpoint_position() keeps only unfinished batches

    def statistics(self) -> LedgerStatistics:
        n = len(self._entries)
        return LedgerStatistics(
            in_flight=n - self._pending - self._poisoned_pending,
            pending=self._pending,
            poisoned_pending=self._poisoned_pending,
            unconfirmed=n,
            max_unconfirmed=self._max_unconfirmed,
            added=self._added,
            confirmed=self._confirmed,
            duplicate_confirms=self._duplicate_confirms,
            unknown_confirms=self._unknown_confirms,
            requeued=self._requeued,
            resent=self._resent,
            failures=self._failures,
            timeouts=self._timeouts,
            poisoned=self._poisoned,
            checkpoint_position=self.checkpoint_position(),
        )

    def __repr__(self) -> str:
        return (
            f"<Ledger unconfirmed={len(self._entries)} pending={self._pending} "
            f"poisoned={self._poisoned_pending} checkpoint={self.checkpoint_position()}>"
        )

    # --- internals ----------------------------------------------------------------------
    def _new_send(self, worker: Hashable, n_events: int) -> int:
        """Number a message of ``n_events`` events to ``worker``; remember it unfinished."""
        send = self._next_send
        self._next_send = send + 1
        q = self._unfinished.get(worker)
        if q is None:
            q = self._unfinished[worker] = deque()
        q.append([send, n_events, self._clock()])
        if not self._tracking and len(q) > 4096:
            q.popleft()  # nobody reports progress: keep this bounded
        return send

    def _worker_dict(self, worker: Hashable) -> dict[int, LedgerEntry]:
        wdict = self._by_worker.get(worker)
        if wdict is None:
            wdict = self._by_worker[worker] = {}
        return wdict

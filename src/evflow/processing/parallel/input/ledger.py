"""The input's ledger: every event sent and not yet confirmed written by the output.

The ledger, not the transport, decides that an event is safe (docs/architecture.md,
"End of stream is a message"). The input ``add``s an event when it first sends it and
keeps a reference to its encoded frames (no copy); the output ``confirm``s uids in batches
after it has written and flushed them. What is still in the ledger when a worker dies,
times out or the output restarts is sent again with ``attempt + 1``.

Cost per event: one dict insert and one delete by uid, one append to the per-worker
dict, and an amortised O(1) pop from a deque of send order for the checkpoint
position (positions are added in increasing order; no sorting).

The ledger's failures: who is charged when a worker dies, times out or fails. Apart
from the per-event path (add, confirm, checkpoint position), these are the rules for
the events that come back (deaths, timeouts, module failures, re-sends); ``progress``
is with them because blame is decided from it.

Blame. A worker holds up to ``event_buffer`` events, in several messages. A culprit
named by the caller (``culprit_uid``: the engine reads it from the shared-memory
scoreboard, which is exact) is charged alone and the worker's other events come back
uncharged; a culprit the worker does not hold (``-1``: it died between events)
charges nobody. Without a culprit (the scoreboard slot was unreadable) the ledger
guesses: when the caller reports finished work (``progress(worker, n_events=...)``,
from the worker's READY credit) it knows which message the worker was working on
when it died: if that message held one event, the event is charged a failure; if it
held several, they come back *isolated* (``isolate = True``: the input sends each
alone to a worker holding nothing else, so that their next failure is charged
exactly); the worker's other events come back uncharged. Without progress reports
every event of a worker that held several is a suspect. As a safety net every second
death an event is a suspect in is charged, so a poison event is quarantined after
``2 * max_attempts`` deaths even if the isolation is not honoured. An event charged
``max_attempts`` failures is *poisoned*: it is not retried; the input sends it raw to
the output to be written with ``FLAG_QUARANTINED`` and the reasons
(``entry.reasons``). A Python exception in a module is charged to its event only
(``fail``); the worker lives on.
"""

from __future__ import annotations

import collections
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from evflow.errors import ConfigurationError, InternalError
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


class Ledger:
    """Events sent and not yet confirmed, keyed by uid.

    ``event_timeout_s`` is how long a worker may go without progress while holding an
    event (progress = one of its events confirmed, or ``progress(worker)``); ``None``
    disables timeouts. ``clock`` returns seconds (``time.monotonic`` by default).
    """

    # (the types of what ``__init__`` sets, for the type checker)
    max_attempts: int
    event_timeout_s: float | None
    _clock: Callable[[], float]
    _tracking: bool
    _pending: int
    _poisoned_pending: int
    _requeued: int
    _resent: int
    _failures: int
    _timeouts: int
    _poisoned: int

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

    # --- blame: failures, timeouts and re-sends -----------------------------------------
    def progress(
        self, worker: Hashable, now: float | None = None, n_events: int | None = None
    ) -> None:
        """A sign of life from ``worker`` (e.g. new credit): restarts its timeout.

        ``n_events``: the worker finished that many events (its READY credit). Workers
        handle their messages in order, so the ledger then knows which message a
        worker is working on, and blames only that one when the worker dies.
        """
        self._progress_s[worker] = self._clock() if now is None else now
        if n_events is None:
            return
        self._tracking = True
        q = self._unfinished.get(worker)
        while q and n_events > 0:
            head = q[0]
            if head[1] > n_events:
                head[1] -= n_events  # partial credit (not sent by evflow's workers)
                break
            n_events -= head[1]
            q.popleft()

    def expired(self, now: float | None = None) -> list[LedgerEntry]:
        """Entries whose worker made no progress for ``event_timeout_s`` since they were sent.

        At most one per worker (its oldest event, the one it is working on); cost
        O(workers). The caller kills ``entry.worker`` and calls ``requeue_worker``.
        """
        if self.event_timeout_s is None:
            return []
        now = self._clock() if now is None else now
        if self._tracking:
            return self._expired_by_progress(now)
        found = []
        for worker in {*self._by_worker, *self._wbatches}:
            wdict = self._by_worker.get(worker)
            wb = self._wbatches.get(worker)
            oldest: Any = next(iter(wdict.values())) if wdict else None
            batch = next(iter(wb.values())) if wb else None
            if batch is not None and (oldest is None or batch.send < oldest.send):
                oldest = batch
            if oldest is None:
                continue
            start = max(oldest.sent_at_s, self._progress_s.get(worker, oldest.sent_at_s))
            if now - start > self.event_timeout_s:
                if type(oldest) is _Batch:
                    oldest = self._materialize(oldest)[0]
                found.append(oldest)
        return found

    def _expired_by_progress(self, now: float) -> list[LedgerEntry]:
        """With READY reports: a worker is late when the message it works on (its first
        unfinished one) started more than ``event_timeout_s`` ago, whether or not its
        events are still unconfirmed (a retry may have been confirmed meanwhile, and the
        worker would otherwise hang unnoticed). Returns one entry per late worker: its
        oldest unconfirmed event, or a placeholder with ``uid = -1``."""
        timeout_s = self.event_timeout_s
        assert timeout_s is not None
        found = []
        for worker, q in self._unfinished.items():
            if not q:
                continue
            _, _, sent_at_s = q[0]
            start = max(sent_at_s, self._progress_s.get(worker, sent_at_s))
            if now - start <= timeout_s:
                continue
            wb = self._wbatches.get(worker)
            if wb:
                self._materialize_worker(worker)
            wdict = self._by_worker.get(worker)
            if wdict:
                found.append(next(iter(wdict.values())))
            else:
                found.append(LedgerEntry(-1, -1, worker, sent_at_s, 0, ()))
        return found

    def requeue_unfinished(self, worker: Hashable, failure: Failure) -> list[LedgerEntry]:
        """``worker`` left in order (GOODBYE): take back the events of the messages it
        did not finish, uncharged. The events of messages it finished stay with it:
        their results are on their way to the output. Call ``requeue_worker`` later for
        whatever is still unconfirmed then. Without progress reports: ``requeue_worker``.
        """
        if not self._tracking:
            return self.requeue_worker(worker, failure, culprit_uid=-1)
        self._materialize_worker(worker)
        q = self._unfinished.pop(worker, None)
        wdict = self._by_worker.get(worker)
        if not wdict or not q:
            return []
        open_sends = {send for send, _, _ in q}
        back = [e for e in wdict.values() if e.send in open_sends]
        for entry in back:
            del wdict[entry.uid]
            self._back_to_pending(entry)
            entry.unstarted = True  # it left after a whole message, before these
        return back

    def requeue_worker(
        self, worker: Hashable, failure: Failure, culprit_uid: int | None = None
    ) -> list[LedgerEntry]:
        """``worker`` died or was killed: take back its unconfirmed events.

        Returns them all, each with ``attempt + 1``; the ones charged with
        ``max_attempts`` failures have ``state = POISONED`` (write them quarantined), the
        others ``PENDING`` (send them again with ``resend``). See the module doc for
        who is charged.
        """
        self._materialize_worker(worker)
        wdict = self._by_worker.pop(worker, None)
        self._progress_s.pop(worker, None)
        q = self._unfinished.pop(worker, None)
        if not wdict:
            return []
        entries = list(wdict.values())
        if culprit_uid is None and self._tracking:
            # we know the message it was working on: only its events are suspects
            current = q[0][0] if q else None
            suspects = [e for e in entries if e.send == current]
            # (a READY still unsent when the worker died can make a finished lone
            # message look current: rare, and bounded by max_attempts; see the docs)
            if len(suspects) == 1:
                culprit_uid = suspects[0].uid
            later = {send for send, _, _ in q} - {current} if q else set()
            for entry in entries:
                if entry.uid == culprit_uid:
                    self._charge(entry, failure)
                elif entry.send == current:
                    self._suspect(entry, failure)
                else:
                    self._back_to_pending(entry)
                    entry.unstarted = entry.send in later
            return entries
        if culprit_uid is None and len(entries) == 1:
            culprit_uid = entries[0].uid
        # results leave a worker one whole message at a time, in order: nothing of the
        # message it died in (the culprit's) or of any later one can have left it
        unstarted_from = None
        culprit = next((e for e in entries if e.uid == culprit_uid), None)
        if culprit is not None:
            unstarted_from = culprit.send
        elif culprit_uid == -1 and self._tracking and q and len(q) > 1:  # (READY may lag)
            unstarted_from = q[1][0]
        for entry in entries:
            if entry.uid == culprit_uid or (culprit_uid is None and entry.isolate):
                # an isolated event travelled alone: the failure is exactly its own
                self._charge(entry, failure)
            elif culprit_uid is None:
                self._suspect(entry, failure)
            else:
                self._back_to_pending(entry)
                entry.unstarted = unstarted_from is not None and entry.send >= unstarted_from
        return entries

    def _suspect(self, entry: LedgerEntry, failure: Failure) -> None:
        """``entry`` was in the message a worker died on, with others: isolate it."""
        entry.suspicions += 1
        entry.isolate = True
        if entry.suspicions % 2 == 0:  # the safety net: two deaths, one failure
            self._charge(entry, failure)
        else:
            self._back_to_pending(entry)

    def fail(self, uid: int, failure: Failure) -> LedgerEntry | None:
        """The worker survived but the event failed (a Python exception in a module).

        Returns the entry (``PENDING`` or ``POISONED``) or ``None`` if it is not ours
        any more (already confirmed).
        """
        entry = self._entry(uid)
        if entry is None or entry.state is not _IN_FLIGHT:
            return None
        wdict = self._by_worker.get(entry.worker)
        if wdict is not None:
            wdict.pop(uid, None)
        self._charge(entry, failure)
        return entry

    def requeue_all(self, reason: str = "output restarted") -> list[LedgerEntry]:
        """Every unconfirmed entry must be sent again (the output lost its results).

        Nobody is charged; in-flight entries become ``PENDING`` with ``attempt + 1``;
        poisoned entries stay poisoned (send them to the output again). Returns all
        entries in position order.
        """
        entries = self.entries()
        self._by_worker.clear()
        self._progress_s.clear()
        self._unfinished.clear()
        for entry in entries:
            if entry.state is _IN_FLIGHT:
                entry.reasons += (f"lost: {reason}",)
                self._back_to_pending(entry)
        return entries

    def resend(self, uid: int, worker: Hashable) -> LedgerEntry:
        """A ``PENDING`` entry is sent again to ``worker`` (its attempt already counted)."""
        return self.resend_many([uid], worker)[0]

    def resend_many(self, uids: Sequence[int], worker: Hashable) -> list[LedgerEntry]:
        """``PENDING`` entries are sent again to ``worker``, together in one message."""
        entries = []
        for uid in uids:
            entry = self._entries.get(uid)
            if entry is None or entry.state is not _PENDING:
                state = "confirmed or unknown" if entry is None else entry.state.value
                raise InternalError(f"ledger: resend of uid {uid}, which is {state}, not pending")
            entries.append(entry)
        send = self._new_send(worker, len(entries))
        now = self._clock()
        wdict = self._worker_dict(worker)
        for entry in entries:
            entry.state = _IN_FLIGHT
            entry.worker = worker
            entry.sent_at_s = now
            entry.send = send
            wdict[entry.uid] = entry
        self._pending -= len(entries)
        self._resent += len(entries)
        return entries

    def _charge(self, entry: LedgerEntry, failure: Failure) -> None:
        self._failures += 1
        if failure.kind == "timeout":
            self._timeouts += 1
        entry.failures += 1
        entry.reasons += (f"attempt {entry.attempt}: {failure}",)
        if entry.failures >= self.max_attempts:
            entry.state = _POISONED
            entry.worker = None
            self._poisoned += 1
            self._poisoned_pending += 1
        else:
            entry.isolate = True  # its next failure should be its own
            self._back_to_pending(entry)

    def _back_to_pending(self, entry: LedgerEntry) -> None:
        entry.state = _PENDING
        entry.unstarted = False  # (the callers that know better say so)
        entry.worker = None
        entry.attempt += 1
        self._pending += 1
        self._requeued += 1

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

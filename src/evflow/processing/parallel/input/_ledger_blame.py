"""The ledger's failures: who is charged when a worker dies, times out or fails.

A mixin of ``ledger.Ledger`` (the attributes, ``_entry``, ``_materialize*``,
``_new_send`` and ``_worker_dict`` are the ledger's). Separate from the
ledger's per-event path (add, confirm, checkpoint position) because these are the
rules for the events that come back (deaths, timeouts, module failures, re-sends);
``progress`` is here because blame is decided from it.

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

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from evflow.errors import InternalError
from evflow.processing.parallel.input._ledger_records import (
    _IN_FLIGHT,
    _PENDING,
    _POISONED,
    Failure,
    LedgerEntry,
    _Batch,
)


class LedgerBlame:
    """Failures, timeouts and re-sends, for ``ledger.Ledger``."""

    max_attempts: int
    event_timeout_s: float | None
    _clock: Callable[[], float]
    _entries: dict[int, Any]
    _by_worker: dict[Hashable, dict[int, LedgerEntry]]
    _progress_s: dict[Hashable, float]
    _unfinished: dict[Hashable, deque[list[Any]]]
    _wbatches: dict[Hashable, dict[int, _Batch]]
    _tracking: bool
    _pending: int
    _poisoned_pending: int
    _requeued: int
    _resent: int
    _failures: int
    _timeouts: int
    _poisoned: int

    if TYPE_CHECKING:  # the ledger's own, which these rules use

        def _materialize(self, batch: _Batch) -> list[LedgerEntry]: ...
        def _materialize_worker(self, worker: Hashable) -> None: ...
        def _entry(self, uid: int) -> LedgerEntry | None: ...
        def entries(self) -> list[LedgerEntry]: ...
        def _new_send(self, worker: Hashable, n_events: int) -> int: ...
        def _worker_dict(self, worker: Hashable) -> dict[int, LedgerEntry]: ...

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

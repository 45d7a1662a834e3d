"""The input's ledger: every event sent and not yet confirmed written by the output.

The ledger, not the transport, decides that an event is safe (DESIGN.md, "End of
stream is a message"). The unit is a *send*: one EVENTS message to one worker, under
a key the caller chooses (the batch id), holding one or many events whose encoded
frames are kept by reference (no copy). The output confirms keys in batches once it
has written and flushed their events; a confirmed send is forgotten.

Blame. A worker handles its sends in order and returns credit (READY) after each, so
``worker_done(worker, n_events)`` tells the ledger which sends it finished. When a
worker dies or times out, the first send it had not finished is the one it was
working on. If that send holds one event, the event is charged a failure. If it
holds many, nobody is charged: its events come back *isolated* (to be sent one per
message), so the next failure names the event exactly. The worker's other sends are
innocent and come back uncharged. An event charged ``max_attempts`` failures is
*poisoned*: never retried; the input sends it to the output to be written raw with
``FLAG_QUARANTINED``; the reasons are in ``entry.reasons``. A Python exception in a
module is reported for its event (``fail``): the worker lives on.

Cost: one ``LedgerEntry``-free record per *send* on the hot path (dict insert, deque
appends); per-event records are made only when a send fails. The checkpoint position
(lowest unconfirmed source position) is amortised O(1): sends are made in increasing
position order and popped from a deque once done.
"""

from __future__ import annotations

import enum
import signal
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evflow.errors import ConfigurationError, InternalError

Clock = Callable[[], float]


class EntryState(enum.Enum):
    IN_FLIGHT = "in-flight"  # part of a send to a worker (or to the output), unconfirmed
    PENDING = "pending"  # taken back, waiting to be sent again (take_pending)
    POISONED = "poisoned"  # max_attempts failures: to be written quarantined
    CONFIRMED = "confirmed"  # written and flushed by the output; gone from the ledger


# plain module globals: enum attribute lookups cost ~50 ns each on the hot path
_IN_FLIGHT = EntryState.IN_FLIGHT
_PENDING = EntryState.PENDING
_POISONED = EntryState.POISONED
_CONFIRMED = EntryState.CONFIRMED


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an attempt failed: ``kind`` is timeout, signal, exit, exception or lost."""

    kind: str
    detail: str

    @classmethod
    def timeout(cls, timeout_s: float) -> Failure:
        return cls("timeout", f"no result within event_timeout_s={timeout_s:g} s")

    @classmethod
    def from_returncode(cls, returncode: int) -> Failure:
        """A worker's exit: negative = killed by that signal (subprocess convention)."""
        if returncode < 0:
            signum = -returncode
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = "unknown signal"
            return cls("signal", f"worker killed by signal {signum} ({name})")
        return cls("exit", f"worker exited with code {returncode}")

    @classmethod
    def exception(cls, text: str) -> Failure:
        return cls("exception", text)

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


class LedgerEntry:
    """One event taken back from a failed send: what the retry or quarantine needs."""

    __slots__ = (
        "attempt",
        "failures",
        "frames",
        "isolate",
        "origin",
        "reasons",
        "state",
        "uid",
    )

    def __init__(self, uid: int, frames: Sequence[Any], attempt: int, origin: Send) -> None:
        self.uid = uid
        self.frames = frames  # the encoded event, by reference
        self.attempt = attempt  # the attempt it will be sent with next
        self.origin = origin  # the first send, which holds its source position
        self.state = _PENDING
        self.failures = 0  # attempts charged as failed
        self.isolate = False  # send it alone in a message, so its failure is its own
        self.reasons: tuple[str, ...] = ()  # why attempts failed, oldest first

    @property
    def position(self) -> int:
        """The source position of the first event of its original send (conservative)."""
        return self.origin.position

    @property
    def poisoned(self) -> bool:
        return self.state is _POISONED

    @property
    def reason(self) -> str:
        """All failure reasons, oldest first, as one line (for the quarantine record)."""
        return "; ".join(self.reasons)

    def __repr__(self) -> str:
        return (
            f"<LedgerEntry uid={self.uid} {self.state.value} attempt={self.attempt} "
            f"failures={self.failures}{' isolate' if self.isolate else ''}>"
        )


class Send:
    """One message of events to a worker (``worker`` None: a quarantine to the output).

    A first send carries the caller's ``uids`` (ints or little-endian uint64 bytes)
    and ``frames`` (one frame list per event); a retry carries ``entries``.
    """

    __slots__ = (
        "attempt",
        "detached",
        "entries",
        "finished",
        "frames",
        "key",
        "n",
        "open",
        "position",
        "sent_at_s",
        "state",
        "uids",
        "worker",
    )

    def __init__(
        self,
        key: Hashable,
        worker: Hashable | None,
        sent_at_s: float,
        attempt: int,
        position: int,
        n: int,
    ) -> None:
        self.key = key
        self.worker = worker
        self.sent_at_s = sent_at_s
        self.attempt = attempt
        self.position = position
        self.n = n  # events of this send still unconfirmed
        self.open = n  # first sends: events not yet confirmed, wherever they went
        self.state = _IN_FLIGHT
        self.finished = False  # the worker returned its credit (READY)
        self.uids: Any = None
        self.frames: Sequence[Any] = ()
        self.entries: list[LedgerEntry] | None = None
        self.detached: set[int] | None = None  # uids taken out by fail()

    def uid_list(self) -> list[int]:
        if self.entries is not None:
            return [e.uid for e in self.entries]
        if isinstance(self.uids, bytes | bytearray | memoryview):
            return np.frombuffer(self.uids, dtype="<u8").tolist()
        return list(self.uids)

    def __repr__(self) -> str:
        return (
            f"<Send key={self.key!r} worker={self.worker!r} n={self.n} "
            f"attempt={self.attempt} {self.state.value}>"
        )


@dataclass(frozen=True, slots=True)
class LedgerStatistics:
    """Counters of a ledger since it was made (units: events, except where noted)."""

    unconfirmed: int  # events not yet confirmed (= len(ledger))
    max_unconfirmed: int
    pending: int  # events taken back, waiting to be sent again
    poisoned_waiting: int  # poisoned events not yet sent to the output
    sends: int  # messages recorded (first sends, retries and quarantines)
    added: int  # events recorded by first sends
    confirmed: int  # events confirmed
    duplicate_confirms: int  # keys confirmed twice (a late result after a retry)
    unknown_confirms: int  # keys this ledger never had (or confirmed long ago)
    retries: int  # events sent again
    failures: int  # attempts charged as failed
    timeouts: int  # failures whose kind is timeout
    workers_lost: int  # requeue_worker calls for a worker that held events
    poisoned: int  # events that reached max_attempts
    checkpoint_position: int


class Ledger:
    """Sends not yet confirmed, keyed by the caller's send key (see the module doc).

    ``event_timeout_s``: how long a worker may work on one send without finishing it
    (None: no limit). ``clock`` returns seconds (``time.monotonic`` by default).
    """

    # confirmed keys remembered (1 to 2 times this) to tell duplicate from unknown confirms
    RECENT_CONFIRMS = 65536

    def __init__(
        self,
        *,
        max_attempts: int = 3,
        event_timeout_s: float | None = None,
        start_position: int = 0,
        clock: Clock = time.monotonic,
    ) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        if event_timeout_s is not None and not event_timeout_s > 0:
            raise ConfigurationError(f"event_timeout_s must be > 0 or None, got {event_timeout_s}")
        self.max_attempts = max_attempts
        self.event_timeout_s = event_timeout_s
        self._clock = clock
        self._sends: dict[Hashable, Send] = {}
        self._by_worker: dict[Hashable, deque[Send]] = {}  # sends not finished, in order
        self._worker_sends: dict[Hashable, dict[Hashable, Send]] = {}
        self._progress_s: dict[Hashable, float] = {}
        self._timed_out: dict[Hashable, Failure] = {}
        self._order: deque[Send] = deque()  # first sends, increasing position
        self._next_position = start_position
        self._pending: deque[LedgerEntry] = deque()
        self._isolated: deque[LedgerEntry] = deque()
        self._poisoned_q: deque[LedgerEntry] = deque()
        self._recent: set[Hashable] = set()
        self._recent_old: set[Hashable] = set()
        self._unconfirmed = 0
        self._n_pending = 0
        self._max_unconfirmed = 0
        self._n_sends = 0
        self._added = 0
        self._confirmed = 0
        self._duplicate_confirms = 0
        self._unknown_confirms = 0
        self._retries = 0
        self._failures = 0
        self._timeouts = 0
        self._workers_lost = 0
        self._poisoned = 0

    # --- the hot path -------------------------------------------------------------------
    def add_batch(
        self,
        key: Hashable,
        worker: Hashable,
        uids: Any,
        frames: Sequence[Any],
        position: int,
        end_position: int | None = None,
        attempt: int = 1,
        now: float | None = None,
    ) -> Send:
        """Record a first send of ``len(frames)`` events to ``worker`` under ``key``.

        ``uids``: the events' uids (ints, or uint64 little-endian bytes, read only on
        failure); ``frames``: one encoded frame list per event, kept by reference;
        ``position``: the source position of its first event, ``end_position`` the one
        after its last (default ``position + 1``); sends come in position order.
        """
        if position < self._next_position:
            raise InternalError(
                f"ledger: send {key!r} at source position {position}, below the previous "
                f"send's position {self._next_position - 1} (positions must not decrease)"
            )
        n = len(frames)
        send = Send(key, worker, self._clock() if now is None else now, attempt, position, n)
        send.uids = uids
        send.frames = frames
        self._record(send)
        self._next_position = position + 1 if end_position is None else end_position
        self._order.append(send)
        self._added += n
        return send

    def add(
        self, uid: int, position: int, worker: Hashable, frames: Sequence[Any], attempt: int = 1
    ) -> Send:
        """Record a send of one event whose key is its uid (one event per message)."""
        return self.add_batch(uid, worker, (uid,), (frames,), position, attempt=attempt)

    def confirm(self, keys: Iterable[Hashable]) -> int:
        """The output wrote and flushed these sends; forget them. Returns events confirmed.

        A key confirmed twice or never recorded is counted, not an error.
        """
        sends = self._sends
        done = 0
        for key in keys:
            send = sends.pop(key, None)
            if send is None:
                if key in self._recent or key in self._recent_old:
                    self._duplicate_confirms += 1
                else:
                    self._unknown_confirms += 1
                continue
            send.state = _CONFIRMED
            n = send.n
            done += n
            wsends = self._worker_sends.get(send.worker)
            if wsends is not None:
                wsends.pop(key, None)
            entries = send.entries
            if entries is None:
                send.open -= n
            else:
                for e in entries:
                    if e.state is _IN_FLIGHT:
                        e.state = _CONFIRMED
                        e.origin.open -= 1
            send.frames = ()  # let the buffers go even if someone keeps the send
            self._recent.add(key)
        self._confirmed += done
        self._unconfirmed -= done
        if len(self._recent) > self.RECENT_CONFIRMS:
            self._recent_old, self._recent = self._recent, set()
        return done

    def worker_done(self, worker: Hashable, n_events: int, now: float | None = None) -> None:
        """``worker`` returned credit for ``n_events`` events: its oldest sends are done."""
        self._progress_s[worker] = self._clock() if now is None else now
        q = self._by_worker.get(worker)
        while q and n_events > 0:
            send = q[0]
            if send.n > n_events and send.state is not _CONFIRMED:
                break  # partial credit: the send is still being worked on
            n_events -= send.n
            send.finished = True
            q.popleft()

    def checkpoint_position(self) -> int:
        """The lowest unconfirmed source position: every position below it is confirmed."""
        order = self._order
        while order and order[0].open <= 0:
            order.popleft()
        return order[0].position if order else self._next_position

    # --- failures -----------------------------------------------------------------------
    def expired(self, now: float | None = None) -> list[Send]:
        """The send each worker is working on, when it has taken too long.

        A worker is late when ``event_timeout_s`` passed since it started its current
        send (the later of its sending and the worker's last READY). Cost O(workers).
        The caller kills ``send.worker``, calls ``note_timeout`` and, once the death is
        seen, ``requeue_worker``.
        """
        if self.event_timeout_s is None:
            return []
        now = self._clock() if now is None else now
        found = []
        for worker, q in self._by_worker.items():
            while q and q[0].state is _CONFIRMED:  # confirmed before its READY came
                q.popleft()
            if not q or worker in self._timed_out:
                continue
            current = q[0]
            start = max(current.sent_at_s, self._progress_s.get(worker, current.sent_at_s))
            if now - start > self.event_timeout_s:
                found.append(current)
        return found

    def note_timeout(self, worker: Hashable) -> None:
        """``worker`` is being killed for a timeout: its requeue charges a timeout."""
        assert self.event_timeout_s is not None
        self._timed_out[worker] = Failure.timeout(self.event_timeout_s)

    def requeue_worker(
        self, worker: Hashable, failure: Failure, culprit_uid: int | None = None
    ) -> list[LedgerEntry]:
        """``worker`` died or was killed: take back every event it held, unconfirmed.

        The events of the send it was working on are charged (one event) or isolated
        (many), or only ``culprit_uid`` is charged if given; all others come back
        uncharged. Returns the entries: ``PENDING`` ones are handed out again by
        ``take_pending``, ``POISONED`` ones by ``take_poisoned``.
        """
        failure = self._timed_out.pop(worker, failure)
        q = self._by_worker.pop(worker, None)
        self._progress_s.pop(worker, None)
        wsends = self._worker_sends.pop(worker, None)
        if not wsends:
            return []
        self._workers_lost += 1
        current = next((s for s in (q or ()) if s.state is not _CONFIRMED), None)
        taken: list[LedgerEntry] = []
        for send in list(wsends.values()):
            del self._sends[send.key]
            send.state = _PENDING
            entries = self._take_entries(send)
            blamed = send is current and culprit_uid is None
            for e in entries:
                e.attempt += 1
                if e.uid == culprit_uid or (blamed and len(entries) == 1):
                    self._charge(e, failure, send.attempt)
                else:
                    e.isolate = e.isolate or blamed
                    self._to_pending(e)
            taken += entries
        return taken

    def fail(self, key: Hashable, uid: int, failure: Failure) -> LedgerEntry | None:
        """The event ``uid`` of send ``key`` failed but its worker lives (an exception).

        Call before confirming ``key``: the event is taken out of the send, charged
        and returned (``PENDING`` or ``POISONED``); None if the send is not ours any more.
        """
        send = self._sends.get(key)
        if send is None:
            return None
        if send.entries is not None:
            entry = next((e for e in send.entries if e.uid == uid and e.state is _IN_FLIGHT), None)
            if entry is None:
                return None
            send.entries = [e for e in send.entries if e is not entry]
        else:
            uids = send.uid_list()
            if uid not in uids or (send.detached and uid in send.detached):
                return None
            entry = LedgerEntry(uid, send.frames[uids.index(uid)], send.attempt, send)
            send.detached = (send.detached or set()) | {uid}  # send.open still counts it
        send.n -= 1
        entry.attempt = send.attempt + 1
        self._charge(entry, failure, send.attempt)
        return entry

    def requeue_all(self, reason: str = "output restarted") -> list[LedgerEntry]:
        """Every unconfirmed event must be sent again (the output lost its results).

        Nobody is charged; poisoned events stay poisoned (they go to the output again).
        """
        taken: list[LedgerEntry] = []
        for send in list(self._sends.values()):
            send.state = _PENDING
            for e in self._take_entries(send):
                e.reasons += (f"lost: {reason}",)
                if e.failures >= self.max_attempts:
                    e.state = _POISONED
                    self._poisoned_q.append(e)
                else:
                    e.attempt += 1
                    self._to_pending(e)
                taken.append(e)
        self._sends.clear()
        self._by_worker.clear()
        self._worker_sends.clear()
        self._progress_s.clear()
        self._timed_out.clear()
        return taken

    # --- sending again ------------------------------------------------------------------
    def take_pending(self, max_events: int) -> list[LedgerEntry]:
        """Events to send again in one message: one isolated event, or up to
        ``max_events`` others of the same attempt. Empty when nothing waits."""
        for queue in (self._isolated, self._pending):
            while queue and queue[0].state is not _PENDING:
                queue.popleft()  # confirmed by a late result meanwhile
        if self._isolated:
            return [self._isolated.popleft()]
        out: list[LedgerEntry] = []
        queue = self._pending
        while queue and len(out) < max_events:
            e = queue[0]
            if e.state is not _PENDING:
                queue.popleft()
                continue
            if out and e.attempt != out[0].attempt:
                break
            out.append(queue.popleft())
        return out

    def resend(
        self, key: Hashable, worker: Hashable, entries: list[LedgerEntry], now: float | None = None
    ) -> Send:
        """Record a send of ``entries`` (from ``take_pending``) to ``worker`` under ``key``."""
        for e in entries:
            if e.state is not _PENDING:
                raise InternalError(f"ledger: resend of {e!r}, which is not pending")
        send = self._send_entries(key, worker, entries, now)
        self._n_pending -= len(entries)
        self._retries += len(entries)
        return send

    def pending(self) -> int:
        """Events waiting to be sent again."""
        return self._n_pending

    def take_poisoned(self) -> list[LedgerEntry]:
        """Poisoned events not yet sent to the output (each once; see ``quarantine``)."""
        out = [e for e in self._poisoned_q if e.state is _POISONED]
        self._poisoned_q.clear()
        return out

    def quarantine(self, key: Hashable, entries: list[LedgerEntry]) -> Send:
        """Record the send of poisoned ``entries`` to the output (confirmed like any send)."""
        return self._send_entries(key, None, entries, None)

    # --- introspection ------------------------------------------------------------------
    def __len__(self) -> int:
        """Events not yet confirmed."""
        return self._unconfirmed

    def __contains__(self, key: object) -> bool:
        return key in self._sends

    def get(self, key: Hashable) -> Send | None:
        return self._sends.get(key)

    def in_flight(self, worker: Hashable) -> int:
        """Events ``worker`` holds (sent, unconfirmed)."""
        wsends = self._worker_sends.get(worker)
        return sum(s.n for s in wsends.values()) if wsends else 0

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics(
            unconfirmed=self._unconfirmed,
            max_unconfirmed=self._max_unconfirmed,
            pending=self._n_pending,
            poisoned_waiting=sum(1 for e in self._poisoned_q if e.state is _POISONED),
            sends=self._n_sends,
            added=self._added,
            confirmed=self._confirmed,
            duplicate_confirms=self._duplicate_confirms,
            unknown_confirms=self._unknown_confirms,
            retries=self._retries,
            failures=self._failures,
            timeouts=self._timeouts,
            workers_lost=self._workers_lost,
            poisoned=self._poisoned,
            checkpoint_position=self.checkpoint_position(),
        )

    def __repr__(self) -> str:
        return (
            f"<Ledger unconfirmed={self._unconfirmed} sends={len(self._sends)} "
            f"pending={self._n_pending} checkpoint={self.checkpoint_position()}>"
        )

    # --- internals ----------------------------------------------------------------------
    def _record(self, send: Send) -> None:
        if self._sends.setdefault(send.key, send) is not send:
            raise InternalError(f"ledger: send key {send.key!r} used twice")
        self._n_sends += 1
        self._unconfirmed += send.n
        if self._unconfirmed > self._max_unconfirmed:
            self._max_unconfirmed = self._unconfirmed
        if send.worker is not None:
            worker = send.worker
            q = self._by_worker.get(worker)
            if q is None:
                q = self._by_worker[worker] = deque()
                self._worker_sends[worker] = {}
            q.append(send)
            self._worker_sends[worker][send.key] = send

    def _send_entries(
        self, key: Hashable, worker: Hashable | None, entries: list[LedgerEntry], now: float | None
    ) -> Send:
        attempt = max((e.attempt for e in entries), default=1)
        send = Send(key, worker, self._clock() if now is None else now, attempt, -1, 0)
        send.entries = entries
        send.frames = [e.frames for e in entries]
        for e in entries:
            e.state = _IN_FLIGHT
        self._record(send)
        send.n = len(entries)  # after _record: these events are counted already
        return send

    def _take_entries(self, send: Send) -> list[LedgerEntry]:
        """The unconfirmed events of a send that is being taken back, as entries."""
        if send.entries is not None:
            entries = [e for e in send.entries if e.state is _IN_FLIGHT]
        else:
            detached = send.detached or ()
            entries = [
                LedgerEntry(uid, frames, send.attempt, send)
                for uid, frames in zip(send.uid_list(), send.frames, strict=True)
                if uid not in detached
            ]
        send.entries = entries
        send.frames = ()
        send.n = 0
        return entries

    def _charge(self, entry: LedgerEntry, failure: Failure, attempt: int) -> None:
        self._failures += 1
        if failure.kind == "timeout":
            self._timeouts += 1
        entry.failures += 1
        entry.reasons += (f"attempt {attempt}: {failure}",)
        if entry.failures >= self.max_attempts:
            entry.state = _POISONED
            entry.attempt = attempt
            self._poisoned += 1
            self._poisoned_q.append(entry)
        else:
            entry.isolate = True  # its next failure should be its own
            self._to_pending(entry)

    def _to_pending(self, entry: LedgerEntry) -> None:
        entry.state = _PENDING
        self._n_pending += 1
        (self._isolated if entry.isolate else self._pending).append(entry)

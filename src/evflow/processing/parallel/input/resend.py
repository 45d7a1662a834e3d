"""The input's queue of events to send again, and how they are grouped into messages.

Events come back from the ledger (a worker died, timed out or left; the output
restarted) as ``PENDING`` entries, and go again in these groups:

- an *isolated* event (``LedgerEntry.isolate``: charged, or a suspect of a death whose
  culprit is unknown) alone, to a worker with nothing in flight, so that its next
  failure is its own. It waits aside, in a queue of its own, and holds up neither
  the other re-sends nor new events (before, one at the head stopped all feeding,
  and the input spun until a worker was idle);
- events of messages their worker never began (``unstarted``: no result of them can
  exist) together, up to a batch;
- the unconfirmed events of one message the worker *finished* (their result may
  still be on its way) together, all of them and nothing else. Results leave a worker
  one whole message at a time, so the late result and the re-send hold the same
  events: whichever arrives second is all duplicates and is dropped with its
  histogram delta (``fills.py``). Such a group that dies again comes back whole, so a
  killed batch never turns into one message per event (which is what happened when
  every such event went alone: under a kill every 100 ms the re-sends grew to most
  of the traffic and the input's CPU per event twenty-fold).

One message carries one attempt number: a group stops at an entry of another attempt.

After a worker's death, the events of messages it finished are most likely written
already (their results left before it died; the output confirms within
``CONFIRM_INTERVAL_MAX_S``): ``add_after_death`` holds them back ``HOLD_S`` and only
those still unconfirmed then go again. A kill no longer makes the workers redo what
was done (under a kill every 100 ms that was a large share of the re-sends); a result
that really was lost with the worker costs ``HOLD_S`` of delay.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from evflow.processing.parallel.input.ledger import EntryState, LedgerEntry

#: how long a dead worker's finished messages wait for their CONFIRM before they go
#: again (s): above the output's longest confirm interval (0.25 s) plus transit
HOLD_S = 0.5


class ResendQueue:
    """Pending entries in the order they came back, and the isolated ones aside."""

    __slots__ = ("_held", "_isolated", "_queue")

    def __init__(self, entries: Iterable[LedgerEntry] = ()) -> None:
        self._queue: deque[LedgerEntry] = deque(entries)
        self._isolated: deque[LedgerEntry] = deque()
        self._held: deque[tuple[float, list[LedgerEntry]]] = deque()  # (due, entries)

    def append(self, entry: LedgerEntry) -> None:
        self._queue.append(entry)

    def extend(self, entries: Iterable[LedgerEntry]) -> None:
        self._queue.extend(entries)

    def add_after_death(self, entries: Iterable[LedgerEntry], now_s: float) -> None:
        """A dead worker's events: those of messages it finished are held back until
        ``now_s + HOLD_S`` (see the module doc), the others queue at once."""
        held = []
        for entry in entries:
            if entry.unstarted or entry.isolate:
                self._queue.append(entry)
            else:
                held.append(entry)
        if held:
            self._held.append((now_s + HOLD_S, held))

    def release(self, now_s: float) -> None:
        """Queue the held entries that are due and still unconfirmed."""
        held = self._held
        while held and held[0][0] <= now_s:
            _, entries = held.popleft()
            self._queue.extend(e for e in entries if e.state is EntryState.PENDING)

    def next_due_s(self) -> float | None:
        """When the next held entries are due (None: none held)."""
        return self._held[0][0] if self._held else None

    def replace(self, entries: Iterable[LedgerEntry]) -> None:
        """Start over with ``entries`` (an output restart hands back everything)."""
        self._queue = deque(entries)
        self._isolated.clear()
        self._held.clear()

    def __len__(self) -> int:
        return len(self._queue) + len(self._isolated) + sum(len(e) for _, e in self._held)

    def __bool__(self) -> bool:
        return bool(self._queue) or bool(self._isolated) or bool(self._held)

    def __iter__(self) -> Iterator[LedgerEntry]:
        yield from self._isolated
        yield from self._queue
        for _, entries in self._held:
            yield from entries

    def only_isolated(self) -> bool:
        """Nothing can go now but isolated entries (true when empty too; held ones
        are not due)."""
        self._set_isolated_aside()
        return not self._queue

    @property
    def isolated(self) -> int:
        """How many isolated entries wait for an idle worker."""
        return len(self._isolated)

    def pick(self, idle: bool, room: int, batch_size: int) -> list[LedgerEntry] | None:
        """The entries of the next message to a worker (``idle``: nothing in flight),
        with ``room`` events left in its window; None if none is for it.

        A finished message's group goes whole even when it exceeds ``room`` (it fit in
        a window once; splitting it would let a late result mix with new events).
        """
        if idle and self._isolated:
            return [self._isolated.popleft()]
        self._set_isolated_aside()
        queue = self._queue
        if not queue:
            return None
        head = queue.popleft()
        picked = [head]
        attempt = head.attempt
        if head.unstarted:
            limit = max(1, min(room, batch_size))
            while queue and len(picked) < limit:
                entry = queue[0]
                if entry.isolate:  # (a culprit amid its message's events)
                    self._isolated.append(queue.popleft())
                elif entry.unstarted and entry.attempt == attempt:
                    picked.append(queue.popleft())
                else:
                    break
        else:
            send = head.send  # (pending: still the number of the message it was in)
            while queue:
                entry = queue[0]
                if entry.isolate:
                    self._isolated.append(queue.popleft())
                elif entry.send == send and not entry.unstarted and entry.attempt == attempt:
                    picked.append(queue.popleft())
                else:
                    break
        return picked

    def _set_isolated_aside(self) -> None:
        queue = self._queue
        while queue and queue[0].isolate:
            self._isolated.append(queue.popleft())

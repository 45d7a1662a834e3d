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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from evflow.processing.parallel.ledger import LedgerEntry


class ResendQueue:
    """Pending entries in the order they came back, and the isolated ones aside."""

    __slots__ = ("_isolated", "_queue")

    def __init__(self, entries: Iterable[LedgerEntry] = ()) -> None:
        self._queue: deque[LedgerEntry] = deque(entries)
        self._isolated: deque[LedgerEntry] = deque()

    def append(self, entry: LedgerEntry) -> None:
        self._queue.append(entry)

    def extend(self, entries: Iterable[LedgerEntry]) -> None:
        self._queue.extend(entries)

    def replace(self, entries: Iterable[LedgerEntry]) -> None:
        """Start over with ``entries`` (an output restart hands back everything)."""
        self._queue = deque(entries)
        self._isolated.clear()

    def __len__(self) -> int:
        return len(self._queue) + len(self._isolated)

    def __bool__(self) -> bool:
        return bool(self._queue) or bool(self._isolated)

    def __iter__(self) -> Iterator[LedgerEntry]:
        yield from self._isolated
        yield from self._queue

    def only_isolated(self) -> bool:
        """Nothing waits but isolated entries (true when empty too)."""
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

"""The records the input's ledger keeps: entry states, failures, entries, batches.

Small classes of their own, apart from the ledger's rules (``ledger.py`` re-exports them).
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any


class EntryState(enum.Enum):
    IN_FLIGHT = "in-flight"  # sent to a worker, not confirmed
    PENDING = "pending"  # requeued, waiting to be sent again
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
    """One event sent and not confirmed. ``frames`` is the encoded event, by reference.

    A plain slotted class (not a dataclass) because one is made per event on the
    input's hot path; the rarely used fields have class-level defaults.
    """

    __slots__ = (
        "attempt",
        "failures",
        "frames",
        "isolate",
        "origin",
        "position",
        "reasons",
        "send",
        "sent_at_s",
        "state",
        "suspicions",
        "uid",
        "unstarted",
        "worker",
    )

    def __init__(
        self,
        uid: int,
        position: int,
        worker: Hashable | None,
        sent_at_s: float,
        attempt: int,
        frames: Sequence[Any],
    ) -> None:
        self.uid = uid
        self.position = position
        self.worker = worker
        self.sent_at_s = sent_at_s
        self.attempt = attempt
        self.frames = frames
        self.state = _IN_FLIGHT
        self.failures = 0  # attempts charged as failed
        self.suspicions = 0  # deaths it was in without being charged
        self.isolate = False  # send it to a worker holding nothing else
        # requeued from a message its worker never began: no result of it can exist,
        # so it may go again with others (a late result beside its re-send in one
        # batch would make that batch's histogram delta count it twice: fills.py)
        self.unstarted = False
        self.reasons: tuple[str, ...] = ()  # why attempts failed, oldest first
        self.send = 0  # number of the message it was last sent in (per ledger)
        self.origin: _Batch | None = None  # the batch it was first sent in, if any

    @property
    def poisoned(self) -> bool:
        return self.state is _POISONED

    @property
    def reason(self) -> str:
        """All failure reasons, oldest first, as one line (for the quarantine flag)."""
        return "; ".join(self.reasons)

    def __repr__(self) -> str:
        return (
            f"<LedgerEntry uid={self.uid} position={self.position} {self.state.value} "
            f"worker={self.worker!r} attempt={self.attempt} failures={self.failures}>"
        )


class _Batch:
    """Events first sent together (``add_batch``): one record instead of one per event.

    ``_entries`` maps each of its uids to the batch until something needs the event
    on its own (a failure, a timeout, ``get``): then the batch is *materialized* into
    ``LedgerEntry`` objects. ``open`` counts its uids still mapped to it, ``live`` its
    materialized entries not yet confirmed; it is done when both are 0.
    """

    __slots__ = ("frames", "live", "open", "positions", "send", "sent_at_s", "uids", "worker")

    def __init__(
        self,
        uids: Sequence[int],
        positions: Sequence[int],
        frames: Sequence[Any],
        worker: Hashable,
        sent_at_s: float,
        send: int,
    ) -> None:
        self.uids = uids
        self.positions = positions
        self.frames = frames
        self.worker = worker
        self.sent_at_s = sent_at_s
        self.send = send
        self.open = len(uids)
        self.live = 0

    @property
    def position(self) -> int:
        return self.positions[0]


@dataclass(frozen=True, slots=True)
class LedgerStatistics:
    """Counters of a ledger since it was made (units: events, except where noted)."""

    in_flight: int  # entries sent to a worker and not confirmed
    pending: int  # requeued entries waiting to be sent again
    poisoned_pending: int  # poisoned entries not yet confirmed written
    unconfirmed: int  # all entries (= len(ledger))
    max_unconfirmed: int
    added: int
    confirmed: int
    duplicate_confirms: int  # a uid confirmed twice (a late result after a retry)
    unknown_confirms: int  # a uid this ledger never had (or confirmed long ago)
    requeued: int  # entries sent back for another attempt
    resent: int  # events sent again (requeued ones confirmed meanwhile are not)
    failures: int  # attempts charged as failed
    timeouts: int  # failures whose kind is timeout
    poisoned: int  # entries that reached max_attempts
    checkpoint_position: int

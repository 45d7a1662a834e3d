"""``--ordered``: the output releases results in input order, through a bounded buffer.

The input numbers the events it sends, consecutively (``seq``, header ``s``; events
its own path drops get none); every copy of an event carries the same seq, and a
restarted input numbers its events as the first one did (it starts at its checkpoint's
position *and* seq). The output holds each result until every lower seq is released.
The input never runs more than ``reorder_window`` events ahead of its oldest
unconfirmed one, which bounds the buffer.

Duplicates hold their place. A uid the output already wrote (a late result after a
re-send, or an event re-sent after an output or input restart that the reopened file
already holds) is not written again, but its seq must still be passed: it enters the
buffer as a *skip*, released in turn without writing anything, and then confirmed
(the input may hold it). Dropping it on arrival, as the unordered output does, would
leave a hole at its seq and stall the buffer for ever.

Where the order starts. A fresh output starts at the run's first seq (0, or the
checkpoint's seq on ``--resume``). A restarted output does not know: it collects
until the input's ORDER message says where (``start_at``): the input's lowest
unconfirmed seq (the output confirms only in order, so every seq below it is written)
and the confirmed seqs above it, if any (a restarted input's catch-up confirms out of
order). A copy whose seq was already released is *late*: written or decided before,
it is only confirmed again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from evflow.errors import InternalError

#: ``frames`` of a duplicate: released in turn, confirmed, never written
SKIP: Any = object()
#: a seq the input reported confirmed (no uid): passed without anything to confirm
_HOLE = (SKIP, False, None)


class ReorderBuffer:
    """Results by seq, released in order: ``put``/``skip`` in, ``release`` out.

    ``start``: the first seq to release, or ``None`` when unknown until ``start_at``.
    Entries are ``(frames, quarantined, uid)``; ``frames`` is ``None`` for an event a
    module dropped and ``SKIP`` for a duplicate.
    """

    __slots__ = ("_buffer", "_late", "next_seq")

    def __init__(self, start: int | None = 0) -> None:
        self.next_seq = start
        self._buffer: dict[int, tuple[Any, bool, int | None]] = {}
        self._late: list[int] = []

    def put(self, seq: int, uid: int, frames: Any, quarantined: bool = False) -> None:
        """The first copy of ``uid`` this output sees: held until its turn."""
        self._hold(seq, (frames, quarantined, uid))

    def skip(self, seq: int, uid: int) -> None:
        """A duplicate of ``uid`` (already written or held): it holds its seq, nothing more."""
        self._hold(seq, (SKIP, False, uid))

    def _hold(self, seq: int, entry: tuple[Any, bool, int | None]) -> None:
        uid = entry[2]
        if self.next_seq is not None and seq < self.next_seq:
            self._late.append(uid)  # type: ignore[arg-type]
            return
        held = self._buffer.setdefault(seq, entry)
        if held is entry or held[2] == uid:
            return  # new, or the first copy is held already (it confirms the uid)
        if held[2] is None:
            self._late.append(uid)  # type: ignore[arg-type]
            return  # the input reported this seq confirmed: an earlier output decided it
        raise InternalError(
            f"--ordered: seq {seq} arrived with uid {uid} but holds uid {held[2]}: the "
            "input's numbering changed (does the source yield the same events from a "
            "position, and does the input path decide the same?)"
        )

    def start_at(self, seq: int, done: Iterable[int] = ()) -> None:
        """The input says every seq below ``seq``, and each in ``done``, is confirmed.

        The order moves on to ``seq`` (never back: a restarted input may report less
        than this output released); held copies of confirmed seqs become late.
        """
        buffer = self._buffer
        if self.next_seq is None or seq > self.next_seq:
            for s in [s for s in buffer if s < seq]:
                self._late_entry(buffer.pop(s))
            self.next_seq = seq
        for s in done:
            if s >= self.next_seq:
                held = buffer.get(s)
                if held is not None:
                    self._late_entry(held)
                buffer[s] = _HOLE

    def _late_entry(self, entry: tuple[Any, bool, int | None]) -> None:
        if entry[2] is not None:
            self._late.append(entry[2])

    def release(self) -> list[tuple[Any, bool, int]]:
        """Pop the entries whose turn came, in seq order (reported holes left out)."""
        out: list[tuple[Any, bool, int]] = []
        seq = self.next_seq
        if seq is None:
            return out
        buffer = self._buffer
        while seq in buffer:
            entry = buffer.pop(seq)
            seq += 1
            if entry[2] is not None:
                out.append(entry)  # type: ignore[arg-type]
        self.next_seq = seq
        return out

    def take_late(self) -> list[int]:
        """Uids of copies whose seq was released before: confirm them, write nothing."""
        late, self._late = self._late, []
        return late

    def __len__(self) -> int:
        return len(self._buffer)

    def __repr__(self) -> str:
        return f"<ReorderBuffer next_seq={self.next_seq} held={len(self._buffer)}>"

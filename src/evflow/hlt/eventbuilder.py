"""Event building: fragments tagged (event id, source id) in, whole events out.

:class:`EventBuilder` is pure logic (no sockets, an injectable clock) and works on
batches with numpy: per fragment it does no Python work, per event a little. The
events in construction live in a ring of ``capacity`` slots indexed by ``event id %
capacity``; the ring covers event ids ``[base, base + capacity)`` where ``base`` is the
oldest event still in construction. Per slot it keeps the event id, a bit mask of the
sources that delivered, the bytes, the time of the first fragment and, per source,
where the fragment is (message serial, offset, length). Fragments are not copied: a
built event refers to the received buffers.

An event leaves construction in one of three states (:class:`BuildState`):

- ``COMPLETE``: every expected source delivered;
- ``INCOMPLETE_TIMEOUT``: ``timeout_s`` passed since its first fragment, or every
  missing source has been silent for ``timeout_s`` (it stopped sending: the builder
  does not wait a full timeout per event for it, so it never stalls);
- ``INCOMPLETE_INFERRED``: every missing source has moved past this id (sources deliver
  in order, ``ordered=True``) or has ended.

Refused and counted, never stored: fragments of unknown sources, of events already
built (``late``), repeated fragments (``duplicate``), event ids more than
``past_window`` before ``base`` or ``future_window`` after it (``far``), ids below
``base`` that were never seen (``stale``: the builder had moved on).

Memory is bounded: at most ``max_events`` events and ``max_bytes`` fragment bytes in
construction. A fragment that would open a new event beyond a limit (or beyond the
ring) is not taken: :meth:`add` returns how many fragments of the batch it took, and
the caller keeps the rest (and withholds the sender's credit) until room is made.
Fragments for events already in construction are always taken, so the sources that
lag behind can still complete the oldest events.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from evflow.hlt.buildtypes import (
    MAX_SOURCES,
    BuilderConfig,
    BuilderCounters,
    BuildState,
    BuiltBatch,
)
from evflow.hlt.fragments import FragmentBatch

__all__ = [
    "MAX_SOURCES",
    "BuildState",
    "BuilderConfig",
    "BuilderCounters",
    "BuiltBatch",
    "EventBuilder",
]
_NEVER = np.iinfo(np.int64).max
#: batches up to this size take the scalar path (numpy's per-call cost dominates)
SMALL_BATCH = 8


class EventBuilder:
    """See the module docstring. ``clock`` gives seconds (default ``time.monotonic``)."""

    def __init__(self, config: BuilderConfig, clock: Callable[[], float] = time.monotonic) -> None:
        config.check()
        self.config = config
        self.clock = clock
        self.sources = [int(s) for s in config.sources]
        self._index = {s: k for k, s in enumerate(self.sources)}
        n = len(self.sources)
        self.full = np.uint64((1 << n) - 1)
        cap = 1024
        while cap < 2 * config.max_events:
            cap *= 2
        self.capacity = cap
        self._cmask = cap - 1
        self._ev = np.full(cap, -1, np.int64)
        self._mask = np.zeros(cap, np.uint64)
        self._nbytes = np.zeros(cap, np.int64)
        self._t0 = np.zeros(cap, np.float64)
        self._msg = np.zeros((cap, n), np.int64)
        self._off = np.zeros((cap, n), np.int64)
        self._len = np.zeros((cap, n), np.int64)
        w = 1 << max(10, (config.past_window - 1).bit_length())
        self._done = np.full(w, -1, np.int64)  # ring of built ids: finds late fragments
        self._wmask = w - 1
        self._bufs: dict[int, list[Any]] = {}  # serial -> [buffer, fragments referring]
        self._serial = 0
        self.base: int | None = None  # oldest id that may be in construction
        self._resume_base: int | None = None  # see resume()
        self.top = 0  # one past the highest id opened
        self.n_open = 0
        self.open_bytes = 0
        now = clock()
        self._last = np.full(n, -1, np.int64)  # highest id each source delivered
        self._heard = np.full(n, now)  # when each source last delivered
        self._ended = np.zeros(n, bool)
        self.counters = BuilderCounters()
        self.incomplete_by_source = dict.fromkeys(self.sources, 0)
        self._out: list[BuiltBatch] = []

    # --- input ----------------------------------------------------------------------------
    def add(self, batch: FragmentBatch, now: float | None = None) -> int:
        """Take fragments of ``batch``; return how many (from the front) were consumed,
        taken or refused. The caller keeps ``batch.tail(n)`` for later (back-pressure).
        """
        c = self.counters
        k = self._index.get(batch.source)
        if k is None:
            c.unknown_source += len(batch)
            return len(batch)
        if not len(batch):
            return 0
        now = self.clock() if now is None else now
        ids = batch.ids
        if self.base is not None and len(ids) <= SMALL_BATCH:
            return self._add_small(k, batch, now)
        if self.base is not None and self._add_run(k, batch, now):
            return len(ids)
        if self.base is None:
            first = int(ids[0])
            self.base = self.top = first if first >= 0 else 0
            if self._resume_base is not None:  # below it, its predecessor built all
                self.base = self.top = self._resume_base
            self._heard[:] = now  # silence is counted from the first fragment on
        base, cap = self.base, self.capacity
        self._heard[k] = now
        self._ended[k] = False
        far = (ids < base - self.config.past_window) | (ids >= base + self.config.future_window)
        if not self.n_open and not far.all():
            low = int(ids[~far].min())
            if low >= base + cap:  # nothing in construction: the ring may jump ahead
                self.base = base = low
        late = ~far & (self._done[ids & self._wmask] == ids)
        slot = ids & self._cmask
        existing = ~far & (self._ev[slot] == ids)
        bit = np.uint64(1 << k)
        dup = existing & ((self._mask[slot] & bit) != 0)
        fresh = ~(far | late | existing)
        stale = fresh & (ids < base)
        new = fresh & ~stale
        if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            # repeated ids inside the batch: only the first occurrence counts
            _, first_at = np.unique(ids, return_index=True)
            again = np.ones(len(ids), bool)
            again[first_at] = False
            dup |= again & (existing | new)
            new &= ~again
            existing &= ~again
        # how far into the batch we can go: new events only while there is room
        cut = len(ids)
        beyond = new & (ids >= base + cap)
        room_events = self.config.max_events - self.n_open
        over = beyond | (new & (np.cumsum(new) > room_events))
        take = existing & ~dup | new
        room_bytes = self.config.max_bytes - self.open_bytes
        over |= new & (np.cumsum(np.where(take, batch.lengths, 0)) > room_bytes)
        if self.n_open == 0 and len(over) and not beyond[0]:
            over[0] = False  # an empty builder takes one event whatever its size
        if over.any():
            cut = int(np.argmax(over))
            c.deferred += 1
        sl = slice(0, cut)
        far, late, dup, stale, new = far[sl], late[sl], dup[sl], stale[sl], new[sl]
        take = take[sl]
        c.far += int(far.sum())
        c.late += int(late.sum())
        c.duplicate += int(dup.sum())
        c.stale += int(stale.sum())
        if self.config.ordered and not far.all():
            self._last[k] = max(int(self._last[k]), int(ids[:cut][~far].max()))
        if take.any():
            self._take(k, bit, batch, take, new, slot[sl], now)
        return cut

    def _take(
        self,
        k: int,
        bit: np.uint64,
        batch: FragmentBatch,
        take: np.ndarray,
        new: np.ndarray,
        slot: np.ndarray,
        now: float,
    ) -> None:
        ids = batch.ids[: len(take)]
        nslots = slot[new]
        if len(nslots):
            self._ev[nslots] = ids[new]
            self._mask[nslots] = 0
            self._nbytes[nslots] = 0
            self._t0[nslots] = now
            self.n_open += len(nslots)
            self.top = max(self.top, int(ids[new].max()) + 1)
        tslots = slot[take]
        lens = batch.lengths[: len(take)][take]
        serial = self._serial
        self._serial += 1
        self._bufs[serial] = [batch.data, len(tslots)]
        self._mask[tslots] |= bit
        self._msg[tslots, k] = serial
        self._off[tslots, k] = batch.offsets[: len(take)][take]
        self._len[tslots, k] = lens
        self._nbytes[tslots] += lens
        nb = int(lens.sum())
        self.open_bytes += nb
        c = self.counters
        c.fragments += len(tslots)
        c.bytes += nb
        c.max_in_construction = max(c.max_in_construction, self.n_open)
        c.max_bytes_in_construction = max(c.max_bytes_in_construction, self.open_bytes)
        done = tslots[self._mask[tslots] == self.full]
        if len(done):
            self._emit(done, BuildState.COMPLETE)

    def _add_run(self, k: int, batch: FragmentBatch, now: float) -> bool:
        """The common case, on ring slices: consecutive ascending ids, all new events
        (with room for them) or all in construction and missing this source; the
        batch is taken whole. False (nothing done) for anything else: :meth:`add`."""
        ids, base, cap = batch.ids, self.base, self.capacity
        assert base is not None
        n = len(ids)
        first, last = int(ids[0]), int(ids[-1])
        s0 = first & self._cmask
        if first < base or last >= base + cap or last - first != n - 1 or s0 + n > cap:
            return False
        if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
            return False  # (first..last spans n ids: ascending means consecutive)
        sl = slice(s0, s0 + n)
        ev = self._ev[sl]
        bit = np.uint64(1 << k)
        lens = batch.lengths
        if ev[0] == first and ev[-1] == last and bool((ev == ids).all()):
            if (self._mask[sl] & bit).any():
                return False  # duplicates among them
            fresh = False
        else:
            d0 = first & self._wmask
            if (
                self.n_open + n > self.config.max_events
                or d0 + n > len(self._done)
                or (self.n_open and (ev == ids).any())  # (an empty ring holds no id)
                or (self._done[d0 : d0 + n] == ids).any()
            ):
                return False  # no room, partly in construction, late or wrapped
            nb = int(lens.sum())
            if self.open_bytes + nb > self.config.max_bytes:
                return False
            fresh = True
        cfg, c = self.config, self.counters
        self._heard[k] = now
        self._ended[k] = False
        if cfg.ordered and last > self._last[k]:
            self._last[k] = last
        if fresh:
            ev[:] = ids
            self._mask[sl] = 0
            self._nbytes[sl] = 0
            self._t0[sl] = now
            self.n_open += n
            self.top = max(self.top, last + 1)
        serial = self._serial
        self._serial += 1
        self._bufs[serial] = [batch.data, n]
        mask = self._mask[sl]
        mask |= bit
        self._msg[sl, k] = serial
        self._off[sl, k] = batch.offsets
        self._len[sl, k] = lens
        self._nbytes[sl] += lens
        nb = int(lens.sum()) if not fresh else nb
        self.open_bytes += nb
        c.fragments += n
        c.bytes += nb
        c.max_in_construction = max(c.max_in_construction, self.n_open)
        c.max_bytes_in_construction = max(c.max_bytes_in_construction, self.open_bytes)
        complete = mask == self.full
        if complete.all():  # the usual last source of a run: the whole slice is built
            self._emit_slice(sl)
        elif complete.any():
            self._emit(np.flatnonzero(complete) + s0, BuildState.COMPLETE, ascending=True)
        return True

    def _add_small(self, k: int, batch: FragmentBatch, now: float) -> int:
        """:meth:`add` fragment by fragment, for a few fragments (same rules)."""
        c, cfg = self.counters, self.config
        base = self.base
        assert base is not None
        bit = 1 << k
        full = int(self.full)
        ev, mask, done = self._ev, self._mask, self._done
        cap, cmask, wmask = self.capacity, self._cmask, self._wmask
        ids = batch.ids.tolist()
        lens = batch.lengths.tolist()
        offs = batch.offsets.tolist()
        self._heard[k] = now
        self._ended[k] = False
        serial = self._serial
        taken = 0
        complete = []
        cut = len(ids)
        seen_max = -1
        if not self.n_open:  # nothing in construction: the ring may jump ahead
            near = [e for e in ids if base - cfg.past_window <= e < base + cfg.future_window]
            if near and min(near) >= base + cap:
                self.base = base = min(near)
        for i, e in enumerate(ids):
            if e < base - cfg.past_window or e >= base + cfg.future_window:
                c.far += 1
                continue
            if int(done[e & wmask]) == e:
                c.late += 1
                seen_max = max(seen_max, e)
                continue
            slot = e & cmask
            m = int(mask[slot])
            if int(ev[slot]) == e:
                if m & bit:
                    c.duplicate += 1
                    seen_max = max(seen_max, e)
                    continue
            elif e < base:
                c.stale += 1
                seen_max = max(seen_max, e)
                continue
            else:
                if (
                    e >= base + cap
                    or self.n_open >= cfg.max_events
                    or (self.n_open and self.open_bytes + lens[i] > cfg.max_bytes)
                ):
                    cut = i
                    c.deferred += 1
                    break
                ev[slot] = e
                m = 0
                self._nbytes[slot] = 0
                self._t0[slot] = now
                self.n_open += 1
                if e >= self.top:
                    self.top = e + 1
            seen_max = max(seen_max, e)
            m |= bit
            mask[slot] = m
            self._msg[slot, k] = serial
            self._off[slot, k] = offs[i]
            self._len[slot, k] = lens[i]
            self._nbytes[slot] += lens[i]
            self.open_bytes += lens[i]
            c.bytes += lens[i]
            taken += 1
            if m == full:
                complete.append(slot)
        if taken:
            self._serial += 1
            self._bufs[serial] = [batch.data, taken]
            c.fragments += taken
            c.max_in_construction = max(c.max_in_construction, self.n_open)
            c.max_bytes_in_construction = max(c.max_bytes_in_construction, self.open_bytes)
        if cfg.ordered and seen_max >= 0 and seen_max > self._last[k]:
            self._last[k] = seen_max
        if complete:
            self._emit(np.array(complete, np.int64), BuildState.COMPLETE)
        return cut

    def resume(self, base: int, built: np.ndarray) -> None:
        """Go on from a dead predecessor (a restarted device): every event below
        ``base`` has left construction there, and ``built`` (ids) are events it built
        and sent on above it. Their fragments, sent again by senders that could not
        know, are then refused as ``late`` (or ``stale``): no event is built twice.
        Call it before the first :meth:`add`."""
        self._resume_base = max(int(base), 0)
        ids = np.asarray(built, np.int64)
        ids = ids[ids >= 0]
        self._done[ids & self._wmask] = ids

    def end_source(self, source: int) -> None:
        """``source`` sent its last fragment: events still missing it are inferred."""
        k = self._index.get(source)
        if k is not None:
            self._ended[k] = True

    # --- output -----------------------------------------------------------------------------
    def poll(self, now: float | None = None) -> None:
        """Time-outs and inferences; call it every few milliseconds."""
        if not self.n_open:
            return
        now = self.clock() if now is None else now
        slots = np.flatnonzero(self._ev >= 0)
        ids = self._ev[slots]
        missing = self.full & ~self._mask[slots]
        n = len(self.sources)
        timeout = self.config.timeout_s
        bits = (np.uint64(1) << np.arange(n, dtype=np.uint64)).astype(np.uint64)
        silent = (now - self._heard >= timeout) & ~self._ended
        silent_bits = np.uint64(int(bits[silent].sum()) if silent.any() else 0)
        ended_bits = np.uint64(int(bits[self._ended].sum()) if self._ended.any() else 0)
        if self.config.ordered:
            last = np.where(self._ended, _NEVER, self._last)
            past = (last[None, :] > ids[:, None]) * bits[None, :]
            past_bits = np.bitwise_or.reduce(past, axis=1) if n > 1 else past[:, 0]
        else:
            past_bits = np.full(len(ids), ended_bits, np.uint64)
        inferred = (missing & ~past_bits) == 0
        timed = ~inferred & (
            (self._t0[slots] + timeout <= now) | ((missing & ~(silent_bits | past_bits)) == 0)
        )
        if inferred.any():
            self._emit(slots[inferred], BuildState.INCOMPLETE_INFERRED)
        if timed.any():
            self._emit(slots[timed], BuildState.INCOMPLETE_TIMEOUT)

    def flush(self) -> None:
        """End of data: every event still in construction leaves, inferred incomplete."""
        if self.n_open:
            self._emit(np.flatnonzero(self._ev >= 0), BuildState.INCOMPLETE_INFERRED)

    def _emit(self, slots: np.ndarray, state: BuildState, ascending: bool = False) -> None:
        """``slots`` leave construction in ``state`` as one batch, in id order
        (``ascending``: they are already, e.g. complete events of consecutive slots)."""
        ids = self._ev[slots]
        if not ascending:
            order = np.argsort(ids, kind="stable")
            slots, ids = slots[order], ids[order]
        if state is BuildState.COMPLETE:  # every source present: nothing to blank
            missing = np.zeros(len(slots), np.uint64)
            lens = self._len[slots]
            msg = self._msg[slots]
            used = msg.ravel()
            present = None
        else:
            mask = self._mask[slots]
            missing = self.full & ~mask
            present = ((mask[:, None] >> np.arange(len(self.sources), dtype=np.uint64)) & 1).astype(
                bool
            )
            lens = np.where(present, self._len[slots], 0)
            msg = np.where(present, self._msg[slots], -1)
            used = msg[present]
        batch = BuiltBatch(
            self.sources,
            ids,
            np.full(len(ids), int(state), np.uint8),
            missing,
            lens,
            msg,
            self._off[slots].copy(),
            self._release(used),
        )
        self._leave(slots, batch, state, present)

    def _emit_slice(self, sl: slice) -> None:
        """:meth:`_emit` of the complete events of consecutive slots ``sl`` (ascending
        ids): slices instead of index arrays, the common case of a paced stream."""
        ids = self._ev[sl].copy()
        msg = self._msg[sl].copy()
        batch = BuiltBatch(
            self.sources,
            ids,
            np.zeros(len(ids), np.uint8),  # BuildState.COMPLETE
            np.zeros(len(ids), np.uint64),
            self._len[sl].copy(),
            msg,
            self._off[sl].copy(),
            self._release(msg.ravel()),
        )
        self._leave(sl, batch, BuildState.COMPLETE, None)

    def _release(self, used: np.ndarray) -> dict[int, Any]:
        """The buffers that the fragments of message serials ``used`` refer to; those
        whose every fragment has now left construction are let go here."""
        if not used.size:
            return {}
        lo = int(used.min())
        counts = np.bincount(used - lo)  # serials are consecutive: cheaper than unique
        serials = np.flatnonzero(counts)
        bufs = {}
        for s, n in zip((serials + lo).tolist(), counts[serials].tolist(), strict=True):
            entry = self._bufs[s]
            bufs[s] = entry[0]
            entry[1] -= n
            if entry[1] <= 0:
                del self._bufs[s]
        return bufs

    def _leave(
        self,
        where: np.ndarray | slice,
        batch: BuiltBatch,
        state: BuildState,
        present: np.ndarray | None,
    ) -> None:
        """The slots ``where`` (an index array or a slice) hold the events of ``batch``:
        free them, count the batch, move ``base`` on and queue it."""
        ids = batch.ids
        self._done[ids & self._wmask] = ids
        self._ev[where] = -1
        self.n_open -= len(ids)
        self.open_bytes -= int(self._nbytes[where].sum())
        c = self.counters
        c.built += len(ids)
        if state is BuildState.COMPLETE:
            c.complete += len(ids)
        else:
            if state is BuildState.INCOMPLETE_TIMEOUT:
                c.incomplete_timeout += len(ids)
            else:
                c.incomplete_inferred += len(ids)
            assert present is not None
            per = present.shape[0] - present.sum(axis=0)
            for k, src in enumerate(self.sources):
                self.incomplete_by_source[src] += int(per[k])
        assert self.base is not None
        if not self.n_open:
            self.base = self.top
        elif int(ids[0]) <= self.base:
            self.base = int(self._ev[self._ev >= 0].min())
        self._out.append(batch)

    def take_built(self) -> list[BuiltBatch]:
        """The batches built since the last call, oldest first."""
        out, self._out = self._out, []
        return out

    def built_events(self) -> Iterator[tuple[BuiltBatch, int]]:
        for b in self.take_built():
            for i in range(len(b)):
                yield b, i

    # --- figures ----------------------------------------------------------------------------
    @property
    def incomplete(self) -> int:
        return self.counters.incomplete_timeout + self.counters.incomplete_inferred

    def metrics(self) -> dict[str, Any]:
        """What goes on the bus: counters, in construction, incomplete per missing source."""
        c = self.counters
        return {
            "built": c.built,
            "complete": c.complete,
            "incomplete": self.incomplete,
            "incomplete_timeout": c.incomplete_timeout,
            "incomplete_inferred": c.incomplete_inferred,
            "incomplete_by_source": {str(k): v for k, v in self.incomplete_by_source.items()},
            "late": c.late,
            "duplicate": c.duplicate,
            "unknown_source": c.unknown_source,
            "far": c.far,
            "stale": c.stale,
            "fragments": c.fragments,
            "bytes": c.bytes,
            "in_construction": self.n_open,
            "bytes_in_construction": self.open_bytes,
            "max_in_construction": c.max_in_construction,
            "max_bytes_in_construction": c.max_bytes_in_construction,
            "deferred": c.deferred,
        }

    def summary_line(self) -> str:
        c = self.counters
        return (
            f"event builder: built {c.built}, incomplete {self.incomplete}, "
            f"late {c.late}, duplicate {c.duplicate}"
        )

"""A worker's event: meta read at once, objects decoded only when a module asks.

Decoding a 1 kB event costs a worker ~5 µs; a module that looks only at the meta (or
at nothing: filters on counters, no-op or pure-CPU modules) never needs it. A
:class:`LazyEvent` reads the meta from the fixed-offset header bytes (``peek_meta``,
< 1 µs) and decodes the rest on the first access to any object. An event no module
opened is forwarded as the frames it arrived in (:func:`untouched`).

Decoding still validates every byte it uses (``CodecError`` on bad frames, from the
module's first access instead of before the path); frames nobody opens are passed on
unread, as the worker already did for events the modules left unchanged.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from evflow.errors import CodecError
from evflow.event import DataStore, EventMeta
from evflow.processing.parallel.batching import unpack_batch
from evflow.wire.check import quick_meta
from evflow.wire.codec import decode_event, peek_meta
from evflow.wire.header import EVENT_PREFIX, META, META_END, META_START


class LazyEvent(DataStore):
    """A ``DataStore`` over encoded frames; the objects are decoded on first use."""

    __slots__ = ("_before", "_frames")

    def __init__(self, frames: Sequence[Any], meta: EventMeta | None = None) -> None:
        # the worker passes the meta it read for the whole batch at once
        self.meta = peek_meta(frames) if meta is None else meta
        self.persistent = {}
        self._frames: Sequence[Any] | None = frames
        self._objects = None  # type: ignore[assignment]
        self._before: list[tuple[str, Any]] = []

    def load(self) -> None:
        """Decode the objects now (``EVFLOW_NO_FASTPATH``: workers decode every event)."""
        self._load()

    @classmethod
    def decoded(cls, frames: Sequence[Any]) -> LazyEvent:
        """The event in ``frames`` decoded at once (``CodecError`` if it does not
        decode), keeping the frames for :meth:`as_received`."""
        store = decode_event(frames)
        event = cls(frames, store.meta)
        event._objects = store.objects
        event._before = list(store.objects.items())
        return event

    @classmethod
    def checked(cls, frames: Sequence[Any]) -> LazyEvent:
        """The event in ``frames``, known to decode (``CodecError`` if it does not):
        a one-frame event of plain values and arrays is checked on its parsed header
        (``quick_meta``) and decoded only if someone opens it; any other is decoded
        now (:meth:`decoded`)."""
        meta = quick_meta(frames)
        return cls.decoded(frames) if meta is None else cls(frames, meta)

    def _load(self) -> dict[str, Any]:
        objects = self._objects
        if objects is None:
            assert self._frames is not None
            objects = self._objects = decode_event(self._frames).objects
            self._before = list(objects.items())  # what untouched() compares against
        return objects

    def as_received(self) -> Sequence[Any] | None:
        """The frames the event came in while they still say what it holds: the
        objects never opened or left as decoded (:func:`untouched`) and the meta as in
        the frames. None otherwise (encode the event). A writer writes them as they are."""
        frames = self._frames
        if frames is None or (self._objects is not None and not untouched(self)):
            return None
        m = self.meta
        if type(m) is not EventMeta:
            return None
        try:
            fields = META.pack(m.uid, m.experiment, m.run, m.event, m.flags, m.attempt)
        except struct.error:
            return None
        return frames if frames[0][META_START:META_END] == fields else None

    @property
    def loaded(self) -> bool:
        """Whether a module asked for the objects (they were decoded)."""
        return self._objects is not None

    def __getitem__(self, key: str) -> Any:
        self._load()
        return DataStore.__getitem__(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        self._load()
        DataStore.__setitem__(self, key, value)

    def __delitem__(self, key: str) -> None:
        self._load()
        DataStore.__delitem__(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def __contains__(self, key: object) -> bool:
        return key in self._load()

    @property
    def objects(self) -> dict[str, Any]:
        return self._load()

    def __repr__(self) -> str:
        return f"<DataStore uid={self.meta.uid} objects={sorted(self._load())}>"


def untouched(store: LazyEvent) -> bool:
    """True when the modules left the objects as received (never opened, or unchanged).

    Decoded arrays are read-only views, so identity is enough for them; dicts and
    lists could have been changed in place, so a store holding one counts as changed.
    """
    objects = store._objects
    if objects is None:
        return True
    before = store._before
    if len(objects) != len(before):
        return False
    get = objects.get
    for key, value in before:
        if get(key) is not value or isinstance(value, dict | list):
            return False
    return True


# --- a received batch: one object per event, nothing else made until asked ------------
_PREFIX_WORD = np.uint64(int.from_bytes(EVENT_PREFIX, "little"))
_PREFIX_MASK = np.uint64((1 << (8 * len(EVENT_PREFIX))) - 1)
_MASK64 = (1 << 64) - 1


def _fields(m: EventMeta) -> tuple[int, ...]:
    return (m.uid, m.experiment, m.run, m.event, m.flags, m.attempt)


class ReceivedBatch:
    """The events of one received EVENTS batch, for the worker's event loop.

    Most of a worker's cost per 1 kB event was objects nobody used: a frame list and
    an ``EventMeta`` per event, made before any module ran (~0.6 µs). Here a packed
    batch is read with numpy once (every event header checked; the meta columns the
    worker needs: experiment, run, attempt) and an event's frames and ``EventMeta``
    are made only when a module (or the worker, to re-encode) asks for them.
    ``attempt`` is the batch's attempt: every meta handed out carries it.

    Raises ``CodecError`` for a header frame that is not an event header (as
    ``peek_metas_at`` did) and ``ValueError`` for counts that do not add up.
    """

    __slots__ = (
        "_blob", "_ends", "_events", "_first", "_head_offsets", "_heads", "_lengths",
        "_rows", "_starts", "attempt", "experiment", "n", "run", "stale", "touched",
    )  # fmt: skip

    def __init__(self, header: dict[str, Any], payload: Sequence[Any], attempt: int) -> None:
        self.attempt = attempt
        #: events a module opened or asked the meta of (an index may repeat)
        self.touched: list[int] = []
        counts = np.frombuffer(header["n"], dtype=np.uint16)
        self.n = n = len(counts)
        self._events: list[list[Any]] | None = None
        self._blob: Any = None
        self._head_offsets: Any = None  # numpy until the first meta(), then a list
        self._lengths: Any = None
        self._heads: Any = None
        self._starts: list[int] = []  # per frame, made on the first frames()
        self._ends: list[int] = []
        self._first: list[int] = []  # per event: index of its first frame
        self._rows: list[tuple[int, ...]] = []  # unpacked batches: each event's meta
        self.experiment: Any  # per event: numpy columns (packed) or lists
        self.run: Any
        #: events whose frames carry another attempt than the batch's (re-encoded)
        self.stale: list[int]
        if not n or not header["p"]:
            # large events (or none): a frame list each; per-event cost is noise here
            events = self._events = unpack_batch(header, payload) if n else []
            rows = self._rows = [_fields(peek_meta(frames)) for frames in events]
            # plain lists: a batch of one 1 MB event must not pay numpy's per-call cost
            self.experiment = [row[1] for row in rows]
            self.run = [row[2] for row in rows]
            self.stale = [i for i, row in enumerate(rows) if row[5] != attempt]
            return
        blob = payload[0]
        data = np.frombuffer(blob, dtype=np.uint8)
        lengths = np.frombuffer(header["l"], dtype=np.uint32).astype(np.intp)
        if int(counts.sum()) != len(lengths):
            raise ValueError(f"batch says {int(counts.sum())} frames, carries {len(lengths)}")
        ends = np.cumsum(lengths)
        if int(ends[-1]) > len(data):
            raise ValueError(f"batch frames need {int(ends[-1])} bytes, payload has {len(data)}")
        heads = np.cumsum(counts, dtype=np.intp) - counts
        head_starts = (ends - lengths)[heads]
        short = np.flatnonzero(lengths[heads] <= META_END)
        if len(short):
            raise CodecError(f"event {int(short[0])} of the batch: header frame too short")
        # 8-byte words that start at every byte of the payload (an overlapping view):
        # one gather per field instead of copying every header's 53 bytes
        words = np.ndarray((len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))
        bad = np.flatnonzero(words[head_starts] & _PREFIX_MASK != _PREFIX_WORD)
        if len(bad):
            raise CodecError(f"event {int(bad[0])} of the batch: not a single-event header")
        meta_starts = head_starts + META_START
        self._blob = blob
        self._lengths = lengths
        self._heads = heads
        self._head_offsets = meta_starts
        self.experiment = words[meta_starts + 8].view(np.int64)
        self.run = words[meta_starts + 16].view(np.int64)
        self.stale = np.flatnonzero(words[meta_starts + 40] != attempt & _MASK64).tolist()

    def runs(self) -> list[tuple[int, int, int, int]]:
        """``(start, stop, experiment, run)`` of each stretch of events of one run."""
        n = self.n
        if not n:
            return []
        e, r = self.experiment, self.run
        if type(e) is list:
            cuts = [i for i in range(1, n) if e[i] != e[i - 1] or r[i] != r[i - 1]]
        else:
            cuts = (np.flatnonzero((e[1:] != e[:-1]) | (r[1:] != r[:-1])) + 1).tolist()
        bounds = [0, *cuts, n]
        return [(a, b, int(e[a]), int(r[a])) for a, b in pairwise(bounds)]

    def stores(self) -> list[BatchEvent]:
        """One :class:`BatchEvent` per event, in batch order."""
        return [BatchEvent(self, i) for i in range(self.n)]

    def frames(self, i: int) -> list[Any]:
        """The frames of event ``i`` (memoryviews into the received payload)."""
        if self._events is not None:
            return self._events[i]
        if not self._first:  # first call in this batch: frame offsets as lists
            ends = np.cumsum(self._lengths)
            self._ends = ends.tolist()
            self._starts = (ends - self._lengths).tolist()
            self._first = [*self._heads.tolist(), len(self._ends)]
        blob, starts, stops = self._blob, self._starts, self._ends
        return [blob[starts[k] : stops[k]] for k in range(self._first[i], self._first[i + 1])]

    def meta(self, i: int) -> EventMeta:
        """A new ``EventMeta`` of event ``i``, carrying the batch's attempt."""
        meta = EventMeta(*self._row(i))
        meta.attempt = self.attempt
        return meta

    def _row(self, i: int) -> tuple[int, ...]:
        """Event ``i``'s meta fields as in its frames (``EventMeta`` order)."""
        if self._events is not None:
            return self._rows[i]
        offsets = self._head_offsets
        if type(offsets) is not list:
            offsets = self._head_offsets = offsets.tolist()
        return META.unpack_from(self._blob, offsets[i])  # type: ignore[no-any-return]

    def changed(self, stores: Sequence[BatchEvent], kept: bytearray) -> set[int]:
        """Kept events whose received frames are no longer right: re-encode those.

        Stale ones (the frames carry another attempt), those whose meta differs from
        the frames' (but for the attempt, which is the batch's), and those a module
        opened and may have changed (:func:`untouched`).
        """
        out = {i for i in self.stale if kept[i]}
        for i in set(self.touched):
            if not kept[i] or i in out:
                continue
            store = stores[i]
            meta = store._meta
            if meta is not None:
                row = self._row(i)
                if (
                    type(meta) is not EventMeta
                    or (meta.uid, meta.experiment, meta.run, meta.event, meta.flags) != row[:5]
                ):
                    out.add(i)
                    continue
            if store._objects is not None and not untouched(store):
                out.add(i)
        return out


class BatchEvent(LazyEvent):
    """An event of a :class:`ReceivedBatch`: its frames and meta are made on first use.

    ``meta`` is a property here (a module that reads it pays ~0.1 µs more per read
    than for a plain attribute; the no-op and pure-CPU modules that never read it
    save ~0.6 µs per event). Anything that opens the event or its meta is noted in
    the batch's ``touched`` list, so the worker checks only those for changes.
    """

    __slots__ = ("_batch", "_i", "_meta")

    def __init__(self, batch: ReceivedBatch, i: int) -> None:
        self._batch = batch
        self._i = i
        self._meta: EventMeta | None = None
        self._objects = None  # type: ignore[assignment]

    @property  # type: ignore[override]
    def meta(self) -> EventMeta:
        meta = self._meta
        if meta is None:
            meta = self._meta = self._batch.meta(self._i)
            self._batch.touched.append(self._i)
        return meta

    @meta.setter
    def meta(self, value: EventMeta) -> None:
        self._meta = value
        self._batch.touched.append(self._i)

    def as_received(self) -> None:
        return None  # the worker forwards the batch's frames itself (changed())

    def _load(self) -> dict[str, Any]:
        objects = self._objects
        if objects is None:
            objects = self._objects = decode_event(self._batch.frames(self._i)).objects
            self._before = list(objects.items())  # what untouched() compares against
            self._batch.touched.append(self._i)
        return objects

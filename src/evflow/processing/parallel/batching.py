"""Events in batches: the EVENTS message layout and the adaptive batch size.

An EVENTS message carries one batch. Its header holds numpy arrays as bytes so that
a batch costs a handful of Python operations, not a handful per event:

- ``b`` batch id, ``a`` attempt, ``u`` uids (uint64), ``s`` input sequence numbers
  (uint64), ``n`` frames per event (uint16);
- small events are *packed*: ``p`` true, ``l`` frame lengths (uint32) and a single
  payload frame, the concatenated frames (one copy of a few hundred kB, far cheaper
  than one zmq frame per event);
- large events travel one per message, their frames as separate zero-copy frames.

Results going from a worker to the output use the same layout plus ``k`` (uint8 per
event of ``u``: 1 kept, 0 dropped by a module) and ``w`` (the worker's name); only
kept events are in the payload.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from evflow.event import EventMeta
from evflow.wire.codec import peek_meta, peek_metas_at

#: events whose encoded size is below this travel packed in batches (bytes)
PACK_LIMIT_B = 64 * 1024
#: aim for batches of about this many bytes (1 MB: 100 kB events moved 1.4-1.5x faster
#: than with 256 kB, 1 kB events ~1.1x; BENCHMARKS.md) ...
TARGET_BATCH_B = 1024 * 1024
#: expensive events: a batch holds at least about this much work (s) ...
TARGET_BATCH_WORK_S = 0.004
#: ... and, while much work is left, up to this much. Every message wakes the input and
#: the output (~0.3 ms of CPU each on these VMs), taken from busy workers: with 10 ms
#: events one event per batch cost 6 % of 2 cores, 20 events per batch ~1 %.
MAX_BATCH_WORK_S = 0.5
#: guided self-scheduling: a batch gets at most 1/(GUIDED_SHARES * workers) of the work
#: not yet sent, so batches shrink towards TARGET_BATCH_WORK_S as the run ends and the
#: workers finish together
GUIDED_SHARES = 2
#: a batch holds at most this fraction of event_timeout_s of work (the timeout watches
#: a worker's progress message by message)
TIMEOUT_SHARE = 0.25
MAX_BATCH_EVENTS = 1024
#: while workers are being lost (killed, crashed, timed out), a batch holds at most this
#: share of the mean time between losses (and at least TARGET_BATCH_WORK_S): a loss then
#: costs a bounded amount of work to re-do, and few events go again. `evflow demo
#: --chaos` (a worker SIGKILLed every 0.2 s, 1 % of attempts hang) with batches of up to
#: 0.25 s of work re-sent 480 k events for 20 k read in 69 s; with 4 ms, 25 k in 46 s.
#: Results leave a worker one batch at a time, so a batch cut by a hang is all re-done.
LOSS_SHARE = 0.02
#: ... and forgets the losses after this many mean intervals without one (full batches
#: again: a fault-free run never pays for the smaller messages)
LOSS_MEMORY = 10.0
#: with transport shm the bytes of large events do not cross the sockets: a message
#: may then point at this many bytes (8 MB: a few 1 MB events share one message)
SHM_TARGET_BATCH_B = 8 * 1024 * 1024
#: frames at least this large are sent without a copy; below it a memcpy is cheaper than
#: pyzmq's zero-copy bookkeeping (measured here: ~40 us per zero-copy frame on 2 cores)
ZERO_COPY_MIN_B = 512 * 1024

_U64 = np.uint64


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Bytes in an encoded event's frames."""
    return sum(len(f) if isinstance(f, bytes) else memoryview(f).nbytes for f in frames)


def pack_batch(encoded: Sequence[Sequence[Any]], header: dict[str, Any], packed: bool) -> list[Any]:
    """Fill ``header`` (``n``, ``p``, ``l``) and return the payload frames of a batch.

    ``encoded`` may be a :class:`PackedEvents` (the input's fast path joins a batch
    of contiguous source rows at once): packed, it goes out as its one buffer.
    """
    if packed and type(encoded) is PackedEvents:
        header["n"], header["p"], header["l"] = encoded.counts, True, encoded.lengths
        return [encoded.blob]
    counts = [len(fr) for fr in encoded]
    if not counts:  # every event of the batch was dropped: no payload at all
        header["n"] = b""
        header["p"] = packed
        return []
    header["n"] = np.array(counts, dtype=np.uint16).tobytes()
    header["p"] = packed
    flat = [f for fr in encoded for f in fr]
    if not packed:
        return flat
    header["l"] = np.array(
        [len(f) if isinstance(f, bytes) else memoryview(f).nbytes for f in flat],
        dtype=np.uint32,
    ).tobytes()
    return [b"".join(flat)]


def unpack_batch(header: dict[str, Any], payload: Sequence[Any]) -> list[list[Any]]:
    """The per-event frame lists of a batch (memoryviews into the received frames)."""
    counts = np.frombuffer(header["n"], dtype=np.uint16).tolist()
    if not counts:
        return []
    if header["p"]:
        blob = memoryview(payload[0])
        lengths = np.frombuffer(header["l"], dtype=np.uint32)
        ends = np.cumsum(lengths).tolist()
        starts = [0, *ends[:-1]]
        frames: list[Any] = [blob[s:e] for s, e in zip(starts, ends, strict=True)]
    else:
        frames = [memoryview(f) for f in payload]
    if sum(counts) != len(frames):
        raise ValueError(f"batch says {sum(counts)} frames, carries {len(frames)}")
    out = []
    i = 0
    for c in counts:
        out.append(frames[i : i + c])
        i += c
    return out


class PackedEvents(Sequence[list[memoryview]]):
    """The events of a packed batch payload as a sequence of frame lists, made on demand.

    The input's ledger keeps a sent batch as this one buffer (the bytes that went out)
    instead of per-event frames that would keep the source's chunk buffers alive: a
    1 kB event stream ran ~15 % faster (BENCHMARKS.md, "Reliability"). Re-sends, rare,
    slice their event out of it.
    """

    __slots__ = ("_blob", "_counts", "_lengths", "_starts")

    def __init__(self, blob: bytes | memoryview, counts: bytes, lengths: bytes) -> None:
        self._blob = blob
        self._counts = counts
        self._lengths = lengths
        self._starts: list[int] | None = None  # first frame index of each event

    def __len__(self) -> int:
        return len(self._counts) // 2  # u16 per event

    @property
    def blob(self) -> bytes | memoryview:
        """The events' frames back to back."""
        return self._blob

    @property
    def counts(self) -> bytes:
        """Frames per event (u16 each), as the ``n`` of an EVENTS header."""
        return self._counts

    @property
    def lengths(self) -> bytes:
        """Frame lengths (u32 each), as the ``l`` of an EVENTS header."""
        return self._lengths

    def __getitem__(self, i: int) -> list[memoryview]:  # type: ignore[override]
        counts = np.frombuffer(self._counts, dtype=np.uint16)
        if self._starts is None:
            self._starts = [0, *np.cumsum(counts).tolist()]
        n = len(counts)
        if not -n <= i < n:
            raise IndexError(f"event {i} of a batch of {n}")
        i %= n
        lengths = np.frombuffer(self._lengths, dtype=np.uint32)
        first, last = self._starts[i], self._starts[i + 1]
        offset = int(lengths[:first].sum())
        view = memoryview(self._blob)
        frames = []
        for length in lengths[first:last].tolist():
            frames.append(view[offset : offset + length])
            offset += length
        return frames


def unpack_batch_metas(
    header: dict[str, Any], payload: Sequence[Any]
) -> tuple[list[list[Any]], list[EventMeta]]:
    """:func:`unpack_batch` plus every event's meta (read in one pass for packed batches)."""
    events = unpack_batch(header, payload)
    if not events:
        return events, []
    if not header["p"]:
        return events, [peek_meta(frames) for frames in events]
    counts = np.frombuffer(header["n"], dtype=np.uint16)
    lengths = np.frombuffer(header["l"], dtype=np.uint32).astype(np.intp)
    starts = np.cumsum(lengths) - lengths
    heads = np.cumsum(counts, dtype=np.intp) - counts  # each event's first frame
    return events, peek_metas_at(payload[0], starts[heads], lengths[heads])


def u64(values: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=_U64).tobytes()


def from_u64(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=_U64)


class BatchSizer:
    """Chooses how many events go in one batch from event size and work per event.

    Small, cheap events are batched up to ``TARGET_BATCH_B`` bytes. Expensive events
    are batched by work: when the events left are known (:attr:`remaining`, from the
    source's ``total()``), a batch gets 1/(``GUIDED_SHARES`` x workers) of the work
    left, between ``TARGET_BATCH_WORK_S`` and ``MAX_BATCH_WORK_S`` (guided
    self-scheduling: few messages while much is left, small batches at the end so that
    no worker idles while another finishes a long one); when not known, batches hold
    ``TARGET_BATCH_WORK_S``; for a stream (:attr:`stream`: the source hands over what
    has arrived, its chunks set the batches) up to ``max_work_s``. Events above
    ``PACK_LIMIT_B`` keep their own frames (a few
    per message up to ``TARGET_BATCH_B``, 1 MB events one by one), sent zero-copy from
    ``ZERO_COPY_MIN_B`` on. While workers are being lost (:meth:`observe_loss`) a batch
    holds at most ``LOSS_SHARE`` of the mean time between losses, so that a kill costs
    a bounded amount of work, not a count of events.
    """

    __slots__ = (
        "_clock",
        "_last_loss_s",
        "event_b",
        "loss_cap_s",
        "loss_gap_s",
        "max_work_s",
        "remaining",
        "stream",
        "target_b",
        "work_s",
        "workers",
    )

    def __init__(
        self,
        target_b: int = TARGET_BATCH_B,
        event_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.event_b = 0.0  # running mean of encoded event size (bytes)
        self.work_s = 0.0  # running mean of worker time per event (s), 0 = unknown
        self.target_b = target_b  # bytes per batch (larger when the bytes go by shm)
        self.max_work_s = MAX_BATCH_WORK_S
        if event_timeout_s:
            self.max_work_s = max(
                TARGET_BATCH_WORK_S, min(MAX_BATCH_WORK_S, TIMEOUT_SHARE * event_timeout_s)
            )
        self.remaining: int | None = None  # events not yet read, if the source knows
        self.workers = 1  # workers sharing the events left
        # a stream (the source's ``streaming``): events arrive over time and the source
        # hands over what has arrived; a batch is that, bounded by max_work_s only
        self.stream = False
        self._clock = clock
        self._last_loss_s: float | None = None
        self.loss_gap_s = 0.0  # running mean of the time between worker losses (s)
        self.loss_cap_s = 0.0  # most work (s) a batch holds while losses go on; 0: none

    def observe_loss(self) -> None:
        """A worker was lost with its unconfirmed events: bound the work of a batch to
        ``LOSS_SHARE`` of the mean time between losses, until they stop."""
        now = self._clock()
        if self._last_loss_s is not None:
            gap = now - self._last_loss_s
            self.loss_gap_s = gap if self.loss_gap_s == 0 else 0.7 * self.loss_gap_s + 0.3 * gap
            self.loss_cap_s = max(TARGET_BATCH_WORK_S, LOSS_SHARE * self.loss_gap_s)
        self._last_loss_s = now

    def observe_size(self, nbytes: int) -> None:
        self.event_b = nbytes if self.event_b == 0 else 0.8 * self.event_b + 0.2 * nbytes

    def observe_work(self, per_event_s: float) -> None:
        self.work_s = per_event_s if self.work_s == 0 else 0.7 * self.work_s + 0.3 * per_event_s

    @property
    def packed(self) -> bool:
        return self.event_b < PACK_LIMIT_B

    def work_target_s(self) -> float:
        """Seconds of work the next batch should hold."""
        longest = self.max_work_s
        if self.loss_cap_s and self._last_loss_s is not None:
            if self._clock() - self._last_loss_s > LOSS_MEMORY * self.loss_gap_s:
                self.loss_cap_s = self.loss_gap_s = 0.0  # the losses stopped
                self._last_loss_s = None
            else:
                longest = min(longest, self.loss_cap_s)
        if self.remaining is None or self.work_s <= 0:
            return longest if self.stream else TARGET_BATCH_WORK_S
        share = self.remaining * self.work_s / (GUIDED_SHARES * max(self.workers, 1))
        return min(max(share, TARGET_BATCH_WORK_S), longest)

    def size(self) -> int:
        by_bytes = int(self.target_b / max(self.event_b, 1.0))
        # until a worker has reported its speed, start with small batches
        by_work = int(self.work_target_s() / self.work_s) if self.work_s > 0 else 4
        return max(1, min(by_bytes, by_work, MAX_BATCH_EVENTS))

    @property
    def zero_copy(self) -> bool:
        """Whether batches should be sent without copying (large events)."""
        return self.event_b >= ZERO_COPY_MIN_B

    def window(self, event_buffer: int) -> int:
        """Events in flight per worker: the announced credit, or two batches if more.

        Expensive events use the credit only up to ``2 * TARGET_BATCH_WORK_S`` of work:
        whatever waits in a worker's queue when the source ends is what the other
        workers may idle for at the end of the run.
        """
        credit = event_buffer
        if self.work_s > 0:
            credit = min(credit, max(1, int(2 * TARGET_BATCH_WORK_S / self.work_s)))
        return max(credit, 2 * self.size())

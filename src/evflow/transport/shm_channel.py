"""Device channels with ``transport = "shm"``: large frames through shared memory.

The sending channel owns a region (:mod:`evflow.transport.shm_region`); only a
*marker* crosses ZeroMQ (:mod:`evflow.transport.shm_marker`): per frame, a descriptor
of its chunk in the region, the frame itself when small (inline), or a pointer to one
of the ZeroMQ frames that follow (a frame too small for the region, or a
``new_message`` buffer that did not fit).

Two ways to send. Zero-copy (as FairMQ): ``msg = channel.new_message(size)`` gives a
buffer in the region, the sender fills it in place and sends it among its frames;
``channel.recv(views=True)`` hands the receiver an
:class:`~evflow.transport.shm_message.InMessage`, a read-only view of the same bytes,
and the chunk goes back to the sender when it is released. Copying (the API every
device already uses): ``send`` copies a frame of ``SHM_MIN_FRAME_B`` bytes or more
into a chunk; ``recv()`` copies it out and releases the chunk at once.

Batches (as the ALICE HLT announced several events in one message):
``send_many(messages)`` sends several messages in one ZeroMQ message, one marker for
all (all or none: with ``NOBLOCK``, ``zmq.Again`` and nothing sent);
``recv_many()`` returns the messages of the next ZeroMQ message (or those still
pending), ``recv()`` one at a time: the rest of a batch waits in the channel
(``pending``; ``poll`` says True while there are any). A receiver that polls the raw
socket must look at ``pending`` too (the device's data loop does).

- One sender, one consumer per region: ``push``/``pull``/``pair`` channels with one
  peer. A second receiver is refused (it drops what it gets, counted in ``shm_bad``,
  :class:`~evflow.transport.shm_region.SecondReceiverError` logged) and the sender's
  next ``send`` raises ConfigurationError.
- A full region (a slow receiver, views held): ``new_message`` waits up to ``wait_s``
  (back-pressure), then gives a heap buffer that goes over ZeroMQ; ``send`` of a large
  frame sends it over ZeroMQ (counted, ``shm_copied``). Never a block beyond that and
  ZeroMQ's own high-water mark, never a deadlock, and a chunk a live receiver holds
  is never reused.
- What arrives is checked: the marker's layout and counts, the region must be an
  evflow region of this session, each chunk must lie in it, carry the generation and
  length of its descriptor and be in state SENT. Anything else: the whole ZeroMQ
  message is dropped, nothing in the region changes, and it is counted (``shm_bad``),
  never a crash.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from evflow.errors import ConfigurationError, ProtocolError
from evflow.transport.channel import Channel
from evflow.transport.shm_marker import (
    HEAP,
    INLINE,
    INLINE_MAX_B,
    MAX_MESSAGES,
    REGION,
    SOCKET,
    pack_marker,
    unpack_marker,
)
from evflow.transport.shm_message import InMessage, OutMessage
from evflow.transport.shm_region import (
    _NAME,
    RING_PREFIX,
    RegionReader,
    SecondReceiverError,
    ShmRegion,
    Slot,
    ring_name,
    sweep_stale_rings,
)

__all__ = [
    "RING_PREFIX",
    "SHM_MIN_FRAME_B",
    "InMessage",
    "OutMessage",
    "ShmChannel",
    "is_ring_path",
    "ring_name",
    "sweep_stale_rings",
]

log = logging.getLogger("evflow.transport")

#: frames at least this large go through the region with the copying ``send``
SHM_MIN_FRAME_B = 32 * 1024
#: the message a bad marker turns into: an unknown type, counted and dropped by decoders
_DROPPED = [b"\x00", b"\x80"]


def is_ring_path(path: str | Path) -> bool:
    return _NAME.fullmatch(Path(path).name) is not None


class ShmChannel(Channel):
    """A Channel whose large frames travel through a :class:`ShmRegion`."""

    def __init__(self, *args: Any, session: str = "default", **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._copy_frames = 1  # the marker as bytes; the rest are large frames
        self._session = session
        self._region: ShmRegion | None = None
        self._region_failed = False
        self._region_lock = threading.Lock()
        self._reader: RegionReader | None = None
        self._pending: deque[list[Any]] = deque()  # the rest of a batch recv() took
        self.shm_frames_out = 0  # frames sent as descriptors (zero-copy or copied in)
        self.shm_zero_copy = 0  # of those, new_message() buffers sent in place
        self.shm_copied = 0  # large frames sent over ZeroMQ: the region was full
        self.shm_frames_in = 0
        self.shm_batches_out = 0  # ZeroMQ messages of more than one message
        self.shm_batches_in = 0
        self.shm_bad = 0
        self.shm_last_bad = ""  # why the last bad message was dropped

    # --- sending ---------------------------------------------------------------------
    def _get_region(self) -> ShmRegion | None:
        if self._region is None and not self._region_failed:
            with self._region_lock:  # buffers may be asked for from several threads
                if self._region is None and not self._region_failed and not self.closed:
                    try:
                        self._region = ShmRegion(self._session, self.label, self.config.shmSize)
                    except ConfigurationError as exc:  # e.g. /dev/shm full: over ZeroMQ
                        self._region_failed = True
                        log.error("channel %s: %s; sending over ZeroMQ instead", self.label, exc)
        return self._region

    def new_message(self, size: int, wait_s: float = 0.0) -> OutMessage:
        """A buffer of ``size`` bytes in the region, to fill in place and send.

        When the region is full it waits up to ``wait_s`` for the receiver to release
        chunks, then returns a heap buffer (``in_region`` False) that goes over ZeroMQ.
        """
        if size < 0:
            raise ValueError(f"message size {size} is negative")
        region = self._get_region()
        if region is None:
            return OutMessage(size)
        slot = region.allocate(size)
        if slot is None and wait_s > 0:
            deadline = time.monotonic() + wait_s
            pause_s = 0.0002
            while slot is None and time.monotonic() < deadline:
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, 0.01)
                slot = region.allocate(size)
        if slot is None:
            self.shm_copied += 1
            return OutMessage(size)
        return OutMessage(size, slot)

    def send(self, frames: Sequence[Any], flags: int = 0) -> None:
        """Send one message (a marker frame and the frames not in the region)."""
        self.send_many((frames,), flags)

    def send_many(self, messages: Sequence[Sequence[Any]], flags: int = 0) -> None:
        """Send several messages in one ZeroMQ message (one marker for all of them).

        All or none: if the send fails (``zmq.Again`` with ``NOBLOCK``), nothing was
        sent and every ``OutMessage`` among the frames is the caller's again.
        """
        if not 0 < len(messages) <= MAX_MESSAGES:
            raise ValueError(f"send_many takes 1 to {MAX_MESSAGES} messages, not {len(messages)}")
        region = self._get_region()
        if region is not None and region.refused_receiver():
            raise ConfigurationError(
                f"channel {self.label}: a second receiver (pid {region.refused_receiver()}) "
                "got this shm channel's messages and refused them: a shm channel has one "
                "receiver per sender (push to one pull; give each receiver its own channel)"
            )
        counts: list[int] = []
        entries: list[int] = []
        inline: list[Any] = []
        out: list[Any] = [b""]
        taken: list[tuple[OutMessage, Slot | None, Any]] = []
        copies: list[Slot] = []  # chunks the frames were copied into
        inline_b = placed = zero = copied = region_b = 0
        try:
            for frames in messages:
                counts.append(len(frames))
                for f in frames:
                    if type(f) is OutMessage:
                        slot, heap = f.take()
                        taken.append((f, slot, heap))
                        if slot is not None and region is not None and slot._owner is region:
                            region.mark_sent(slot)
                            entries += (REGION, slot.offset, slot.nbytes, slot.gen)
                            zero += 1
                            region_b += slot.nbytes
                            continue
                        if slot is None:  # a heap buffer: over ZeroMQ, wrapped on arrival
                            entries += (HEAP, 0, 0, 0)
                            out.append(heap)
                            continue
                        f = np.asarray(slot)  # another channel's buffer: copied like bytes
                    # bytes, not items: a frame may be an array of floats
                    size = len(f) if type(f) is bytes else memoryview(f).nbytes
                    if size <= INLINE_MAX_B:
                        entries += (INLINE, inline_b, size, 0)
                        inline.append(f)
                        inline_b += size
                        continue
                    if region is not None and size >= SHM_MIN_FRAME_B:
                        slot = region.allocate(size)
                        if slot is not None:
                            np.asarray(slot)[:] = np.frombuffer(f, np.uint8)  # the one copy in
                            region.mark_sent(slot)
                            copies.append(slot)
                            entries += (REGION, slot.offset, size, slot.gen)
                            placed += 1
                            region_b += size
                            continue
                        copied += 1
                    entries += (SOCKET, 0, 0, 0)
                    out.append(f)
            # named and numbered with or without chunks: a copy that reaches the
            # receiver tells the sender what was lost before it (ShmRegion)
            name, seq = (region.name.encode(), region.stamp()) if region is not None else (b"", 0)
            out[0] = pack_marker(name, counts, entries, inline, seq)
            super().send(out, flags)
        except BaseException:
            for slot in copies:  # not sent: free again when dropped
                region.unsend(slot)  # type: ignore[union-attr]
            for msg, slot, heap in taken:  # not sent: the caller still owns them
                if slot is not None and region is not None and slot._owner is region:
                    region.unsend(slot)
                msg._slot, msg._heap = slot, heap
            raise
        self.messages_out += len(messages) - 1  # Channel.send counted one
        self.shm_batches_out += len(messages) > 1
        self.shm_frames_out += placed + zero
        self.shm_zero_copy += zero
        self.shm_copied += copied
        self.bytes_out += region_b  # the payload, not only the descriptors on the socket

    # --- receiving -------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Messages of a batch received already, that ``recv`` hands out next."""
        return len(self._pending)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._pending) or super().poll(timeout_ms)

    def recv(self, flags: int = 0, *, views: bool = False) -> list[Any]:
        """One message; frames that came through the region are copied out as bytes,
        or with ``views=True`` handed over in place as :class:`InMessage` objects."""
        if self._pending:
            return self._unpend(views)
        batch = self._recv_batch(flags)
        if len(batch) > 1:
            self._pending.extend(batch[1:])
        return _as_asked(batch[0], views)

    def recv_many(self, flags: int = 0, *, views: bool = False) -> list[list[Any]]:
        """The messages still pending, or else those of the next ZeroMQ message (one
        message, or a batch from ``send_many``), in order."""
        if self._pending:
            return [self._unpend(views) for _ in range(len(self._pending))]
        return [_as_asked(m, views) for m in self._recv_batch(flags)]

    def _unpend(self, views: bool) -> list[Any]:
        return _as_asked(self._pending.popleft(), views)

    def _recv_batch(self, flags: int) -> list[list[Any]]:
        """The messages of one ZeroMQ message; region and heap frames as InMessage."""
        frames = super().recv(flags)  # counts one message
        if self._reader is None:
            self._reader = RegionReader(self._session)
        try:
            batch = self._resolve(frames[0], frames[1:])
        except ProtocolError as exc:
            self.shm_bad += 1
            self.shm_last_bad = str(exc)
            if isinstance(exc, SecondReceiverError) and self.shm_bad == 1:
                log.error("channel %s: %s", self.label, self.shm_last_bad)
            elif self.shm_bad == 1 or self.shm_bad % 1000 == 0:
                # the text, not the exception: a kept log record must not keep its frames
                # (and the mappings they name) alive
                log.warning(
                    "channel %s: dropped a message (%d so far): %s",
                    self.label,
                    self.shm_bad,
                    self.shm_last_bad,
                )
            return [list(_DROPPED)]
        self.messages_in += len(batch) - 1
        self.shm_batches_in += len(batch) > 1
        return batch

    def _resolve(self, marker: bytes, frames: list[Any]) -> list[list[Any]]:
        """The messages a marker describes, their frames put together in order."""
        m = unpack_marker(marker, len(frames))
        entries = m.entries
        slots: list[Slot] = []
        reader = self._reader
        assert reader is not None
        if m.n_region:
            descs = [
                (entries[i + 1], entries[i + 2], entries[i + 3])
                for i in range(0, len(entries), 4)
                if entries[i] == REGION
            ]
            slots = reader.claim_all(m.region, descs, m.seq)  # all checked, then claimed
        elif m.seq:
            reader.passed(m.region, m.seq)
        raw, base = m.inline, m.inline_at
        next_slot = iter(slots).__next__
        next_frame = iter(frames).__next__
        batch: list[list[Any]] = []
        i = region_b = 0
        for count in m.counts:
            msg: list[Any] = []
            for _ in range(count):
                kind = entries[i]
                if kind == INLINE:
                    at = base + entries[i + 1]
                    msg.append(raw[at : at + entries[i + 2]])
                elif kind == REGION:
                    slot = next_slot()
                    region_b += slot.nbytes
                    msg.append(InMessage(slot.nbytes, slot))
                elif kind == SOCKET:
                    msg.append(next_frame())
                else:  # HEAP: a new_message() buffer that came over ZeroMQ
                    f = next_frame()
                    msg.append(InMessage(len(f), frame=f))
                i += 4
            batch.append(msg)
        self.shm_frames_in += len(slots)
        self.bytes_in += region_b
        return batch

    def shm_metrics(self) -> dict[str, int]:
        """The shared-memory counters (in the device's metrics, per channel)."""
        region = self._region
        return {
            "frames_out": self.shm_frames_out,
            "zero_copy": self.shm_zero_copy,
            "copied": self.shm_copied,
            "frames_in": self.shm_frames_in,
            "batches_out": self.shm_batches_out,
            "batches_in": self.shm_batches_in,
            "bad": self.shm_bad,
            "chunks_in_use": region.in_use() if region is not None else 0,
            "reclaimed_dead": region.reclaimed_dead if region is not None else 0,
        }

    def close(self, linger_ms: int | None = None) -> None:
        super().close(linger_ms)
        self._pending.clear()  # their chunks go back as they are dropped
        with self._region_lock:
            if self._region is not None:
                self._region.close()
        if self._reader is not None:
            self._reader.close()


def _as_asked(msg: list[Any], views: bool) -> list[Any]:
    """``views=False``: region frames copied out as bytes (the chunk released at once),
    heap buffers as the ZeroMQ frames they came in."""
    if views:
        return msg
    for i, f in enumerate(msg):
        if type(f) is InMessage:
            msg[i] = f.tobytes() if f._slot is not None else f._frame
            f.release()
    return msg

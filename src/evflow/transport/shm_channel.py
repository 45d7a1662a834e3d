"""Device channels with ``transport = "shm"``: large frames through shared memory.

The sending channel owns a region (:mod:`evflow.transport.shm_region`); only a
descriptor crosses ZeroMQ, in a first *marker* frame (msgpack, one entry per frame
that is not on the socket; an empty marker frame when there is none):

- ``[index, region, offset, length, generation]``: the frame is a chunk of the region;
- ``[index]``: the frame is an :class:`~evflow.transport.shm_message.OutMessage` that
  did not fit in the region and came over ZeroMQ (so ``recv(views=True)`` wraps it too).

Two ways to send. Zero-copy (as FairMQ): ``msg = channel.new_message(size)`` gives a
buffer in the region, the sender fills it in place and sends it among its frames;
``channel.recv(views=True)`` hands the receiver an
:class:`~evflow.transport.shm_message.InMessage`, a read-only view of the same bytes,
and the chunk goes back to the sender when it is released. Copying (the API every
device already uses): ``send`` copies a frame of ``SHM_MIN_FRAME_B`` bytes or more
into a chunk; ``recv()`` copies it out and releases the chunk at once.

- One sender, one consumer per region: ``push``/``pull``/``pair`` channels with one peer.
- A full region (a slow receiver, views held): ``new_message`` waits up to ``wait_s``
  (back-pressure), then gives a heap buffer that goes over ZeroMQ; ``send`` of a large
  frame sends it over ZeroMQ (counted, ``shm_copied``). Never a block beyond that and
  ZeroMQ's own high-water mark, never a deadlock, and a chunk a live receiver holds
  is never reused.
- What arrives is checked: the marker is msgpack with a fixed layout, the region must
  be an evflow region of this session, the chunk must lie in it, carry the generation
  and length of the descriptor and be in state SENT. Anything else is dropped and
  counted (``shm_bad``), never a crash.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from evflow.errors import ConfigurationError, ProtocolError
from evflow.transport.channel import Channel
from evflow.transport.shm_message import InMessage, OutMessage
from evflow.transport.shm_region import (
    _NAME,
    RING_PREFIX,
    RegionReader,
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
        self._copy_frames = 3  # marker, type, header as bytes
        self._session = session
        self._region: ShmRegion | None = None
        self._region_failed = False
        self._region_lock = threading.Lock()
        self._reader: RegionReader | None = None
        self.shm_frames_out = 0  # frames sent as descriptors (zero-copy or copied in)
        self.shm_zero_copy = 0  # of those, new_message() buffers sent in place
        self.shm_copied = 0  # large frames sent over ZeroMQ: the region was full
        self.shm_frames_in = 0
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
        region = self._get_region()
        entries: list[list[Any]] = []
        out: list[Any] = [b""]
        taken: list[tuple[OutMessage, Slot | None, Any]] = []
        copies: list[Slot] = []  # chunks the frames were copied into
        placed = zero = copied = region_b = 0
        try:
            for i, f in enumerate(frames):
                if type(f) is OutMessage:
                    slot, heap = f.take()
                    taken.append((f, slot, heap))
                    if slot is not None and region is not None and slot._owner is region:
                        region.mark_sent(slot)
                        entries.append([i, region.name, slot.offset, slot.nbytes, slot.gen])
                        zero += 1
                        region_b += slot.nbytes
                        continue
                    if slot is None:  # a heap buffer: over ZeroMQ, wrapped on arrival
                        entries.append([i])
                        out.append(heap)
                        continue
                    f = np.asarray(slot)  # another channel's buffer: copied like bytes
                size = f.nbytes if type(f) is memoryview else len(f)
                if region is not None and size >= SHM_MIN_FRAME_B:
                    slot = region.allocate(size)
                    if slot is not None:
                        np.asarray(slot)[:] = np.frombuffer(f, np.uint8)  # the one copy in
                        region.mark_sent(slot)
                        copies.append(slot)
                        entries.append([i, region.name, slot.offset, size, slot.gen])
                        placed += 1
                        region_b += size
                        continue
                    copied += 1
                out.append(f)
            if entries:
                out[0] = msgpack.packb(entries)
            super().send(out, flags)
        except BaseException:
            for slot in copies:  # not sent: free again when dropped
                region.unsend(slot)  # type: ignore[union-attr]
            for msg, slot, heap in taken:  # not sent: the caller still owns them
                if slot is not None and region is not None and slot._owner is region:
                    region.unsend(slot)
                msg._slot, msg._heap = slot, heap
            raise
        self.shm_frames_out += placed + zero
        self.shm_zero_copy += zero
        self.shm_copied += copied
        self.bytes_out += region_b  # the payload, not only the descriptors on the socket

    # --- receiving -------------------------------------------------------------------
    def recv(self, flags: int = 0, *, views: bool = False) -> list[Any]:
        """One message; frames that came through the region are copied out as bytes,
        or with ``views=True`` handed over in place as :class:`InMessage` objects."""
        frames = super().recv(flags)
        marker, rest = frames[0], frames[1:]
        if not len(marker):
            return rest
        if self._reader is None:
            self._reader = RegionReader(self._session)
        try:
            resolved = self._resolve(bytes(marker), rest, views)
        except ProtocolError as exc:
            self.shm_bad += 1
            self.shm_last_bad = str(exc)
            if self.shm_bad == 1 or self.shm_bad % 1000 == 0:
                # the text, not the exception: a kept log record must not keep its frames
                # (and the mappings they name) alive
                log.warning(
                    "channel %s: dropped a message (%d so far): %s",
                    self.label,
                    self.shm_bad,
                    self.shm_last_bad,
                )
            return list(_DROPPED)
        return resolved

    def _resolve(self, marker: bytes, frames: list[Any], views: bool) -> list[Any]:
        """The message's frames in order: those in the region (not on the socket) put
        back at their index, in place or copied out."""
        try:
            entries = msgpack.unpackb(marker)
        except Exception as exc:
            raise ProtocolError(f"bad shared-memory marker: {exc}") from None
        if not isinstance(entries, list):
            raise ProtocolError("bad shared-memory marker: not a list of frame entries")
        for entry in entries:
            if not isinstance(entry, list) or len(entry) not in (1, 5):
                raise ProtocolError("bad shared-memory marker entry")
        total = len(frames) + sum(len(e) == 5 for e in entries)
        indices = [e[0] for e in entries]
        for index in indices:
            if type(index) is not int or not 0 <= index < total:
                raise ProtocolError(f"shared-memory marker names frame {index!r} of {total}")
        if len(set(indices)) != len(indices):
            raise ProtocolError("shared-memory marker names a frame twice")
        reader = self._reader
        assert reader is not None
        out: list[Any] = [None] * total
        region_b = 0
        for entry in entries:
            if len(entry) == 5:
                slot = reader.claim(*entry[1:])
                region_b += slot.nbytes
                out[entry[0]] = (
                    InMessage(slot.nbytes, slot) if views else np.asarray(slot).tobytes()
                )  # in place, or the one copy out
        rest = iter(frames)
        for i, f in enumerate(out):
            if f is None:
                out[i] = next(rest)
        if views:
            for entry in entries:
                if len(entry) == 1:  # a heap buffer that came over ZeroMQ
                    f = out[entry[0]]
                    out[entry[0]] = InMessage(len(f), frame=f)
        self.shm_frames_in += total - len(frames)
        self.bytes_in += region_b
        return out

    def shm_metrics(self) -> dict[str, int]:
        """The shared-memory counters (in the device's metrics, per channel)."""
        region = self._region
        return {
            "frames_out": self.shm_frames_out,
            "zero_copy": self.shm_zero_copy,
            "copied": self.shm_copied,
            "frames_in": self.shm_frames_in,
            "bad": self.shm_bad,
            "chunks_in_use": region.in_use() if region is not None else 0,
            "reclaimed_dead": region.reclaimed_dead if region is not None else 0,
        }

    def close(self, linger_ms: int | None = None) -> None:
        super().close(linger_ms)
        with self._region_lock:
            if self._region is not None:
                self._region.close()
        if self._reader is not None:
            self._reader.close()

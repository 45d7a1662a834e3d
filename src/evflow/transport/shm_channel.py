"""Device channels with ``transport = "shm"``: large frames through shared memory.

A sending channel owns a ring in ``/dev/shm/evflow-dc-<pid>-<session>-<channel>``
(``shmSize`` bytes, reserved with ``posix_fallocate`` up front so that a full tmpfs is
an error at start, never a SIGBUS later). A frame of ``SHM_MIN_FRAME_B`` bytes or more
is copied into the ring once; the message carries, in a first *marker* frame, where it
is (segment, position, length); the receiving channel copies it out and advances the
ring's *consumed* counter (in the segment's header), which frees the space. Small
messages carry an empty marker frame.

- One sender, one consumer per ring: ``push``/``pull``/``pair`` channels with one peer.
- A full ring (a slow or dead receiver) sends the frame over ZeroMQ as usual (counted,
  ``copied``): no blocking beyond ZeroMQ's own high-water mark, no deadlock.
- Cleanup: the sender removes its ring when the channel closes. A ring whose owner
  died (``kill -9``) is removed by the next shm channel opened on this host (any
  session): the owner's pid is in the name, and ``/proc/<pid>`` tells if it lives.
- What arrives is checked: the marker is msgpack with a fixed layout, the segment
  name must be an evflow ring of this session, position and length must lie in it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack

from evflow.errors import ConfigurationError, ProtocolError
from evflow.transport.channel import Channel

__all__ = [
    "SHM_MIN_FRAME_B",
    "ShmChannel",
    "ShmRing",
    "ShmRingReader",
    "ring_name",
    "sweep_stale_rings",
]

log = logging.getLogger("evflow.transport")

SHM_DIR = "/dev/shm"
RING_PREFIX = "evflow-dc-"
HEADER_B = 64  # consumed (u64) at 8, size at 16
ALIGN_B = 64
#: frames at least this large go through the ring
SHM_MIN_FRAME_B = 32 * 1024
_NAME = re.compile(r"evflow-dc-(\d+)-[A-Za-z0-9_.-]+")
_U64 = struct.Struct("<Q")


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def ring_name(session: str, label: str, pid: int | None = None) -> str:
    return f"{RING_PREFIX}{pid or os.getpid()}-{_safe(session)}-{_safe(label)}"


def sweep_stale_rings() -> list[str]:
    """Remove the rings of processes that no longer exist; return their names."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(SHM_DIR):
            m = _NAME.fullmatch(name)
            if m is None or os.path.exists(f"/proc/{m.group(1)}"):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    if removed:
        log.info("removed shared-memory rings of dead processes: %s", ", ".join(removed))
    return removed


class ShmRing:
    """The sender's ring: :meth:`place` copies a frame in, or returns None when full."""

    def __init__(self, session: str, label: str, size_b: int) -> None:
        if size_b < 1 << 20:
            raise ConfigurationError(f"shmSize of {size_b} bytes is too small (at least 1 MB)")
        sweep_stale_rings()
        self.name = ring_name(session, label)
        self.path = os.path.join(SHM_DIR, self.name)
        self.size_b = size_b
        self.capacity = size_b - HEADER_B
        # made under a hidden name and renamed once mapped: a sweeper that removes
        # unmapped evflow segments (test fixtures do) never sees it half made
        tmp = os.path.join(SHM_DIR, f".{self.name}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size_b)
            os.posix_fallocate(fd, 0, size_b)  # a full tmpfs fails here, not with SIGBUS
            self._mm = mmap.mmap(fd, size_b)
            os.rename(tmp, self.path)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise ConfigurationError(
                f"cannot make the shared-memory ring {self.path} ({size_b} bytes): {exc.strerror}"
            ) from exc
        os.close(fd)
        self._view = memoryview(self._mm)
        _U64.pack_into(self._mm, 16, size_b)
        self.written = 0  # monotonic position of the next byte
        self.placed = 0
        self.full = 0

    def place(self, frame: Any) -> list[Any] | None:
        """``[name, position, length, end]`` of ``frame`` copied into the ring, or None."""
        data = memoryview(frame).cast("B")
        n = data.nbytes
        cap = self.capacity
        consumed = _U64.unpack_from(self._mm, 8)[0]
        pos = self.written
        off = pos % cap
        if off + n > cap:  # does not fit before the end: start again at the beginning
            pos += cap - off
            off = 0
        end = pos + -(-n // ALIGN_B) * ALIGN_B
        if n > cap or end - consumed > cap:
            self.full += 1
            return None
        start = HEADER_B + off
        self._view[start : start + n] = data
        self.written = end
        self.placed += 1
        return [self.name, pos, n, end]

    def close(self) -> None:
        if self._view is None:
            return
        self._view.release()
        self._view = None  # type: ignore[assignment]
        self._mm.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ShmRingReader:
    """The receiver's side: maps the rings named in markers and copies frames out."""

    def __init__(self, session: str) -> None:
        sweep_stale_rings()
        self.session = _safe(session)
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}

    def _ring(self, name: Any) -> tuple[mmap.mmap, int]:
        ring = self._maps.get(name)
        if ring is not None:
            return ring
        m = _NAME.fullmatch(name) if isinstance(name, str) else None
        if m is None or f"-{self.session}-" not in name:
            raise ProtocolError(f"shared-memory ring {name!r} is not one of this session")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except OSError as exc:
            raise ProtocolError(f"cannot open shared-memory ring {name}: {exc.strerror}") from None
        try:
            mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        size = _U64.unpack_from(mm, 16)[0]
        if size != len(mm):
            mm.close()
            raise ProtocolError(f"shared-memory ring {name} has a bad header")
        if len(self._maps) >= 16:  # senders come and go: keep the newest
            _, (old, _) = self._maps.popitem()
            old.close()
        self._maps[name] = ring = (mm, size - HEADER_B)
        return ring

    def resolve(self, marker: bytes, frames: list[Any]) -> list[Any]:
        """``frames`` with the ring frames the marker names copied out (ProtocolError)."""
        try:
            entries = msgpack.unpackb(marker)
        except Exception as exc:
            raise ProtocolError(f"bad shared-memory marker: {exc}") from None
        if not isinstance(entries, list):
            raise ProtocolError("bad shared-memory marker: not a list")
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 5):
                raise ProtocolError("bad shared-memory marker entry")
            index, name, pos, n, end = entry
            if not all(type(v) is int and v >= 0 for v in (index, pos, n, end)):
                raise ProtocolError("bad shared-memory marker entry")
            if index >= len(frames):
                raise ProtocolError(f"shared-memory marker names frame {index} of {len(frames)}")
            mm, cap = self._ring(name)
            off = pos % cap
            if off + n > cap or end < pos + n:
                raise ProtocolError(f"shared-memory frame at {pos} (+{n}) lies outside ring {name}")
            frames[index] = mm[HEADER_B + off : HEADER_B + off + n]  # the one copy out
            if _U64.unpack_from(mm, 8)[0] < end:
                _U64.pack_into(mm, 8, end)  # frees the space for the sender
        return frames

    def close(self) -> None:
        for mm, _ in self._maps.values():
            mm.close()
        self._maps.clear()


def wrap_frames(ring: ShmRing | None, frames: Sequence[Any]) -> tuple[list[Any], int, int]:
    """``[marker, *frames]`` with large frames placed in ``ring``; how many were placed,
    and how many went over ZeroMQ for lack of room."""
    entries = []
    out: list[Any] = [b""]
    copied = 0
    for i, f in enumerate(frames):
        size = f.nbytes if type(f) is memoryview else len(f)
        if ring is not None and size >= SHM_MIN_FRAME_B:
            where = ring.place(f)
            if where is not None:
                entries.append([i, *where])
                out.append(b"")
                continue
            copied += 1
        out.append(f)
    if entries:
        out[0] = msgpack.packb(entries)
    return out, len(entries), copied


def is_ring_path(path: str | Path) -> bool:
    return _NAME.fullmatch(Path(path).name) is not None


class ShmChannel(Channel):
    """A Channel whose large frames travel through a :class:`ShmRing`."""

    def __init__(self, *args: Any, session: str = "default", **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._copy_frames = 3  # marker, type, header as bytes
        self._session = session
        self._ring: ShmRing | None = None
        self._ring_failed = False
        self._reader: ShmRingReader | None = None
        self.shm_frames_out = 0
        self.shm_copied = 0  # large frames sent over ZeroMQ: the ring was full
        self.shm_frames_in = 0
        self.shm_bad = 0

    def send(self, frames: Sequence[Any], flags: int = 0) -> None:
        if self._ring is None and not self._ring_failed:
            try:
                self._ring = ShmRing(self._session, self.label, self.config.shmSize)
            except ConfigurationError as exc:  # e.g. /dev/shm full: copy over ZeroMQ
                self._ring_failed = True
                log.error("channel %s: %s; sending over ZeroMQ instead", self.label, exc)
        out, placed, copied = wrap_frames(self._ring, frames)
        self.shm_frames_out += placed
        self.shm_copied += copied
        super().send(out, flags)

    def recv(self, flags: int = 0) -> list[Any]:
        frames = super().recv(flags)
        marker, rest = frames[0], frames[1:]
        if not len(marker):
            return rest
        if self._reader is None:
            self._reader = ShmRingReader(self._session)
        try:
            resolved = self._reader.resolve(bytes(marker), rest)
        except ProtocolError as exc:
            self.shm_bad += 1
            if self.shm_bad == 1:
                log.warning("channel %s: dropped a message: %s", self.label, exc)
            return [b"\x00", b"\x80"]  # an unknown type: counted and dropped by the decoder
        self.shm_frames_in += 1
        return resolved

    def close(self, linger_ms: int | None = None) -> None:
        super().close(linger_ms)
        if self._ring is not None:
            self._ring.close()
        if self._reader is not None:
            self._reader.close()

"""Writing record files: ``RecordWriter`` appends raw records with few system calls.

Small records are copied into one write buffer, large payloads go out zero-copy with
``writev``. Reopening a file scans it with :class:`RecordReader` first: a torn tail
left by a killed writer is truncated before appending. The format is described in
``evflow.io._recformat``.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Sequence

from evflow.errors import ClosedError, EvflowError, OutputError
from evflow.io._recformat import RECORD_HEADER_SIZE, file_header, record_header
from evflow.io._recreader import RecordReader

log = logging.getLogger(__name__)

_IOV_MAX = 1000  # below Linux's IOV_MAX (1024)
_SMALL = 64 * 1024  # buffers below this are copied into the write buffer
_U32 = struct.Struct("<I")
_MAX_U64, _MAX_U32 = (1 << 64) - 1, (1 << 32) - 1
_QUEUE_MAX = 64  # one-frame records framed together at most
_ONE_FRAME = struct.Struct("<IQ")  # pack_frames header of a single frame


def _writev_all(fd: int, bufs: list[bytes | bytearray | memoryview]) -> None:
    """Write all of ``bufs`` with as few ``writev`` calls as the kernel allows."""
    views = [memoryview(b).cast("B") for b in bufs]
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i : i + _IOV_MAX])
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:  # partial write inside one buffer
            views[i] = views[i][n:]


class RecordWriter:
    """Writes records to a file through a large buffer (one ``writev`` per buffer).

    ``append=False`` creates or truncates the file. ``append=True`` reopens an existing
    file: its records are scanned (``written_uids()``), a torn tail left by a killed
    writer is logged and truncated, and new records go after the last complete one.
    ``flush()`` writes the buffer and, with ``fsync=True``, ``fdatasync``s it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        append: bool = False,
        buffer_bytes: int = 4 << 20,
        fsync: bool = True,
    ) -> None:
        self.path = os.fspath(path)
        self.buffer_bytes = buffer_bytes
        self.fsync = fsync
        self._uids: set[int] = set()
        self._iov: list[bytes | bytearray | memoryview] = []
        self._small = bytearray()
        # small one-frame records waiting to be framed: done for many at once, in one
        # warm loop, instead of right after each event's modules ran (cold caches)
        self._queued: list[tuple[int, int, bytes | memoryview, int]] = []  # uid, flags, frame, n
        self._pending = 0
        self.records_written = 0
        self.bytes_written = 0
        exists = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        if append and exists:
            self._fd = self._reopen()
        else:
            self._fd = self._open(os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                _writev_all(self._fd, [file_header()])
            except OSError as err:
                os.close(self._fd)
                raise OutputError(
                    f"cannot write record file {self.path!r}: {err.strerror}"
                ) from err

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as err:
            raise OutputError(
                f"cannot open record output {self.path!r} for writing: {err.strerror}"
            ) from err

    def _reopen(self) -> int:
        """Open an existing file for append after scanning (and repairing) it."""
        try:
            with RecordReader(self.path, on_corrupt="raise") as reader:
                # verify payloads: a damaged record must not count as written
                self._uids = set(reader.uids(verify=True))
                end = reader.end_offset
                torn = reader.torn_tail
        except EvflowError as err:
            raise OutputError(f"cannot append to {self.path!r}: {err}") from err
        fd = self._open(os.O_WRONLY)
        if torn is not None:
            log.warning(
                "record file %r: truncating %d torn bytes at offset %d before appending",
                self.path,
                torn.nbytes,
                torn.offset,
            )
            os.ftruncate(fd, end)
            os.fsync(fd)
        os.lseek(fd, end, os.SEEK_SET)
        return fd

    def write_record(self, uid: int, flags: int, payload: bytes | bytearray | memoryview) -> None:
        """Append one record (buffered; the payload must not change until ``flush``)."""
        if self._queued:
            self._frame_queued()  # records keep the order they were written in
        if type(payload) is not bytes:
            self.write_parts(uid, flags, (payload,))
            return
        if self._fd < 0:
            raise ClosedError(f"record file {self.path!r} is closed")
        n = len(payload)
        head = record_header(n, uid, flags, zlib.crc32(payload))
        if n < _SMALL:  # the common small-event path: one append to one buffer
            self._small += head + payload
        else:
            if self._small:
                self._iov.append(self._small)
                self._small = bytearray()
            self._iov.append(head)
            self._iov.append(payload)
        self._uids.add(uid)
        self._pending += RECORD_HEADER_SIZE + n
        self.records_written += 1
        if self._pending >= self.buffer_bytes or len(self._iov) >= _IOV_MAX:
            self._write_out()

    def write_frames(self, uid: int, flags: int, frames: Sequence[bytes | memoryview]) -> None:
        """Append one record whose payload is ``pack_frames(frames)``, without the copy.

        Large frames, and a small one that is bytes or a read-only view, are referenced,
        not copied, until the buffer is written: they must not change until ``flush``.
        """
        if len(frames) == 1:
            # a small event is one frame (bytes, or a received view). Immutable ones are
            # queued and framed with the next ones (_frame_queued); a writable view (a
            # shared-memory arena) is copied now; a uid or flags that do not fit take
            # the long way and raise there
            frame = frames[0]
            immutable = type(frame) is bytes
            if not immutable:
                frame = memoryview(frame)
                immutable = frame.readonly
            n = frame.nbytes if type(frame) is memoryview else len(frame)
            if immutable and n < _SMALL and 0 <= uid <= _MAX_U64 and 0 <= flags <= _MAX_U32:
                if self._fd < 0:
                    raise ClosedError(f"record file {self.path!r} is closed")
                queued = self._queued
                queued.append((uid, flags, frame, n))
                self._uids.add(uid)
                self._pending += RECORD_HEADER_SIZE + _ONE_FRAME.size + n
                self.records_written += 1
                if self._pending >= self.buffer_bytes:
                    self._write_out()  # (frames the queue first)
                elif len(queued) >= _QUEUE_MAX:
                    self._frame_queued()
                return
            if n < _SMALL:
                self.write_record(uid, flags, _ONE_FRAME.pack(1, n) + frame)
                return
        lens = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
        head = _U32.pack(len(lens)) + struct.pack(f"<{len(lens)}Q", *lens)
        if sum(lens) < _SMALL and all(type(f) is bytes for f in frames):
            self.write_record(uid, flags, b"".join((head, *frames)))
        else:
            self.write_parts(uid, flags, (head, *frames))

    def _frame_queued(self) -> None:
        """Frame the queued one-frame records into the write buffer, in order."""
        queued, self._queued = self._queued, []
        small = self._small
        one, crc32 = _ONE_FRAME.pack, zlib.crc32
        for uid, flags, frame, n in queued:
            prefix = one(1, n)
            small += record_header(_ONE_FRAME.size + n, uid, flags, crc32(frame, crc32(prefix)))
            small += prefix
            small += frame

    def write_parts(
        self, uid: int, flags: int, parts: Sequence[bytes | bytearray | memoryview]
    ) -> None:
        """Append one record whose payload is the concatenation of ``parts``."""
        if self._queued:
            self._frame_queued()
        if self._fd < 0:
            raise ClosedError(f"record file {self.path!r} is closed")
        views = [memoryview(p).cast("B") for p in parts]
        n = 0
        crc = 0
        for v in views:
            n += v.nbytes
            crc = zlib.crc32(v, crc)
        head = record_header(n, uid, flags, crc)
        small = self._small
        small += head
        for v in views:
            if v.nbytes < _SMALL:
                small += v
            else:  # reference big buffers instead of copying them
                if small:
                    self._iov.append(small)
                    small = self._small = bytearray()
                self._iov.append(v)
        self._uids.add(uid)
        self._pending += RECORD_HEADER_SIZE + n
        self.records_written += 1
        if self._pending >= self.buffer_bytes or len(self._iov) >= _IOV_MAX:
            self._write_out()

    def _write_out(self) -> None:
        if self._queued:
            self._frame_queued()
        if self._small:
            self._iov.append(self._small)
            self._small = bytearray()
        if not self._iov:
            return
        try:
            _writev_all(self._fd, self._iov)
        except OSError as err:
            raise OutputError(f"cannot write record file {self.path!r}: {err.strerror}") from err
        self.bytes_written += self._pending
        self._iov = []
        self._pending = 0

    def flush(self) -> None:
        """Write the buffer; with ``fsync`` also make it durable (``fdatasync``)."""
        if self._fd < 0:
            raise ClosedError(f"record file {self.path!r} is closed")
        self._write_out()
        if self.fsync:
            os.fdatasync(self._fd)

    def written_uids(self) -> set[int]:
        """Uids found in the file on reopen plus every uid written since."""
        return set(self._uids)

    def close(self) -> None:
        """Flush and close; closing twice is fine."""
        if self._fd < 0:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._fd = -1

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<RecordWriter {self.path!r} {state} records={self.records_written}>"

"""Record files on disk: ``RecordWriter`` and ``RecordReader`` for raw records.

A record is (uid, flags, payload bytes); ``evflow.io.records`` puts events into them.
The format is described in ``evflow.io._recformat``.

A reader recovers every complete record of a file whose writer was killed: a torn
tail is logged (file, offset, bytes) and skipped. Damage in the middle of a file
raises ``CorruptRecordError`` by default; ``on_corrupt="skip"`` logs and skips the
damaged record instead (the header CRC makes the skip exact, the record magic lets
the reader find the next record after a damaged header).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple

from evflow.errors import ClosedError, CorruptRecordError, EvflowError, InputError, OutputError
from evflow.io._recformat import (
    FILE_HEADER_SIZE,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    RECORD_MAGIC,
    check_file_header,
    file_header,
    header_ok,
    record_header,
)

log = logging.getLogger(__name__)

OnCorrupt = Literal["raise", "skip"]
_IOV_MAX = 1000  # below Linux's IOV_MAX (1024)
_SMALL = 64 * 1024  # buffers below this are copied into the write buffer
_U32 = struct.Struct("<I")
_ONE_FRAME = struct.Struct("<IQ")  # pack_frames header of a single frame


class Record(NamedTuple):
    """One record: its byte offset in the file, uid, flags and payload (a view)."""

    offset: int
    uid: int
    flags: int
    payload: memoryview


class TornTail(NamedTuple):
    """Bytes after the last complete record (a writer died mid-write)."""

    offset: int
    nbytes: int
    reason: str


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

        Large frames are referenced, not copied, until the buffer is written: they must
        not change until ``flush``.
        """
        if len(frames) == 1 and type(frames[0]) is bytes and len(frames[0]) < _SMALL:
            # a small event is one frame: build the packed payload directly (cheapest)
            frame = frames[0]
            self.write_record(uid, flags, _ONE_FRAME.pack(1, len(frame)) + frame)
            return
        lens = [len(f) if type(f) is bytes else memoryview(f).nbytes for f in frames]
        head = _U32.pack(len(lens)) + struct.pack(f"<{len(lens)}Q", *lens)
        if sum(lens) < _SMALL and all(type(f) is bytes for f in frames):
            self.write_record(uid, flags, b"".join((head, *frames)))  # type: ignore[arg-type]
        else:
            self.write_parts(uid, flags, (head, *frames))

    def write_parts(
        self, uid: int, flags: int, parts: Sequence[bytes | bytearray | memoryview]
    ) -> None:
        """Append one record whose payload is the concatenation of ``parts``."""
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


class RecordReader:
    """Reads the records of a file through a private (copy-on-write) memory map.

    Payloads are zero-copy, writable views into the map; the map stays alive while
    any view (or array decoded from one) does. ``torn_tail`` and ``problems`` report
    what was skipped; each is also logged once as a warning naming file and offset.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, on_corrupt: OnCorrupt | str = "raise"
    ) -> None:
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        self.path = os.fspath(path)
        self.on_corrupt = on_corrupt
        self.torn_tail: TornTail | None = None
        self.problems: list[str] = []
        self._reported: set[int] = set()
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise InputError(f"record file {self.path!r} does not exist") from None
        except OSError as err:
            raise InputError(f"cannot open record file {self.path!r}: {err.strerror}") from err
        try:
            self.size = os.fstat(fd).st_size
            self.version = check_file_header(self.path, os.pread(fd, FILE_HEADER_SIZE, 0))
            self._mm: mmap.mmap | None = mmap.mmap(fd, self.size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self._view = memoryview(self._mm)
        self._end_offset: int | None = None

    # --- walking ----------------------------------------------------------------------
    def _walk(self, start: int, verify: bool) -> Iterator[Record]:
        """Yield every good record from the ``start``-th on, in order.

        Payload CRCs are checked for the records yielded when ``verify`` (and always for
        the last record, which is where a crash leaves damage).
        """
        view, size = self._view, self.size
        crc32, unpack_from, hsize, magic = (
            zlib.crc32,
            RECORD_HEADER.unpack_from,
            RECORD_HEADER_SIZE,
            RECORD_MAGIC,
        )
        off = FILE_HEADER_SIZE
        index = 0
        while off < size:
            if size - off < hsize:
                self._torn(off, "incomplete record header")
                break
            m, hcrc, n, uid, flags, crc = unpack_from(view, off)
            if m != magic or crc32(view[off + 8 : off + hsize]) != hcrc:
                nxt = self._resync(off + 1)
                if nxt < 0:
                    self._torn(off, "damaged record header and no record after it")
                    break
                self._corrupt(off, f"damaged record header (next record at offset {nxt})")
                off = nxt
                continue
            end = off + hsize + n
            if end > size:
                self._torn(off, f"record of {n} payload bytes cut short at {size - off} bytes")
                break
            wanted = index >= start
            payload = view[off + hsize : end]
            if ((verify and wanted) or end == size) and crc32(payload) != crc:
                if end == size:
                    self._torn(off, f"payload CRC mismatch in the last record (uid {uid})")
                    break
                self._corrupt(off, f"payload CRC mismatch (uid {uid})")
                off = end
                continue
            if wanted:
                yield Record(off, uid, flags, payload)
            index += 1
            off = end
        self._end_offset = off if self.torn_tail is None else self.torn_tail.offset

    def _resync(self, start: int) -> int:
        mm = self._mm
        assert mm is not None
        pos = mm.find(RECORD_MAGIC, start)
        while pos >= 0 and pos + RECORD_HEADER_SIZE <= self.size:
            if header_ok(self._view, pos):
                return pos
            pos = mm.find(RECORD_MAGIC, pos + 1)
        return -1

    def _torn(self, offset: int, reason: str) -> None:
        self.torn_tail = TornTail(offset, self.size - offset, reason)
        if offset not in self._reported:
            self._reported.add(offset)
            log.warning(
                "record file %r: torn tail at offset %d (%d bytes, %s; the writer "
                "probably died mid-write): skipped, every record before it is intact",
                self.path,
                offset,
                self.size - offset,
                reason,
            )

    def _corrupt(self, offset: int, what: str) -> None:
        message = f"record file {self.path!r}: {what} at offset {offset}"
        if self.on_corrupt == "raise":
            raise CorruptRecordError(
                f"{message}; open it with on_corrupt='skip' to skip damaged records"
            )
        if offset not in self._reported:
            self._reported.add(offset)
            self.problems.append(message)
            log.warning("%s: record skipped", message)

    # --- public -----------------------------------------------------------------------
    def records(self, start: int = 0) -> Iterator[Record]:
        """The good records from the ``start``-th on, payload CRCs checked (an iterator)."""
        if self._mm is None:
            raise ClosedError(f"record file {self.path!r} is closed")
        return self._walk(start, verify=True)

    def __iter__(self) -> Iterator[Record]:
        return self.records()

    def uids(self, verify: bool = False) -> list[int]:
        """The uid of every good record, in file order.

        Reads headers only (fast) unless ``verify`` checks every payload CRC too.
        """
        if self._mm is None:
            raise ClosedError(f"record file {self.path!r} is closed")
        return [record.uid for record in self._walk(0, verify)]

    def __len__(self) -> int:
        return len(self.uids())

    @property
    def end_offset(self) -> int:
        """Where the last complete record ends (where an appending writer continues)."""
        if self._end_offset is None:
            self.uids()
        assert self._end_offset is not None
        return self._end_offset

    def close(self) -> None:
        """Release the map; views still held elsewhere keep it alive until dropped."""
        if self._mm is None:
            return
        self._view.release()
        # payload views may still be exported; then the map goes when they do
        with contextlib.suppress(BufferError):
            self._mm.close()
        self._mm = None

    def __enter__(self) -> RecordReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<RecordReader {self.path!r} {self.size} bytes version={self.version}>"

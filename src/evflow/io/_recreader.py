"""Reading record files: ``RecordReader`` walks the raw records of a file.

A reader recovers every complete record of a file whose writer was killed: a torn
tail is logged (file, offset, bytes) and skipped. Damage in the middle of a file
raises ``CorruptRecordError`` by default; ``on_corrupt="skip"`` logs and skips the
damaged record instead (the header CRC makes the skip exact, the record magic lets
the reader find the next record after a damaged header). The format is described in
``evflow.io._recformat``.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import zlib
from collections.abc import Iterator
from typing import Literal, NamedTuple

from evflow.errors import ClosedError, CorruptRecordError, InputError
from evflow.io._recformat import (
    FILE_HEADER_SIZE,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    RECORD_MAGIC,
    check_file_header,
    header_ok,
)

log = logging.getLogger(__name__)

OnCorrupt = Literal["raise", "skip"]


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

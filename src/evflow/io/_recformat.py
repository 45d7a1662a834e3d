"""The record file format: a file header, then append-only checksummed records.

Layout (all integers little-endian)::

    file header, 16 bytes:   magic b"EVFLOWRF" | u16 version | u16 reserved
                             | u32 crc32 of bytes 0..12
    record header, 32 bytes: magic b"\\xabEVR" | u32 header crc32 (bytes 8..32)
                             | u64 payload length | u64 uid | u32 flags | u32 payload crc32
    payload: pack_frames(encode_event(store))

The header CRC makes the length trustworthy (so one damaged payload can be skipped
exactly) and the record magic lets a reader find the next record after a damaged header.
The first 16 bytes of the file keep this layout in every future version, so that any
version can say which version a file has.
"""

from __future__ import annotations

import struct
import zlib

from evflow.errors import CorruptRecordError, InputError

MAGIC = b"EVFLOWRF"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
FILE_HEADER = struct.Struct("<8sHHI")
FILE_HEADER_SIZE = FILE_HEADER.size  # 16
RECORD_MAGIC = b"\xabEVR"
RECORD_HEADER = struct.Struct("<4sIQQII")
RECORD_HEADER_SIZE = RECORD_HEADER.size  # 32
_U32 = struct.Struct("<I")
_MAX_U32 = 0xFFFFFFFF
_MAX_U64 = 0xFFFFFFFFFFFFFFFF


def file_header(version: int = FORMAT_VERSION) -> bytes:
    """The 16-byte header that starts every record file."""
    head = MAGIC + struct.pack("<HH", version, 0)
    return head + _U32.pack(zlib.crc32(head))


def check_file_header(path: str, data: bytes) -> int:
    """Validate the first bytes of ``path``; return the format version or raise.

    ``CorruptRecordError`` for a file that is not a record file or has a damaged
    header; ``InputError`` for a version this evflow does not read.
    """
    if len(data) < FILE_HEADER_SIZE:
        if MAGIC.startswith(data[:8]) and data:
            raise CorruptRecordError(
                f"record file {path!r} is truncated: {len(data)} bytes, shorter than "
                f"the {FILE_HEADER_SIZE}-byte file header"
            )
        raise CorruptRecordError(
            f"{path!r} is not an evflow record file: {len(data)} bytes, no file header"
        )
    magic, version, _reserved, crc = FILE_HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptRecordError(
            f"{path!r} is not an evflow record file: starts with {magic!r}, expected {MAGIC!r}"
        )
    if zlib.crc32(data[:12]) != crc:
        raise CorruptRecordError(
            f"record file {path!r} has a damaged file header (header CRC mismatch)"
        )
    if version not in SUPPORTED_VERSIONS:
        raise InputError(
            f"record file {path!r} has format version {version}; this evflow reads "
            f"version(s) {', '.join(map(str, SUPPORTED_VERSIONS))} (a newer evflow wrote it?)"
        )
    return int(version)


_TAIL = struct.Struct("<QQII")  # the header from byte 8: what the header CRC covers


def record_header(payload_len: int, uid: int, flags: int, payload_crc: int) -> bytes:
    """The 32-byte header of one record (its CRC filled in)."""
    try:
        tail = _TAIL.pack(payload_len, uid, flags, payload_crc)
    except struct.error:
        if not 0 <= uid <= _MAX_U64:
            raise ValueError(f"record uid {uid} does not fit in 64 bits unsigned") from None
        raise ValueError(f"record flags {flags} do not fit in 32 bits unsigned") from None
    return RECORD_MAGIC + _U32.pack(zlib.crc32(tail)) + tail


def header_ok(view: memoryview, offset: int) -> bool:
    """Whether a valid record header starts at ``offset`` (magic and header CRC)."""
    return bool(
        view[offset : offset + 4] == RECORD_MAGIC
        and zlib.crc32(view[offset + 8 : offset + RECORD_HEADER_SIZE])
        == _U32.unpack_from(view, offset + 4)[0]
    )

"""A replayed event joined from its pieces, re-headed without decoding it.

The pieces of a complete replayed event joined are ``pack_frames(encode_event(...))``
of the original store: one header frame whose msgpack array is ``(version, kind,
meta, entries)``. The builder's event is the same header under the builder's meta
with ``hlt_state`` and ``hlt_missing`` appended to ``entries``: both are byte edits
(the meta has a fixed place, the entries array is the header's last element), so
the objects are never rebuilt. The bytes come from a socket: the header is parsed
once (msgpack, in C) and every entry checked as the decoder would check it; anything
unusual returns None and the caller takes the long way (a full decode).
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np

from evflow.wire.arrays import dtype_str, ext_hook
from evflow.wire.check import entries_ok
from evflow.wire.header import EVENT_PREFIX, META_END, T_ARRAY, T_VALUE, packb

__all__ = ["NONE_MISSING", "rehead"]

#: ``pack_frames`` of one frame: count 1, then the frame's length (u64)
_ONE_FRAME = struct.Struct("<IQ")
_HEAD_AT = _ONE_FRAME.size  # where the header frame starts in the packed buffer
_ENTRIES_AT = _HEAD_AT + META_END  # where the entries array starts
_PREFIX_END = _HEAD_AT + len(EVENT_PREFIX)
_U4 = dtype_str(np.dtype(np.uint32))
#: ``hlt_missing``: none (a complete event)
NONE_MISSING = ("hlt_missing", T_ARRAY, _U4, (0,), b"")
_EXTRA: dict[int, bytes] = {}  # state -> the two appended entries, packed


def _extra(state: int) -> bytes:
    packed = _EXTRA.get(state)
    if packed is None:
        packed = packb(("hlt_state", T_VALUE, state)) + packb(NONE_MISSING)
        if len(_EXTRA) < 256:
            _EXTRA[state] = packed
    return packed


def _array_head(n: int) -> bytes:
    """msgpack's (shortest) array header for ``n`` elements, as ``packb`` writes it."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def rehead(data: bytes, meta: bytes, state: int) -> bytes | None:
    """The header frame of the event packed in ``data`` with ``meta`` (48 bytes) and the
    entries ``hlt_state = state`` and ``hlt_missing`` (none) appended; None when ``data``
    is not a one-frame event whose entries are all checked here (decode it instead)."""
    size = len(data)
    if size <= _ENTRIES_AT or data[_HEAD_AT:_PREFIX_END] != EVENT_PREFIX:
        return None
    count, length = _ONE_FRAME.unpack_from(data)
    if count != 1 or length != size - _HEAD_AT:
        return None
    try:
        header = msgpack.unpackb(
            memoryview(data)[_HEAD_AT:], raw=False, strict_map_key=False, ext_hook=ext_hook
        )
    except Exception:  # not msgpack, trailing bytes, a bad ext: the decoder says why
        return None
    entries = header[3]
    if not entries_ok(entries):
        return None
    tag = data[_ENTRIES_AT]
    if 0x90 <= tag <= 0x9F:
        start = _ENTRIES_AT + 1
    elif tag == 0xDC:
        start = _ENTRIES_AT + 3
    elif tag == 0xDD:
        start = _ENTRIES_AT + 5
    else:
        return None
    return b"".join(
        (
            EVENT_PREFIX,
            meta,
            _array_head(len(entries) + 2),
            memoryview(data)[start:],
            _extra(state),
        )
    )

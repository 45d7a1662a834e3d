"""A quick check that one-frame events decode, without decoding them.

:func:`decode_event` builds every array (numpy views, ~3 µs for a 1 kB event) to
validate the bytes. An event whose header holds only plain values and arrays inline
can be checked on the parsed header alone, with the decoder's own rules; whatever is
not that simple (buffer frames, awkward arrays, n-d shapes, an unusual header) is
left to the decoder (None here): the check never accepts what the decoder refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from evflow.errors import CodecError
from evflow.event import EventMeta
from evflow.wire.arrays import ext_hook, parse_dtype
from evflow.wire.header import CODEC_VERSION, KIND_EVENT, META, T_ARRAY, T_VALUE

__all__ = ["entries_ok", "quick_meta"]


def entries_ok(entries: Any) -> bool:
    """True when ``entries`` decode (``_decode_body`` with no buffer frames) to plain
    values and 1-d arrays inline; False for anything else (decode to be sure)."""
    if type(entries) is not list:
        return False
    for e in entries:
        if type(e) is not list or len(e) < 2 or type(e[0]) is not str:
            return False
        tag, n = e[1], len(e)
        if tag == T_VALUE and n == 3:
            continue
        if not (tag == T_ARRAY and n == 5 and type(e[4]) is bytes):
            return False
        shape = e[3]
        if not (type(shape) is list and len(shape) == 1 and type(shape[0]) is int):
            return False
        try:
            size = parse_dtype(e[2]).itemsize
        except CodecError:
            return False
        if not size or shape[0] < 0 or shape[0] * size != len(e[4]):
            return False
    return True


def quick_meta(frames: Sequence[Any]) -> EventMeta | None:
    """The meta of the event in ``frames`` when it is one header frame that
    :func:`entries_ok` accepts (so it decodes); None: let the decoder decide."""
    if len(frames) != 1:
        return None
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False, ext_hook=ext_hook)
    except Exception:  # not msgpack, trailing bytes, a bad ext: the decoder says why
        return None
    if (
        type(header) is not list
        or len(header) != 4
        or type(header[0]) is not int
        or header[0] != CODEC_VERSION
        or type(header[1]) is not int
        or header[1] != KIND_EVENT
        or type(header[2]) is not bytes
        or len(header[2]) != META.size
        or not entries_ok(header[3])
    ):
        return None
    return EventMeta(*META.unpack(header[2]))

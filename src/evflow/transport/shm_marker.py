"""The marker frame of a shm device channel: where each frame of each message is.

One ZeroMQ message of a ``transport = "shm"`` channel carries one message (``send``)
or several (``send_many``). Its first frame, the *marker*, lists every frame of every
message, in order; a frame is in the sender's region (a descriptor), inline in the
marker (small frames: no ZeroMQ frame of their own, no ZeroMQ call per frame), or
one of the ZeroMQ frames that follow the marker. Layout, little-endian::

    0    u8 TAG (0xc1: never the first byte of msgpack), u8 VERSION, u16 0,
         u32 messages
    8    u32 frames, u32 region-name bytes, u32 inline bytes, u32 0
    24   u64 send sequence: this ZeroMQ message's place in what the sender sent (one
         counter for its chunks and its messages, after those of its chunks); 0 and
         no region name when the sender has no region
    32   the region's name (ASCII), zero-padded to 8 bytes
         u32 per message: its number of frames; zero-padded to 8 bytes
         4 x u64 per frame: kind, a, b, c
             REGION  a = chunk offset, b = length, c = generation
             SOCKET  the next ZeroMQ frame
             HEAP    the next ZeroMQ frame, a ``new_message`` buffer that did not fit
                     in the region (``recv(views=True)`` wraps it as an InMessage)
             INLINE  a = position in the inline bytes, b = length
         the inline bytes

Every marker of a sender with a region names it and carries a send sequence, also
when no frame is in the region (a copy over ZeroMQ because the region was full, or
all frames inline): the receiver marks it claimed in the region's header, which tells
the sender that chunks sent before it went to a receiver that died (see
:mod:`evflow.transport.shm_region`). Version 1 had no sequence (24-byte head).

A marker comes from a socket: :func:`unpack_marker` checks every count and bound
(exact total length, the frames per message add up, kinds known, inline frames inside
the inline bytes, as many ZeroMQ frames as announced, a sequence exactly when a region
is named) and raises ProtocolError; the region's descriptors and the sequence are
checked against the region by the region reader.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

from evflow.errors import ProtocolError

__all__ = [
    "HEAP",
    "INLINE",
    "INLINE_MAX_B",
    "MAX_FRAMES",
    "MAX_MESSAGES",
    "REGION",
    "SOCKET",
    "Marker",
    "pack_marker",
    "unpack_marker",
]

TAG = 0xC1
VERSION = 2  # 2: the send sequence in the head
REGION, SOCKET, HEAP, INLINE = range(4)
#: frames up to this size travel inside the marker
INLINE_MAX_B = 1024
#: bounds of one marker (a batch): a forged count never makes the receiver allocate more
#: (at most 2 MB of entries, a few MB of Python ints)
MAX_MESSAGES = 1 << 14
MAX_FRAMES = 1 << 16
_HEAD = struct.Struct("<BBHIIIIIQ")


def _pad8(n: int) -> int:
    return -n % 8


class Marker(NamedTuple):
    """A checked marker: ``counts[i]`` frames of message i, ``entries`` flat (4 per frame)."""

    region: str
    seq: int  # the send sequence (0: no region)
    counts: tuple[int, ...]
    entries: tuple[int, ...]
    inline: bytes  # the marker itself; inline frames lie at inline_at + a
    inline_at: int
    n_region: int


@functools.lru_cache(maxsize=256)
def _layout(n_msgs: int, n_frames: int, n_name: int) -> struct.Struct:
    """Everything but the inline bytes, in one struct (one pack or unpack per marker)."""
    pads = f"{_pad8(n_name)}x{n_msgs}I{_pad8(4 * n_msgs)}x"
    return struct.Struct(f"<BBHIIIIIQ{n_name}s{pads}{4 * n_frames}Q")


def pack_marker(
    region: bytes, counts: list[int], entries: list[int], inline: list[object], seq: int = 0
) -> bytes:
    """The marker of one batch (``entries``: 4 ints per frame; ``inline``: the buffers
    of the INLINE frames, in order; ``seq``: its send sequence, 0 if no ``region``)."""
    n_msgs, n_frames = len(counts), len(entries) // 4
    data = b"".join(inline) if inline else b""  # type: ignore[arg-type]  # buffers
    layout = _layout(n_msgs, n_frames, len(region))
    sizes = (n_msgs, n_frames, len(region), len(data))
    head = layout.pack(TAG, VERSION, 0, *sizes, 0, seq, region, *counts, *entries)
    return head + data


def unpack_marker(marker: bytes, n_socket: int) -> Marker:
    """The checked marker of a batch whose ZeroMQ message had ``n_socket`` more frames."""
    if len(marker) < _HEAD.size:
        raise ProtocolError(f"bad shared-memory marker: {len(marker)} bytes")
    tag, version, _, n_msgs, n_frames, n_name, n_inline, _, seq = _HEAD.unpack_from(marker)
    if tag != TAG:
        raise ProtocolError(f"bad shared-memory marker: first byte {tag:#x}")
    if version != VERSION:
        raise ProtocolError(f"shared-memory marker version {version}, we speak {VERSION}")
    if not 0 < n_msgs <= MAX_MESSAGES or n_frames > MAX_FRAMES or n_name > 255:
        raise ProtocolError(
            f"bad shared-memory marker: {n_msgs} messages, {n_frames} frames, "
            f"a region name of {n_name} bytes"
        )
    if (seq == 0) != (n_name == 0):  # a sender with a region numbers every message
        raise ProtocolError(
            f"bad shared-memory marker: send sequence {seq}, region name of {n_name} bytes"
        )
    layout = _layout(n_msgs, n_frames, n_name)
    if len(marker) != layout.size + n_inline:
        raise ProtocolError(
            f"bad shared-memory marker: {len(marker)} bytes, its counts say "
            f"{layout.size + n_inline}"
        )
    fields = layout.unpack_from(marker)
    counts = fields[10 : 10 + n_msgs]
    if sum(counts) != n_frames:
        raise ProtocolError(f"bad shared-memory marker: {sum(counts)} frames of {n_frames}")
    entries = fields[10 + n_msgs :]
    kinds = entries[0::4]
    n_region = kinds.count(REGION)
    n_inline_frames = kinds.count(INLINE)
    n_zmq = kinds.count(SOCKET) + kinds.count(HEAP)
    if n_region + n_inline_frames + n_zmq != n_frames:
        raise ProtocolError("bad shared-memory marker: unknown frame kind")
    if n_zmq != n_socket:
        raise ProtocolError(f"bad shared-memory marker: {n_socket} frames on the socket")
    if n_inline_frames:
        for i in range(0, len(entries), 4):
            if entries[i] == INLINE and entries[i + 1] + entries[i + 2] > n_inline:
                raise ProtocolError("bad shared-memory marker: inline frame beyond its bytes")
    try:
        region = fields[9].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("bad shared-memory marker: region name not ASCII") from None
    return Marker(region, seq, counts, entries, marker, layout.size, n_region)

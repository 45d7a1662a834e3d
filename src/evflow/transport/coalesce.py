"""Several small messages in one ZeroMQ message, their boundaries kept.

A ZeroMQ message costs a few microseconds of Python and libzmq on each side whatever
its size; a 1 kB message is almost all overhead. A channel with batching on
(``batchUs`` > 0, see :class:`~evflow.transport.channel.Channel`) packs the messages
it is given into one ZeroMQ message of three frames::

    [BATCH_TAG][index: uint32 n, frames per message (n), frame lengths][blob]

and the receiving channel hands them out again one by one, each as the frames it was
sent with. ``BATCH_TAG`` (``b"\\x00"``) is no message type of the wire protocol, so a
peer that does not unpack batches refuses the whole message as a bad message rather
than taking it for data.

What arrives is untrusted: :func:`unpack` checks the index against the blob before it
cuts anything, and returns None for a batch that does not add up (the channel then
passes the frames on unchanged and the device's decoder refuses and counts them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: first frame of a batch: a byte no wire-protocol message type uses
BATCH_TAG = b"\x00"
#: most messages in one batch (the index stays small; a bound for the receiver)
MAX_BATCH_MESSAGES = 4096

#: a received blob up to this size is copied to bytes once and cut into bytes frames
COPY_BLOB_MAX_B = 1 << 20

_U32 = np.dtype("<u4")


def pack(messages: Sequence[Sequence[Any]]) -> list[Any]:
    """The three frames that carry ``messages`` (each a list of frames)."""
    counts = [len(m) for m in messages]
    flat = [f for m in messages for f in m]
    lengths = [f.nbytes if type(f) is memoryview else len(f) for f in flat]
    index = np.array([len(messages), *counts, *lengths], dtype=_U32).tobytes()
    return [BATCH_TAG, index, b"".join(flat)]


def is_batch(frames: Sequence[Any]) -> bool:
    """``frames`` (as received, type frame first) is a batch."""
    return len(frames) == 3 and frames[0] == BATCH_TAG


def messages_of(frames: list[Any]) -> list[list[Any]]:
    """What a plain pyzmq receiver of a batching evflow sender calls on each
    ``recv_multipart()``: the messages it carried (one unless it was a batch; a
    malformed batch comes back as it is, for the decoder to refuse)."""
    if is_batch(frames):
        messages = unpack(frames[1], frames[2])
        if messages is not None:
            return [[f if type(f) is bytes else bytes(f) for f in m] for m in messages]
    return [frames]


def unpack(index: Any, blob: Any) -> list[list[Any]] | None:
    """The messages of a batch, each a list of frames cut from ``blob`` (bytes when the
    blob is small enough to copy once, else memoryviews into it); None when the index
    is malformed or does not match the blob (nothing is cut then)."""
    raw = memoryview(index)
    if raw.nbytes < 8 or raw.nbytes % 4:
        return None
    values = np.frombuffer(raw, dtype=_U32)
    n = int(values[0])
    if not 1 <= n <= MAX_BATCH_MESSAGES or len(values) < 1 + n:
        return None
    counts = values[1 : 1 + n]
    lengths = values[1 + n :]
    if counts.min() < 1 or int(counts.sum()) != len(lengths):
        return None
    view = memoryview(blob)
    if int(lengths.sum(dtype=np.uint64)) != view.nbytes:
        return None
    # one copy of a small blob, then bytes slices: what receivers want for the type and
    # header frames, and cheaper than a memoryview per frame
    data: Any = view.tobytes() if view.nbytes <= COPY_BLOB_MAX_B else view
    ends = np.cumsum(lengths, dtype=np.uint64).tolist()
    frames = [data[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]
    per = int(counts[0])
    if per * n == len(frames):  # every message has as many frames (the usual case)
        return [frames[i : i + per] for i in range(0, len(frames), per)]
    out: list[list[Any]] = []
    i = 0
    for c in counts.tolist():
        out.append(frames[i : i + c])
        i += c
    return out

"""Zero-copy messages of shm device channels: a buffer to fill, a view to read.

:class:`OutMessage` is what ``channel.new_message(size)`` returns: writable memory in
the sender's shared-memory region (or, when the region is full, in the process heap:
it then travels over ZeroMQ, still without a copy on the sending side). Fill it in
place (``msg.data``, ``msg.array(dtype)``) and put it among the frames given to
``channel.send``: only a descriptor crosses the socket.

:class:`InMessage` is what ``channel.recv(views=True)`` returns for such a frame: a
read-only view of the same memory. The region's chunk is given back to the sender
when the message is released (:meth:`InMessage.release`, the end of a ``with``
block, or garbage collection) *and* no view taken from it is alive any more: a view
kept longer keeps the chunk, so its bytes cannot change under it.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import numpy as np

from evflow.transport.shm_region import Slot

__all__ = ["InMessage", "OutMessage"]


def _array(slot: Slot | None, frame: Any, dtype: Any, writable: bool) -> np.ndarray:
    if slot is not None:
        raw = np.asarray(slot)  # its base is the slot: the chunk lives as long as it
    elif frame is not None:
        raw = np.frombuffer(frame, np.uint8)
        if not writable:
            raw = raw.view()
            raw.flags.writeable = False
    else:
        raise ValueError("message already released")
    return raw if dtype is np.uint8 or np.dtype(dtype) == np.uint8 else raw.view(dtype)


class OutMessage:
    """A buffer to fill and send once (``channel.new_message(size)``)."""

    __slots__ = ("_heap", "_slot", "nbytes")

    def __init__(self, nbytes: int, slot: Slot | None = None) -> None:
        self.nbytes = nbytes
        self._slot = slot
        self._heap: bytearray | None = None if slot is not None else bytearray(nbytes)

    @property
    def in_region(self) -> bool:
        """True if the buffer lies in the shared-memory region (False: heap fallback)."""
        return self._slot is not None

    @property
    def data(self) -> memoryview:
        """The writable bytes (a ``memoryview`` of ``nbytes`` unsigned bytes)."""
        return self.array().data

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        """The buffer as a writable 1-d numpy array of ``dtype`` (no copy)."""
        return _array(self._slot, self._heap, dtype, True)

    def __len__(self) -> int:
        return self.nbytes

    def take(self) -> tuple[Slot | None, bytearray | None]:
        """For the channel: hand over the memory; the message is spent after this."""
        slot, heap = self._slot, self._heap
        if slot is None and heap is None:
            raise ValueError("message already sent or released")
        self._slot = self._heap = None
        return slot, heap

    def release(self) -> None:
        """Give the buffer back unsent (also what happens when it is garbage)."""
        self._slot = self._heap = None

    def __enter__(self) -> OutMessage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        where = "region" if self._slot else ("heap" if self._heap is not None else "spent")
        return f"<OutMessage {self.nbytes} bytes, {where}>"


class InMessage:
    """A received frame, read in place (``channel.recv(views=True)``)."""

    __slots__ = ("_frame", "_slot", "nbytes")

    def __init__(self, nbytes: int, slot: Slot | None = None, frame: Any = None) -> None:
        self.nbytes = nbytes
        self._slot = slot
        self._frame = frame

    @property
    def in_region(self) -> bool:
        """True if the bytes are in the sender's region (False: came over ZeroMQ)."""
        return self._slot is not None

    @property
    def data(self) -> memoryview:
        """The bytes, read-only, no copy."""
        return self.array().data

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        """The bytes as a read-only 1-d numpy array of ``dtype`` (no copy)."""
        return _array(self._slot, self._frame, dtype, False)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.array(np.uint8 if dtype is None else dtype)

    def tobytes(self) -> bytes:
        return self.array().tobytes()

    __bytes__ = tobytes

    def __len__(self) -> int:
        return self.nbytes

    def release(self) -> None:
        """Done with it: the chunk goes back to the sender once no view of it is alive."""
        self._slot = self._frame = None

    close = release

    def __enter__(self) -> InMessage:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        where = "region" if self._slot else ("zmq" if self._frame is not None else "released")
        return f"<InMessage {self.nbytes} bytes, {where}>"

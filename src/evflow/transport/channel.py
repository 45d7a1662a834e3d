"""Channels: named zmq sockets built from FairMQ-style configs.

:class:`Channel` is one open socket with its config; ``open_channel()``
(:mod:`evflow.transport.opening`) is the ONE place in evflow that creates them. A
config uses FairMQ's keys and defaults::

    name=data,type=push,method=bind,address=tcp://*:5555,sndBufSize=1000

The same keys work in TOML/JSON (a dict or a list of dicts, or ``{"channels": [...]}``).
Several endpoints are separated by ``;``; FairMQ's ``@``/``>`` prefixes pick bind or
connect per endpoint. A name given twice makes sub-channels ``name[0]``, ``name[1]``.

Deviation from FairMQ, on purpose: ``autoBind`` defaults to False. A fixed address that
silently moves to another port strands the peers that connect to it; say ``tcp://*:0``
(or set ``autoBind=true``) when any free port will do.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import zmq

from evflow.transport import coalesce
from evflow.transport.channel_config import (
    COPY_THRESHOLD_BYTES,
    METHODS,
    RECEIVING,
    SENDING,
    SOCKET_TYPES,
    TRANSPORTS,
    ChannelConfig,
    channel_configs_from_args,
    channel_configs_from_data,
    config_from_mapping,
    load_channel_configs,
    parse_channel_config,
    validate,
)
from evflow.transport.curve import CurveSecurity
from evflow.transport.shm_message import OutMessage
from evflow.wire.messages import MsgType

__all__ = [
    "COPY_THRESHOLD_BYTES",
    "DEFAULT_BATCH_US",
    "METHODS",
    "RECEIVING",
    "SENDING",
    "SOCKET_TYPES",
    "TRANSPORTS",
    "Channel",
    "ChannelConfig",
    "ChannelStats",
    "channel_configs_from_args",
    "channel_configs_from_data",
    "config_from_mapping",
    "load_channel_configs",
    "parse_channel_config",
    "validate",
]

log = logging.getLogger("evflow.channel")

_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLOUT = int(zmq.POLLOUT)
#: the type frame of data: the only messages a batching channel holds back
_DATA_TYPE = bytes([int(MsgType.EVENTS)])
#: socket types whose sends may be batched (one peer gets each message whole, and no
#: topic prefix or request/reply envelope depends on the first frame)
BATCHING_TYPES = frozenset({"push", "pair"})
#: the built-in devices' batching (µs a small message may wait for company): at full
#: speed a 64 kB batch of 1 kB messages fills in ~0.1 ms; a trickle waits at most this
DEFAULT_BATCH_US = 500
#: a batch's blob is copied into its ZeroMQ message below this size: it is a new
#: buffer every time, and pyzmq's zero-copy bookkeeping (a gc notification per frame)
#: costs more than the copy of a few hundred kB here
BATCH_ZERO_COPY_MIN_B = 512 * 1024


@dataclass(frozen=True)
class ChannelStats:
    """Counters of one channel since it was opened (messages and bytes, in and out)."""

    name: str
    index: int
    type: str
    messages_in: int
    messages_out: int
    bytes_in: int
    bytes_out: int


class Channel:
    """An open socket with its config, real endpoints and counters.

    Send with :meth:`send` (frames; large ones go without a copy) and receive with
    :meth:`recv` so that the counters stay right. ``socket`` is there for polling and
    for code that needs the raw socket; traffic sent on it directly is not counted.

    Batching (``batchUs`` > 0, push and pair channels with evflow framing): data
    messages (EVENTS) smaller than ``batchBytes`` are held and go together in one
    ZeroMQ message (:mod:`evflow.transport.coalesce`) when ``batchBytes`` are held, when
    the oldest has waited ``batchUs`` microseconds, when any other message (END, ACK,
    ...) is sent behind them, or at :meth:`flush` (the device loops flush before they
    wait). Every message is still counted, acknowledged and handed out on its own: the
    receiving channel unpacks a batch and :meth:`recv` returns one message at a time
    (the rest wait in :attr:`pending`). A receiver of any kind unpacks batches; only
    senders choose to batch.
    """

    def __init__(
        self,
        config: ChannelConfig,
        index: int,
        socket: zmq.Socket[Any],
        endpoints: list[str],
        ipc_files: list[Path],
    ) -> None:
        self.config = config
        self.name = config.name
        self.index = index
        self.type = config.type
        self.socket = socket
        self.endpoints = endpoints
        self._ipc_files = ipc_files
        #: session directories our connects made (the peer may never come): removed at
        #: close when empty, as those of our binds are
        self.ipc_dirs: set[Path] = set()
        self.messages_in = 0
        self.messages_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.closed = False
        #: raw framing: messages are bare frames (FairMQ), see channel_config.FRAMINGS
        self.raw = config.framing == "raw"
        #: CURVE on this socket (None without), closed with the channel
        self.security: CurveSecurity | None = None
        # frames received as bytes: [identity,] type, header (raw: only the identity)
        self._copy_frames = (
            (1 if self.raw else 3) if config.type == "router" else (0 if self.raw else 2)
        )
        # batching: messages held back (sender), and the rest of a batch (receiver)
        self.batch_us = 0
        self.batch_bytes = config.batchBytes
        self._held: list[Sequence[Any]] = []
        self._held_bytes = 0
        self._held_until = 0.0  # when the oldest held message has waited batch_us
        self._pending: deque[list[Any]] = deque()
        self.batches_out = 0  # ZeroMQ messages that carried more than one message
        self.batches_in = 0
        if config.batchUs > 0:
            self.set_batching(config.batchUs)

    def set_batching(self, batch_us: int) -> bool:
        """Hold data messages up to ``batch_us`` microseconds (0: off) and send them in
        one ZeroMQ message; False (and off) where this channel cannot batch."""
        if (
            self.raw
            or self.config.transport != "zmq"
            or self.type not in BATCHING_TYPES
            or batch_us <= 0
            or self.batch_bytes <= 0
        ):
            self.batch_us = 0
            return False
        self.batch_us = int(batch_us)
        return True

    @property
    def held(self) -> int:
        """Messages sent and held back for the next batch (0 without batching)."""
        return len(self._held)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ",".join(self.endpoints)
        return f"<Channel {self.name}[{self.index}] {self.type} {state}>"

    @property
    def label(self) -> str:
        return f"{self.name}[{self.index}]"

    def new_message(self, size: int, wait_s: float = 0.0) -> OutMessage:
        """A buffer of ``size`` bytes to fill and send (in the shared-memory region on a
        ``transport=shm`` channel, see :mod:`evflow.transport.shm_channel`; here: heap)."""
        if size < 0:
            raise ValueError(f"message size {size} is negative")
        return OutMessage(size)

    def send(self, frames: Sequence[Any], flags: int = 0) -> None:
        """Send one multipart message; frames of 64 kB and more go zero-copy.

        With batching on, a small data message may be held for the next batch; with
        ``zmq.NOBLOCK`` a ``zmq.Again`` means this message was neither sent nor held."""
        if self.batch_us:
            self._send_batching(frames, int(flags))
            return
        self._send_frames(frames, flags)
        self.messages_out += 1

    def _send_batching(self, frames: Sequence[Any], flags: int) -> None:
        if self._held_bytes >= self.batch_bytes:
            self.flush(flags)  # full: room first (zmq.Again: this one is not taken)
        size = sum([f.nbytes if type(f) is memoryview else len(f) for f in frames])
        held = self._held
        if size >= self.batch_bytes or frames[0] != _DATA_TYPE:
            # control messages and large data go now, behind what is held
            if held:
                held.append(frames)
                try:
                    self._flush_held(flags)
                except zmq.Again:
                    held.pop()
                    raise
                self.bytes_out += size
            else:
                self._send_frames(frames, flags)
            self.messages_out += 1
            return
        if not held:
            self._open_batch(flags)
        held.append(frames)
        self._held_bytes += size
        self.messages_out += 1
        self.bytes_out += size
        n = len(held)
        if (
            self._held_bytes >= self.batch_bytes
            or n >= coalesce.MAX_BATCH_MESSAGES
            # the clock every 8th message: a busy sender is flushed by size anyway
            or (not n & 7 and time.monotonic() >= self._held_until)
        ):
            with contextlib.suppress(zmq.Again):  # held: it goes with the next one
                self._flush_held(flags)

    def _open_batch(self, flags: int) -> None:
        """Start holding a new batch. It starts only where one could go now: with no
        peer (or a full queue) a non-blocking send is refused as zmq refuses it, and
        nothing is held for nobody."""
        if flags & _NOBLOCK and not self.socket.getsockopt(zmq.EVENTS) & _POLLOUT:  # type: ignore[operator]
            raise zmq.Again()
        self._held_until = time.monotonic() + self.batch_us * 1e-6

    def flush(self, flags: int = 0) -> None:
        """Send the messages held for a batch now (``zmq.Again`` with ``zmq.NOBLOCK``
        when the peer cannot take them: they stay held)."""
        if self._held:
            self._flush_held(int(flags))

    def _flush_held(self, flags: int) -> None:
        held = self._held
        try:
            if len(held) == 1:
                self._send_frames(held[0], flags, count=False)
            else:
                try:
                    frames = coalesce.pack(held)
                except TypeError:  # new_message() buffers: their arrays join
                    frames = coalesce.pack([[_buffer(f) for f in m] for m in held])
                self._send_frames(frames, flags, count=False, copy_below=BATCH_ZERO_COPY_MIN_B)
                self.batches_out += 1
        except zmq.Again:
            raise  # no room yet: they stay held
        except zmq.ZMQError:
            held.clear()  # the socket cannot send them (closed, terminated): gone, not retried
            self._held_bytes = 0
            raise
        held.clear()
        self._held_bytes = 0

    def _send_frames(
        self,
        frames: Sequence[Any],
        flags: int,
        count: bool = True,
        copy_below: int = COPY_THRESHOLD_BYTES,
    ) -> None:
        send = self.socket.send
        last = len(frames) - 1
        # plain ints: or-ing pyzmq's flag enums builds a new enum member per message
        flags = int(flags)
        more = flags | _SNDMORE
        nbytes = 0
        for i, f in enumerate(frames):
            if type(f) is OutMessage:
                f = f.array()  # new_message(): sent without a copy (a heap buffer here)
            size = f.nbytes if type(f) is memoryview else len(f)
            nbytes += size
            # small frames are cheaper to copy than to track (pyzmq's zero-copy path
            # notifies a gc thread per frame); large ones must not be copied
            send(f, more if i < last else flags, copy=size < copy_below)
        if count:
            self.bytes_out += nbytes

    def send_many(self, messages: Sequence[Sequence[Any]], flags: int = 0) -> None:
        """Send several messages. On a batching channel (small data messages) and on a
        ``transport=shm`` channel all or none; else one after the other, so with
        ``zmq.NOBLOCK`` a ``zmq.Again`` may come after the first ones went."""
        flags = int(flags)
        if self.batch_us and self._hold_many(messages, flags):
            return
        for frames in messages:
            self.send(frames, flags)

    def _hold_many(self, messages: Sequence[Sequence[Any]], flags: int) -> bool:
        """Hold ``messages`` all at once if they are small data messages (False, and
        nothing done, if one is not); ``zmq.Again`` as :meth:`send` raises it."""
        if len(self._held) + len(messages) > coalesce.MAX_BATCH_MESSAGES:
            return False
        sizes = []
        last: Any = None
        size = 0
        limit = self.batch_bytes
        for frames in messages:
            if frames is not last:  # (a sampler sends one list again and again)
                if frames[0] != _DATA_TYPE:
                    return False
                size = sum([f.nbytes if type(f) is memoryview else len(f) for f in frames])
                if size >= limit:
                    return False
                last = frames
            sizes.append(size)
        if not sizes:
            return True
        if self._held_bytes >= limit:
            self.flush(flags)  # full: room first (zmq.Again: none is taken)
        held = self._held
        if not held:
            self._open_batch(flags)
        held.extend(messages)
        total = sum(sizes)
        self._held_bytes += total
        self.messages_out += len(sizes)
        self.bytes_out += total
        if (
            self._held_bytes >= limit
            or len(held) >= coalesce.MAX_BATCH_MESSAGES
            or time.monotonic() >= self._held_until
        ):
            with contextlib.suppress(zmq.Again):  # held: they go with the next ones
                self._flush_held(flags)
        return True

    @property
    def pending(self) -> int:
        """Messages received already that :meth:`recv` hands out next without asking
        the socket (the rest of a batch)."""
        return len(self._pending)

    def recv_many(self, flags: int = 0, *, views: bool = False) -> list[list[Any]]:
        """The messages still pending, or else those of the next ZeroMQ message
        (several when it was a batch)."""
        out = [self.recv(flags, views=views)]
        if self._pending:
            out += self._pending
            self._pending.clear()
        return out

    def recv(self, flags: int = 0, *, views: bool = False) -> list[Any]:
        """Receive one multipart message as a list of frames.

        ``views`` matters on ``transport=shm`` channels only (payload frames here are
        ``zmq.Frame`` views already).

        The routing identity (ROUTER), the type and the header frames come as bytes
        (cheap for small frames, and what the decoder wants); payload frames come as
        ``zmq.Frame`` without a copy (on a raw channel, every frame but the identity).
        """
        if self._pending:
            return self._pending.popleft()
        # every frame as a zmq.Frame, whose ``more`` says if another follows: half the
        # cost of asking the socket for RCVMORE after each one (an enum per call)
        recv = self.socket.recv
        n_bytes = self._copy_frames
        frame = recv(flags, copy=False)
        frames: list[Any] = [frame.bytes if n_bytes > 0 else frame]
        nbytes = len(frame)
        while frame.more:
            frame = recv(copy=False)
            frames.append(frame.bytes if len(frames) < n_bytes else frame)
            nbytes += len(frame)
        self.bytes_in += nbytes
        if n_bytes >= 2 and len(frames) >= n_bytes and frames[n_bytes - 2] == coalesce.BATCH_TAG:
            return self._unbatch(frames, n_bytes - 2)
        self.messages_in += 1
        return frames

    def _unbatch(self, frames: list[Any], at: int) -> list[Any]:
        """The first message of a received batch (the rest go to ``pending``); the
        frames unchanged, to be refused by the decoder, if the batch does not add up."""
        messages = None
        if len(frames) == at + 3:
            messages = coalesce.unpack(frames[at + 1], frames[at + 2])
        if messages is None:
            self.messages_in += 1
            return frames
        if type(messages[0][0]) is not bytes:  # a large blob: type and header as bytes
            messages = [[bytes(m[0]), bytes(m[1]), *m[2:]] if len(m) > 1 else m for m in messages]
        if at:  # a ROUTER's peer identity before each
            messages = [[*frames[:at], *m] for m in messages]
        self.messages_in += len(messages)
        self.batches_in += 1
        self._pending.extend(messages[1:])
        return messages[0]

    def poll(self, timeout_ms: int) -> bool:
        """True if a message can be received within ``timeout_ms``."""
        return bool(self._pending) or bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def readable(self) -> bool:
        """True if :meth:`recv` has a message now. Cheaper than reading until
        ``zmq.Again`` (a raised exception) to learn that the socket is empty."""
        return self.pending > 0 or bool(cast(int, self.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def statistics(self) -> ChannelStats:
        return ChannelStats(
            self.name,
            self.index,
            self.type,
            self.messages_in,
            self.messages_out,
            self.bytes_in,
            self.bytes_out,
        )

    def close(self, linger_ms: int | None = None) -> None:
        """Close the socket (``linger_ms`` overrides the config) and remove our ipc files."""
        if self.closed:
            return
        self.closed = True
        linger = self.config.linger if linger_ms is None else linger_ms
        if self._held and linger != 0:
            with contextlib.suppress(zmq.ZMQError):  # a peer that is gone takes none
                self._flush_held(int(zmq.NOBLOCK))
        self._pending.clear()
        if self.security is not None:
            self.security.close()
        with contextlib.suppress(zmq.ZMQError):
            self.socket.close(linger=linger)
        for path in self._ipc_files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        _remove_empty_dirs({p.parent for p in self._ipc_files} | self.ipc_dirs)


def _buffer(frame: Any) -> Any:
    return frame.array() if type(frame) is OutMessage else frame


def _remove_empty_dirs(dirs: set[Path]) -> None:
    from evflow.transport.paths import runtime_base_dir

    base = runtime_base_dir()
    for parent in dirs:
        if parent.parent == base:
            with contextlib.suppress(OSError):
                parent.rmdir()  # only succeeds when empty: other devices may share it

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import zmq

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

__all__ = [
    "COPY_THRESHOLD_BYTES",
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
        """Send one multipart message; frames of 64 kB and more go zero-copy."""
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
            send(f, more if i < last else flags, copy=size < COPY_THRESHOLD_BYTES)
        self.messages_out += 1
        self.bytes_out += nbytes

    def send_many(self, messages: Sequence[Sequence[Any]], flags: int = 0) -> None:
        """Send several messages. On a ``transport=shm`` channel they go in one ZeroMQ
        message, all or none; here one after the other, so with ``zmq.NOBLOCK`` a
        ``zmq.Again`` may come after the first ones went (block, or send one by one)."""
        for frames in messages:
            self.send(frames, flags)

    @property
    def pending(self) -> int:
        """Messages received already that :meth:`recv` hands out next without asking
        the socket (the rest of a shm batch; always 0 here)."""
        return 0

    def recv_many(self, flags: int = 0, *, views: bool = False) -> list[list[Any]]:
        """The messages of the next ZeroMQ message: several after a shm ``send_many``,
        else one."""
        return [self.recv(flags, views=views)]

    def recv(self, flags: int = 0, *, views: bool = False) -> list[Any]:
        """Receive one multipart message as a list of frames.

        ``views`` matters on ``transport=shm`` channels only (payload frames here are
        ``zmq.Frame`` views already).

        The routing identity (ROUTER), the type and the header frames come as bytes
        (cheap for small frames, and what the decoder wants); payload frames come as
        ``zmq.Frame`` without a copy (on a raw channel, every frame but the identity).
        """
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
        self.messages_in += 1
        self.bytes_in += nbytes
        return frames

    def poll(self, timeout_ms: int) -> bool:
        """True if a message can be received within ``timeout_ms``."""
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

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
        if self.security is not None:
            self.security.close()
        with contextlib.suppress(zmq.ZMQError):
            self.socket.close(linger=linger)
        for path in self._ipc_files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        _remove_empty_dirs({p.parent for p in self._ipc_files} | self.ipc_dirs)


def _remove_empty_dirs(dirs: set[Path]) -> None:
    from evflow.transport.paths import runtime_base_dir

    base = runtime_base_dir()
    for parent in dirs:
        if parent.parent == base:
            with contextlib.suppress(OSError):
                parent.rmdir()  # only succeeds when empty: other devices may share it

"""``open_channel()``: the one place in evflow that creates a channel's zmq socket.

It validates the config, loads the CURVE keys, applies the socket options, binds or
connects every endpoint (resolving tcp port 0 and bare ``ipc://``) and returns a
:class:`~evflow.transport.channel.Channel`, or a
:class:`~evflow.transport.shm_channel.ShmChannel` for ``transport=shm``. It lives above
both channel kinds, so that neither imports the other's module back.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from evflow.errors import ConfigurationError
from evflow.transport.address import Endpoint, resolve_for_socket
from evflow.transport.channel import Channel, _remove_empty_dirs
from evflow.transport.channel_config import SOCKET_TYPES, ChannelConfig, validate
from evflow.transport.curve import CurveOptions, CurveSecurity
from evflow.transport.farmkeys import farm_keys
from evflow.transport.paths import ipc_listening
from evflow.transport.shm_channel import ShmChannel

__all__ = ["IPC_RECONNECT_IVL_MAX_MS", "IPC_RECONNECT_IVL_MS", "open_channel"]

log = logging.getLogger("evflow.channel")


#: reconnect interval of ipc connects (ms), doubling up to the maximum (ms)
IPC_RECONNECT_IVL_MS = 2
IPC_RECONNECT_IVL_MAX_MS = 100


def open_channel(
    context: zmq.Context[Any],
    config: ChannelConfig,
    session: str,
    index: int = 0,
    configure: Callable[[zmq.Socket[Any]], None] | None = None,
) -> Channel:
    """Create the socket of ``config``, apply its options, bind/connect every endpoint.

    ``configure(socket)`` runs before the first bind or connect: security options
    (``transport/security.py``) must be set by then.

    Returns a Channel whose ``endpoints`` are the real ones (tcp port 0 and bare
    ``ipc://`` resolved). Raises ConfigurationError when an address is in use or
    cannot be bound/connected; the socket is closed again on any failure.
    """
    validate(config)
    security = _security(config, index)  # loads and checks keys
    sock = context.socket(SOCKET_TYPES[config.type])
    ipc_files: list[Path] = []
    ipc_dirs: set[Path] = set()
    endpoints: list[str] = []
    try:
        if security is not None:
            security.apply(sock, context)
        sock.setsockopt(zmq.LINGER, config.linger)
        sock.setsockopt(zmq.SNDHWM, config.sndBufSize)
        sock.setsockopt(zmq.RCVHWM, config.rcvBufSize)
        if config.sndKernelSize:
            sock.setsockopt(zmq.SNDBUF, config.sndKernelSize)
        if config.rcvKernelSize:
            sock.setsockopt(zmq.RCVBUF, config.rcvKernelSize)
        if config.type == "sub":
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        elif config.type == "xsub":
            sock.send(b"\x01")  # subscribe to everything
        if configure is not None:
            configure(sock)
        label = f"{config.name}-{index}"
        for ep in config.endpoints:
            method = ep.method or config.method
            url, ipc_file = resolve_for_socket(ep, session, label)
            if method == "connect":
                if ipc_file is not None:
                    ipc_dirs.add(ipc_file.parent)
                if url.startswith("ipc://"):
                    # a peer on this host binds within milliseconds: retry at 10 ms
                    # (doubling up to libzmq's usual 100 ms) instead of 100 ms; a role
                    # forked before its peer had bound waited 100 ms for its first hop
                    sock.setsockopt(zmq.RECONNECT_IVL, IPC_RECONNECT_IVL_MS)
                    sock.setsockopt(zmq.RECONNECT_IVL_MAX, IPC_RECONNECT_IVL_MAX_MS)
                try:
                    sock.connect(url)
                except zmq.ZMQError as exc:
                    raise ConfigurationError(
                        f"channel {config.name!r}: cannot connect to {url!r}: {exc.strerror}"
                    ) from None
                endpoints.append(url)
                continue
            if ipc_file is not None:
                if ipc_listening(ipc_file):
                    raise ConfigurationError(
                        f"channel {config.name!r}: address {url!r} already in use "
                        "(another device bound it; pick another path or use bare ipc://)"
                    )
                with contextlib.suppress(FileNotFoundError):
                    ipc_file.unlink()  # stale file of a dead process
            endpoints.append(_bind(sock, url, ep, config))
            if ipc_file is not None:
                ipc_files.append(ipc_file)
    except BaseException:
        if security is not None:
            security.close()
        sock.close(linger=0)
        for path in ipc_files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        _remove_empty_dirs({p.parent for p in ipc_files} | ipc_dirs)
        raise
    if config.transport == "shm":
        channel: Channel = ShmChannel(config, index, sock, endpoints, ipc_files, session=session)
    else:
        channel = Channel(config, index, sock, endpoints, ipc_files)
    channel.security = security
    channel.ipc_dirs = ipc_dirs
    log.debug("opened %r", channel)
    return channel


def _security(config: ChannelConfig, index: int) -> CurveSecurity | None:
    """CURVE for this channel: its own curve=... keys, else the farm's keys for tcp."""
    label = f"{config.name}[{index}]"
    if config.curve in ("server", "client"):
        opts = CurveOptions(
            config.curve, config.curveSecretKey, config.curveServerKey, config.curveAllow
        )
        return CurveSecurity(label, opts)
    if config.curve == "none":
        return None
    tcp = [ep for ep in config.endpoints if ep.scheme == "tcp"]
    if not tcp:
        return None
    keys = farm_keys()
    if keys is None:
        return None
    return CurveSecurity(label, keys.options(config.name, tcp, config.method))


def _bind(sock: zmq.Socket[Any], url: str, ep: Endpoint, config: ChannelConfig) -> str:
    for attempt in range(3):
        try:
            sock.bind(url)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EADDRINUSE and config.autoBind and ep.scheme == "tcp":
                url = f"tcp://{ep.host}:0"
                continue
            if exc.errno == errno.ENOENT and attempt < 2:
                # a device of the same session removed the (then empty) session dir
                Path(url[len("ipc://") :]).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                time.sleep(0.01)
                continue
            if exc.errno == errno.EADDRINUSE:
                raise ConfigurationError(
                    f"channel {config.name!r}: address {url!r} already in use "
                    "(another process bound it; use port 0 for a free port or autoBind=true)"
                ) from None
            raise ConfigurationError(
                f"channel {config.name!r}: cannot bind {url!r}: {exc.strerror}"
            ) from None
    raise ConfigurationError(f"channel {config.name!r}: cannot bind {url!r}")

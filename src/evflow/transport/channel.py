"""Channels: named zmq sockets built from FairMQ-style configs.

``open_channel()`` is the ONE place in evflow that creates zmq sockets. A config uses
FairMQ's keys and defaults::

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
import errno
import json
import logging
import socket as pysocket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import zmq

from evflow.errors import ConfigurationError
from evflow.transport.address import (
    Endpoint,
    check_endpoint,
    parse_address,
    resolve_for_socket,
)

log = logging.getLogger("evflow.channel")

SOCKET_TYPES: dict[str, int] = {
    "push": zmq.PUSH,
    "pull": zmq.PULL,
    "pub": zmq.PUB,
    "sub": zmq.SUB,
    "xpub": zmq.XPUB,
    "xsub": zmq.XSUB,
    "router": zmq.ROUTER,
    "dealer": zmq.DEALER,
    "pair": zmq.PAIR,
    "req": zmq.REQ,
    "rep": zmq.REP,
}
#: socket types that can receive / send
RECEIVING = frozenset({"pull", "sub", "xpub", "xsub", "router", "dealer", "pair", "req", "rep"})
SENDING = frozenset({"push", "pub", "xpub", "xsub", "router", "dealer", "pair", "req", "rep"})
METHODS = ("bind", "connect")
TRANSPORTS = ("zmq",)
#: frames at least this large are sent without copying (zmq keeps a reference)
COPY_THRESHOLD_BYTES = 65536


@dataclass
class ChannelConfig:
    """One channel (or sub-channel). Field names and defaults are FairMQ's.

    ``sndBufSize``/``rcvBufSize`` are the high-water marks in messages; ``linger`` is in
    ms (-1 = wait for ever); ``rateLogging`` in seconds (0 = off); ``sndKernelSize`` /
    ``rcvKernelSize`` are kernel socket buffer sizes in bytes (0 = OS default).
    """

    name: str
    type: str = ""
    method: str = ""
    address: str = ""
    transport: str = "zmq"
    sndBufSize: int = 1000
    rcvBufSize: int = 1000
    sndKernelSize: int = 0
    rcvKernelSize: int = 0
    linger: int = 500
    rateLogging: int = 1
    autoBind: bool = False

    def __post_init__(self) -> None:
        validate(self)

    @property
    def endpoints(self) -> list[Endpoint]:
        return parse_address(self.address)


_KEYS = {f.name: f for f in fields(ChannelConfig)}
_INT_KEYS = ("sndBufSize", "rcvBufSize", "sndKernelSize", "rcvKernelSize", "linger", "rateLogging")


def _bad(name: str, key: str, value: Any, expected: str) -> ConfigurationError:
    return ConfigurationError(f"channel {name!r}: bad {key} {value!r}; expected {expected}")


def validate(cfg: ChannelConfig) -> None:
    """Raise one ConfigurationError naming the first bad key of ``cfg``."""
    name = cfg.name
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_.-" for c in name):
        raise _bad(str(name), "name", name, "letters, digits, '_', '.', '-'")
    if not cfg.type:
        raise ConfigurationError(
            f"channel {name!r}: missing key 'type' ({' | '.join(SOCKET_TYPES)})"
        )
    if cfg.type not in SOCKET_TYPES:
        raise _bad(name, "type", cfg.type, " | ".join(SOCKET_TYPES))
    if cfg.transport not in TRANSPORTS:
        raise _bad(name, "transport", cfg.transport, "zmq (the only transport built so far)")
    for key in _INT_KEYS:
        value = getattr(cfg, key)
        low = -1 if key == "linger" else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise _bad(name, key, value, f"an integer >= {low}")
    if not isinstance(cfg.autoBind, bool):
        raise _bad(name, "autoBind", cfg.autoBind, "true or false")
    if not cfg.address:
        raise ConfigurationError(f"channel {name!r}: missing key 'address'")
    endpoints = parse_address(cfg.address)
    if cfg.method not in ("", *METHODS):
        raise _bad(name, "method", cfg.method, "bind or connect")
    for ep in endpoints:
        method = ep.method or cfg.method
        if not method:
            raise ConfigurationError(
                f"channel {name!r}: missing key 'method' (bind or connect) for {ep.url!r}"
            )
        check_endpoint(ep, method)


def _convert(name: str, key: str, value: Any) -> Any:
    """Convert a string value from the command line (or a TOML/JSON value) to its type."""
    if key == "autoBind":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise _bad(name, key, value, "true or false")
    if key in _INT_KEYS:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return int(str(value).strip())
        except ValueError:
            raise _bad(name, key, value, "an integer") from None
    if not isinstance(value, str):
        raise _bad(name, key, value, "a string")
    return value.strip()


def config_from_mapping(data: Mapping[str, Any]) -> ChannelConfig:
    """A ChannelConfig from a dict with FairMQ keys; unknown keys are refused."""
    if not isinstance(data, Mapping):
        raise ConfigurationError(f"channel config must be a table/dict, got {data!r}")
    name = str(data.get("name", ""))
    if not name:
        raise ConfigurationError(f"channel config {dict(data)!r}: missing key 'name'")
    unknown = [k for k in data if k not in _KEYS]
    if unknown:
        raise ConfigurationError(
            f"channel {name!r}: unknown key {unknown[0]!r}; expected one of {', '.join(_KEYS)}"
        )
    values = {k: _convert(name, k, v) for k, v in data.items() if k != "name"}
    return ChannelConfig(name=name, **values)


def parse_channel_config(text: str) -> list[ChannelConfig]:
    """Parse FairMQ's ``name=data,type=push,...`` form, or JSON (a dict or a list)."""
    stripped = text.strip()
    if stripped[:1] in "[{":
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"channel config is not valid JSON: {exc}") from None
        return channel_configs_from_data(data)
    values: dict[str, str] = {}
    for item in stripped.split(","):
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigurationError(
                f"malformed channel config {text!r}: {item!r} is not key=value "
                "(expected e.g. name=data,type=push,method=bind,address=tcp://*:5555)"
            )
        key, value = item.split("=", 1)
        values[key.strip()] = value
    return [config_from_mapping(values)]


def channel_configs_from_data(data: Any) -> list[ChannelConfig]:
    """Configs from decoded TOML/JSON: a dict, a list of dicts, or ``{"channels": [...]}``."""
    if isinstance(data, Mapping) and "channels" in data:
        data = data["channels"]
    if isinstance(data, Mapping):
        return [config_from_mapping(data)]
    if isinstance(data, list):
        return [config_from_mapping(d) for d in data]
    raise ConfigurationError(f"channel config must be a dict or a list of dicts, got {data!r}")


def load_channel_configs(path: str | Path) -> list[ChannelConfig]:
    """Read channel configs from a ``.toml`` or ``.json`` file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigurationError(f"cannot read channel config file {str(path)!r}: {exc}") from None
    if path.suffix == ".toml":
        import tomllib

        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"channel config file {str(path)!r}: {exc}") from None
        return channel_configs_from_data(data)
    return parse_channel_config(text)


def channel_configs_from_args(values: Iterable[str]) -> list[ChannelConfig]:
    """``--channel-config`` values: key=value strings, JSON, or .toml/.json file paths."""
    out: list[ChannelConfig] = []
    for value in values:
        if value.endswith((".toml", ".json")) and "=" not in value:
            out.extend(load_channel_configs(value))
        else:
            out.extend(parse_channel_config(value))
    return out


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
        self.messages_in = 0
        self.messages_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.closed = False
        # frames received as bytes: [identity,] type, header
        self._copy_frames = 3 if config.type == "router" else 2

    def __repr__(self) -> str:
        state = "closed" if self.closed else ",".join(self.endpoints)
        return f"<Channel {self.name}[{self.index}] {self.type} {state}>"

    @property
    def label(self) -> str:
        return f"{self.name}[{self.index}]"

    def send(self, frames: Sequence[Any], flags: int = 0) -> None:
        """Send one multipart message; frames of 64 kB and more go zero-copy."""
        send = self.socket.send
        last = len(frames) - 1
        more = flags | zmq.SNDMORE
        nbytes = 0
        for i, f in enumerate(frames):
            size = f.nbytes if type(f) is memoryview else len(f)
            nbytes += size
            # small frames are cheaper to copy than to track (pyzmq's zero-copy path
            # notifies a gc thread per frame); large ones must not be copied
            send(f, more if i < last else flags, copy=size < COPY_THRESHOLD_BYTES)
        self.messages_out += 1
        self.bytes_out += nbytes

    def recv(self, flags: int = 0) -> list[Any]:
        """Receive one multipart message as a list of frames.

        The routing identity (ROUTER), the type and the header frames come as bytes
        (cheap for small frames, and what the decoder wants); payload frames come as
        ``zmq.Frame`` without a copy.
        """
        sock = self.socket
        getsockopt = sock.getsockopt
        first = sock.recv(flags)
        frames: list[Any] = [first]
        nbytes = len(first)
        copied = 1
        while getsockopt(zmq.RCVMORE):
            if copied < self._copy_frames:
                f: Any = sock.recv()
                copied += 1
            else:
                f = sock.recv(copy=False)
            frames.append(f)
            nbytes += len(f)
        self.messages_in += 1
        self.bytes_in += nbytes
        return frames

    def poll(self, timeout_ms: int) -> bool:
        """True if a message can be received within ``timeout_ms``."""
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

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
        with contextlib.suppress(zmq.ZMQError):
            self.socket.close(linger=linger)
        for path in self._ipc_files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        _remove_empty_parent(self._ipc_files)


def _remove_empty_parent(files: list[Path]) -> None:
    from evflow.transport.paths import runtime_base_dir

    base = runtime_base_dir()
    for parent in {p.parent for p in files}:
        if parent.parent == base:
            with contextlib.suppress(OSError):
                parent.rmdir()  # only succeeds when empty: other devices may share it


def _ipc_in_use(path: Path) -> bool:
    """True if something listens on the unix socket ``path`` (a stale file is not in use)."""
    if not path.exists():
        return False
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def open_channel(
    context: zmq.Context[Any], config: ChannelConfig, session: str, index: int = 0
) -> Channel:
    """Create the socket of ``config``, apply its options, bind/connect every endpoint.

    Returns a Channel whose ``endpoints`` are the real ones (tcp port 0 and bare
    ``ipc://`` resolved). Raises ConfigurationError when an address is in use or
    cannot be bound/connected; the socket is closed again on any failure.
    """
    validate(config)
    sock = context.socket(SOCKET_TYPES[config.type])
    ipc_files: list[Path] = []
    endpoints: list[str] = []
    try:
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
        label = f"{config.name}-{index}"
        for ep in config.endpoints:
            method = ep.method or config.method
            url, ipc_file = resolve_for_socket(ep, session, label)
            if method == "connect":
                try:
                    sock.connect(url)
                except zmq.ZMQError as exc:
                    raise ConfigurationError(
                        f"channel {config.name!r}: cannot connect to {url!r}: {exc.strerror}"
                    ) from None
                endpoints.append(url)
                continue
            if ipc_file is not None:
                if _ipc_in_use(ipc_file):
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
        sock.close(linger=0)
        for path in ipc_files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        raise
    channel = Channel(config, index, sock, endpoints, ipc_files)
    log.debug("opened %r", channel)
    return channel


def _bind(sock: zmq.Socket[Any], url: str, ep: Endpoint, config: ChannelConfig) -> str:
    for attempt in range(3):
        try:
            sock.bind(url)
            return str(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
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

"""Channel configs with FairMQ's keys and defaults: parsing and validation.

Accepted forms: FairMQ's command line ``name=data,type=push,method=bind,address=...``,
JSON (a dict, a list of dicts or ``{"channels": [...]}``) and ``.toml``/``.json`` files.
Every mistake is one ConfigurationError naming the key, the value and what was expected.
(Re-exported by :mod:`evflow.transport.channel`.)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import zmq

from evflow.errors import ConfigurationError
from evflow.transport.address import Endpoint, check_endpoint, parse_address

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
#: "evflow": wire-protocol messages (type byte, header, payload); "raw": each message is
#: just its frames, as FairMQ's zeromq transport sends them (no END/ACK possible)
FRAMINGS = ("evflow", "raw")
#: "" = CURVE only if farm keys are configured (transport.farmkeys); "none" = never
CURVE_ROLES = ("", "server", "client", "none")
TRANSPORTS = ("zmq", "shm")
#: socket types a shm channel may have (one sender, one consumer per ring)
SHM_SOCKET_TYPES = ("push", "pull", "pair")
#: frames at least this large are sent without copying (zmq keeps a reference)
COPY_THRESHOLD_BYTES = 65536


@dataclass
class ChannelConfig:
    """One channel (or sub-channel). Field names and defaults are FairMQ's.

    ``sndBufSize``/``rcvBufSize`` are the high-water marks in messages; ``linger`` is in
    ms (-1 = wait for ever); ``rateLogging`` in seconds (0 = off); ``sndKernelSize`` /
    ``rcvKernelSize`` are kernel socket buffer sizes in bytes (0 = OS default).

    evflow's own keys: ``framing`` (evflow | raw, see FRAMINGS); ``curve`` (server |
    client | none; empty: CURVE on tcp when farm keys are configured, see
    :mod:`evflow.transport.farmkeys`) with ``curveSecretKey`` (our ``.key_secret``
    file), ``curveServerKey`` (a client's: the server's ``.key`` file) and
    ``curveAllow`` (a server's: directory of allowed clients' ``.key`` files; default
    the secret key's directory). See :mod:`evflow.transport.curve`.

    ``batchUs`` (microseconds; 0 = off, -1 = the device's default: on for the built-in
    devices) and ``batchBytes``: small data messages of a push or pair channel go
    together in one ZeroMQ message, flushed at ``batchBytes`` or after ``batchUs``
    (:class:`~evflow.transport.channel.Channel`).
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
    framing: str = "evflow"
    curve: str = ""
    curveSecretKey: str = ""
    curveServerKey: str = ""
    curveAllow: str = ""
    shmSize: int = 64 << 20  # bytes of a sending shm channel's ring
    batchUs: int = -1  # hold small data messages this long for a batch (-1: device's choice)
    batchBytes: int = 65536  # ... and send a batch once it holds this much

    def __post_init__(self) -> None:
        validate(self)

    @property
    def endpoints(self) -> list[Endpoint]:
        return parse_address(self.address)


_KEYS = {f.name: f for f in fields(ChannelConfig)}
#: FairMQ's socket options and evflow's batching keys (integers): the keys a topology
#: file's channel passes through
SOCKET_OPTIONS = (
    "sndBufSize",
    "rcvBufSize",
    "sndKernelSize",
    "rcvKernelSize",
    "linger",
    "rateLogging",
    "batchUs",
    "batchBytes",
)
_INT_KEYS = (*SOCKET_OPTIONS, "shmSize")


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
        raise _bad(name, "transport", cfg.transport, "zmq or shm")
    if cfg.transport == "shm" and cfg.type not in SHM_SOCKET_TYPES:
        raise _bad(name, "type", cfg.type, "push | pull | pair with transport shm")
    for key in _INT_KEYS:
        value = getattr(cfg, key)
        low = -1 if key in ("linger", "batchUs") else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise _bad(name, key, value, f"an integer >= {low}")
    if not isinstance(cfg.autoBind, bool):
        raise _bad(name, "autoBind", cfg.autoBind, "true or false")
    if cfg.framing not in FRAMINGS:
        raise _bad(name, "framing", cfg.framing, " | ".join(FRAMINGS))
    _validate_curve(cfg)
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


def _validate_curve(cfg: ChannelConfig) -> None:
    name = cfg.name
    if cfg.curve not in CURVE_ROLES:
        raise _bad(name, "curve", cfg.curve, "server, client or none")
    if cfg.curve in ("", "none"):
        for key in ("curveSecretKey", "curveServerKey", "curveAllow"):
            if getattr(cfg, key):
                raise ConfigurationError(
                    f"channel {name!r}: {key} given without curve=server|client"
                )
        return
    from evflow.transport.curve import require_curve

    require_curve()
    if not cfg.curveSecretKey:
        raise ConfigurationError(
            f"channel {name!r}: curve={cfg.curve} needs curveSecretKey=<NAME.key_secret> "
            "(make keys with: evflow keys DIR)"
        )
    if cfg.curve == "client" and not cfg.curveServerKey:
        raise ConfigurationError(
            f"channel {name!r}: curve=client needs curveServerKey=<the server's NAME.key>"
        )
    if cfg.curve == "client" and cfg.curveAllow:
        raise ConfigurationError(f"channel {name!r}: curveAllow is for curve=server only")
    if cfg.curve == "server" and cfg.curveServerKey:
        raise ConfigurationError(f"channel {name!r}: curveServerKey is for curve=client only")


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

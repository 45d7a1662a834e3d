"""A topology file (TOML) -> checked dataclasses.

```toml
name = "fan-in"                       # optional; default: the file's stem

[devices.sampler]
class = "sampler"                     # built-in name or module:Class
instances = 4
hosts = ["h1", "h2"]                  # round robin; "every" = one per host
max_iterations = 10000                # runtime options: rate, max_iterations
params = { msg_size = 1024 }          # the class's declared parameters
channels = [{ name = "data", type = "dealer", connect = "merger.data-in" }]

[devices.merger]
class = "merger"
channels = [
  { name = "data-in", type = "router", bind = true },
  { name = "data-out", type = "dealer", connect = "sink.data" },
]

[collections.proc]                    # devices placed together, copied together
devices = ["reco", "qc"]
instances = 3
n_min = 2                             # keep running while >= 2 copies are alive
expendable = false                    # true: its loss never stops the rest

[qc.det]                              # QC merger layers (evflow.qc.topology_tables)
producers = "qc"
mergers_per_layer = [2, 1]            # or reduction = 50
```

Every mistake is one ConfigurationError that names the file, the device and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from evflow.errors import ConfigurationError
from evflow.transport.channel_config import SOCKET_OPTIONS, SOCKET_TYPES, config_from_mapping
from evflow.transport.hosts import HostSpec, parse_hosts

__all__ = [
    "EVERY_HOST",
    "ChannelSpec",
    "CollectionSpec",
    "DeviceSpec",
    "TopologySpec",
    "build_spec",
]

#: ``hosts = "every"``: one instance per host
EVERY_HOST = "every"
PEER_MODES = ("one", "all")
RESTARTS = ("never", "on-failure")
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,39}$")
_TOP_KEYS = {"name", "devices", "collections", "hosts", "qc"}
_DEVICE_KEYS = {
    "class",
    "instances",
    "hosts",
    "params",
    "channels",
    "n_min",
    "expendable",
    "restart",
    "max_restarts",
    "restart_backoff_s",
    "rate",
    "max_iterations",
    "stop_order",
}
_COLLECTION_KEYS = {"devices", "instances", "hosts", "n_min", "expendable"}
_CHANNEL_KEYS = {"name", "type", "bind", "connect", "address", "peers"}
_FAIRMQ_OPTIONS = frozenset(SOCKET_OPTIONS)  # the channel config's own list


@dataclass(frozen=True)
class ChannelSpec:
    """One logical channel of a device: it binds, connects to ``peer`` (``device.channel``)
    or uses a fixed ``address`` (a peer outside the topology, e.g. a FairMQ device)."""

    name: str
    type: str
    bind: bool = False
    connect: str | None = None
    address: str | None = None
    peers: str = "one"
    options: dict[str, Any] = field(default_factory=dict)
    #: instance k connects to device ``route[k]`` (same channel name): set by ``[qc]``
    route: tuple[str, ...] = ()

    @property
    def peer_device(self) -> str:
        return (self.connect or "").split(".", 1)[0]

    @property
    def peer_channel(self) -> str:
        return (self.connect or "").split(".", 1)[1]


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    cls: str
    instances: int = 1
    hosts: tuple[str, ...] | None = None  # None: the default placement
    every_host: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    channels: tuple[ChannelSpec, ...] = ()
    n_min: int | None = None  # None: every instance is needed
    expendable: bool = False
    restart: str = "never"
    max_restarts: int = 3
    restart_backoff_s: float = 0.1
    rate: float = 0.0
    max_iterations: int = 0
    stop_order: int | None = None
    collection: str | None = None

    def channel(self, name: str) -> ChannelSpec | None:
        return next((c for c in self.channels if c.name == name), None)


@dataclass(frozen=True)
class CollectionSpec:
    name: str
    devices: tuple[str, ...]
    instances: int = 1
    hosts: tuple[str, ...] | None = None
    every_host: bool = False
    n_min: int | None = None
    expendable: bool = False


@dataclass(frozen=True)
class TopologySpec:
    name: str
    source: str
    devices: dict[str, DeviceSpec]
    collections: dict[str, CollectionSpec] = field(default_factory=dict)
    hosts: dict[str, HostSpec] = field(default_factory=dict)


def build_spec(
    data: dict[str, Any],
    *,
    source: str,
    default_name: str = "topology",
    hosts: dict[str, HostSpec] | None = None,
) -> TopologySpec:
    """The tables of decoded TOML as dataclasses, each entry checked on its own; the
    QC layers and the checks across entries are the loader's (``topology/loader.py``)."""
    _unknown(data, _TOP_KEYS, source, "the top level")
    name = str(data.get("name", default_name))
    all_hosts = dict(parse_hosts(data["hosts"], source=source)) if "hosts" in data else {}
    all_hosts.update(hosts or {})
    raw_devices = data.get("devices")
    if not isinstance(raw_devices, dict) or not raw_devices:
        raise ConfigurationError(
            f'{source}: no devices; add at least one table like [devices.sink] with class = "sink"'
        )
    collections = {
        cname: _collection(cname, entry, source)
        for cname, entry in _table(data.get("collections", {}), source, "[collections]").items()
    }
    member_of: dict[str, str] = {}
    for coll in collections.values():
        for dev in coll.devices:
            if dev not in raw_devices:
                raise ConfigurationError(
                    f"{source}: collection {coll.name!r} names device {dev!r}, which is not "
                    f"defined (devices: {', '.join(sorted(raw_devices))})"
                )
            if dev in member_of:
                raise ConfigurationError(
                    f"{source}: device {dev!r} is in collections {member_of[dev]!r} and "
                    f"{coll.name!r}; a device belongs to at most one collection"
                )
            member_of[dev] = coll.name
    devices = {
        dname: _device(dname, entry, source, member_of.get(dname))
        for dname, entry in raw_devices.items()
    }
    return TopologySpec(name, source, devices, collections, all_hosts)


# --- pieces -------------------------------------------------------------------------------
def _table(value: Any, source: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigurationError(f"{source}: {what} must be a table")
    return value


def _unknown(entry: dict[str, Any], known: set[str], source: str, where: str) -> None:
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ConfigurationError(
            f"{source}: {where} has unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})"
        )


def _check_name(name: str, source: str, what: str) -> None:
    if not _NAME_RE.match(name):
        raise ConfigurationError(
            f"{source}: {what} name {name!r} is not valid: use a letter, then letters, "
            "digits, '_' or '-' (at most 40)"
        )


def _int(entry: dict[str, Any], key: str, default: Any, where: str, low: int = 0) -> Any:
    value = entry.get(key, default)
    if value is default:
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigurationError(f"{where}: {key} must be an integer >= {low}, got {value!r}")
    return value


def _placement(entry: dict[str, Any], where: str) -> tuple[tuple[str, ...] | None, bool]:
    value = entry.get("hosts")
    if value is None:
        return None, False
    if value == EVERY_HOST:
        return None, True
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(h, str) for h in value):
        raise ConfigurationError(
            f'{where}: hosts must be a list of host names or "every", got {value!r}'
        )
    return tuple(value), False


def _placement_counts(
    entry: dict[str, Any], where: str
) -> tuple[int, tuple[str, ...] | None, bool, int | None, bool]:
    hosts, every = _placement(entry, where)
    instances = _int(entry, "instances", None, where)
    if every and instances is not None:
        raise ConfigurationError(
            f'{where}: hosts = "every" places one instance per host; remove instances = {instances}'
        )
    instances = 1 if instances is None else instances
    n_min = _int(entry, "n_min", None, where)
    expendable = entry.get("expendable", False)
    if not isinstance(expendable, bool):
        raise ConfigurationError(f"{where}: expendable must be true or false, got {expendable!r}")
    if instances == 0 and not every and (n_min is None or n_min > 0) and not expendable:
        raise ConfigurationError(
            f"{where}: instances = 0 but the topology needs it (n_min = {n_min or 1}); "
            "set instances >= 1, or n_min = 0 to allow none"
        )
    if n_min is not None and not every and n_min > instances:
        raise ConfigurationError(
            f"{where}: n_min = {n_min} but instances = {instances}; "
            f"raise instances or lower n_min to at most {instances}"
        )
    return instances, hosts, every, n_min, expendable


def _collection(name: str, entry: Any, source: str) -> CollectionSpec:
    where = f"{source}: collection {name!r}"
    _check_name(name, source, "collection")
    entry = _table(entry, source, f"collection {name!r}")
    _unknown(entry, _COLLECTION_KEYS, source, f"collection {name!r}")
    members = entry.get("devices")
    if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
        raise ConfigurationError(f"{where}: devices must be a non-empty list of device names")
    instances, hosts, every, n_min, expendable = _placement_counts(entry, where)
    return CollectionSpec(name, tuple(members), instances, hosts, every, n_min, expendable)


def _device(name: str, entry: Any, source: str, collection: str | None) -> DeviceSpec:
    where = f"{source}: device {name!r}"
    _check_name(name, source, "device")
    if name in ("controller", "bus"):
        raise ConfigurationError(f"{where}: the name is taken by the control bus; rename it")
    entry = _table(entry, source, f"device {name!r}")
    _unknown(entry, _DEVICE_KEYS, source, f"device {name!r}")
    cls = entry.get("class")
    if not isinstance(cls, str) or not cls:
        raise ConfigurationError(
            f'{where}: missing class (a built-in name such as "sampler", or "module:Class")'
        )
    if collection is not None and ({"instances", "hosts", "n_min", "expendable"} & set(entry)):
        raise ConfigurationError(
            f"{where}: it is in collection {collection!r}; set instances, hosts, n_min and "
            "expendable on the collection, not on the device"
        )
    instances, hosts, every, n_min, expendable = _placement_counts(entry, where)
    params = entry.get("params", {})
    if not isinstance(params, dict):
        raise ConfigurationError(f"{where}: params must be a table, got {params!r}")
    restart = entry.get("restart", "never")
    if restart not in RESTARTS:
        raise ConfigurationError(
            f"{where}: restart must be one of {', '.join(RESTARTS)}, got {restart!r}"
        )
    rate = entry.get("rate", 0.0)
    if not isinstance(rate, int | float) or isinstance(rate, bool) or rate < 0:
        raise ConfigurationError(f"{where}: rate must be a number >= 0, got {rate!r}")
    backoff = entry.get("restart_backoff_s", 0.1)
    if not isinstance(backoff, int | float) or isinstance(backoff, bool) or backoff < 0:
        raise ConfigurationError(
            f"{where}: restart_backoff_s must be a number of seconds >= 0, got {backoff!r}"
        )
    raw_channels = entry.get("channels", [])
    if not isinstance(raw_channels, list):
        raise ConfigurationError(f"{where}: channels must be a list of tables")
    channels = tuple(_channel(c, where) for c in raw_channels)
    seen: set[str] = set()
    for ch in channels:
        if ch.name in seen:
            raise ConfigurationError(f"{where}: channel {ch.name!r} is defined twice")
        seen.add(ch.name)
    return DeviceSpec(
        name=name,
        cls=cls,
        instances=instances,
        hosts=hosts,
        every_host=every,
        params=dict(params),
        channels=channels,
        n_min=n_min,
        expendable=expendable,
        restart=restart,
        max_restarts=_int(entry, "max_restarts", 3, where),
        restart_backoff_s=float(backoff),
        rate=float(rate),
        max_iterations=_int(entry, "max_iterations", 0, where),
        stop_order=_int(entry, "stop_order", None, where),
        collection=collection,
    )


def _channel(entry: Any, where: str) -> ChannelSpec:
    if not isinstance(entry, dict):
        raise ConfigurationError(f"{where}: each channel must be a table, got {entry!r}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"{where}: a channel has no name")
    cwhere = f"{where}, channel {name!r}"
    unknown = sorted(set(entry) - _CHANNEL_KEYS - _FAIRMQ_OPTIONS)
    if unknown:
        raise ConfigurationError(
            f"{cwhere}: unknown key {unknown[0]!r} (known: "
            f"{', '.join(sorted(_CHANNEL_KEYS | _FAIRMQ_OPTIONS))})"
        )
    ctype = entry.get("type")
    if ctype not in SOCKET_TYPES:
        raise ConfigurationError(
            f"{cwhere}: type must be one of {' | '.join(SOCKET_TYPES)}, got {ctype!r}"
        )
    bind = entry.get("bind", False)
    connect = entry.get("connect")
    address = entry.get("address")
    if not isinstance(bind, bool):
        raise ConfigurationError(f"{cwhere}: bind must be true or false, got {bind!r}")
    given = [k for k, v in (("bind", bind), ("connect", connect), ("address", address)) if v]
    if len(given) != 1:
        raise ConfigurationError(
            f"{cwhere}: give exactly one of bind = true, connect = "
            f'"device.channel" or address = "tcp://host:port" (got {given or "none"})'
        )
    if connect is not None and (
        not isinstance(connect, str) or connect.count(".") != 1 or not all(connect.split("."))
    ):
        raise ConfigurationError(
            f'{cwhere}: connect must name a peer as "device.channel", got {connect!r}'
        )
    peers = entry.get("peers", "one")
    if peers not in PEER_MODES:
        raise ConfigurationError(f"{cwhere}: peers must be one of {PEER_MODES}, got {peers!r}")
    options = {k: v for k, v in entry.items() if k in _FAIRMQ_OPTIONS}
    # FairMQ keys are checked by the channel config itself (one clear error)
    probe = {"name": name, "type": ctype, "method": "bind", "address": "ipc://", **options}
    if address is not None:
        probe.update(method="", address=address)
    try:
        config_from_mapping(probe)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{cwhere}: {exc}") from None
    return ChannelSpec(name, ctype, bind, connect, address, peers, options)

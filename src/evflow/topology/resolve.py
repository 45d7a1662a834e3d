"""A checked topology -> concrete device instances, placed on hosts, with their channels.

- **Ids**: ``sampler_3`` for instance 3 of a device with several instances (or in a
  collection), the plain name for a single instance.
- **Placement**: ``hosts = [...]`` spreads instances round robin over the list,
  ``hosts = "every"`` puts one on each host; by default instances go round robin over
  every host of the topology (``localhost`` when none is defined). A collection's copy
  k puts all its devices on one host.
- **Channels**: a binding channel binds ``ipc://`` (a fresh file in the host's session
  directory) when a peer is on its host and ``tcp://<host address>:0`` when a peer is on
  another host; the real endpoints travel over the bus at start-up. A connecting
  channel of instance i reaches instance ``i mod n`` of its peer (``peers = "one"``,
  fan-in), every instance (``peers = "all"``), or the peer of its own copy when both
  are in the same collection; a ``route`` (QC merger layers) names the peer device of
  each instance.
- Devices with an ``inputs`` parameter (sink, merger, ...) that the file leaves unset
  get the number of peers connected to their input channel, so they wait for one END
  from each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evflow.errors import ConfigurationError
from evflow.topology.spec import ChannelSpec, DeviceSpec, TopologySpec
from evflow.transport.hosts import LOCALHOST, HostSpec, local_host

__all__ = ["Group", "ResolvedChannel", "ResolvedDevice", "ResolvedTopology", "resolve"]


@dataclass
class ResolvedChannel:
    """``bind`` (an address to bind), ``connect`` (peer keys ``device_id.channel`` with
    ``same_host``), or a fixed ``address`` (method by its ``@``/``>`` prefix, else connect)."""

    name: str
    type: str
    bind: str | None = None
    connect: list[tuple[str, bool]] = field(default_factory=list)
    address: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "bind": self.bind,
            "connect": [[key, same] for key, same in self.connect],
            "address": self.address,
            "options": self.options,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ResolvedChannel:
        return cls(
            name=str(data["name"]),
            type=str(data["type"]),
            bind=data.get("bind"),
            connect=[(str(k), bool(s)) for k, s in data.get("connect") or []],
            address=data.get("address"),
            options=dict(data.get("options") or {}),
        )


@dataclass
class ResolvedDevice:
    id: str
    name: str
    cls: str
    host: str
    index: int
    params: dict[str, Any]
    channels: list[ResolvedChannel]
    rate: float = 0.0
    max_iterations: int = 0
    restart: str = "never"
    max_restarts: int = 3
    stop_order: int = 0
    restart_backoff_s: float = 0.1

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "class": self.cls,
            "host": self.host,
            "index": self.index,
            "params": self.params,
            "channels": [c.to_wire() for c in self.channels],
            "rate": self.rate,
            "max_iterations": self.max_iterations,
            "restart": self.restart,
            "max_restarts": self.max_restarts,
            "stop_order": self.stop_order,
            "restart_backoff_s": self.restart_backoff_s,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ResolvedDevice:
        return cls(
            id=str(data["id"]),
            name=str(data["name"]),
            cls=str(data["class"]),
            host=str(data["host"]),
            index=int(data["index"]),
            params=dict(data.get("params") or {}),
            channels=[ResolvedChannel.from_wire(c) for c in data.get("channels") or []],
            rate=float(data.get("rate", 0.0)),
            max_iterations=int(data.get("max_iterations", 0)),
            restart=str(data.get("restart", "never")),
            max_restarts=int(data.get("max_restarts", 3)),
            stop_order=int(data.get("stop_order", 0)),
            restart_backoff_s=float(data.get("restart_backoff_s", 0.1)),
        )


@dataclass
class Group:
    """What the desired state counts: ``copies`` (device ids of each copy), how many must
    stay alive (``n_min``) and whether its loss may stop the topology at all."""

    name: str
    copies: list[list[str]]
    n_min: int
    expendable: bool


@dataclass
class ResolvedTopology:
    name: str
    source: str
    devices: dict[str, ResolvedDevice]
    hosts: dict[str, HostSpec]
    groups: list[Group]
    #: device id -> [(consumer device id, consumer channel)] of the channels it feeds
    consumers: dict[str, list[tuple[str, str]]]

    def on_host(self, host: str) -> list[ResolvedDevice]:
        return [d for d in self.devices.values() if d.host == host]

    @property
    def spans_hosts(self) -> bool:
        return len({d.host for d in self.devices.values()}) > 1


def host_list(spec: TopologySpec) -> list[str]:
    """The topology's host names (this host alone when it names none)."""
    return list(spec.hosts) or [LOCALHOST]


def place_instances(
    spec: TopologySpec, instances: int, hosts: tuple[str, ...] | None, every: bool
) -> list[str]:
    """The host of each instance: one per host (``every``), else round robin over
    ``hosts`` (all the topology's hosts when None)."""
    if every:
        return host_list(spec)
    pool = list(hosts) if hosts else host_list(spec)
    return [pool[i % len(pool)] for i in range(instances)]


def resolve(spec: TopologySpec) -> ResolvedTopology:
    """Instances, hosts and channels of every device of ``spec``."""
    # 1. instances and their hosts: (device name) -> [(id, host, index, copy)]
    instances: dict[str, list[tuple[str, str, int]]] = {}
    groups: list[Group] = []
    for coll in spec.collections.values():
        hosts = place_instances(spec, coll.instances, coll.hosts, coll.every_host)
        copies: list[list[str]] = [[] for _ in hosts]
        for dname in coll.devices:
            instances[dname] = [(f"{dname}_{k}", host, k) for k, host in enumerate(hosts)]
            for k in range(len(hosts)):
                copies[k].append(f"{dname}_{k}")
        n_min = len(hosts) if coll.n_min is None else coll.n_min
        groups.append(Group(f"collection {coll.name!r}", copies, n_min, coll.expendable))
    for dev in spec.devices.values():
        if dev.collection is not None:
            continue
        hosts = place_instances(spec, dev.instances, dev.hosts, dev.every_host)
        single = len(hosts) == 1 and not dev.every_host
        ids = [dev.name if single else f"{dev.name}_{i}" for i in range(len(hosts))]
        instances[dev.name] = [(i, h, k) for k, (i, h) in enumerate(zip(ids, hosts, strict=True))]
        n_min = len(hosts) if dev.n_min is None else dev.n_min
        groups.append(Group(f"device {dev.name!r}", [[i] for i in ids], n_min, dev.expendable))
    host_specs = {
        h: spec.hosts.get(h) or (local_host() if h == LOCALHOST else None)
        for h in {h for insts in instances.values() for _, h, _ in insts}
    }
    for name, found in host_specs.items():
        if found is None:  # checked by the spec already; kept for hand-built specs
            raise ConfigurationError(f"{spec.source}: unknown host {name!r}")
    hosts_ok: dict[str, HostSpec] = {k: v for k, v in host_specs.items() if v is not None}

    # 2. who connects to which bound channel instance
    connections: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (binder id, ch) -> [(id, h)]
    plans: dict[str, dict[str, list[str]]] = {}  # connector id -> channel -> [binder ids]
    for dev in spec.devices.values():
        for ch in dev.channels:
            if ch.connect is None:
                continue
            for dev_id, host, k in instances[dev.name]:
                peer = spec.devices[ch.route[k] if ch.route else ch.peer_device]
                targets = instances[peer.name]
                chosen = _peers_of(dev, peer, ch, k, targets)
                if not chosen:
                    raise ConfigurationError(
                        f"{spec.source}: device {dev.name!r}, channel {ch.name!r}: peer "
                        f"{ch.connect!r} has no instance to connect to"
                    )
                plans.setdefault(dev_id, {})[ch.name] = chosen
                for target in chosen:
                    connections.setdefault((target, ch.peer_channel), []).append((dev_id, host))
    host_of = {i: h for insts in instances.values() for i, h, _ in insts}

    # 3. concrete devices
    devices: dict[str, ResolvedDevice] = {}
    consumers: dict[str, list[tuple[str, str]]] = {}
    for (binder, bch), peers in connections.items():
        for peer_id, _ in peers:
            consumers.setdefault(peer_id, []).append((binder, bch))
    levels = _stop_levels(connections)
    for dev in spec.devices.values():
        for dev_id, host, k in instances[dev.name]:
            channels = []
            for ch in dev.channels:
                channels.append(_channel(ch, dev_id, host, hosts_ok, connections, plans, host_of))
            params = dict(dev.params)
            _auto_inputs(dev, params, dev_id, connections)
            devices[dev_id] = ResolvedDevice(
                id=dev_id,
                name=dev.name,
                cls=dev.cls,
                host=host,
                index=k,
                params=params,
                channels=channels,
                rate=dev.rate,
                max_iterations=dev.max_iterations,
                restart=dev.restart,
                max_restarts=dev.max_restarts,
                restart_backoff_s=dev.restart_backoff_s,
                stop_order=dev.stop_order if dev.stop_order is not None else levels.get(dev_id, 0),
            )
    return ResolvedTopology(spec.name, spec.source, devices, hosts_ok, groups, consumers)


def _peers_of(
    dev: DeviceSpec, peer: DeviceSpec, ch: ChannelSpec, k: int, targets: list[tuple[str, str, int]]
) -> list[str]:
    if not targets:
        return []
    if dev.collection is not None and dev.collection == peer.collection:
        return [t for t, _, tk in targets if tk == k]
    if ch.peers == "all":
        return [t for t, _, _ in targets]
    return [targets[k % len(targets)][0]]


def _channel(
    ch: ChannelSpec,
    dev_id: str,
    host: str,
    hosts: dict[str, HostSpec],
    connections: dict[tuple[str, str], list[tuple[str, str]]],
    plans: dict[str, dict[str, list[str]]],
    host_of: dict[str, str],
) -> ResolvedChannel:
    out = ResolvedChannel(ch.name, ch.type, options=dict(ch.options))
    if ch.address is not None:
        out.address = ch.address
    elif ch.bind:
        peer_hosts = {h for _, h in connections.get((dev_id, ch.name), [])}
        parts = []
        if host in peer_hosts:
            parts.append("ipc://")
        if peer_hosts - {host} or not peer_hosts:  # no peer yet: reachable from anywhere
            parts.append(f"tcp://{hosts[host].address}:0")
        out.bind = ";".join(parts)
    else:
        out.connect = [
            (f"{target}.{ch.peer_channel}", host_of[target] == host)
            for target in plans[dev_id][ch.name]
        ]
    return out


def _auto_inputs(
    dev: DeviceSpec,
    params: dict[str, Any],
    dev_id: str,
    connections: dict[tuple[str, str], list[tuple[str, str]]],
) -> None:
    """Set ``inputs`` to the number of peers of the input channel, and ``senders`` to
    their ids (whose END alone counts), if the class has them and the file does not."""
    try:
        from evflow.runtime.runner import load_device_class

        declared = load_device_class(dev.cls).declared_params()
    except ConfigurationError:
        return
    if "inputs" not in declared:
        return
    name = params.get("in_channel") or params.get("channel_name")
    if name is None:
        for key in ("in_channel", "channel_name"):
            if key in declared:
                name = declared[key].default
                break
    peers = connections.get((dev_id, str(name)))
    if peers and "inputs" not in params:
        params["inputs"] = len(peers)
    if peers and "senders" in declared and "senders" not in params:
        params["senders"] = ",".join(sorted({p for p, _ in peers}))


def _stop_levels(connections: dict[tuple[str, str], list[tuple[str, str]]]) -> dict[str, int]:
    """Connectors stop before the devices they connect to (sources first, sinks last)."""
    into: dict[str, set[str]] = {}
    for (binder, _), peers in connections.items():
        into.setdefault(binder, set()).update(p for p, _ in peers)
    levels: dict[str, int] = {}

    def level(node: str, path: frozenset[str]) -> int:
        if node in levels:
            return levels[node]
        ups = [u for u in into.get(node, ()) if u not in path]
        value = 1 + max((level(u, path | {node}) for u in ups), default=-1)
        levels[node] = value
        return value

    for node in list(into):
        level(node, frozenset())
    return levels

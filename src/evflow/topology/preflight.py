"""Checks of a whole topology: hosts exist, channels name real peers that bind, no
cycle of connects, device classes and their parameters exist (and, for a topology
that runs on this host only, what a class checks with ``check_params``, e.g. input files).

Called by :func:`evflow.topology.loader.parse_topology`; each failure is one
ConfigurationError naming the file, the device, the channel and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from evflow.errors import ConfigurationError, EvflowError
from evflow.params import resolve_params

if TYPE_CHECKING:
    from evflow.topology.spec import ChannelSpec, TopologySpec

__all__ = ["check_channels", "check_classes", "check_hosts"]


def _placements(spec: TopologySpec) -> list[tuple[str, tuple[str, ...] | None]]:
    out: list[tuple[str, tuple[str, ...] | None]] = []
    for dev in spec.devices.values():
        if dev.collection is None:
            out.append((f"device {dev.name!r}", dev.hosts))
    for coll in spec.collections.values():
        out.append((f"collection {coll.name!r}", coll.hosts))
    return out


def check_hosts(spec: TopologySpec) -> None:
    for what, hosts in _placements(spec):
        for host in hosts or ():
            if host in spec.hosts or (host == "localhost" and not spec.hosts):
                continue
            known = ", ".join(sorted(spec.hosts)) or "none"
            raise ConfigurationError(
                f"{spec.source}: {what} is placed on unknown host {host!r} (known hosts: "
                f"{known}); define it in [hosts] or pass --hosts HOSTS.toml"
            )


def check_channels(spec: TopologySpec) -> None:
    for dev in spec.devices.values():
        for ch in dev.channels:
            if ch.connect is None:
                continue
            where = f"{spec.source}: device {dev.name!r}, channel {ch.name!r}"
            peer = spec.devices.get(ch.peer_device)
            if peer is None:
                raise ConfigurationError(
                    f"{where} connects to {ch.connect!r}, but there is no device "
                    f"{ch.peer_device!r} (devices: {', '.join(sorted(spec.devices))})"
                )
            target = peer.channel(ch.peer_channel)
            if target is None:
                have = ", ".join(c.name for c in peer.channels) or "none"
                raise ConfigurationError(
                    f"{where} connects to {ch.connect!r}, but device {peer.name!r} has no "
                    f"channel {ch.peer_channel!r} (its channels: {have})"
                )
            if not target.bind:
                chain = _connect_chain(spec, dev.name, ch)
                if chain is not None:
                    raise ConfigurationError(
                        f"{where}: cycle of connects with no bind: {' -> '.join(chain)}; "
                        "set bind = true on one of these channels"
                    )
                raise ConfigurationError(
                    f"{where} connects to {ch.connect!r}, which does not bind; set bind = "
                    f"true on {ch.connect!r} (one side of a channel binds, the other connects)"
                )
            if peer.instances == 0 and not peer.every_host and peer.collection is None:
                raise ConfigurationError(
                    f"{where} connects to {ch.connect!r}, but device {peer.name!r} has "
                    "instances = 0"
                )


def _connect_chain(spec: TopologySpec, start: str, ch: ChannelSpec) -> list[str] | None:
    """The loop of connects starting at ``start.ch`` if it comes back, else None."""
    chain = [f"{start}.{ch.name}"]
    current: ChannelSpec | None = ch
    while current is not None and current.connect is not None:
        if current.connect in chain:
            return [*chain, current.connect]
        chain.append(current.connect)
        peer = spec.devices.get(current.peer_device)
        current = peer.channel(current.peer_channel) if peer else None
    return None


def check_classes(spec: TopologySpec) -> None:
    from evflow.runtime.device import Device
    from evflow.runtime.runner import load_device_class

    runtime_options = {"rate", "max_iterations"}
    for dev in spec.devices.values():
        where = f"{spec.source}: device {dev.name!r}"
        try:
            cls = load_device_class(dev.cls)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{where}: {exc}") from None
        declared = cls.declared_params()
        for key, value in dev.params.items():
            if key in runtime_options:
                raise ConfigurationError(
                    f"{where}: {key} is a device option, not a parameter; write "
                    f"{key} = {value!r} next to class, outside params"
                )
            if key not in declared:
                raise ConfigurationError(
                    f"{where}: class {dev.cls!r} has no parameter {key!r} "
                    f"(known: {', '.join(sorted(declared)) or 'none'})"
                )
            try:
                declared[key].check(f"device {dev.name!r}", value)
            except ConfigurationError as exc:
                raise ConfigurationError(f"{spec.source}: {exc}") from None
        checker = next(k for k in cls.__mro__ if "check_params" in vars(k))
        if not spec.hosts and checker is not Device:
            # every device runs on this host: what it will read can be looked at now,
            # one line before anything starts instead of a device failing at INIT_TASK
            try:
                cls.check_params(resolve_params(f"device {dev.name!r}", declared, dev.params))
            except EvflowError as exc:
                raise ConfigurationError(f"{where}: {exc}") from None

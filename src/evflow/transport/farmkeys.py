"""CURVE on every tcp channel of a farm process, from three environment variables.

A controller that has keys (``evflow keys DIR --names h1 h2 ...``) starts each agent
with::

    EVFLOW_CURVE_KEYS=DIR          # the key directory (shared or copied to each host)
    EVFLOW_HOST=h2                 # this host's name (its key pair: DIR/h2.key_secret)
    EVFLOW_HOSTS_FILE=hosts.toml   # name -> address, to find a peer's public key

and every process below it inherits them. Then every tcp channel that does not say
``curve=...`` itself (the control bus included) uses CURVE: a binding channel is a
server with this host's key and DIR as allow-list, a connecting channel is a client of
the host whose address it connects to (loopback: this host). ``curve=none`` on a
channel opts out (a raw channel to a FairMQ device, which has no CURVE). ipc and inproc
channels stay on their host and are not touched.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from evflow.errors import ConfigurationError
from evflow.transport.address import Endpoint
from evflow.transport.curve import CurveOptions, KeyRing

ENV_KEYS = "EVFLOW_CURVE_KEYS"
ENV_HOST = "EVFLOW_HOST"
ENV_HOSTS_FILE = "EVFLOW_HOSTS_FILE"
#: the controller's addresses (comma-separated), set by ``evflow up`` for its agents:
#: the control bus there is a CURVE server with the key pair ``DIR/controller``
ENV_CONTROLLER = "EVFLOW_CURVE_CONTROLLER"
CONTROLLER_KEY = "controller"
_LOOPBACK = ("127.", "localhost", "::1")


def key_names(
    hosts: Mapping[str, str], controller_addresses: Iterable[str]
) -> tuple[str, dict[str, str]]:
    """The key policy of a farm: (the controller's key name, key name by address).

    A peer's key is found by the address it is reached at, so one address must mean one
    key pair. Each host uses its own pair; the controller uses ``controller``, unless it
    runs on a host of the farm (the first node of an allocation): then it shares that
    host's address, and so that host's pair.
    """
    by_address = {address: name for name, address in hosts.items()}
    controller = [a for a in controller_addresses if a]
    me = next((by_address[a] for a in controller if a in by_address), CONTROLLER_KEY)
    by_address.update({a: me for a in controller})
    return me, by_address


@dataclass(frozen=True)
class FarmKeys:
    """This process's host, the farm's key ring and its hosts' addresses."""

    ring: KeyRing
    host: str
    host_by_address: dict[str, str]

    def options(self, channel: str, endpoints: list[Endpoint], method: str) -> CurveOptions:
        """CURVE options for a tcp channel with ``endpoints`` (one method for all)."""
        methods = {ep.method or method for ep in endpoints}
        if len(methods) != 1:
            raise ConfigurationError(
                f"channel {channel!r} both binds and connects; with farm CURVE keys a socket "
                "is either server or client: split it, or set curve=... on it"
            )
        if methods == {"bind"}:
            opts = self.ring.server_options(self.host)
            return CurveOptions("server", opts["curveSecretKey"], allow=opts["curveAllow"])
        servers = {self._host_of(channel, ep.host) for ep in endpoints}
        if len(servers) != 1:
            raise ConfigurationError(
                f"channel {channel!r} connects to several hosts {sorted(servers)}; a CURVE "
                "client socket knows one server key: use one channel per host"
            )
        opts = self.ring.client_options(self.host, servers.pop())
        return CurveOptions("client", opts["curveSecretKey"], server_key=opts["curveServerKey"])

    def _host_of(self, channel: str, address: str) -> str:
        if address.startswith(_LOOPBACK):
            return self.host
        try:
            return self.host_by_address[address]
        except KeyError:
            raise ConfigurationError(
                f"channel {channel!r} connects to {address}, which is no host of the hosts "
                f"file ({', '.join(sorted(self.host_by_address)) or 'none'}): its CURVE key "
                "is unknown"
            ) from None


_cached: tuple[tuple[str, str, str, str], FarmKeys | None] | None = None


def farm_keys() -> FarmKeys | None:
    """The farm keys named by the environment (None when ``EVFLOW_CURVE_KEYS`` is unset)."""
    global _cached
    env = (os.environ.get(ENV_KEYS, ""), os.environ.get(ENV_HOST, ""),
           os.environ.get(ENV_HOSTS_FILE, ""), os.environ.get(ENV_CONTROLLER, ""))  # fmt: skip
    if _cached is not None and _cached[0] == env:
        return _cached[1]
    keys_dir, host, hosts_file, controller = env
    keys: FarmKeys | None = None
    if keys_dir:
        if not host or not hosts_file:
            raise ConfigurationError(
                f"{ENV_KEYS} is set but {ENV_HOST} and {ENV_HOSTS_FILE} are not both set: "
                "farm CURVE needs this host's name and the hosts file"
            )
        from evflow.transport.hosts import load_hosts

        hosts = load_hosts(Path(hosts_file))
        if host not in hosts and host != CONTROLLER_KEY:
            raise ConfigurationError(f"{ENV_HOST}={host!r} is not a host of {hosts_file}")
        addresses = {h.name: h.address for h in hosts.values()}
        _, by_address = key_names(addresses, controller.split(","))
        keys = FarmKeys(KeyRing(keys_dir), host, by_address)
    _cached = (env, keys)
    return keys


def preload_farm_keys() -> None:
    """Read the farm keys of this process's host now: a zygote forked afterwards gives
    every device the parsed hosts file and key files. Errors are left to the sockets
    that need the keys (they say which channel)."""
    from evflow.transport.curve import PUBLIC_SUFFIX, load_public_key, load_secret_key

    try:
        keys = farm_keys()
        if keys is None:
            return
        for path in sorted(keys.ring.directory.glob(f"*{PUBLIC_SUFFIX}")):
            load_public_key(path)
        load_secret_key(keys.ring.server_options(keys.host)["curveSecretKey"])
    except ConfigurationError:
        pass

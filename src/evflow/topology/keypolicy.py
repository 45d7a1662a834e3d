"""CURVE for a farm: which keys ``evflow up`` and ``evflow run --hosts`` use.

With a key directory (``--keys DIR`` or ``EVFLOW_CURVE_KEYS=DIR``; made by
``evflow keys DIR --names controller h1 h2 ...``) the controller's sockets (its bus
proxy; for a path run also the input's and output's tcp sockets) are CURVE servers with
the pair that :func:`~evflow.transport.farmkeys.key_names` gives it (``controller``, or
the pair of the host it runs on), and every agent is started with the farm-key
environment (:mod:`evflow.transport.farmkeys`), which its processes inherit: every tcp
socket, the control bus included, is CURVE. A farm that spans hosts (a remote
launcher, or a host that is not a loopback address) without keys starts only with
``--insecure``, and then with a warning.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evflow.errors import ConfigurationError
from evflow.transport.farmkeys import (
    CONTROLLER_KEY,
    ENV_CONTROLLER,
    ENV_HOST,
    ENV_HOSTS_FILE,
    ENV_KEYS,
    key_names,
)
from evflow.transport.hosts import HostSpec

__all__ = [
    "BusRefusals",
    "FarmSecurity",
    "farm_security",
    "refusal_line",
    "spans_hosts",
    "tcp_only_binds",
]

log = logging.getLogger("evflow.topology")
_LOOPBACK = ("127.", "localhost", "::1")


def spans_hosts(launcher: str, hosts: dict[str, HostSpec]) -> bool:
    """True when tcp traffic of the topology may leave this machine."""
    return launcher != "local" or any(not h.address.startswith(_LOOPBACK) for h in hosts.values())


@dataclass
class FarmSecurity:
    """The key directory, the hosts file naming every host's address, the controller's."""

    keys_dir: Path
    hosts_file: Path
    controller_addresses: list[str] = field(default_factory=list)
    #: host name -> address, for the key policy (farmkeys.key_names)
    addresses: dict[str, str] = field(default_factory=dict)

    def agent_env(self, host: str) -> dict[str, str]:
        """What an agent (and every device it forks) needs for CURVE on tcp."""
        return {
            ENV_KEYS: str(self.keys_dir),
            ENV_HOST: host,
            ENV_HOSTS_FILE: str(self.hosts_file),
            ENV_CONTROLLER: ",".join(self.controller_addresses),
        }

    def apply_to_controller(self) -> None:
        """The controller's own process (and its bus proxy, forked later) use the keys:
        its own pair, or a host's when it runs on that host (farmkeys.key_names)."""
        me, _ = key_names(self.addresses, self.controller_addresses)
        if me != CONTROLLER_KEY:
            from evflow.transport.curve import KeyRing

            KeyRing(self.keys_dir).server_options(me)  # one error if its secret is not here
        os.environ.update(self.agent_env(me))

    def host_of(self, address: str, hosts: dict[str, HostSpec]) -> str | None:
        """The host name whose address is ``address`` (``ip`` or ``ip:port``)."""
        ip = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
        addresses = self.addresses or {h.name: h.address for h in hosts.values()}
        name = key_names(addresses, self.controller_addresses)[1].get(ip)
        return name if name in hosts else None


def tcp_only_binds(topology: Any) -> None:
    """With CURVE, a binding channel binds tcp only (peers on its own host connect to
    its host's address): CURVE is a property of the socket, so an ipc endpoint next to a
    CURVE tcp one would refuse a plaintext same-host peer."""
    for dev in topology.devices.values():
        for ch in dev.channels:
            parts = (ch.bind or "").split(";")
            if len(parts) > 1 and any(p.startswith("tcp://") for p in parts):
                ch.bind = ";".join(p for p in parts if p.startswith("tcp://"))


def farm_security(
    *,
    topology_name: str,
    launcher: str,
    hosts: dict[str, HostSpec],
    hosts_file: str,
    keys_dir: str | None,
    insecure: bool,
    what: str = "",
    warn: Callable[[str], None] | None = None,
    hosts_keys: bool = True,
) -> FarmSecurity | None:
    """Check the keys for ``hosts`` (the hosts the farm uses); None = plaintext.

    One error naming the missing or unsafe file and the fix; plaintext across hosts
    only with ``insecure`` (then a warning, to ``warn`` if given). ``what`` names the
    farm in messages (default: the topology); ``hosts_keys=False`` leaves a host without
    a public key to be refused when it connects (a path run goes on without it).
    """
    from evflow.transport.curve import (
        PUBLIC_SUFFIX,
        SECRET_SUFFIX,
        check_secret_permissions,
        require_curve,
    )

    keys_dir = keys_dir or os.environ.get(ENV_KEYS) or None
    names = sorted(hosts)
    fix = f"evflow keys DIR --names {CONTROLLER_KEY} {' '.join(names)}"
    what = what or f"topology {topology_name!r}"
    if keys_dir is None:
        if not spans_hosts(launcher, hosts):
            return None
        if not insecure:
            raise ConfigurationError(
                f"{what} spans hosts {', '.join(names)} (launcher "
                f"{launcher}) but no CURVE keys are configured, so every tcp socket would be "
                f"plaintext: make keys with '{fix}' and pass '--keys DIR' (or set {ENV_KEYS}"
                "=DIR), or accept plaintext with --insecure"
            )
        (warn or log.warning)(
            f"--insecure: {what} spans hosts {', '.join(names)} with plaintext tcp (no CURVE "
            "keys); anyone on the network can read and inject messages and bus commands"
        )
        return None
    require_curve()
    directory = Path(keys_dir).absolute()
    make = fix.replace("DIR", str(directory))
    if not directory.is_dir():
        raise ConfigurationError(
            f"key directory {str(directory)!r} does not exist (make it with: {make})"
        )
    if not hosts_file:
        raise ConfigurationError(
            "CURVE keys need the hosts' addresses: name the hosts in a [hosts] table "
            "(the topology file or --hosts HOSTS.toml)"
        )
    by_address: dict[str, str] = {}
    for host in hosts.values():
        other = by_address.setdefault(host.address, host.name)
        if other != host.name:
            raise ConfigurationError(
                f"{hosts_file}: hosts {other!r} and {host.name!r} share the address "
                f"{host.address}; with CURVE keys each host needs its own address (its key "
                "is found by the address a peer connects to)"
            )
    # the controller's own secret is read here; the hosts' secrets live on their hosts,
    # so only their public keys are checked (a wrong secret is refused at run time)
    secret = directory / f"{CONTROLLER_KEY}{SECRET_SUFFIX}"
    if not secret.is_file():
        raise ConfigurationError(
            f"no CURVE key pair for the controller: {str(secret)!r} is missing "
            f"(make it with: {make})"
        )
    check_secret_permissions(secret)
    for name in [CONTROLLER_KEY, *(names if hosts_keys else [])]:
        public = directory / f"{name}{PUBLIC_SUFFIX}"
        if not public.is_file():
            raise ConfigurationError(
                f"no public CURVE key for host {name!r}: {str(public)!r} is missing "
                f"(make it with: {make})"
            )
    local_secrets = [directory / f"{n}{SECRET_SUFFIX}" for n in names]
    for path in local_secrets:
        if path.is_file():
            check_secret_permissions(path)
    addresses = {h.name: h.address for h in hosts.values()}
    return FarmSecurity(directory, Path(hosts_file).absolute(), addresses=addresses)


def refusal_line(host: str, peer: str, reason: str, keys: Path | str) -> str:
    """One line for an agent the control bus refused (CURVE): the host, the key files."""
    return (
        f"host {host!r}: its agent was refused by the control bus (CURVE, peer {peer}: "
        f"{reason}): the key pair it uses ({keys}/{host}.key_secret on {host}) does not "
        f"match {keys}/{host}.key; make a new pair with 'evflow keys DIR --names {host}' "
        f"and copy both files to the same place on {host}"
    )


class BusRefusals:
    """While agents start: ask the bus proxy for CURVE refusals, so that an agent with
    a wrong key is one error naming its host and key file, not a start-up time-out."""

    def __init__(self, ctrl: Any, every_s: float = 0.3) -> None:
        self.ctrl = ctrl
        self.every_s = every_s
        self._next_s = time.monotonic() + every_s
        self._req: str | None = None
        self._told: set[str] = set()

    def check(self, missing: list[str]) -> None:
        bus = self.ctrl.bus
        if self._req is not None:
            replies = bus.replies.get(self._req)
            if replies:
                bus.forget(self._req)
                self._req = None
                reply: dict[str, Any] = next(iter(replies.values()), {})
                data = reply.get("data") or {}
                for item in data.get("refusals") or []:
                    self._judge(str(item.get("peer", "")), str(item.get("reason", "")), missing)
        if self._req is None and time.monotonic() >= self._next_s:
            self._next_s = time.monotonic() + self.every_s
            self._req = bus.send("get-metrics", "bus")

    def _judge(self, peer: str, reason: str, missing: list[str]) -> None:
        security: FarmSecurity = self.ctrl.security
        host = security.host_of(peer, self.ctrl.topology.hosts)
        if host in missing:
            raise ConfigurationError(refusal_line(host, peer, reason, security.keys_dir))
        if peer not in self._told:
            self._told.add(peer)
            log.warning("control bus: CURVE refused peer %s (%s): no agent of ours", peer, reason)

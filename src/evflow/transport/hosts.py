"""Named hosts of a farm: the ``[hosts]`` table of a topology or a hosts file.

```toml
[hosts]
h1 = { address = "10.211.0.1", ssh = "root@10.211.0.1" }
h2 = { address = "10.211.0.2", ssh = "root@10.211.0.2", python = "/opt/venv/bin/python" }
```

``address`` is where the host's devices bind tcp endpoints and where peers reach
them; ``ssh`` is the ssh destination (``user@host``) for the ssh launcher; ``slurm``
is the node name for the Slurm launcher (default: the host's name); ``python`` is the
interpreter that runs evflow there (default: the controller's own: hosts in network
namespaces share the filesystem).
"""

from __future__ import annotations

import ipaddress
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evflow.errors import ConfigurationError

LOCALHOST = "localhost"
_KNOWN_KEYS = {"address", "ssh", "python", "slurm", "workers"}  # workers: path runs


@dataclass(frozen=True)
class HostSpec:
    """One host of the farm, as named in a topology or hosts file."""

    name: str
    address: str = "127.0.0.1"
    ssh: str | None = None
    python: str = sys.executable
    slurm: str | None = None

    @property
    def is_local(self) -> bool:
        """True for the controller's own host (no launcher needed to reach it)."""
        return self.name == LOCALHOST

    @property
    def slurm_node(self) -> str:
        return self.slurm or self.name


def local_host() -> HostSpec:
    return HostSpec(name=LOCALHOST)


def parse_hosts(table: Any, *, source: str) -> dict[str, HostSpec]:
    """Hosts from a ``[hosts]`` table; ``source`` names the file in every error."""
    if not isinstance(table, dict):
        raise ConfigurationError(f"{source}: [hosts] must be a table of name = {{...}}")
    hosts: dict[str, HostSpec] = {}
    for name, entry in table.items():
        if not isinstance(entry, dict):
            raise ConfigurationError(
                f"{source}: host {name!r} must be a table like "
                f'{{ address = "10.0.0.1", ssh = "root@10.0.0.1" }}'
            )
        unknown = set(entry) - _KNOWN_KEYS
        if unknown:
            raise ConfigurationError(
                f"{source}: host {name!r} has unknown key(s) {sorted(unknown)} "
                f"(known: {sorted(_KNOWN_KEYS)})"
            )
        address = str(entry.get("address", "127.0.0.1"))
        try:
            ipaddress.ip_address(address)
        except ValueError:
            if not address.replace("-", "").replace(".", "").isalnum():
                raise ConfigurationError(
                    f"{source}: host {name!r} has an invalid address {address!r}"
                ) from None
        hosts[name] = HostSpec(
            name=name,
            address=address,
            ssh=entry.get("ssh"),
            python=str(entry.get("python", sys.executable)),
            slurm=entry.get("slurm"),
        )
    return hosts


def load_hosts(path: str | Path) -> dict[str, HostSpec]:
    """Read a hosts file (a TOML file with a ``[hosts]`` table)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigurationError(f"hosts file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{path}: not valid TOML: {exc}") from None
    if "hosts" not in data:
        raise ConfigurationError(f"{path}: no [hosts] table")
    return parse_hosts(data["hosts"], source=str(path))

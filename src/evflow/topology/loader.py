"""Load a topology file: read the TOML, build the spec, expand the QC layers, check.

The steps live in modules below this one (``spec.py`` builds the dataclasses,
``qclayers.py`` adds the QC merger devices, ``checks.py`` checks hosts, channels and
classes across the devices), so that none of them imports another back.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from evflow.errors import ConfigurationError
from evflow.topology import checks
from evflow.topology.spec import TopologySpec, build_spec
from evflow.transport.hosts import HostSpec

__all__ = ["load_topology", "parse_topology"]


def load_topology(
    path: str | Path, hosts: dict[str, HostSpec] | None = None, *, check_classes: bool = True
) -> TopologySpec:
    """Read and check a topology file; ``hosts`` (from ``--hosts``) add to its [hosts]."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigurationError(f"topology file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise ConfigurationError(f"cannot read topology file {str(path)!r}: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{path}: not valid TOML: {exc}") from None
    return parse_topology(
        data, source=str(path), default_name=path.stem, hosts=hosts, check_classes=check_classes
    )


def parse_topology(
    data: dict[str, Any],
    *,
    source: str,
    default_name: str = "topology",
    hosts: dict[str, HostSpec] | None = None,
    check_classes: bool = True,
) -> TopologySpec:
    """Check decoded TOML (see ``topology/spec.py``); errors name ``source``."""
    spec = build_spec(data, source=source, default_name=default_name, hosts=hosts)
    if "qc" in data:  # QC merger layers: more devices, producers wired to them
        from evflow.topology.qclayers import expand_qc

        devices = expand_qc(data["qc"], spec.devices, spec.collections, spec.hosts, source)
        spec = dataclasses.replace(spec, devices=devices)
    checks.check_hosts(spec)
    checks.check_channels(spec)
    if check_classes:
        checks.check_classes(spec)
    return spec

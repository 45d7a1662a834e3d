"""Load a topology file: read the TOML, build the spec, expand the tables that add
devices, check.

``spec.py`` builds the dataclasses; the ``[qc.NAME]`` tables are expanded into QC
merger devices by ``qc/topology_tables.py``, found by name in ``EXPANSIONS``;
``preflight.py`` checks hosts, channels and classes across the devices. This module runs
them in order, so that none of them imports another back.
"""

from __future__ import annotations

import dataclasses
import pkgutil
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from evflow.errors import ConfigurationError
from evflow.topology import preflight
from evflow.topology.spec import CollectionSpec, DeviceSpec, TopologySpec, build_spec
from evflow.transport.hosts import HostSpec

__all__ = ["EXPANSIONS", "load_topology", "parse_topology"]

#: top-level tables that add devices, and the function that expands each
#: (``module:function``, imported when a file has the table: an application such as
#: qc/ registers its tables by name, so that topology/ does not import it)
EXPANSIONS: dict[str, str] = {"qc": "evflow.qc.topology_tables:expand_qc"}

Expansion = Callable[
    [Any, dict[str, DeviceSpec], dict[str, CollectionSpec], dict[str, HostSpec], str],
    dict[str, DeviceSpec],
]


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
    for table, target in EXPANSIONS.items():
        if table in data:
            expand = cast(Expansion, pkgutil.resolve_name(target))
            devices = expand(data[table], spec.devices, spec.collections, spec.hosts, source)
            spec = dataclasses.replace(spec, devices=devices)
    preflight.check_hosts(spec)
    preflight.check_channels(spec)
    if check_classes:
        preflight.check_classes(spec)
    return spec

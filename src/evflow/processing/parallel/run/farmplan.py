"""What a path run across hosts is given: hosts and workers per host.

``plan_hosts`` reads ``options.hosts`` (a hosts file or a dict) and the counts
(``workers``, a host's own ``workers``, ``host_workers`` / ``-p h1=2,h2=1``). Its CURVE
keys are those of ``evflow up`` (topology/keypolicy.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evflow.errors import ConfigurationError
from evflow.processing.options import ProcessOptions


def plan_hosts(options: ProcessOptions) -> tuple[dict[str, Any], dict[str, int]]:
    """(hosts by name, workers per host) from ``options.hosts`` and the counts."""
    from evflow.transport.hosts import load_hosts, parse_hosts

    source = options.hosts
    table: Any  # the [hosts] table, or whatever a broken file holds there
    if isinstance(source, dict):
        table, name = source, "hosts="
    else:
        import tomllib

        try:
            table = tomllib.loads(Path(str(source)).read_text()).get("hosts")
        except (OSError, tomllib.TOMLDecodeError):
            table = None
        name = str(source)
        if table is None:
            load_hosts(str(source))  # its one clear error
    hosts = parse_hosts(table, source=name)
    if not hosts:
        raise ConfigurationError(f"{name}: no hosts")
    counts: dict[str, int] = {}
    per_host = options.host_workers or {}
    unknown = sorted(set(per_host) - set(hosts))
    if unknown:
        raise ConfigurationError(
            f"-p names unknown host(s) {', '.join(unknown)} (hosts of {name}: "
            f"{', '.join(sorted(hosts))})"
        )
    for h in hosts:
        entry = table.get(h, {}) if isinstance(table, dict) else {}
        default = 0 if per_host else entry.get("workers", options.workers or 1)
        n = per_host.get(h, default)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigurationError(f"{name}: host {h!r}: workers must be a whole number >= 0")
        if n:
            counts[h] = n
    if not counts:
        raise ConfigurationError(f"{name}: no host has a worker")
    return hosts, counts

"""``[qc.NAME]`` in a topology file: QC merger layers, expanded into devices at load time.

```toml
[qc.det]
producers = "producer"             # the device whose instances publish (qc-producer)
mergers_per_layer = [2, 1]         # or reduction = 4 (producers / 4 per layer, until 1)
repository = "repository"          # optional: the top merger sends to repository.qc-in
params = { cycle_s = 1.0, run_number = 42, window_cycles = 3 }   # to every merger
hosts = [["h1", "h2"], ["h1"]]     # optional, one list per layer (round robin)
restart = "on-failure"             # optional, with state_dir (checkpoints) and max_restarts
state_dir = "/var/lib/qc"
```

The layout is :func:`evflow.qc.layers.layer_layout`, the wiring
:func:`evflow.qc.layers.build_layers` (producers in contiguous blocks), the parameters
:func:`evflow.qc.layers.merger_params` (``expected`` and ``inputs`` of each merger;
``window_cycles`` and ``reset_every`` only at the top). Each merger becomes a device
``NAME-merger-<layer>-<i>`` (``NAME-merger`` when there is one) of class ``qc-merger``
with a bound ``qc-in`` and a ``qc-out`` to its parent's ``qc-in`` (the top's to the
repository's, if named); each producer gets a ``qc-out`` DEALER to its layer-1
merger, routed per instance. Placement: a merger below the top goes on the host where
most of its inputs run (on a tie, the one of them with the fewest mergers of its layer
so far: producers placed round robin spread their mergers over their hosts), the top
on the topology's first host (``localhost`` without hosts); ``hosts`` overrides it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from typing import Any

from evflow.errors import ConfigurationError
from evflow.qc.layers import MergerSpec, build_layers, layer_layout, merger_params
from evflow.topology.resolve import host_list, place_instances
from evflow.topology.spec import ChannelSpec, CollectionSpec, DeviceSpec, TopologySpec
from evflow.transport.hosts import HostSpec

__all__ = ["expand_qc"]

_KEYS = {
    "producers",
    "mergers_per_layer",
    "reduction",
    "repository",
    "params",
    "hosts",
    "restart",
    "max_restarts",
    "state_dir",
}
#: merger parameters the layers set themselves
_SET_BY_LAYERS = ("expected", "expected_count", "inputs", "state_file")
IN, OUT = "qc-in", "qc-out"
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,24}$")


def expand_qc(
    raw: Any,
    devices: dict[str, DeviceSpec],
    collections: dict[str, CollectionSpec],
    hosts: dict[str, HostSpec],
    source: str,
) -> dict[str, DeviceSpec]:
    """``devices`` with the mergers of every ``[qc.NAME]`` table added and the producers'
    ``qc-out`` channels wired; one ConfigurationError naming the file and the fix."""
    if not isinstance(raw, dict):
        raise ConfigurationError(f"{source}: [qc] must hold tables like [qc.det]")
    out = dict(devices)
    tops: Counter[str] = Counter()  # repository -> top mergers sending to it
    for name, entry in raw.items():
        out = _expand_one(name, entry, out, collections, hosts, source)
        repo = entry.get("repository")
        if isinstance(repo, str):
            tops[repo] += 1
    for repo, count in tops.items():  # it waits for the END of each, unless told
        if "inputs" not in out[repo].params:
            out[repo] = replace(out[repo], params={**out[repo].params, "inputs": count})
        if "senders" not in out[repo].params:  # and counts only theirs, once each
            ids = sorted(
                d.name for d in out.values()
                if d.cls == "qc-merger" and any(c.connect == f"{repo}.{IN}" for c in d.channels)
            )  # fmt: skip
            out[repo] = replace(out[repo], params={**out[repo].params, "senders": ",".join(ids)})
    return out


def _expand_one(
    name: str,
    entry: Any,
    devices: dict[str, DeviceSpec],
    collections: dict[str, CollectionSpec],
    hosts: dict[str, HostSpec],
    source: str,
) -> dict[str, DeviceSpec]:
    where = f"{source}: [qc.{name}]"
    if not _NAME_RE.match(name):
        raise ConfigurationError(
            f"{where}: the name must start with a letter, then letters, digits, '_' or '-' "
            "(at most 25: it prefixes the merger names, NAME-merger-<layer>-<i>)"
        )
    if not isinstance(entry, dict):
        raise ConfigurationError(f"{where} must be a table (producers = ..., mergers_per_layer)")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise ConfigurationError(
            f"{where} has unknown key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})"
        )
    producer = _producer_device(entry, devices, where)
    topo = TopologySpec("qc", source, devices, collections, hosts)
    ids, prod_hosts = _instances(topo, producer)
    if not ids:
        raise ConfigurationError(f"{where}: device {producer.name!r} has no instances")
    try:
        layout = layer_layout(len(ids), **_layout_args(entry, where))
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"{where}: {exc} ({len(ids)} producers: give mergers_per_layer as a list that "
            "shrinks layer by layer and ends with 1, e.g. [2, 1], or reduction >= 2)"
        ) from None
    specs, routes = build_layers(ids, layout, prefix=f"{name}-merger", address="{id}")
    clash = sorted({s.id for s in specs} & set(devices))
    if clash:
        raise ConfigurationError(
            f"{where}: device {clash[0]!r} is defined in the file and would be a merger of "
            f"these layers; rename it or the [qc.{name}] table"
        )
    placed = _merger_hosts(entry, specs, dict(zip(ids, prod_hosts, strict=True)), topo, where)
    common = _params(entry, where)
    repo = _repository(entry, devices, where)
    restart, max_restarts, state_dir = _restart(entry, where)
    out = dict(devices)
    for spec in specs:
        params = merger_params(spec, **common)
        if state_dir:
            params["state_file"] = f"{state_dir.rstrip('/')}/{spec.id}.state"
        channels = [ChannelSpec(IN, "router", bind=True)]
        parent = spec.parent or repo
        if parent:
            channels.append(ChannelSpec(OUT, "dealer", connect=f"{parent}.{IN}"))
        out[spec.id] = DeviceSpec(
            name=spec.id,
            cls="qc-merger",
            hosts=(placed[spec.id],),
            params=params,
            channels=tuple(channels),
            restart=restart,
            max_restarts=max_restarts,
        )
    route = tuple(routes[i] for i in ids)
    out[producer.name] = _with_channel(
        producer, ChannelSpec(OUT, "dealer", connect=f"{route[0]}.{IN}", route=route)
    )
    return out


def _producer_device(
    entry: dict[str, Any], devices: dict[str, DeviceSpec], where: str
) -> DeviceSpec:
    name = entry.get("producers")
    if not isinstance(name, str) or name not in devices:
        have = ", ".join(sorted(devices))
        raise ConfigurationError(
            f"{where}: producers = {name!r} names no device; give the name of the device "
            f"whose instances publish QC objects (devices: {have})"
        )
    dev = devices[name]
    if dev.channel(OUT) is not None:
        raise ConfigurationError(
            f"{where}: device {name!r} already has a channel {OUT!r}; remove it (the layers "
            "wire each producer to its merger)"
        )
    if not _is_producer(dev.cls):
        raise ConfigurationError(
            f"{where}: producers = {name!r} is a device of class {dev.cls!r}, not a QC "
            'producer; name a device of class "qc-producer" (or a subclass of it)'
        )
    if dev.params.get("source"):
        raise ConfigurationError(
            f"{where}: device {name!r} sets source = {dev.params['source']!r}, which every "
            "instance would share; remove it (each instance publishes as its device id)"
        )
    if dev.params.get("merger"):
        raise ConfigurationError(
            f"{where}: device {name!r} sets merger = {dev.params['merger']!r}; remove it "
            "(the layers wire each producer to its merger through qc-out)"
        )
    return dev


def _is_producer(cls: str) -> bool:
    """False for a class that loads and is no QcProducer (one that does not load is
    reported by the class check of the whole file)."""
    from evflow.qc.producer_device import QcProducer
    from evflow.runtime.runner import load_device_class

    try:
        return issubclass(load_device_class(cls), QcProducer)
    except ConfigurationError:
        return True


def _instances(topo: TopologySpec, dev: DeviceSpec) -> tuple[list[str], list[str]]:
    """The ids and hosts ``resolve`` gives the instances of ``dev``."""
    if dev.collection is not None:
        coll = topo.collections[dev.collection]
        placed = place_instances(topo, coll.instances, coll.hosts, coll.every_host)
        return [f"{dev.name}_{k}" for k in range(len(placed))], placed
    placed = place_instances(topo, dev.instances, dev.hosts, dev.every_host)
    if len(placed) == 1 and not dev.every_host:
        return [dev.name], placed
    return [f"{dev.name}_{k}" for k in range(len(placed))], placed


def _layout_args(entry: dict[str, Any], where: str) -> dict[str, Any]:
    per_layer, reduction = entry.get("mergers_per_layer"), entry.get("reduction")
    if per_layer is None and reduction is None:
        raise ConfigurationError(
            f"{where}: give mergers_per_layer (e.g. [10, 1]) or reduction (e.g. 50)"
        )
    if per_layer is not None and (
        not isinstance(per_layer, list)
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in per_layer)
    ):
        raise ConfigurationError(
            f"{where}: mergers_per_layer must be a list of integers ending with 1, e.g. [10, 1]; "
            f"got {per_layer!r}"
        )
    if reduction is not None and (not isinstance(reduction, int) or isinstance(reduction, bool)):
        raise ConfigurationError(f"{where}: reduction must be an integer >= 2, got {reduction!r}")
    return {"mergers_per_layer": per_layer, "reduction": reduction}


def _merger_hosts(
    entry: dict[str, Any],
    specs: list[MergerSpec],
    host_of: dict[str, str],
    topo: TopologySpec,
    where: str,
) -> dict[str, str]:
    layers = 1 + max(s.layer for s in specs)
    given = entry.get("hosts")
    if given is not None:
        if (
            not isinstance(given, list)
            or len(given) != layers
            or not all(
                isinstance(h, list) and h and all(isinstance(x, str) for x in h) for h in given
            )
        ):
            raise ConfigurationError(
                f"{where}: hosts must be one list of host names per layer ({layers} layers), "
                f"e.g. {[['h1', 'h2']] * (layers - 1) + [['h1']]}; got {given!r}"
            )
        known = set(host_list(topo))
        for host in (h for layer in given for h in layer):
            if host not in known:
                raise ConfigurationError(
                    f"{where}: host {host!r} is not defined (known hosts: "
                    f"{', '.join(sorted(known))}); define it in [hosts] or pass --hosts"
                )
    placed: dict[str, str] = {}
    index = Counter[int]()
    load = Counter[tuple[int, str]]()  # (layer, host) -> mergers placed there
    for spec in specs:
        if given is not None:
            pool = given[spec.layer]
            placed[spec.id] = pool[index[spec.layer] % len(pool)]
            index[spec.layer] += 1
        elif spec.parent is None:
            placed[spec.id] = host_list(topo)[0]
        else:  # where most of its inputs run; on a tie, the one with fewest mergers yet
            counts = Counter(host_of[i] for i in spec.inputs)
            best = max(counts.values())
            tied = [h for h, n in counts.items() if n == best]
            placed[spec.id] = min(tied, key=lambda h: load[(spec.layer, h)])
        load[(spec.layer, placed[spec.id])] += 1
        host_of[spec.id] = placed[spec.id]
    return placed


def _params(entry: dict[str, Any], where: str) -> dict[str, Any]:
    params = entry.get("params", {})
    if not isinstance(params, dict):
        raise ConfigurationError(f"{where}: params must be a table, got {params!r}")
    for key in _SET_BY_LAYERS:
        if key in params:
            raise ConfigurationError(
                f"{where}: params sets {key!r}, which the layers set for each merger; remove it"
            )
    return dict(params)


def _repository(entry: dict[str, Any], devices: dict[str, DeviceSpec], where: str) -> str | None:
    repo = entry.get("repository")
    if repo is None:
        return None
    dev = devices.get(repo) if isinstance(repo, str) else None
    if dev is None:
        raise ConfigurationError(
            f"{where}: repository = {repo!r} names no device (devices: "
            f"{', '.join(sorted(devices))}); define it with a bound {IN!r} channel"
        )
    ch = dev.channel(IN)
    if ch is None or not ch.bind:
        raise ConfigurationError(
            f"{where}: repository {repo!r} needs a channel "
            f'{{ name = "{IN}", type = "router", bind = true }} for the top merger'
        )
    return str(repo)


def _restart(entry: dict[str, Any], where: str) -> tuple[str, int, str]:
    restart = entry.get("restart", "never")
    if restart not in ("never", "on-failure"):
        raise ConfigurationError(f"{where}: restart must be never or on-failure, got {restart!r}")
    max_restarts = entry.get("max_restarts", 3)
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ConfigurationError(f"{where}: max_restarts must be an integer >= 0")
    state_dir = entry.get("state_dir", "")
    if not isinstance(state_dir, str):
        raise ConfigurationError(f"{where}: state_dir must be a directory path (a string)")
    if restart == "on-failure" and not state_dir:
        raise ConfigurationError(
            f"{where}: restart = on-failure needs state_dir (a restarted merger resumes "
            "from its checkpoint there; without one it would start again from nothing)"
        )
    return str(restart), int(max_restarts), state_dir


def _with_channel(dev: DeviceSpec, channel: ChannelSpec) -> DeviceSpec:
    return replace(dev, channels=(*dev.channels, channel))

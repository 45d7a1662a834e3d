"""Merger layers: how many mergers per layer, who feeds whom, and a local launcher.

``layer_layout(n_producers, mergers_per_layer=..., reduction=...)`` gives the number
of mergers in each layer (the last has one): ``reduction=50`` for 500 producers gives
``[10, 1]``. ``build_layers`` turns that into :class:`MergerSpec` s: each merger's
id, its bound ``qc-in`` address, the sources it expects (producers or the mergers of
the layer below) and where its publications go (the next layer's ``qc-in``; the top
merger's ``qc-out`` is the caller's). Producers are spread in contiguous blocks.

``launch_layers(supervisor, layers, ...)`` starts every merger under a
:class:`~evflow.runtime.supervisor.Supervisor`: forked from the zygote (default, fast)
or as ``evflow device qc-merger`` commands (``exec_devices=True``), restarted on
failure from their checkpoint (``state_dir``), on the supervisor's control bus.
On many hosts, a topology file can run the same mergers as ``qc-merger`` devices
(``merger_params`` and ``MergerSpec.channel_configs`` give their settings).
"""

from __future__ import annotations

import math
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from evflow.errors import ConfigurationError

__all__ = [
    "MergerSpec",
    "build_layers",
    "launch_layers",
    "layer_layout",
    "run_device",
    "run_merger",
]


def layer_layout(
    n_producers: int,
    mergers_per_layer: Sequence[int] | None = None,
    reduction: int | None = None,
) -> list[int]:
    """Mergers per layer, bottom first; the last layer has exactly one merger."""
    if n_producers < 1:
        raise ConfigurationError(f"QC layers: need at least one producer, got {n_producers}")
    if mergers_per_layer is not None and reduction is not None:
        raise ConfigurationError("QC layers: give mergers_per_layer or reduction, not both")
    if mergers_per_layer is not None:
        layout = [int(n) for n in mergers_per_layer]
        if not layout or layout[-1] != 1:
            raise ConfigurationError(
                f"QC layers: mergers_per_layer {layout} must end with 1 (one top merger)"
            )
        below = n_producers
        for n in layout:
            if n < 1 or n > below:
                raise ConfigurationError(
                    f"QC layers: {n} mergers cannot take {below} inputs "
                    f"(each needs at least one; mergers_per_layer={layout})"
                )
            below = n
        return layout
    factor = 0 if reduction is None else int(reduction)
    if factor < 2:
        if reduction is None:
            return [1]
        raise ConfigurationError(f"QC layers: reduction must be >= 2, got {reduction}")
    layout, below = [], n_producers
    while True:
        below = max(1, math.ceil(below / factor))
        layout.append(below)
        if below == 1:
            return layout


def split_blocks(items: Sequence[str], parts: int) -> list[list[str]]:
    """``items`` in ``parts`` contiguous blocks of sizes differing by at most one."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


@dataclass(frozen=True, slots=True)
class MergerSpec:
    """One merger: where it listens, what it expects, where it publishes."""

    id: str
    layer: int
    address: str
    inputs: tuple[str, ...]
    #: the next layer's qc-in (None for the top merger)
    parent: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def channel_configs(self, out_address: str | None = None, out_type: str = "push") -> list[str]:
        """``--channel-config`` texts of this merger."""
        cfgs = [f"name=qc-in,type=router,method=bind,address={self.address}"]
        if self.parent is not None:
            cfgs.append(f"name=qc-out,type=dealer,method=connect,address={self.parent}")
        elif out_address:
            cfgs.append(f"name=qc-out,type={out_type},method=connect,address={out_address}")
        return cfgs


def build_layers(
    producers: Sequence[str],
    layout: Sequence[int],
    *,
    prefix: str = "qc-merger",
    address: str = "ipc://{id}",
) -> tuple[list[MergerSpec], dict[str, str]]:
    """(mergers bottom-up, producer id -> the address it publishes to)."""
    if not producers:
        raise ConfigurationError("QC layers: no producers")
    if len(set(producers)) != len(producers):
        raise ConfigurationError("QC layers: producer ids must be unique")
    ids = [
        [f"{prefix}-{layer}-{i}" if len(layout) > 1 else f"{prefix}-{i}" for i in range(n)]
        for layer, n in enumerate(layout)
    ]
    if len(layout) == 1 and layout[0] == 1:
        ids = [[prefix]]
    specs: list[MergerSpec] = []
    routes: dict[str, str] = {}
    below: list[str] = list(producers)
    for layer, names in enumerate(ids):
        parents = ids[layer + 1] if layer + 1 < len(ids) else None
        blocks = split_blocks(below, len(names))
        parent_of: dict[str, str] = {}
        if parents is not None:
            for pid, block in zip(parents, split_blocks(names, len(parents)), strict=True):
                parent_of.update(dict.fromkeys(block, address.format(id=pid)))
        for mid, block in zip(names, blocks, strict=True):
            addr = address.format(id=mid)
            specs.append(MergerSpec(mid, layer, addr, tuple(block), parent_of.get(mid)))
            if layer == 0:
                routes.update(dict.fromkeys(block, addr))
        below = names
    return specs, routes


#: parameters of the top merger only: lower mergers publish their plain integral, from
#: which the top merger computes the window and the integral since its last reset
TOP_ONLY = ("window_cycles", "reset_every")


def merger_params(spec: MergerSpec, **common: Any) -> dict[str, Any]:
    """The device parameters of a merger: it expects and waits for its inputs.

    ``window_cycles`` and ``reset_every`` go to the top merger only (see TOP_ONLY)."""
    if spec.parent is not None:
        common = {k: v for k, v in common.items() if k not in TOP_ONLY}
    return {
        "expected": ",".join(spec.inputs),
        "inputs": len(spec.inputs),
        **common,
        **spec.params,
    }


def run_device(
    cls: type,
    device_id: str,
    channels: list[str],
    session: str,
    params: dict[str, Any],
    bus: str = "",
    *,
    error_exits_1: bool = False,
) -> int:
    """A zygote target: one device of class ``cls`` until it ends (SIGTERM: orderly
    stop); ``error_exits_1``: a device that ended in ERROR exits 1 at least."""
    import logging

    import zmq

    from evflow.runtime.busclient import BusClient
    from evflow.transport.channel import parse_channel_config

    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {device_id} %(levelname)s %(message)s",
    )
    configs = [cfg for text in channels for cfg in parse_channel_config(text)]
    context = zmq.Context()
    device = cls(device_id, configs, session=session, context=context, **params)

    def on_term(signum: int, frame: FrameType | None) -> None:
        device.request_shutdown()

    signal.signal(signal.SIGTERM, on_term)
    client = None
    if bus:
        client = BusClient(context, device_id, bus)
        device.attach_bus(client)
    try:
        code = int(device.run())
        return max(code, 1) if error_exits_1 and device.error is not None else code
    finally:
        if client is not None:
            client.close()
        context.term()


def run_merger(
    device_id: str, channels: list[str], session: str, params: dict[str, Any], bus: str = ""
) -> int:
    """A zygote target: one ``qc-merger`` device until it ends (SIGTERM: orderly stop)."""
    from evflow.qc.merger import QcMerger

    return run_device(QcMerger, device_id, channels, session, params, bus)


def launch_layers(
    supervisor: Any,
    specs: Sequence[MergerSpec],
    *,
    out_address: str | None = None,
    out_type: str = "push",
    state_dir: str | Path | None = None,
    exec_devices: bool = False,
    restart: str = "on-failure",
    max_restarts: int = 5,
    **common: Any,
) -> list[str]:
    """Add every merger to ``supervisor`` (top merger last to stop); returns their names.

    ``common`` are device parameters for all (``cycle_s``, ``run_number``, ...). With
    ``state_dir`` each merger checkpoints to ``<state_dir>/<id>.state`` and a restarted
    one resumes there.
    """
    bus = str(supervisor.bus_endpoints) if getattr(supervisor, "bus_endpoints", None) else ""
    names = []
    for spec in specs:
        params = merger_params(spec, **common)
        if state_dir is not None:
            params["state_file"] = str(Path(state_dir) / f"{spec.id}.state")
        channels = spec.channel_configs(out_address, out_type)
        policy = {
            "restart": restart,
            "max_restarts": max_restarts,
            "backoff_s": 0.05,
            "stop_order": spec.layer,
        }
        if exec_devices:
            argv = [
                sys.executable,
                "-m",
                "evflow",
                "device",
                "qc-merger",
                "--id",
                spec.id,
                "--session",
                supervisor.session,
            ]
            for text in channels:
                argv += ["--channel-config", text]
            for key, value in params.items():
                argv += [f"--{key.replace('_', '-')}", str(value)]
            if bus:
                argv += ["--bus", bus]
            supervisor.add_command(spec.id, argv, device_id=spec.id if bus else None, **policy)
        else:
            supervisor.add_function(
                spec.id, run_merger, spec.id, channels, supervisor.session, params, bus, **policy
            )
        names.append(spec.id)
    return names

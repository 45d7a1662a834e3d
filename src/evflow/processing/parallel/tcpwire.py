"""Path runs across hosts: which run channels also go over tcp, and where they are.

A run with ``hosts=`` keeps its input and output on this host and forks workers on
other hosts (``farm.py``). Those workers reach three channels over tcp: ``events`` (the
input's ROUTER), ``results`` (the output's PULL) and ``ctl`` (the caller's ROUTER).

- The caller sets :data:`BIND_ADDRESS` (its own address on the route to the hosts)
  before its zygote forks: every role then binds those channels on
  ``ipc://NAME;tcp://BIND_ADDRESS:0`` and writes the real tcp endpoint (port chosen by
  the kernel, never guessed) to ``NAME.tcp`` in the run's session directory, where the
  caller reads it and tells the agents.
- A remote worker sets :data:`CONNECT` (name -> tcp endpoint, told by its agent) and
  connects there instead of the ipc file.

With farm keys in the environment (``EVFLOW_CURVE_KEYS``, set for the whole run by the
caller and for each agent: transport/farmkeys.py), those sockets use CURVE as every tcp
socket of a farm: the binding sockets are servers with the caller's key pair, remote
workers clients with their host's (the local input and output reach ``ctl`` over tcp
too, as clients). Runs without hosts leave every setting empty and their channels
unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from evflow.errors import ConfigurationError
from evflow.transport.channel_config import ChannelConfig
from evflow.transport.farmkeys import farm_keys

#: the channels remote workers use
TCP_NAMES = ("events", "results", "ctl")
#: caller: bind those channels on tcp too, on this address (None: ipc only)
BIND_ADDRESS: str | None = None
#: remote worker: channel name -> tcp endpoint to connect to
CONNECT: dict[str, str] = {}
#: a host agent imports the steering file: the first parallel run raises SplitCaptured
CAPTURE = False


def adjust(config: ChannelConfig, session: str) -> ChannelConfig:
    """The run channel ``config`` as a path run across hosts needs it (else unchanged)."""
    if config.name not in TCP_NAMES or not (BIND_ADDRESS or CONNECT):
        return config
    changes: dict[str, Any] = {}
    curve = farm_keys() is not None
    if config.method == "bind" and BIND_ADDRESS:
        tcp = f"tcp://{BIND_ADDRESS}:0"
        # with CURVE the socket is tcp only: a CURVE socket's ipc peers would need keys
        # too, and the refusal monitor reads tcp peers only
        changes["address"] = tcp if curve else f"{config.address};{tcp}"
    elif config.method == "connect" and config.name in CONNECT:
        changes["address"] = CONNECT[config.name]
    elif config.method == "connect" and BIND_ADDRESS and curve:
        # a local role (input, output) reaches the caller's ctl over tcp as well
        changes["address"] = _published(session, config.name)
    if not changes:
        return config
    # with keys, the channel leaves curve unset: the farm keys make it a server or a
    # client of the host it connects to (farmkeys.FarmKeys.options)
    return dataclasses.replace(config, **changes)


def _published(session: str, name: str) -> str:
    from evflow.transport.paths import session_dir

    try:
        return (session_dir(session) / f"{name}.tcp").read_text().strip()
    except OSError:
        raise ConfigurationError(
            f"run channel {name!r}: its tcp endpoint is not published"
        ) from None


def publish(session: str, name: str, endpoints: list[str]) -> None:
    """Write the tcp endpoint a role bound for ``name`` where the caller finds it."""
    if not BIND_ADDRESS or name not in TCP_NAMES:
        return
    tcp = [e for e in endpoints if e.startswith("tcp://")]
    if not tcp:
        return
    from evflow.transport.paths import session_dir

    target = session_dir(session) / f"{name}.tcp"
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(tcp[0])
    tmp.replace(target)  # readers never see half a line


def read_endpoints(session: str) -> dict[str, str] | None:
    """The three tcp endpoints once every role published its own, else None."""
    from evflow.transport.paths import session_dir

    found = {}
    for name in TCP_NAMES:
        try:
            text = (session_dir(session) / f"{name}.tcp").read_text().strip()
        except OSError:
            return None
        if not text.startswith("tcp://"):
            return None
        found[name] = text
    return found


class SplitCaptured(BaseException):
    """Raised by ``run_parallel`` under CAPTURE: carries the split path, runs nothing
    (a BaseException, so no ``except Exception`` of a steering file stops it)."""

    def __init__(self, split: Any) -> None:
        super().__init__("split captured")
        self.split = split

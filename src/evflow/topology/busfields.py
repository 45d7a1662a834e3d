"""Typed reading of the maps that controllers, agents and devices take from the bus.

Anything may arrive on a session's bus (any process that can open its ipc file can
publish), so the handlers of :mod:`evflow.topology.intake`, the agent and the device
nodes read nested values through these functions: each returns the value when it has
the expected type and range and raises :class:`~evflow.errors.ProtocolError` (kind
``bad-field``, naming the field and the value) otherwise, so that a bad message is
refused as a whole, counted by the receiver's ``BadMessageCounter`` and logged once
per kind, before it changed anything.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from evflow.runtime.states import State
from evflow.wire.messages import refuse

__all__ = [
    "STATES",
    "AgentBeat",
    "DeviceEntry",
    "endpoint_map",
    "node_name",
    "opt_bool",
    "opt_int",
    "opt_number",
    "opt_str",
    "parse_beat",
    "parse_summary",
    "state_name",
    "str_list",
    "str_map",
]

#: the state names a device may report (FairMQ's)
STATES = frozenset(s.value for s in State)
#: a device id, an agent id or a property key (``device.channel``)
_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,200}")
#: most endpoints one property may list (a channel bound on many addresses is rare)
MAX_ENDPOINTS = 64
#: the largest pid Linux hands out (pid_max is at most 2**22)
PID_MAX = 1 << 22


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(what: str, value: Any, expected: str) -> Exception:
    return refuse("bad-field", f"{what} is {_short(value)}; expected {expected}")


def str_map(value: Any, what: str, max_items: int = 4096) -> dict[str, Any]:
    """``value`` as a map whose keys are strings (at most ``max_items`` of them)."""
    if type(value) is not dict or len(value) > max_items:
        raise _bad(what, value, f"a map of at most {max_items} entries")
    for key in value:
        if type(key) is not str:
            raise _bad(f"a key of {what}", key, "a string")
    return value


def opt_int(m: dict[str, Any], key: str, what: str, lo: int = 0, hi: int = 2**63 - 1) -> int | None:
    """``m[key]`` as an int in ``[lo, hi]``; None when absent or None (bools refused)."""
    value = m.get(key)
    if value is None:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(f"{what}.{key}", value, f"an int in [{lo}, {hi}]")
    return value


def opt_number(
    m: dict[str, Any], key: str, what: str, lo: float = 0.0, hi: float = 1e15
) -> float | None:
    """``m[key]`` as a finite number in ``[lo, hi]``; None when absent or None."""
    value = m.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise _bad(f"{what}.{key}", value, f"a number in [{lo:g}, {hi:g}]")
    return float(value)


def opt_str(m: dict[str, Any], key: str, what: str, max_len: int = 4096) -> str | None:
    """``m[key]`` as a string of at most ``max_len`` characters; None when absent."""
    value = m.get(key)
    if value is None:
        return None
    if type(value) is not str or len(value) > max_len:
        raise _bad(f"{what}.{key}", value, f"a string of at most {max_len} characters")
    return value


def opt_bool(m: dict[str, Any], key: str, what: str) -> bool | None:
    """``m[key]`` as a bool (not a truthy anything); None when absent."""
    value = m.get(key)
    if value is None:
        return None
    if type(value) is not bool:
        raise _bad(f"{what}.{key}", value, "true or false")
    return value


def str_list(value: Any, what: str, max_items: int = 4096, max_len: int = 4096) -> list[str]:
    """``value`` as a list of strings."""
    if type(value) is not list or len(value) > max_items:
        raise _bad(what, value, f"a list of at most {max_items} strings")
    for item in value:
        if type(item) is not str or len(item) > max_len:
            raise _bad(f"an item of {what}", item, f"a string of at most {max_len} characters")
    return value


def node_name(value: Any, what: str) -> str:
    """A device id, agent id or property key (letters, digits and ``_.:@-``)."""
    if type(value) is not str or not _NAME.fullmatch(value):
        raise _bad(what, value, "a device id or property name")
    return value


def endpoint_map(value: Any, what: str) -> dict[str, list[str]]:
    """``{"device.channel": [endpoint, ...]}`` (what binders publish)."""
    out = {}
    for key, urls in str_map(value, what).items():
        if not 0 < len(key) <= 300:  # (a channel name may hold any character)
            raise _bad(f"a key of {what}", key, "a property name")
        out[key] = str_list(urls, f"{what}[{key!r}]", MAX_ENDPOINTS, 1024)
    return out


def state_name(value: Any, what: str) -> str:
    """One of FairMQ's state names (``RUNNING``...)."""
    if type(value) is not str or value not in STATES:
        raise _bad(what, value, "a device state name")
    return value


# --- a device's final report (protocol.py: device -> all, METRICS at exit) ----------------
#: sections of a device's summary that the end report reads as maps
SUMMARY_SECTIONS = (
    "sink",
    "sampler",
    "forwarded",
    "replay",
    "qc",
    "qc_repository",
    "eventbuilder",
)


def parse_summary(value: Any) -> dict[str, Any]:
    """A device's final summary: a map with string keys, its sections maps too."""
    summary = str_map(value, "METRICS.summary")
    for key in SUMMARY_SECTIONS:
        if key in summary:
            str_map(summary[key], f"METRICS.summary.{key}")
    opt_str(summary, "host", "METRICS.summary", 256)
    return summary


# --- the agent's heartbeat (protocol.py: agent -> controller) -----------------------------
@dataclass(frozen=True)
class DeviceEntry:
    """One device process as its agent reports it."""

    state: str
    pid: int | None
    returncode: int | None
    message: str
    restarts: int
    #: it ended while its agent was shutting down (stopped by the controller)
    shutdown: bool


@dataclass(frozen=True)
class AgentBeat:
    pid: int | None
    preflight: dict[str, Any] | None
    devices: dict[str, DeviceEntry]


def parse_beat(agent: Any) -> AgentBeat:
    """The ``agent`` map of an agent's METRICS, checked whole (ProtocolError if bad)."""
    agent = str_map(agent, "agent beat")
    pid = opt_int(agent, "pid", "agent beat", 1, PID_MAX)
    preflight = agent.get("preflight")
    if preflight is not None:
        preflight = str_map(preflight, "agent beat.preflight")
        str_list(preflight.get("removed") or [], "agent beat.preflight.removed")
        live = preflight.get("live") or []
        if type(live) is not list:
            raise _bad("agent beat.preflight.live", live, "a list")
        for item in live:
            item = str_map(item, "an item of agent beat.preflight.live")
            opt_str(item, "session", "agent beat.preflight.live")
            opt_int(item, "pid", "agent beat.preflight.live", 0, PID_MAX)
    devices = {}
    for dev_id, entry in str_map(agent.get("devices") or {}, "agent beat.devices").items():
        what = f"agent beat.devices[{dev_id!r}]"
        entry = str_map(entry, what)
        state = opt_str(entry, "state", what, 32)
        devices[dev_id] = DeviceEntry(
            state=state or "",
            pid=opt_int(entry, "pid", what, 1, PID_MAX),
            returncode=opt_int(entry, "returncode", what, -255, 255),
            message=opt_str(entry, "message", what) or "",
            restarts=opt_int(entry, "restarts", what, 0, 1 << 20) or 0,
            shutdown=bool(opt_bool(entry, "shutdown", what)),
        )
    return AgentBeat(pid, preflight, devices)

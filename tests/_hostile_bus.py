"""Hostile messages for a session's control bus: a publisher and a catalogue.

:class:`BusAttacker` publishes raw frames into a session's bus (an XPUB connected to
the proxy's ``bus-in.ipc``; it waits until the proxy's subscriptions reached it, so
that nothing it sends is dropped). :func:`fuzzed` builds, from harmless messages of
every kind that the topology controller, the agents and the devices read, one message
per field and per value of a wrong type (or out of range), each with one field bad.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import zmq

from evflow.runtime.busclient import BusEndpoints
from evflow.wire.messages import MsgType, encode_message

#: values of every msgpack type, and numbers out of any sensible range
BAD_VALUES: tuple[Any, ...] = (
    "fast",
    -1,
    2**64 - 1,
    -(2**63),
    1.5,
    math.nan,
    math.inf,
    True,
    [1, "x"],
    {"a": 1},
    {1: 2},
    b"\xff\xfe",
)


class BusAttacker:
    """An XPUB connected to the proxy's publish side of ``session``'s local bus."""

    def __init__(self, session: str, timeout_s: float = 60.0) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.linger = 1000
        self.pub.connect(BusEndpoints.for_session(session).publish)
        # the proxy passes its subscribers' subscriptions on: once the ones for
        # COMMAND and METRICS are here, what we send reaches the controller
        wanted = {b"\x01" + bytes([MsgType.COMMAND]), b"\x01" + bytes([MsgType.METRICS])}
        deadline = time.monotonic() + timeout_s
        while wanted:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"the bus of {session} did not subscribe within {timeout_s} s"
            if self.pub.poll(left_ms):
                wanted.discard(bytes(self.pub.recv_multipart()[0]))

    def send(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def publish(self, mtype: MsgType, header: dict[Any, Any]) -> None:
        self.send(encode_message(mtype, header))

    def close(self) -> None:
        self.pub.close()
        self.ctx.term()

    def __enter__(self) -> BusAttacker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def garbage_frames() -> list[list[bytes]]:
    """Messages the decoder itself refuses."""
    return [
        [bytes([MsgType.METRICS])],
        [bytes([MsgType.METRICS]), b"\xc1"],
        [bytes([MsgType.REPLY]), msgpack.packb([1, 2])],
        [b"\xff", b"\x80"],
        [b"", b"\x80"],
        [bytes([MsgType.STATE]), msgpack.packb({"from": "x"}) + b"trailing"],
    ]


def _set(msg: dict[Any, Any], path: tuple[Any, ...], value: Any) -> dict[Any, Any]:
    out = copy.deepcopy(msg)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def _wrong(value: Any, expected: type | tuple[type, ...]) -> bool:
    """``value`` is not what a field of type ``expected`` holds (bool is no number)."""
    if isinstance(value, bool):
        return bool not in (expected if isinstance(expected, tuple) else (expected,))
    if isinstance(value, float) and not math.isfinite(value):
        return True
    if isinstance(value, dict) and any(not isinstance(k, str) for k in value):
        return True  # a map with other keys than strings is no field's value
    return not isinstance(value, expected)


def fuzzed(
    base: dict[Any, Any], fields: dict[tuple[Any, ...], type | tuple[type, ...]]
) -> Iterator[dict[Any, Any]]:
    """``base`` with each field of ``fields`` (a path of keys -> its type) set in turn
    to each value of BAD_VALUES that is not of its type."""
    for path, expected in fields.items():
        for value in BAD_VALUES:
            if _wrong(value, expected):
                yield _set(base, path, value)


def catalogue(agent: str, device: str) -> list[tuple[MsgType, dict[Any, Any]]]:
    """Every hostile message: each kind the controller reads (from ``device`` and the
    agent ``agent``), and commands for the agent and for ``device``. Only wrong types
    and ranges: a message of the right shape would be an order, not an attack."""
    out: list[tuple[MsgType, dict[Any, Any]]] = []

    def add(mtype: MsgType, base: dict[Any, Any], fields: dict[Any, Any]) -> None:
        out.extend((mtype, m) for m in fuzzed(base, fields))

    rates = {"messages_in_hz": 1.0, "messages_out_hz": 0.0}
    metrics = {"from": device, "metrics": {"node_state": "RUNNING", "rates": rates}}
    add(
        MsgType.METRICS,
        metrics,
        {
            ("from",): str,
            ("metrics",): dict,
            ("metrics", "node_state"): str,
            ("metrics", "rates"): dict,
            ("metrics", "rates", "messages_in_hz"): (int, float),
            ("metrics", "rates", "messages_out_hz"): (int, float),
            ("final",): bool,
        },
    )
    final = {"from": device, "metrics": {}, "final": True, "summary": {"sink": {}}}
    add(MsgType.METRICS, final, {("summary",): dict, ("summary", "sink"): dict, ("error",): str})
    entry = {"state": "running", "restarts": 0}
    beat = {
        "from": agent,
        "metrics": {
            "agent": {
                "preflight": {"removed": [], "live": [{"session": "s", "pid": 1}]},
                "devices": {device: entry},
            }
        },
    }
    add(
        MsgType.METRICS,
        beat,
        {
            ("metrics", "agent"): dict,
            ("metrics", "agent", "pid"): int,
            ("metrics", "agent", "preflight"): dict,
            ("metrics", "agent", "preflight", "removed"): list,
            ("metrics", "agent", "preflight", "live"): list,
            ("metrics", "agent", "preflight", "live", 0): dict,
            ("metrics", "agent", "preflight", "live", 0, "session"): str,
            ("metrics", "agent", "preflight", "live", 0, "pid"): int,
            ("metrics", "agent", "devices"): dict,
            ("metrics", "agent", "devices", device): dict,
            ("metrics", "agent", "devices", device, "state"): str,
            ("metrics", "agent", "devices", device, "pid"): int,
            ("metrics", "agent", "devices", device, "returncode"): int,
            ("metrics", "agent", "devices", device, "message"): str,
            ("metrics", "agent", "devices", device, "restarts"): int,
        },
    )
    add(MsgType.STATE, {"from": device, "state": "RUNNING"}, {("state",): str})
    reply = {
        "from": device,
        "to": "controller",
        "req": "",
        "cmd": "check-state",
        "ok": True,
        "data": {"node_state": "RUNNING", "endpoints": {"zz.none": ["ipc:///nowhere"]}},
    }
    add(
        MsgType.REPLY,
        reply,
        {
            ("ok",): bool,
            ("data", "node_state"): str,
            ("data", "endpoints"): dict,
            ("data", "endpoints", "zz.none"): list,
            ("data", "endpoints", "zz.none", 0): str,
        },
    )
    notice = {
        "from": device,
        "to": "controller",
        "req": "",
        "cmd": "set-property",
        "ok": True,
        "data": {"endpoints": {"zz.none": ["ipc:///nowhere"]}},
    }
    add(
        MsgType.REPLY, notice, {("data", "endpoints"): dict, ("data", "endpoints", "zz.none"): list}
    )
    ask = {
        "from": device,
        "to": "controller",
        "req": "",
        "cmd": "get-properties",
        "ok": True,
        "data": {"keys": ["zz.none"]},
    }
    add(MsgType.REPLY, ask, {("data", "keys"): list, ("data", "keys", 0): str})
    command = {
        "from": device,
        "to": "controller",
        "req": "h",
        "cmd": "get-properties",
        "args": {"keys": ["zz.none"]},
    }
    add(MsgType.COMMAND, command, {("args", "keys"): list, ("args", "keys", 0): str})
    setprop = {
        "from": device,
        "to": "controller",
        "req": "h",
        "cmd": "set-property",
        "args": {"endpoints": {"zz.none": ["ipc:///nowhere"]}},
    }
    add(MsgType.COMMAND, setprop, {("args", "endpoints"): dict})
    # commands for the agent: a spawn of nothing, and shutdowns that must not be taken
    spawn = {
        "from": "hostile",
        "to": agent,
        "req": "",
        "cmd": "spawn",
        "args": {"devices": [], "connect_timeout_s": 20.0, "stats_dir": "", "first_steps": []},
    }
    add(
        MsgType.COMMAND,
        spawn,
        {
            ("args", "devices"): list,
            ("args", "connect_timeout_s"): (int, float),
            ("args", "stats_dir"): str,
            ("args", "first_steps"): list,
        },
    )
    for launch in ({"id": "x"}, {"id": 5, "name": "x", "class": "sink", "host": "h", "index": 0}):
        out.append((MsgType.COMMAND, _set(spawn, ("args", "devices"), [launch])))
    for field in ("grace_s", "kill"):
        shutdown = {"from": "hostile", "to": agent, "req": "", "cmd": "shutdown", "args": {}}
        add(
            MsgType.COMMAND,
            _set(shutdown, ("args", field), None),
            {("args", field): bool if field == "kill" else (int, float)},
        )
    out.append((MsgType.COMMAND, _set(shutdown, ("args",), {"grace_s": -1.0})))
    # commands for a device
    for cmd, field, expected in (
        ("set-properties", "properties", dict),
        ("transition", "transition", str),
        ("transition", "transitions", list),
        ("peer-lost", "peer", str),
    ):
        base = {"from": "hostile", "to": device, "req": "", "cmd": cmd, "args": {field: None}}
        add(MsgType.COMMAND, base, {("args", field): expected})
    bad_props = {"zz.none": ["ipc:///nowhere", 5]}
    out.append(
        (
            MsgType.COMMAND,
            {
                "from": "hostile",
                "to": device,
                "req": "",
                "cmd": "set-properties",
                "args": {"properties": bad_props},
            },
        )
    )
    return out

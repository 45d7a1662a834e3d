"""Hostile messages on a running topology's control bus never stop it.

A real ``evflow up`` of the fan-in example (samplers paced so that it runs a few
seconds); once RUNNING, messages of every kind that the controller, the agent and the
devices read, each with one field of a wrong type or out of range, are published into
the session's ``bus-in.ipc``. The topology ends as it would have: exit 0, every message
at the sink, no traceback; the controller counted what it refused (``evflow status``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack

from _hostile_bus import BusAttacker, catalogue, garbage_frames
from _topo import Lines
from evflow.wire.messages import MsgType

EXAMPLES = Path(__file__).parent.parent / "examples" / "topologies"
RATE_HZ = 400
MESSAGES = 2400  # per sampler: about 6 s, the time the attack takes and more


def paced_fan_in(tmp_path: Path) -> Path:
    """examples/topologies/fan_in.toml with its samplers paced (RUNNING long enough)."""
    text = (EXAMPLES / "fan_in.toml").read_text()
    assert "max_iterations = 10000\n" in text
    text = text.replace(
        "max_iterations = 10000\n", f"max_iterations = {MESSAGES}\nrate = {RATE_HZ}\n"
    )
    path = tmp_path / "fan_in.toml"
    path.write_text(text)
    return path


def status(session: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "evflow", "status", "--session", session, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, f"evflow status failed: {out.stderr}"
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def test_hostile_bus_messages_do_not_stop_a_topology(tmp_path: Path) -> None:
    session = f"hostile{tmp_path.name[-12:]}".replace("_", "-")[:40]
    stats_dir = tmp_path / "stats"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "evflow",
            "up",
            "--quiet",
            "--session",
            session,
            "--stats-dir",
            str(stats_dir),
            str(paced_fan_in(tmp_path)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = Lines(proc)
    try:
        lines.wait_for("devices RUNNING", 60)
        hostile = catalogue("agent.localhost", "sink")
        with BusAttacker(session) as bus:
            # the three of issue 21 first, then the rest
            bus.send(
                [
                    bytes([MsgType.METRICS]),
                    msgpack.packb(
                        {"from": "sink", "metrics": {"rates": {"messages_in_hz": "fast"}}}
                    ),
                ]
            )
            bus.publish(
                MsgType.METRICS,
                {
                    "from": "agent.localhost",
                    "metrics": {
                        "agent": {"devices": {"sink": {"state": "running", "restarts": "many"}}}
                    },
                },
            )
            bus.publish(
                MsgType.REPLY,
                {
                    "from": "sink",
                    "to": "controller",
                    "req": "",
                    "ok": True,
                    "cmd": "get-properties",
                    "data": {"keys": 5},
                },
            )
            for frames in garbage_frames():
                bus.send(frames)
            for mtype, header in hostile:
                bus.publish(mtype, header)
        # every one the controller reads is refused and counted, and it goes on
        for_controller = [
            h for t, h in hostile if t is not MsgType.COMMAND or h.get("to") == "controller"
        ]
        expected = 3 + len(for_controller)  # (the proxy drops the garbage frames)
        deadline = time.monotonic() + 30
        while True:
            refused = status(session)["bad_messages"]
            print(f"refused {sum(refused.values())} of {expected}: {refused}")
            if sum(refused.values()) >= expected or time.monotonic() > deadline:
                break
        assert sum(refused.values()) == expected, refused
        assert "unchecked-value" not in refused, refused  # each was refused by a check
    finally:
        code, text = lines.finish(120)
    assert "Traceback" not in text, text
    assert code == 0, text
    sink = json.loads((stats_dir / "sink.json").read_text())["sink"]
    assert sink["received"] == sink["announced"] == 4 * MESSAGES, sink
    assert sink["ends"] == 1
    # one line per kind of refusal, not one per message
    assert text.count("dropped bad message on topology controller") <= 8, text


def test_the_controller_refuses_each_hostile_message_before_it_changes_anything() -> None:
    """Each message of the catalogue on its own: refused, counted under its kind, and
    the records (device, host, endpoints) are as they were."""
    import dataclasses

    import zmq

    from evflow.runtime.busclient import BusEndpoints
    from evflow.topology.intake import ControllerBus
    from evflow.topology.knowledge import DeviceRecord, HostRecord
    from evflow.topology.resolve import ResolvedDevice
    from evflow.wire.messages import Message

    ctx: zmq.Context[Any] = zmq.Context()
    nowhere = BusEndpoints("ipc:///nonexistent/in", "ipc:///nonexistent/out")
    sink = DeviceRecord(ResolvedDevice("sink", "sink", "sink", "localhost", 0, {}, []))
    sink.process, sink.state, sink.rank, sink.pid = "running", "RUNNING", 9, 1234
    host = HostRecord("localhost", last_beat_s=1.0, pid=99)
    bus = ControllerBus(ctx, nowhere, {"sink": sink}, {"localhost": host}, lambda c, a: {})
    before = (dataclasses.asdict(sink), dataclasses.asdict(host))
    try:
        for mtype, header in catalogue("agent.localhost", "sink"):
            if mtype is MsgType.COMMAND and header.get("to") != "controller":
                continue
            total = bus.bad.total
            bus._handle(Message(mtype, header, []))
            assert bus.bad.total == total + 1, f"not refused: {mtype.name} {header}"
            assert (dataclasses.asdict(sink), dataclasses.asdict(host)) == before, header
            assert bus.properties == {}, header
        assert set(bus.bad.counts) <= {"bad-field", "bad-sender"}, bus.bad.counts
    finally:
        bus.close()
        ctx.term()

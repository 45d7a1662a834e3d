"""A splitter whose output reaches every sink (``peers = "all"``) ends every sink's stream.

``peers = "all"`` used to connect one socket to every sink: ZeroMQ spread the data over
them, and the splitter's one END reached one sink only, with the count of all of them
(that sink failed its count; the others waited for an END that never came). Each peer
of such a channel is now a sub-channel of its own: the splitter counts what it sends to
each, and each sink gets one END with its own count (issue 21).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from evflow.topology.node import Exchange
from evflow.topology.resolve import ResolvedChannel, ResolvedDevice

SINKS = 3
MESSAGES = 3000

DEALER = """
[devices.splitter]
class = "splitter"
channels = [
  { name = "data-in", type = "router", bind = true },
  { name = "data-out", type = "dealer", connect = "sink.data", peers = "all" },
]
[devices.sink]
class = "sink"
instances = %d
channels = [{ name = "data", type = "router", bind = true }]
"""

PUSH = """
[devices.splitter]
class = "splitter"
channels = [
  { name = "data-in", type = "router", bind = true },
  { name = "data-out", type = "push", connect = "sink.data", peers = "all" },
  { name = "data-out-ack", type = "pull", bind = true },
]
[devices.sink]
class = "sink"
instances = %d
channels = [
  { name = "data", type = "pull", bind = true },
  { name = "data-ack", type = "push", connect = "splitter.data-out-ack" },
]
"""

SAMPLER = """
name = "split-all"
[devices.sampler]
class = "sampler"
max_iterations = %d
params = { msg_size = 100 }
channels = [{ name = "data", type = "dealer", connect = "splitter.data-in" }]
"""


def stats(stats_dir: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in stats_dir.glob("*.json")}


@pytest.mark.parametrize("wiring", ["dealer", "push"])
def test_every_sink_of_a_splitter_gets_its_end_with_its_own_count(
    tmp_path: Path, wiring: str
) -> None:
    topo = tmp_path / "split.toml"
    sinks = (DEALER if wiring == "dealer" else PUSH) % SINKS
    topo.write_text(SAMPLER % MESSAGES + sinks)
    out = tmp_path / "stats"
    proc = subprocess.run(
        [sys.executable, "-m", "evflow", "up", "--quiet", str(topo), "--stats-dir", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR" not in proc.stderr, proc.stderr[-3000:]
    found = stats(out)
    assert found["sampler"]["sampler"]["sent"] == MESSAGES
    assert found["sampler"]["sampler"]["acked"] == 1
    split = found["splitter"]["forwarded"]
    assert split["received"] == MESSAGES and sum(split["sent"]) == MESSAGES
    assert len(split["sent"]) == SINKS  # one sub-channel, and one count, per sink
    for k in range(SINKS):
        sink = found[f"sink_{k}"]["sink"]
        assert sink["ends"] == 1
        assert sink["received"] == sink["announced"] == split["sent"][k] > 0


def test_a_load_balancing_channel_to_all_peers_is_one_sub_channel_per_peer() -> None:
    """The connect configs of a push/dealer channel with several peers: one each (a
    receiving channel keeps one socket connected to all: it needs no count per peer)."""
    channels = [
        ResolvedChannel("out", "dealer", connect=[("sink_0.data", True), ("sink_1.data", True)]),
        ResolvedChannel("in", "pull", connect=[("src_0.data", True), ("src_1.data", True)]),
    ]
    spec = ResolvedDevice("splitter", "splitter", "splitter", "localhost", 0, {}, channels)
    exchange = Exchange(client=None, launch=spec, timeout_s=1)  # type: ignore[arg-type]
    exchange.properties = {
        "sink_0.data": ["ipc:///tmp/s0.ipc"],
        "sink_1.data": ["ipc:///tmp/s1.ipc"],
        "src_0.data": ["ipc:///tmp/a.ipc"],
        "src_1.data": ["ipc:///tmp/b.ipc"],
    }
    configs = exchange.channel_configs(device=None, binding=False)
    assert [(c.name, c.address) for c in configs] == [
        ("out", "ipc:///tmp/s0.ipc"),
        ("out", "ipc:///tmp/s1.ipc"),
        ("in", "ipc:///tmp/a.ipc;ipc:///tmp/b.ipc"),
    ]

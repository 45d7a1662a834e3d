"""``evflow up`` over ssh on real hosts: network namespaces running sshd (h11b's farm).

The 3-host example, slowed down so that it is still running when ``evflow status``
asks: every device runs in the namespace of the host the spec placed it on (its pid is
there), the samplers on h1 and h3 reach the merger on h2 over tcp, the counts check out,
and after ``evflow down`` nothing is left on any host (the ``farm`` fixture checks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from farm_hosts import NamespaceFarm

pytestmark = [pytest.mark.netns, pytest.mark.sshd]

EXAMPLES = Path(__file__).parent.parent / "examples" / "topologies"


def evflow(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evflow", *args], capture_output=True, text=True, timeout=90, env=env
    )


def test_three_hosts_example_over_ssh(farm: NamespaceFarm, tmp_path: Path) -> None:
    hosts = farm.write_hosts_file(tmp_path / "hosts.toml")
    topo = tmp_path / "three_hosts.toml"
    text = (EXAMPLES / "three_hosts.toml").read_text()
    topo.write_text(text.replace("max_iterations = 10000", "max_iterations = 3000\nrate = 300"))
    out = tmp_path / "stats"
    env = {**os.environ, **farm.ssh_env()}
    up = evflow(
        env, "up", str(topo), "--launcher", "ssh", "--hosts", str(hosts), "--session", "farm3",
        "--stats-dir", str(out), "--detach",
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    try:
        status = evflow(env, "status", "--session", "farm3", "--json")
        assert status.returncode == 0, status.stderr
        data: dict[str, Any] = json.loads(status.stdout)
        placed = {d["id"]: d["host"] for d in data["devices"]}
        assert placed == {
            "sampler_0": "h1",
            "sampler_1": "h2",
            "sampler_2": "h3",
            "merger": "h2",
            "sink": "h3",
        }
        for dev in data["devices"]:
            assert dev["pid"] in farm.pids(dev["host"]), f"{dev['id']} is not on {dev['host']}"
        for host in data["hosts"]:
            assert host["agent_pid"] in farm.pids(host["name"])
    finally:
        down = evflow(env, "down", "--session", "farm3")
    assert down.returncode == 0, down.stderr
    found = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    sink = found["sink"]["sink"]
    sent = sum(found[f"sampler_{i}"]["sampler"]["sent"] for i in range(3))
    assert sink["received"] == sink["announced"] == sent > 0

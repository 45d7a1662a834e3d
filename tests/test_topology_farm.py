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
import time
from pathlib import Path
from typing import Any

import pytest

from _topo import Lines
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
        "--stats-dir", str(out), "--detach", "--insecure",
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


LOSS = """
name = "farm-loss"
[devices.sampler]
class = "sampler"
instances = 2
hosts = ["h1", "h2"]
rate = 200
max_iterations = 1400
params = { msg_size = 100 }
channels = [{ name = "data", type = "dealer", connect = "merger.data-in" }]
[devices.far]
class = "sampler"
hosts = ["h3"]
expendable = true
rate = 200
params = { msg_size = 100 }
channels = [{ name = "data", type = "dealer", connect = "merger.data-in" }]
[devices.merger]
class = "merger"
hosts = ["h1"]
channels = [
  { name = "data-in", type = "router", bind = true },
  { name = "data-out", type = "dealer", connect = "sink.data" },
]
[devices.sink]
class = "sink"
hosts = ["h1"]
channels = [{ name = "data", type = "router", bind = true }]
"""


def test_a_whole_host_killed_is_reported_and_the_rest_finishes(
    farm: NamespaceFarm, tmp_path: Path
) -> None:
    """SIGKILL of every process of h3 (its namespace, sshd included) mid-run: the
    controller names the host within 2 s; the expendable (endless) sampler there is given up,
    the merger stops waiting for its END, the sink's counts still check out."""
    hosts = farm.write_hosts_file(tmp_path / "hosts.toml")
    topo = tmp_path / "loss.toml"
    topo.write_text(LOSS)
    out = tmp_path / "stats"
    env = {**os.environ, **farm.ssh_env()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "evflow", "up", str(topo), "--launcher", "ssh", "--hosts",
         str(hosts), "--stats-dir", str(out), "--quiet", "--insecure"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    lines = Lines(proc)
    try:
        lines.wait_for("devices RUNNING", 60)
        killed_at = time.monotonic()
        assert farm.kill_host("h3")
        reported_at = lines.wait_for("host 'h3' lost", 10)
        assert reported_at - killed_at < 2.0
        code, text = lines.finish(90)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes its pipes, also after a failure
    assert code == 0, text
    found = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert "far" not in found  # it died with its host
    assert found["merger"]["forwarded"]["lost_peers"] == ["far"]
    sink = found["sink"]["sink"]
    assert sink["received"] == sink["announced"] > 0
    for dev in ("sampler_0", "sampler_1"):
        assert found[dev]["sampler"]["sent"] == 1400 and found[dev]["sampler"]["acked"] == 1


def test_hosts_over_ssh_without_keys_need_insecure(farm: NamespaceFarm, tmp_path: Path) -> None:
    hosts = farm.write_hosts_file(tmp_path / "hosts.toml")
    env = {**os.environ, **farm.ssh_env()}
    proc = evflow(env, "up", str(EXAMPLES / "three_hosts.toml"), "--launcher", "ssh",
                  "--hosts", str(hosts))  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"evflow: error: {EXAMPLES / 'three_hosts.toml'}: the topology runs on hosts h1, h2, h3 "
        "over tcp without CURVE keys; pass --insecure to run it in plaintext on a trusted network"
    ]


@pytest.mark.slurm
def test_three_hosts_example_over_slurm(slurm: Any, farm: NamespaceFarm, tmp_path: Path) -> None:
    """One agent per node through srun: same counts, each device on its node."""
    hosts = farm.write_hosts_file(tmp_path / "hosts.toml")
    out = tmp_path / "stats"
    env = {**os.environ, **slurm.env}
    proc = evflow(
        env, "up", str(EXAMPLES / "three_hosts.toml"), "--launcher", "slurm", "--hosts",
        str(hosts), "--stats-dir", str(out), "--quiet", "--insecure",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert {k: v["host"] for k, v in found.items()} == {
        "sampler_0": "h1",
        "sampler_1": "h2",
        "sampler_2": "h3",
        "merger": "h2",
        "sink": "h3",
    }
    sink = found["sink"]["sink"]
    assert sink["received"] == sink["announced"] == 30000

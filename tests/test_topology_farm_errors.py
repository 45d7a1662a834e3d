"""``evflow up`` across hosts: Slurm, and bad input that must be one clear error.

Without keys a topology that spans hosts does not start (unless ``--insecure``, with a
warning); a secret key others can read, an unreachable ssh host and a Slurm without a
free node are each one error naming the file or host and the fix. The 3-host example
runs under Slurm with the counts of the local run, each device on its node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from farm_hosts import NamespaceFarm
from farm_slurm import SlurmCluster
from test_launch_slurm import _block
from test_topology_farm import (
    PLACED,
    THREE,
    assert_clean,
    errors_of,
    evflow,
    make_keys,
    running_forever,
)
from test_topology_up import alive, check_delivery, stats

REMOTE_HOSTS = "[hosts]\n" + "".join(
    f'h{i} = {{ address = "10.254.9.{i}", ssh = "root@10.254.9.{i}" }}\n' for i in (1, 2, 3)
)


class _NoFarm:
    """evflow() without namespace hosts (the checks fail before any host is reached)."""

    hosts = ("h1", "h2", "h3")

    def ssh_env(self) -> dict[str, str]:
        return {}


def test_spanning_hosts_without_keys_is_one_error_naming_the_fix(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(REMOTE_HOSTS)
    proc = evflow(_NoFarm(), "up", str(THREE), "--hosts", str(hosts), "--launcher", "ssh")  # type: ignore[arg-type]
    assert proc.returncode == 1
    assert errors_of(proc.stderr) == [
        "evflow: error: topology 'three-hosts' spans hosts h1, h2, h3 (launcher ssh) but no "
        "CURVE keys are configured, so every tcp socket would be plaintext: make keys with "
        "'evflow keys DIR --names controller h1 h2 h3' and pass '--keys DIR' (or set "
        "EVFLOW_CURVE_KEYS=DIR), or accept plaintext with --insecure"
    ], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["controller", "h2"])
def test_a_secret_key_others_can_read_is_one_error_naming_file_and_fix(
    tmp_path: Path, name: str
) -> None:
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(REMOTE_HOSTS)
    keys = make_keys(_NoFarm(), tmp_path / "keys")  # type: ignore[arg-type]
    secret = keys / f"{name}.key_secret"
    secret.chmod(0o644)
    proc = evflow(
        _NoFarm(), "up", str(THREE), "--hosts", str(hosts), "--launcher", "ssh",  # type: ignore[arg-type]
        "--keys", str(keys),
    )  # fmt: skip
    assert proc.returncode == 1
    assert errors_of(proc.stderr) == [
        f"evflow: error: secret key file '{secret}' is accessible by other users (mode 0644); "
        f"fix: chmod 600 {secret}"
    ], proc.stderr


def test_missing_controller_key_names_the_command_that_makes_it(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(REMOTE_HOSTS)
    keys = tmp_path / "keys"
    made = evflow(_NoFarm(), "keys", str(keys), "--names", "h1", "h2", "h3")  # type: ignore[arg-type]
    assert made.returncode == 0, made.stderr
    env_keys = {"EVFLOW_CURVE_KEYS": str(keys)}
    proc = subprocess.run(
        [sys.executable, "-m", "evflow", "up", str(THREE), "--hosts", str(hosts),
         "--launcher", "ssh"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, **env_keys),
    )  # fmt: skip
    assert proc.returncode == 1
    errors = errors_of(proc.stderr)
    assert len(errors) == 1, proc.stderr
    assert f"'{keys}/controller.key_secret' is missing" in errors[0]
    assert f"evflow keys {keys} --names controller h1 h2 h3" in errors[0]


@pytest.mark.netns
def test_unreachable_ssh_host_is_one_error_with_ssh_s_own_line(
    farm: NamespaceFarm, tmp_path: Path
) -> None:
    hosts = tmp_path / "hosts.toml"
    text = farm.hosts_toml()
    h2 = farm.hosts["h2"].address
    hosts.write_text(text.replace(f'ssh = "root@{h2}"', f'ssh = "ssh://root@{h2}:2222"'))
    proc = evflow(
        farm, "up", str(THREE), "--hosts", str(hosts), "--launcher", "ssh", "--insecure",
        "--quiet",
    )  # fmt: skip
    assert proc.returncode == 1
    errors = errors_of(proc.stderr)
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith(f"evflow: error: host 'h2': ssh ssh://root@{h2}:2222 failed:")
    assert f"connect to host {h2} port 2222: Connection refused" in errors[0]
    assert "Traceback" not in proc.stderr
    assert_clean(farm)


@pytest.mark.slurm
def test_three_hosts_under_slurm_status_and_down(
    farm: NamespaceFarm, slurm: SlurmCluster, tmp_path: Path
) -> None:
    hosts = farm.write_hosts_file(tmp_path / "hosts.toml")
    out = tmp_path / "stats"
    session = "farmslurm"
    up = evflow(
        farm, "up", str(running_forever(tmp_path)), "--hosts", str(hosts), "--launcher", "slurm",
        "--insecure", "--session", session, "--detach", "--stats-dir", str(out),
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert "--insecure: topology 'three-hosts' spans hosts h1, h2, h3 with plaintext" in up.stderr
    pid = 0
    try:
        status = evflow(farm, "status", "--session", session, "--json")
        assert status.returncode == 0, status.stderr
        data = json.loads(status.stdout)
        pid = data["pid"]
        rows = {d["id"]: d for d in data["devices"]}
        assert {k: (v["host"], v["state"]) for k, v in rows.items()} == {
            k: (h, "RUNNING") for k, h in PLACED.items()
        }
        for dev, host in PLACED.items():
            inode = os.stat(f"/proc/{rows[dev]['pid']}/ns/net").st_ino
            assert inode == farm.hosts[host].netns_inode(), f"{dev} is not on {host}"
        jobs = subprocess.run(["squeue", "-h", "-o", "%N %j"], capture_output=True, text=True)
        assert sorted(jobs.stdout.split("\n")[:3]) == [f"h{i} evflow-h{i}" for i in (1, 2, 3)]
        down = evflow(farm, "down", "--session", session)
        assert down.returncode == 0, down.stderr
        deadline = time.monotonic() + 60
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), "the controller outlived down"
    finally:
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)
    check_delivery(stats(out), 3)
    assert_clean(farm)


@pytest.mark.slurm
def test_slurm_without_a_free_node_is_one_error_not_a_hang(
    farm: NamespaceFarm, slurm: SlurmCluster, tmp_path: Path
) -> None:
    hosts = farm.write_hosts_file(tmp_path / "hosts.toml")
    job = _block("h3")
    try:
        # not a hang: the blocking job runs for 600 s, and evflow() fails a run still
        # going after 60 s
        proc = evflow(
            farm, "up", str(THREE), "--hosts", str(hosts), "--launcher", "slurm", "--insecure",
            "--quiet",
        )  # fmt: skip
    finally:
        subprocess.run(["scancel", job], check=False)
    assert proc.returncode == 1
    errors = errors_of(proc.stderr)
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("evflow: error: host 'h3': srun on node 'h3' failed:")
    assert "no free Slurm node 'h3' within 5 s (--immediate); try later" in errors[0]
    assert_clean(farm)

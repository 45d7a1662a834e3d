"""The test farm itself: hosts are separate network namespaces reachable over real TCP
and ssh, the controller's root namespace is reachable from them, and the host-loss
helpers (kill_host, cut_link, revive) do what later tests rely on."""

from __future__ import annotations

import socket
import subprocess

import pytest

from farm_hosts import NamespaceFarm
from farm_slurm import SlurmCluster

pytestmark = [pytest.mark.netns, pytest.mark.sshd]


def test_hosts_are_separate_namespaces_reachable_over_ssh(farm: NamespaceFarm) -> None:
    inodes = {name: h.netns_inode() for name, h in farm.hosts.items()}
    assert len(set(inodes.values())) == len(farm.hosts) == 3
    for name, host in farm.hosts.items():
        out = farm.ssh(name, "readlink /proc/self/ns/net")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"net:[{inodes[name]}]"
        assert host.daemons["sshd"] in farm.pids(name)
    toml = farm.hosts_toml()
    assert all(f'address = "{h.address}"' in toml for h in farm.hosts.values())


def test_controller_is_reachable_from_a_host(farm: NamespaceFarm) -> None:
    with socket.socket() as server:
        server.bind((farm.controller_address, 0))
        server.listen()
        port = server.getsockname()[1]
        out = farm.ssh(
            "h2",
            f"python3 -c \"import socket; socket.create_connection(('{farm.controller_address}',"
            f" {port}), timeout=5).sendall(b'from h2')\"",
        )
        assert out.returncode == 0, out.stderr
        conn, (peer, _) = server.accept()
        with conn:
            assert conn.recv(16) == b"from h2"
        assert peer == farm.hosts["h2"].address


def test_popen_runs_a_process_inside_a_host(farm: NamespaceFarm) -> None:
    proc = farm.popen("h3", ["readlink", "/proc/self/ns/net"], stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=10)
    assert out.decode().strip() == f"net:[{farm.hosts['h3'].netns_inode()}]"


def test_cut_link_takes_a_host_off_the_network(farm: NamespaceFarm) -> None:
    farm.cut_link("h3")
    with pytest.raises(OSError):
        socket.create_connection((farm.hosts["h3"].address, 22), timeout=1).close()
    farm.restore_link("h3")
    assert farm.ssh("h3", "true").returncode == 0


def test_kill_host_kills_everything_and_revive_restores_it(farm: NamespaceFarm) -> None:
    sleeper = farm.ssh("h1", "setsid sleep 600 >/dev/null 2>&1 < /dev/null & echo started")
    assert sleeper.stdout.strip() == "started"
    assert farm.leftovers("h1", timeout_s=0)  # the sleep
    victims = farm.kill_host("h1")
    assert farm.hosts["h1"].daemons["sshd"] in victims
    assert farm.leftovers("h1") == [] and farm.pids("h1") == []
    assert farm.ssh("h1", "true", timeout_s=10).returncode == 255  # no sshd: host lost
    farm.revive()
    assert farm.ssh("h1", "true").returncode == 0


@pytest.mark.slurm
def test_revive_restarts_a_killed_slurmd(farm: NamespaceFarm, slurm: SlurmCluster) -> None:
    farm.kill_host("h2")
    farm.revive()  # restarts sshd and slurmd, waits for every node idle
    assert slurm.node_states()["h2"] == "idle"
    out = subprocess.run(
        ["srun", "--nodelist=h2", "-N1", "-n1", "--immediate=5", "readlink", "/proc/self/ns/net"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.stdout.strip() == f"net:[{farm.hosts['h2'].netns_inode()}]", out.stderr

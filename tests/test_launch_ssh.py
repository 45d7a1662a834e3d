"""The ssh launcher on real namespace hosts running sshd: where the command runs, how it
ends (terminate, controller SIGKILL, lost link), and one clear error per failure."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import psutil
import pytest

from _wait import wait_until
from evflow.errors import ConfigurationError
from evflow.topology.launch import get_launcher
from evflow.topology.launch.ssh import SshLauncher
from farm_hosts import NamespaceFarm, probe_argv, probe_env, read_json_line

pytestmark = [pytest.mark.netns, pytest.mark.sshd]


def launcher(farm: NamespaceFarm) -> SshLauncher:
    return SshLauncher(ssh_config=str(farm.ssh_config))


def test_get_launcher_finds_ssh() -> None:
    assert isinstance(get_launcher("ssh"), SshLauncher)


def test_command_runs_on_each_host_in_its_namespace(farm: NamespaceFarm) -> None:
    ssh = launcher(farm)
    specs = farm.host_specs()
    handles = {
        name: ssh.start_command(
            spec, probe_argv(), probe_env(PROBE_MARKER=name), capture_stdout=True
        )
        for name, spec in specs.items()
    }
    try:
        for name, handle in handles.items():
            report = read_json_line(handle.stdout)
            assert report["netns"] == farm.hosts[name].netns_inode()
            assert farm.hosts[name].address in report["addresses"]
            assert report["marker"] == name  # env reaches the remote command
            assert report["pid"] == handle.remote_pid
            assert report["pid"] in farm.pids(name)
            assert handle.poll() is None
    finally:
        for handle in handles.values():
            handle.terminate(1.0)
    for name, handle in handles.items():
        assert handle.poll() is not None
        assert farm.leftovers(name) == []


def test_terminate_ends_descendants_that_escape_and_ignore_sigterm(farm: NamespaceFarm) -> None:
    handle = launcher(farm).start_command(
        farm.host_specs()["h1"], probe_argv(sys.executable, "--children", "3"), probe_env(),
        capture_stdout=True,
    )  # fmt: skip
    try:
        read_json_line(handle.stdout)
        # the probe and 3 orphaned grandchildren (plus the guard) live on h1
        assert len(farm.leftovers("h1", timeout_s=0)) >= 5
    finally:
        handle.terminate(0.3)
    assert farm.leftovers("h1") == []


def test_controller_sigkill_leaves_nothing_on_the_host(farm: NamespaceFarm, tmp_path) -> None:
    """A controller process starts the command over ssh and is SIGKILLed: its ssh
    client loses its stdin, the connection ends, and the guard ends the command."""
    script = (
        "import sys, time\n"
        "from farm_hosts import probe_argv, probe_env\n"
        "from evflow.transport.hosts import HostSpec\n"
        "from evflow.topology.launch.ssh import SshLauncher\n"
        f"host = HostSpec(name='h2', address={farm.hosts['h2'].address!r}, "
        f"ssh='root@{farm.hosts['h2'].address}')\n"
        f"h = SshLauncher(ssh_config={str(farm.ssh_config)!r}).start_command(\n"
        "    host, probe_argv(sys.executable, '--children', '2'), probe_env())\n"
        "print(h.process.pid, h.remote_pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    controller = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, env={**os.environ, **probe_env()}
    )
    try:
        line = controller.stdout.readline().split()  # type: ignore[union-attr]
        ssh_pid, remote_pid = int(line[0]), int(line[1])
        assert remote_pid in farm.pids("h2")
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait()
        controller.stdout.close()  # type: ignore[union-attr]
    assert farm.leftovers("h2") == []

    # the orphaned ssh client ends too once the remote side is gone
    def ended() -> bool:
        try:
            return psutil.Process(ssh_pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(ended, 30, "the orphaned ssh client to end")


def test_exit_code_of_the_command_reaches_poll(farm: NamespaceFarm) -> None:
    handle = launcher(farm).start_command(
        farm.host_specs()["h3"], probe_argv(sys.executable, "--exit", "3"), probe_env()
    )
    try:
        assert handle.wait(20) == 3
    finally:
        handle.terminate(0.5)
    assert farm.leftovers("h3") == []


def test_lost_link_ends_the_client_and_the_remote_command(farm: NamespaceFarm) -> None:
    handle = launcher(farm).start_command(farm.host_specs()["h3"], probe_argv(), probe_env())
    try:
        farm.cut_link("h3")
        # ServerAliveInterval=1 x 3: the client notices and ends; the controller sees it
        assert handle.wait(15) == 255
        # sshd notices the dead client the same way and the guard sweeps the command
        assert farm.leftovers("h3", timeout_s=10) == []
    finally:
        handle.terminate(0.5)


def test_unreachable_host_is_one_error_with_ssh_s_own_line(farm: NamespaceFarm) -> None:
    spec = dataclasses.replace(
        farm.host_specs()["h1"], ssh=f"ssh://root@{farm.hosts['h1'].address}:2"
    )
    with pytest.raises(ConfigurationError) as err:
        launcher(farm).start_command(spec, probe_argv(), probe_env())
    text = str(err.value)
    assert "'h1'" in text and "Connection refused" in text


def test_wrong_key_is_one_error_naming_the_host(farm: NamespaceFarm, tmp_path) -> None:
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    ssh = SshLauncher(identity_file=str(key))  # not the farm's config: only this key
    with pytest.raises(ConfigurationError) as err:
        ssh.start_command(farm.host_specs()["h2"], probe_argv(), probe_env())
    assert "'h2'" in str(err.value) and "Permission denied" in str(err.value)


def test_missing_python_on_the_host_is_one_error(farm: NamespaceFarm) -> None:
    spec = dataclasses.replace(farm.host_specs()["h1"], python="/nonexistent/bin/python")
    with pytest.raises(ConfigurationError) as err:
        launcher(farm).start_agent(spec, ["--session", "x"])
    assert "'h1'" in str(err.value) and "/nonexistent/bin/python" in str(err.value)

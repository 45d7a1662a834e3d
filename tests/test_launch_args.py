"""What the ssh and Slurm launchers ask their clients for (no hosts needed)."""

from __future__ import annotations

import shlex

import pytest

from evflow.errors import ConfigurationError
from evflow.topology.launch._process import guarded
from evflow.topology.launch.ssh import SshLauncher
from evflow.transport.hosts import HostSpec


def test_ssh_argv_is_batch_mode_with_a_bounded_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EVFLOW_SSH_CONFIG", raising=False)
    monkeypatch.setenv("EVFLOW_SSH_IDENTITY", "/keys/id")
    argv = SshLauncher().ssh_argv(HostSpec(name="h1", address="10.0.0.1", ssh="root@10.0.0.1"))
    text = " ".join(argv)
    for option in ("BatchMode=yes", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null",
                   "ConnectTimeout=5", "ServerAliveInterval=1"):  # fmt: skip
        assert f"-o {option}" in text
    assert "-i /keys/id" in text and "-T" in argv and argv[-1] == "root@10.0.0.1"


def test_host_without_ssh_destination_is_one_error() -> None:
    with pytest.raises(ConfigurationError, match="host 'h1' has no ssh destination"):
        SshLauncher().ssh_argv(HostSpec(name="h1", address="10.0.0.1"))


def test_guarded_command_quotes_env_and_arguments() -> None:
    argv = guarded("/py", ["/py", "-m", "evflow", "agent", "a b"], {"K": "v w"})
    assert argv[:2] == ["env", "K=v w"]
    assert argv[2:7] == ["/py", "-m", "evflow.topology.launch._guard", "--", "/py"]
    assert shlex.split(shlex.join(argv)) == argv  # survives the remote shell intact

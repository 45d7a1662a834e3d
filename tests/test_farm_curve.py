"""CURVE between namespace hosts: devices started over ssh exchange an exact count with
keys; a device on a third host with a key not in the allow-list is refused, and the
receiving device's log names that host's address."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from evflow.topology.launch.ssh import SshLauncher
from evflow.transport.curve import create_keys
from farm_hosts import NamespaceFarm

pytestmark = [pytest.mark.netns, pytest.mark.sshd]

PORT, ACK_PORT = 47011, 47012  # the namespaces are ours alone: fixed ports are free there


def _device(cls: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "evflow", "device", cls, "--severity", "info", *args]


def _wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_curve_across_hosts_counts_and_refuses_a_stranger(
    farm: NamespaceFarm, tmp_path: Path, _runtime_dir: Path
) -> None:
    keys, other = tmp_path / "keys", tmp_path / "other"
    create_keys(keys, ["h1", "h2"])
    create_keys(other, ["h3"])
    h1, h2, h3 = (farm.hosts[n].address for n in ("h1", "h2", "h3"))
    server = f"curve=server,curveSecretKey={keys}/h2.key_secret,curveAllow={keys}"

    def client(secret: Path) -> str:
        return f"curve=client,curveSecretKey={secret},curveServerKey={keys}/h2.key"

    n = 2000
    ssh = SshLauncher(ssh_config=str(farm.ssh_config))
    specs = farm.host_specs()
    env = {"EVFLOW_RUNTIME_DIR": str(_runtime_dir)}
    sink = ssh.start_command(specs["h2"], _device(
        "sink", "--id", "sink", "--stats-file", str(tmp_path / "sink.json"),
        "--channel-config", f"name=data,type=pull,method=bind,address=tcp://{h2}:{PORT},{server}",
        "--channel-config",
        f"name=data-ack,type=push,method=bind,address=tcp://{h2}:{ACK_PORT},{server}",
    ), env)  # fmt: skip
    stranger = ssh.start_command(specs["h3"], _device(
        "sampler", "--id", "stranger", "--max-iterations", "10", "--ack-timeout-s", "30",
        "--channel-config",
        f"name=data,type=push,method=connect,address=tcp://{h2}:{PORT},"
        f"{client(other / 'h3.key_secret')}",
        "--channel-config",
        f"name=data-ack,type=pull,method=connect,address=tcp://{h2}:{ACK_PORT},"
        f"{client(other / 'h3.key_secret')}",
    ), env)  # fmt: skip
    sampler = None
    try:
        _wait_for(lambda: f"CURVE refused peer {h3}" in sink.error_output(), 30,
                  f"the sink never logged the refusal of {h3}: {sink.error_output()}")  # fmt: skip
        sampler = ssh.start_command(specs["h1"], _device(
            "sampler", "--id", "sampler", "--max-iterations", str(n), "--msg-size", "1000",
            "--channel-config",
            f"name=data,type=push,method=connect,address=tcp://{h2}:{PORT},"
            f"{client(keys / 'h1.key_secret')}",
            "--channel-config",
            f"name=data-ack,type=pull,method=connect,address=tcp://{h2}:{ACK_PORT},"
            f"{client(keys / 'h1.key_secret')}",
        ), env)  # fmt: skip
        assert sampler.wait(60) == 0, sampler.error_output()
        assert sink.wait(60) == 0, sink.error_output()
        stats = json.loads((tmp_path / "sink.json").read_text())["sink"]
        assert stats["received"] == stats["announced"] == n  # nothing from the stranger
        refusals = [ln for ln in sink.error_output().splitlines() if "CURVE refused" in ln]
        # logged once per channel the stranger tried, naming h3's address and key
        assert len(refusals) == 2, refusals
        assert "channel data[0]:" in refusals[0] + refusals[1]
        assert "channel data-ack[0]:" in refusals[0] + refusals[1]
        assert all(f"peer {h3}" in r and "not in the allow-list" in r for r in refusals)
        assert h1 not in " ".join(refusals)
        # the stranger is still waiting for an ACK that cannot come, and its own log
        # says why: it was refused
        assert stranger.poll() is None
        _wait_for(lambda: "refused by ZAP" in stranger.error_output(), 10,
                  f"the stranger never logged its refusal: {stranger.error_output()}")  # fmt: skip
    finally:
        for handle in (stranger, sampler, sink):
            if handle is not None:
                handle.terminate(0.5)
    assert not os.listdir(_runtime_dir)


def test_farm_keys_from_the_environment_secure_every_tcp_channel(
    farm: NamespaceFarm, tmp_path: Path, _runtime_dir: Path
) -> None:
    """No curve=... in any channel: EVFLOW_CURVE_KEYS/HOST/HOSTS_FILE make the sink a
    CURVE server and the sampler its client; a plaintext sender (curve=none) is refused."""
    keys = tmp_path / "keys"
    create_keys(keys, ["h1", "h2", "h3"])
    hosts_file = farm.write_hosts_file(tmp_path / "hosts.toml")
    h2 = farm.hosts["h2"].address
    ssh = SshLauncher(ssh_config=str(farm.ssh_config))
    specs = farm.host_specs()

    def env(host: str) -> dict[str, str]:
        return {"EVFLOW_RUNTIME_DIR": str(_runtime_dir), "EVFLOW_CURVE_KEYS": str(keys),
                "EVFLOW_HOST": host, "EVFLOW_HOSTS_FILE": str(hosts_file)}  # fmt: skip

    n = 1000
    data = f"tcp://{h2}:{PORT}"
    ack = f"tcp://{h2}:{ACK_PORT}"
    sink = ssh.start_command(specs["h2"], _device(
        "sink", "--id", "sink", "--stats-file", str(tmp_path / "sink.json"),
        "--channel-config", f"name=data,type=pull,method=bind,address={data}",
        "--channel-config", f"name=data-ack,type=push,method=bind,address={ack}",
    ), env("h2"))  # fmt: skip
    plain = sampler = None
    try:
        plain = ssh.start_command(specs["h3"], _device(
            "sampler", "--id", "plain", "--max-iterations", "10", "--ack-timeout-s", "30",
            "--channel-config", f"name=data,type=push,method=connect,address={data},curve=none",
        ), env("h3"))  # fmt: skip
        _wait_for(lambda: "CURVE refused peer" in sink.error_output(), 30,
                  "the sink never refused the plaintext sender")  # fmt: skip
        sampler = ssh.start_command(specs["h1"], _device(
            "sampler", "--id", "sampler", "--max-iterations", str(n), "--msg-size", "100",
            "--channel-config", f"name=data,type=push,method=connect,address={data}",
            "--channel-config", f"name=data-ack,type=pull,method=connect,address={ack}",
        ), env("h1"))  # fmt: skip
        assert sampler.wait(60) == 0, sampler.error_output()
        assert sink.wait(60) == 0, sink.error_output()
        stats = json.loads((tmp_path / "sink.json").read_text())["sink"]
        assert stats["received"] == stats["announced"] == n
        assert "handshake failed" in sink.error_output()
    finally:
        for handle in (plain, sampler, sink):
            if handle is not None:
                handle.terminate(0.5)

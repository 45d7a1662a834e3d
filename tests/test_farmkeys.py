"""Farm-wide CURVE from EVFLOW_CURVE_KEYS / EVFLOW_HOST / EVFLOW_HOSTS_FILE: every tcp
channel without curve=... becomes a server (bind) or a client of the host it connects
to; curve=none opts out; ipc is left alone; bad set-ups are one clear error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from evflow.errors import ConfigurationError
from evflow.transport.channel import Channel, parse_channel_config
from evflow.transport.curve import create_keys
from evflow.transport.opening import open_channel


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def farm_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    create_keys(tmp_path / "keys", ["h1", "h2"])
    hosts = tmp_path / "hosts.toml"
    hosts.write_text('[hosts]\nh1 = { address = "10.9.0.1" }\nh2 = { address = "10.9.0.2" }\n')
    monkeypatch.setenv("EVFLOW_CURVE_KEYS", str(tmp_path / "keys"))
    monkeypatch.setenv("EVFLOW_HOST", "h1")
    monkeypatch.setenv("EVFLOW_HOSTS_FILE", str(hosts))
    return tmp_path


def _open(ctx: zmq.Context[Any], text: str) -> Channel:
    return open_channel(ctx, parse_channel_config(text)[0], "s")


def test_tcp_channels_get_curve_and_talk(ctx: zmq.Context[Any], farm_env: Path) -> None:
    server = _open(ctx, "name=data,type=pull,method=bind,address=tcp://127.0.0.1:0")
    client = _open(ctx, f"name=data,type=push,method=connect,address={server.endpoints[0]},"
                        "linger=0")  # fmt: skip
    try:
        assert server.security is not None and server.security.options.role == "server"
        assert client.security is not None and client.security.options.role == "client"
        assert client.security.options.server_key.endswith("h1.key")  # loopback: this host
        client.send([b"sealed"])
        assert server.poll(5000) and bytes(server.recv()[0]) == b"sealed"
    finally:
        client.close()
        server.close()


def test_curve_none_opts_out_and_is_refused_by_a_farm_socket(
    ctx: zmq.Context[Any], farm_env: Path
) -> None:
    server = _open(ctx, "name=data,type=pull,method=bind,address=tcp://127.0.0.1:0")
    plain = _open(ctx, f"name=data,type=push,method=connect,address={server.endpoints[0]},"
                       "linger=0,curve=none")  # fmt: skip
    try:
        assert plain.security is None
        plain.send([b"in clear"])
        assert not server.poll(500)
    finally:
        plain.close()
        server.close()


def test_ipc_channels_are_left_alone(ctx: zmq.Context[Any], farm_env: Path) -> None:
    ch = _open(ctx, "name=data,type=pull,method=bind,address=ipc://farmkeys-test")
    try:
        assert ch.security is None
    finally:
        ch.close()


def test_connecting_to_a_host_outside_the_hosts_file_is_one_error(
    ctx: zmq.Context[Any], farm_env: Path
) -> None:
    with pytest.raises(ConfigurationError, match=r"connects to 10\.9\.9\.9, which is no host"):
        _open(ctx, "name=data,type=push,method=connect,address=tcp://10.9.9.9:5555")
    with pytest.raises(ConfigurationError, match="both binds and connects"):
        _open(ctx, "name=d,type=pair,address=@tcp://127.0.0.1:0;>tcp://10.9.0.2:5")


def test_client_of_another_host_uses_that_host_s_key(ctx: zmq.Context[Any], farm_env: Path) -> None:
    ch = _open(ctx, "name=data,type=push,method=connect,address=tcp://10.9.0.2:5555,linger=0")
    try:
        assert ch.security is not None
        assert ch.security.options.server_key.endswith("h2.key")
        assert ch.security.options.secret_key.endswith("h1.key_secret")
    finally:
        ch.close()


def test_incomplete_environment_is_one_error(
    ctx: zmq.Context[Any], farm_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EVFLOW_HOST")
    with pytest.raises(ConfigurationError, match="EVFLOW_HOST and EVFLOW_HOSTS_FILE"):
        _open(ctx, "name=data,type=pull,method=bind,address=tcp://127.0.0.1:0")
    monkeypatch.setenv("EVFLOW_HOST", "h7")
    with pytest.raises(ConfigurationError, match="'h7' is not a host"):
        _open(ctx, "name=data,type=pull,method=bind,address=tcp://127.0.0.1:0")


def test_a_controller_on_a_farm_host_uses_that_hosts_key() -> None:
    """One address, one key pair: the controller at h1's address is found as h1 by
    every peer, so it must serve with h1's pair (issue 23: every socket was refused)."""
    from evflow.transport.farmkeys import key_names

    hosts = {"h1": "10.9.0.1", "h2": "10.9.0.2"}
    me, by_address = key_names(hosts, ["10.9.0.1"])
    assert me == "h1" and by_address == {"10.9.0.1": "h1", "10.9.0.2": "h2"}
    me, by_address = key_names(hosts, ["10.9.0.254"])
    assert me == "controller" and by_address["10.9.0.254"] == "controller"

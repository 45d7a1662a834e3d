"""CURVE on tcp channels: keys with safe permissions, allowed clients get through, a
wrong or missing key is refused and the refusal logged once with the peer's address."""

from __future__ import annotations

import logging
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from _wait import wait_until
from evflow.errors import ConfigurationError
from evflow.transport import curve
from evflow.transport.channel import (
    Channel,
    config_from_mapping,
    parse_channel_config,
)
from evflow.transport.curve import create_keys
from evflow.transport.opening import open_channel


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    create_keys(tmp_path / "keys", ["server", "client"])
    create_keys(tmp_path / "other", ["stranger"])
    return tmp_path


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _server(ctx: zmq.Context[Any], keys: Path) -> Channel:
    k = keys / "keys"
    cfg = parse_channel_config(
        f"name=data,type=pull,method=bind,address=tcp://127.0.0.1:0,curve=server,"
        f"curveSecretKey={k}/server.key_secret,curveAllow={k}"
    )[0]
    return open_channel(ctx, cfg, "s")


def _client(ctx: zmq.Context[Any], address: str, secret: Path, server_key: Path) -> Channel:
    cfg = parse_channel_config(
        f"name=data,type=push,method=connect,address={address},curve=client,"
        f"curveSecretKey={secret},curveServerKey={server_key},linger=0"
    )[0]
    return open_channel(ctx, cfg, "s")


def _wait_refusals(ch: Channel, n: int, timeout_s: float = 30) -> None:
    assert ch.security is not None
    deadline = time.monotonic() + timeout_s
    while ch.security.refusals < n:
        assert time.monotonic() < deadline, f"only {ch.security.refusals} refusals"
        time.sleep(0.02)


def test_keys_command_writes_pairs_with_safe_modes(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "evflow", "keys", str(tmp_path / "k"), "--names", "h1", "h2"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "h1.key" in out.stdout
    for name in ("h1", "h2"):
        assert stat.S_IMODE((tmp_path / "k" / f"{name}.key_secret").stat().st_mode) == 0o600
        public, _secret = curve.load_secret_key(tmp_path / "k" / f"{name}.key_secret")
        assert curve.load_public_key(tmp_path / "k" / f"{name}.key") == public
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    again = subprocess.run(
        [sys.executable, "-m", "evflow", "keys", str(tmp_path / "k"), "--names", "h1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert again.returncode == 1
    assert "h1.key_secret exists already" in again.stderr and "Traceback" not in again.stderr


def test_allowed_client_gets_through(ctx: zmq.Context[Any], keys: Path) -> None:
    server = _server(ctx, keys)
    client = _client(ctx, server.endpoints[0], keys / "keys/client.key_secret",
                     keys / "keys/server.key")  # fmt: skip
    try:
        for i in range(100):
            client.send([b"x%d" % i])
        got = []
        while len(got) < 100:
            assert server.poll(5000), f"only {len(got)} of 100 arrived"
            got.append(bytes(server.recv()[0]))
        assert got == [b"x%d" % i for i in range(100)]
        assert server.security is not None and server.security.refusals == 0
    finally:
        client.close()
        server.close()


def test_wrong_client_key_is_refused_and_logged_once(
    ctx: zmq.Context[Any], keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "evflow.curve")
    server = _server(ctx, keys)
    client = _client(ctx, server.endpoints[0], keys / "other/stranger.key_secret",
                     keys / "keys/server.key")  # fmt: skip
    try:
        client.send([b"secret data"])
        _wait_refusals(server, 1)
        assert not server.poll(300)
        stranger, _ = curve.load_secret_key(keys / "other/stranger.key_secret")
        messages = [r.getMessage() for r in caplog.records]
        # the server names the peer and its key, once; the client learns it was refused
        on_server = [m for m in messages if "not in the allow-list" in m]
        assert len(on_server) == 1, messages
        assert "peer 127.0.0.1" in on_server[0] and stranger.decode() in on_server[0]
        assert any("refused by ZAP" in m and server.endpoints[0] in m for m in messages)
    finally:
        client.close()
        server.close()


def test_plaintext_client_gets_nothing_and_is_logged(
    ctx: zmq.Context[Any], keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "evflow.curve")
    server = _server(ctx, keys)
    plain = ctx.socket(zmq.DEALER)  # no CURVE at all: a peer without a key
    plain.linger = 0
    plain.connect(server.endpoints[0])
    try:
        plain.send(b"hello?")
        _wait_refusals(server, 1)
        assert not server.poll(200)
        # the server never answers a plaintext peer (nothing reaches the application)
        assert not plain.poll(200)
        records = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(records) == 1, records
        assert "handshake failed" in records[0]
        # the address is read from the accepted socket by the monitor thread; on a
        # loaded machine libzmq may close it first, and the line says so instead
        assert "127.0.0.1:" in records[0] or "address unknown" in records[0]
    finally:
        plain.close()
        server.close()


def test_a_handshake_cut_short_is_a_refusal_until_the_run_winds_down(
    ctx: zmq.Context[Any], keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that closes in the middle of the handshake is a refusal (a plaintext
    peer seeing the mismatch first does that, once); once the run is ending it is a
    process leaving with it, an INFO line (it was 'CURVE refused' on a good farm run)."""
    caplog.set_level(logging.INFO, "evflow.curve")
    server = _server(ctx, keys)
    security = server.security
    assert security is not None
    host, port = server.endpoints[0].removeprefix("tcp://").rsplit(":", 1)

    def connect_and_leave() -> None:
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"\xff" + bytes(8) + b"\x7f")  # the start of a ZMTP greeting

    def lines(word: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if word in r.getMessage()]

    try:
        connect_and_leave()
        _wait_refusals(server, 1)
        assert len(lines("refused")) == 1 and "handshake failed" in lines("refused")[0]
        security.winding_down()
        connect_and_leave()
        wait_until(lambda: lines("left during the CURVE handshake"), 30, "the INFO line")
        assert security.refusals == 1 and len(lines("refused")) == 1
    finally:
        server.close()


def test_client_with_wrong_server_key_logs_its_refusal(
    ctx: zmq.Context[Any], keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "evflow.curve")
    server = _server(ctx, keys)
    client = _client(ctx, server.endpoints[0], keys / "keys/client.key_secret",
                     keys / "other/stranger.key")  # fmt: skip
    try:
        client.send([b"data"])
        _wait_refusals(server, 1)
        assert not server.poll(300)
        messages = [r.getMessage() for r in caplog.records]
        assert any("127.0.0.1:" in m and "handshake failed" in m for m in messages), messages
    finally:
        client.close()
        server.close()


def test_secret_key_readable_by_others_is_one_clear_error(
    ctx: zmq.Context[Any], keys: Path
) -> None:
    secret = keys / "keys/server.key_secret"
    secret.chmod(0o644)
    with pytest.raises(ConfigurationError) as err:
        _server(ctx, keys)
    assert str(secret) in str(err.value) and f"chmod 600 {secret}" in str(err.value)


def test_missing_or_wrong_key_files_are_one_error(ctx: zmq.Context[Any], keys: Path) -> None:
    with pytest.raises(ConfigurationError, match="does not exist"):
        _client(ctx, "tcp://127.0.0.1:5", keys / "nope.key_secret", keys / "keys/server.key")
    with pytest.raises(ConfigurationError, match="holds no secret key"):
        (keys / "keys/server.key").chmod(0o600)
        _client(ctx, "tcp://127.0.0.1:5", keys / "keys/server.key", keys / "keys/server.key")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("curve=maybe", "bad curve 'maybe'"),
        ("curve=client,curveSecretKey=a.key_secret", "needs curveServerKey"),
        ("curve=server", "needs curveSecretKey"),
        ("curveAllow=keys", "without curve=server|client"),
    ],
)
def test_bad_curve_options_are_one_error(options: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        parse_channel_config(f"name=d,type=pull,method=bind,address=tcp://*:0,{options}")


def test_curve_is_refused_when_libzmq_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zmq, "has", lambda what: what != "curve")
    with pytest.raises(ConfigurationError, match="built without CURVE"):
        parse_channel_config(
            "name=d,type=pull,method=bind,address=tcp://*:0,curve=server,curveSecretKey=x"
        )
    with pytest.raises(ConfigurationError, match="built without CURVE"):
        create_keys("/nonexistent-never-created", ["a"])


def test_keyring_gives_channel_options_per_host(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    create_keys(tmp_path / "ring", ["h1", "h2"])
    ring = curve.KeyRing(tmp_path / "ring")
    server = config_from_mapping({"name": "data", "type": "pull", "method": "bind",
        "address": "tcp://127.0.0.1:0", **ring.server_options("h2")})  # fmt: skip
    bound = open_channel(ctx, server, "s")
    client = config_from_mapping({"name": "data", "type": "push", "method": "connect",
        "address": bound.endpoints[0], "linger": 0, **ring.client_options("h1", "h2")})  # fmt: skip
    out = open_channel(ctx, client, "s")
    try:
        out.send([b"over curve"])
        assert bound.poll(5000) and bytes(bound.recv()[0]) == b"over curve"
    finally:
        out.close()
        bound.close()
    with pytest.raises(ConfigurationError, match=r"no CURVE key for host 'h3'.*--names h3"):
        ring.server_options("h3")
    with pytest.raises(ConfigurationError, match="does not exist"):
        curve.KeyRing(tmp_path / "nope")


#: a sender's END wait follows its receiver's connection on a CURVE channel, whose one
#: socket monitor is the refusal log's (a second monitor closed the first under its
#: thread: SIGABRT in libzmq's signaler, every farm sampler at its END); run in a child
#: so that an abort fails the test instead of ending the suite
_PEER_WATCH = """
import sys, time
from pathlib import Path
import zmq
from evflow.runtime.devices.stream import PeerWatch
from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel

keys = Path(sys.argv[1])
k = keys / "keys"
ctx = zmq.Context()

def server(port, secret):
    return open_channel(ctx, parse_channel_config(
        f"name=data,type=pull,method=bind,address=tcp://127.0.0.1:{port},curve=server,"
        f"curveSecretKey={secret},curveAllow={k}")[0], "s")

srv = server(0, k / "server.key_secret")
address = srv.endpoints[0]
cli = open_channel(ctx, parse_channel_config(
    f"name=data,type=push,method=connect,address={address},curve=client,"
    f"curveSecretKey={k}/client.key_secret,curveServerKey={k}/server.key,linger=0")[0], "c")
cli.send([b"data"])
assert srv.poll(30_000), "the allowed client got nothing through"
srv.recv()
watch = PeerWatch(cli)
assert watch.connected
srv.close()
deadline = time.monotonic() + 60
while watch.connected:
    assert time.monotonic() < deadline, "the receiver's departure was never seen"
    watch.read()
    time.sleep(0.02)
watch.close()
# the refusal log still runs: a server with another key at that address is refused
stranger = server(address.rsplit(":", 1)[1], keys / "other/stranger.key_secret")
while cli.security.refusals < 1:
    assert time.monotonic() < deadline, "no refusal counted after the END wait"
    time.sleep(0.02)
print("watched")
"""


def test_an_end_wait_on_a_curve_channel_sees_its_receiver_leave_and_keeps_the_refusal_log(
    keys: Path, tmp_path: Path
) -> None:
    script = tmp_path / "peer_watch.py"
    script.write_text(_PEER_WATCH)
    done = subprocess.run([sys.executable, str(script), str(keys)], capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "watched"

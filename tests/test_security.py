"""The connection check of a run's sockets (transport/security.py) and the session
directory's permissions; with a real run: outsiders get nothing acted on, and a
compromised member of the run (holding the secret) still meets validation."""

from __future__ import annotations

import logging
import os
import pickle
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from _hostile import ALL_TYPES, ENDPOINTS, MEMBER_USER, HostileRun, garbage_messages, send
from evflow.errors import ConfigurationError
from evflow.transport.security import (
    CurveAllowList,
    PlainSecret,
    RunAuth,
    ZapHandler,
    ZapRequest,
    workers_only,
)
from evflow.transport.sessions import secure_dir

_OPEN: list[Any] = []  # sockets of the running test, closed by the fixture


@pytest.fixture
def ctx() -> Any:
    context = zmq.Context()
    yield context
    while _OPEN:
        _OPEN.pop().close(linger=0)
    context.term()


def _socket(ctx: Any, kind: int) -> Any:
    s = ctx.socket(kind)
    _OPEN.append(s)
    return s


def _pair(ctx: Any, tmp_path: Path, auth: RunAuth, handler: ZapHandler, user: str, secret: bytes):
    server = _socket(ctx, zmq.PULL)
    auth.server(server, "results")
    server.bind(f"ipc://{tmp_path}/s")
    client = _socket(ctx, zmq.PUSH)
    client.plain_username = user.encode()
    client.plain_password = secret
    client.sndtimeo = 300
    client.connect(f"ipc://{tmp_path}/s")
    return server, client


def _delivered(server: Any, client: Any) -> Any:
    try:
        client.send(b"hello")
    except zmq.Again:
        return None  # no accepted peer to send to
    if not server.poll(500):
        return None
    return server.recv(copy=False)


def test_the_run_secret_lets_a_role_in_and_tags_its_messages(ctx: Any, tmp_path: Path) -> None:
    auth = RunAuth.generate()
    handler = auth.handler(ctx, "test", {"results": workers_only})
    try:
        server, client = _pair(ctx, tmp_path, auth, handler, "worker-3", auth.secret)
        frame = _delivered(server, client)
        assert frame is not None and frame.bytes == b"hello"
        assert frame.get("User-Id") == "worker-3"
        assert handler.accepted == 1 and not handler.refused
    finally:
        handler.close()


@pytest.mark.parametrize(
    ("user", "secret", "reason"),
    [
        ("worker-3", b"0" * 64, "wrong secret"),
        ("output", None, "user not allowed"),  # the results socket takes workers only
        ("worker-3; rm", None, "user not allowed"),
    ],
)
def test_a_wrong_secret_or_user_is_refused_and_counted(
    ctx: Any, tmp_path: Path, user: str, secret: bytes | None, reason: str
) -> None:
    auth = RunAuth.generate()
    handler = auth.handler(ctx, "test", {"results": workers_only})
    try:
        server, client = _pair(ctx, tmp_path, auth, handler, user, secret or auth.secret)
        assert _delivered(server, client) is None
        deadline = time.monotonic() + 30
        while not handler.refused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handler.refused == {reason: handler.refused[reason]}
        assert handler.accepted == 0
    finally:
        handler.close()


def test_a_socket_without_credentials_gets_no_message_through(ctx: Any, tmp_path: Path) -> None:
    auth = RunAuth.generate()
    handler = auth.handler(ctx, "test", {})
    try:
        server = _socket(ctx, zmq.PULL)
        auth.server(server, "results")
        server.bind(f"ipc://{tmp_path}/s")
        client = _socket(ctx, zmq.PUSH)  # NULL mechanism: the handshake fails
        client.sndtimeo = 300
        client.connect(f"ipc://{tmp_path}/s")
        assert _delivered(server, client) is None
    finally:
        handler.close()


def test_a_process_outside_the_run_is_refused_even_with_the_secret(
    ctx: Any, tmp_path: Path
) -> None:
    # members descend from the run's zygote; this test process does not descend from pid 1's
    # child "zygote" we name here, so the kernel's peer credentials give it away
    auth = RunAuth(RunAuth.generate().secret, zygote_pid=os.getppid() + 10**6)
    handler = auth.handler(ctx, "test", {})
    try:
        server, client = _pair(ctx, tmp_path, auth, handler, "worker-0", auth.secret)
        assert _delivered(server, client) is None
        deadline = time.monotonic() + 30
        while not handler.refused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(handler.refused) == ["not in the run"]
    finally:
        handler.close()


def test_a_peer_that_ended_before_its_check_is_refused_without_a_warning(
    ctx: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # a role killed as its run aborts at start-up: its connection request may still be
    # queued; refused and counted, but not a warning before the run's one error line
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # reaped: no such process any more
    auth = RunAuth(RunAuth.generate().secret, zygote_pid=os.getppid())
    handler = auth.handler(ctx, "test", {})
    try:
        request = ZapRequest("results", f"localhost:0:{os.getuid()}:{ended.pid}", "PLAIN", ())
        frames = [b"id", b"", b"1.0", b"1", request.domain.encode(), request.address.encode()]
        frames += [b"", b"PLAIN", b"worker-0", auth.secret]
        with caplog.at_level(logging.DEBUG, logger="evflow.security"):
            reply = handler.handle(frames)
        assert reply is not None and reply[4] == b"400"
        assert handler.refused == {"ended": 1}
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]
        # a live process of another parent is still a warning
        caplog.clear()
        frames[5] = f"localhost:0:{os.getuid()}:{os.getppid()}".encode()
        with caplog.at_level(logging.DEBUG, logger="evflow.security"):
            handler.handle(frames)
        assert "not in the run" in handler.refused
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
    finally:
        handler.close()


def test_zap_requests_are_checked_field_by_field() -> None:
    plain = PlainSecret(b"s" * 64)
    ok = ZapRequest("ctl", "localhost:0:0:1", "PLAIN", (b"input", b"s" * 64))
    assert plain.check(ok) == ("input", "")
    assert plain.check(ZapRequest("ctl", "", "NULL", ()))[0] is None
    assert plain.check(ZapRequest("ctl", "", "PLAIN", (b"input",)))[0] is None
    assert ok.peer == (0, 0, 1)
    assert ZapRequest("ctl", "tcp-peer", "PLAIN", ()).peer is None
    curve = CurveAllowList({b"k" * 32: "worker-7"})
    assert curve.check(ZapRequest("events", "", "CURVE", (b"k" * 32,))) == ("worker-7", "")
    assert curve.check(ZapRequest("events", "", "CURVE", (b"x" * 32,)))[0] is None


def test_the_secret_never_shows_and_travels_to_forked_roles() -> None:
    auth = RunAuth.generate(zygote_pid=42)
    assert auth.secret.decode() not in repr(auth)
    assert len(auth.secret) == 64 and auth.secret != RunAuth.generate().secret
    assert pickle.loads(pickle.dumps(auth)) == auth  # (the zygote pickles spawn arguments)


def test_session_directories_are_for_their_owner_only(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o777)
    secure_dir(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    link = tmp_path / "link"
    link.symlink_to(loose)
    with pytest.raises(ConfigurationError, match="symbolic link"):
        secure_dir(link)
    if os.getuid() == 0:  # (only root can give a directory away)
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ConfigurationError, match="belongs to user 65534"):
            secure_dir(theirs)


def test_outsiders_get_nothing_acted_on_in_a_real_run(tmp_path: Path) -> None:
    with HostileRun(tmp_path, n=2000) as run:
        assert run.session is not None
        assert stat.S_IMODE(run.session.stat().st_mode) == 0o700
        assert stat.S_IMODE(run.session.parent.stat().st_mode) == 0o700
        run.wait_flowing()
        for name in ENDPOINTS:
            for kind in ALL_TYPES:
                sock = run.connect(kind, name)
                for frames in garbage_messages()[:60]:
                    send(sock, frames)
            # the right user name and a guessed secret: refused as well
            sock = run.connect(zmq.DEALER, name)
            sock.close(linger=0)
            sock = run.ctx.socket(zmq.DEALER)
            run.sockets.append(sock)
            sock.linger, sock.sndtimeo = 0, 100
            sock.plain_username, sock.plain_password = MEMBER_USER[name].encode(), b"0" * 64
            sock.connect(run.endpoint(name))
            for frames in garbage_messages()[:60]:
                send(sock, frames)
        rc, summary, err = run.finish()
        assert rc == 0, err
        run.assert_exactly_once()
        assert summary["counters"]["output restarts"] == summary["counters"]["input restarts"] == 0
        # refused at the handshake: not one message reached a handler
        assert "malformed messages" not in summary["counters"]
        assert summary["counters"]["connections refused"] >= len(ENDPOINTS)
        assert "refused a connection" in err


def test_a_compromised_member_with_the_secret_still_meets_validation(tmp_path: Path) -> None:
    # a module in the workers opens sockets with the run's own credentials and sends
    # forged CONFIRMs, ENDs, HELLOs, STATE ERRORs and garbage to every socket
    with HostileRun(tmp_path, n=2000, attacker=True) as run:
        rc, summary, err = run.finish()
        assert rc == 0, err
        run.assert_exactly_once()
        assert summary["counters"]["output restarts"] == summary["counters"]["input restarts"] == 0
        assert summary["counters"]["events lost"] == 0
        assert summary["counters"]["workers lost"] == 0
        assert summary["counters"]["malformed messages"] > 0

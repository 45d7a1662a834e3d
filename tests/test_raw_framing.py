"""framing = "raw": evflow devices and plain ZeroMQ peers playing FairMQ devices (one
plain frame per message part, no evflow header) exchange data with exact counts."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import zmq

from _proc import finish, read_stats, start_device
from evflow.runtime.framing import incoming, outgoing
from evflow.transport.channel import open_channel, parse_channel_config
from evflow.wire.messages import BadMessageCounter, MsgType


def cc(**keys: Any) -> tuple[str, str]:
    return ("--channel-config", ",".join(f"{k}={v}" for k, v in keys.items()))


@pytest.fixture
def ctx() -> Any:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _bound(ctx: zmq.Context[Any], kind: int) -> tuple[zmq.Socket[Any], str]:
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.rcvtimeo = 20_000
    sock.bind("tcp://127.0.0.1:0")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def test_raw_channel_frames_are_the_payload(ctx: zmq.Context[Any]) -> None:
    cfg = parse_channel_config("name=data,type=pull,method=bind,address=tcp://127.0.0.1:0,"
                               "framing=raw")[0]  # fmt: skip
    ch = open_channel(ctx, cfg, "s")
    try:
        assert outgoing(ch, MsgType.EVENTS, {"x": 1}, [b"a", b"b"]) == [b"a", b"b"]
        assert outgoing(ch, MsgType.END, {"count": 3}) is None  # no raw form
        msg = incoming(ch, [b"\x07garbage"], BadMessageCounter())
        assert msg is not None and msg.type is MsgType.EVENTS and msg.payload == [b"\x07garbage"]
    finally:
        ch.close()
    with pytest.raises(Exception, match="bad framing 'fairmq'"):
        parse_channel_config("name=d,type=pull,method=bind,address=tcp://*:0,framing=fairmq")


def test_fairmq_style_sender_to_evflow_sink(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    """Like ``fairmq-bsampler --msg-size 1000`` (and multipart 2-part messages) -> sink."""
    n = 5000
    push, address = _bound(ctx, zmq.PUSH)
    sink = start_device(
        "sink", "--id", "sink", "--max-iterations", str(2 * n),
        "--stats-file", str(tmp_path / "sink.json"),
        *cc(name="data", type="pull", method="connect", address=address, framing="raw"),
    )  # fmt: skip
    payload = os.urandom(1000)
    for i in range(n):
        push.send(payload)
        push.send_multipart([b"head%d" % i, payload])  # one message, two parts
    code, _, err = finish(sink, 60)
    push.close()
    assert code == 0, err[-800:]
    stats = read_stats(tmp_path / "sink.json")["sink"]
    assert stats["received"] == 2 * n
    assert stats["payload_bytes"] == n * 1000 + sum(len(b"head%d" % i) + 1000 for i in range(n))
    assert stats["other"] == 0


def test_evflow_sampler_to_fairmq_style_receiver(ctx: zmq.Context[Any]) -> None:
    """Like ``fairmq-sink --max-iterations N``: each message is the bare payload."""
    n = 3000
    pull, address = _bound(ctx, zmq.PULL)
    sampler = start_device(
        "sampler", "--id", "sampler", "--max-iterations", str(n), "--msg-size", "100000",
        *cc(name="data", type="push", method="connect", address=address, framing="raw",
            linger=-1),
    )  # fmt: skip
    sizes = []
    for _ in range(n):
        frames = pull.recv_multipart(copy=False)
        sizes.append([len(f) for f in frames])
    code, _, err = finish(sampler, 60)
    assert code == 0, err[-800:]
    assert sizes == [[100000]] * n  # one plain frame each, no type byte, no header
    assert not pull.poll(200)  # and nothing else: no END on raw
    pull.close()


def test_proxy_bridges_fairmq_data_into_an_evflow_stream_with_exact_counts(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """raw in (a FairMQ sampler) -> proxy -> evflow sink: the proxy stops after its
    count and ends the evflow side with END, which the sink checks against what came."""
    n = 4000
    push, raw_address = _bound(ctx, zmq.PUSH)
    sink = start_device(
        "sink", "--id", "sink", "--stats-file", str(tmp_path / "sink.json"),
        *cc(name="data", type="pair", method="bind", address="ipc://bridge"),
    )  # fmt: skip
    proxy = start_device(
        "proxy", "--id", "proxy", "--max-iterations", str(n),
        *cc(name="data-in", type="pull", method="connect", address=raw_address, framing="raw"),
        *cc(name="data-out", type="pair", method="connect", address="ipc://bridge"),
    )  # fmt: skip
    for i in range(n):
        push.send(b"event %d" % i)
    codes = [finish(p, 60) for p in (proxy, sink)]
    push.close()
    assert [c[0] for c in codes] == [0, 0], [c[2][-800:] for c in codes]
    stats = read_stats(tmp_path / "sink.json")["sink"]
    assert stats["received"] == stats["announced"] == n
    assert stats["payload_bytes"] == sum(len(b"event %d" % i) for i in range(n))


def test_proxy_sends_an_evflow_stream_out_raw(ctx: zmq.Context[Any]) -> None:
    """evflow sampler (END/ACK) -> proxy -> raw out to a FairMQ-style receiver."""
    n = 2000
    pull, raw_address = _bound(ctx, zmq.PULL)
    proxy = start_device(
        "proxy", "--id", "proxy",
        *cc(name="data-in", type="pair", method="bind", address="ipc://src"),
        *cc(name="data-out", type="push", method="connect", address=raw_address,
            framing="raw", linger=-1),
    )  # fmt: skip
    sampler = start_device(
        "sampler", "--id", "sampler", "--max-iterations", str(n), "--msg-size", "64",
        *cc(name="data", type="pair", method="connect", address="ipc://src"),
    )  # fmt: skip
    got = [pull.recv_multipart() for _ in range(n)]
    codes = [finish(p, 60) for p in (sampler, proxy)]
    assert [c[0] for c in codes] == [0, 0], [c[2][-800:] for c in codes]
    assert all(len(m) == 1 and len(m[0]) == 64 for m in got)
    assert not pull.poll(200)  # END stayed on the evflow side
    pull.close()


def test_channel_configs_in_the_docs_parse() -> None:
    """The FairMQ and evflow command lines in docs/farm.md use keys evflow accepts."""
    doc = (Path(__file__).parents[1] / "docs" / "farm.md").read_text()
    assert "fairmq-bsampler" in doc and "framing=raw" in doc
    configs = re.findall(r"--channel-config\s+'?([^\s']+)", doc)
    assert len(configs) >= 4
    for text in configs:
        parse_channel_config(text)

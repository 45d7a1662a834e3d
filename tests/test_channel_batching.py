"""Batching on a channel: small data messages share one ZeroMQ message, each is still
handed out, counted and ended on its own, and a forged batch is refused and counted."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from _proc import finish, read_stats, start_device
from evflow.runtime.framing import decoder
from evflow.transport import coalesce
from evflow.transport.channel import Channel, ChannelConfig
from evflow.transport.opening import open_channel
from evflow.wire.messages import BadMessageCounter, MsgType, decode_message, encode_message


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def pair_of(
    ctx: zmq.Context[Any], tmp_path: Path, batch_us: int, batch_bytes: int = 65536
) -> tuple[Channel, Channel]:
    address = f"ipc://{tmp_path}/b"
    keys = {"sndBufSize": 100000, "rcvBufSize": 100000, "rateLogging": 0}
    out = open_channel(
        ctx,
        ChannelConfig(
            name="out",
            type="push",
            method="bind",
            address=address,
            batchUs=batch_us,
            batchBytes=batch_bytes,
            **keys,
        ),
        "t",
    )
    into = open_channel(
        ctx, ChannelConfig(name="in", type="pull", method="connect", address=address, **keys), "t"
    )
    return out, into


def data(i: int, size: int = 100) -> list[Any]:
    return encode_message(MsgType.EVENTS, {"i": i}, [bytes([i % 256]) * size])


def drain(into: Channel, n: int) -> list[list[Any]]:
    got = []
    while len(got) < n:
        assert into.poll(5000), f"only {len(got)} of {n} messages arrived"
        got.append(into.recv())
    return got


def test_small_messages_go_in_batches_and_come_out_one_by_one_in_order(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    out, into = pair_of(ctx, tmp_path, batch_us=10**9, batch_bytes=4096)
    for i in range(1000):
        out.send(data(i))
    out.send(encode_message(MsgType.END, {"count": 1000}))  # END goes at once, behind them
    got = drain(into, 1001)
    msgs = [decode_message(f) for f in got]
    assert [m.header["i"] for m in msgs[:1000]] == list(range(1000))
    assert all(bytes(m.payload[0]) == bytes([i % 256]) * 100 for i, m in enumerate(msgs[:1000]))
    assert msgs[1000].type is MsgType.END
    assert out.messages_out == into.messages_in == 1001
    # 4 kB batches of ~110 B messages: far fewer ZeroMQ messages than messages
    assert 1000 // 40 <= out.batches_out <= 1000 // 30
    assert into.batches_in == out.batches_out and into.pending == 0
    out.close(0)
    into.close(0)


def test_a_held_message_waits_for_a_flush_and_large_ones_do_not_wait(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    out, into = pair_of(ctx, tmp_path, batch_us=10**9)
    out.send(data(1))
    assert out.held == 1 and not into.poll(200)  # (a day-long linger: it waits)
    out.flush()
    assert out.held == 0 and decode_message(drain(into, 1)[0]).header == {"i": 1}
    out.send(data(2))
    big = encode_message(MsgType.EVENTS, {"i": 3}, [b"x" * 100_000])
    out.send(big)  # a large message takes the held one along, in order
    assert [decode_message(f).header["i"] for f in drain(into, 2)] == [2, 3]
    out.close(0)
    into.close(0)


def test_the_oldest_message_waits_at_most_batch_us_while_the_sender_sends(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    out, into = pair_of(ctx, tmp_path, batch_us=1)  # 1 µs: every check finds it due
    for i in range(8):  # the clock is read every 8th message
        out.send(data(i))
    assert out.held == 0
    assert [decode_message(f).header["i"] for f in drain(into, 8)] == list(range(8))
    out.close(0)
    into.close(0)


def test_no_peer_means_again_and_nothing_held(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/np"
    cfg = ChannelConfig(name="out", type="push", method="bind", address=address, batchUs=1000)
    out = open_channel(ctx, cfg, "t")
    with pytest.raises(zmq.Again):
        out.send(data(0), zmq.NOBLOCK)
    assert out.held == 0 and out.messages_out == 0
    out.close(0)


def test_batching_is_off_where_it_cannot_hold(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    def opened(**keys: Any) -> Channel:
        address = f"ipc://{tmp_path}/{keys['type']}-{len(keys)}"
        return open_channel(
            ctx, ChannelConfig(name="c", method="bind", address=address, **keys), "t"
        )

    for ch in (
        opened(type="push", batchUs=0),
        opened(type="push", batchUs=500, framing="raw"),  # FairMQ: one message each
        opened(type="router", batchUs=500),
        opened(type="pub", batchUs=500),  # topics are the first frame
    ):
        assert ch.batch_us == 0, ch
        ch.close(0)
    ch = opened(type="push", batchUs=500)
    assert ch.batch_us == 500
    ch.close(0)


@pytest.mark.parametrize(
    "index",
    [
        b"",
        b"\x01\x00\x00",  # not whole uint32s
        np.array([0], dtype="<u4").tobytes(),  # no message
        np.array([2, 1], dtype="<u4").tobytes(),  # counts missing
        np.array([1, 2, 5], dtype="<u4").tobytes(),  # 2 frames said, 1 length given
        np.array([1, 1, 7], dtype="<u4").tobytes(),  # lengths do not add up to the blob
        np.array([1, 0], dtype="<u4").tobytes(),  # a message of no frame
        np.array([2**31, 1, 5], dtype="<u4").tobytes(),  # absurd count
    ],
)
def test_a_forged_batch_is_refused_and_counted_not_cut(
    ctx: zmq.Context[Any], tmp_path: Path, index: bytes
) -> None:
    out, into = pair_of(ctx, tmp_path, batch_us=0)
    out.socket.send_multipart([coalesce.BATCH_TAG, index, b"\x03\x80"])
    out.send(data(9))
    bad = BadMessageCounter("t/in")
    decode = decoder(into, bad)
    first, second = drain(into, 2)
    assert decode(first) is None and bad.total == 1
    msg = decode(second)
    assert msg is not None and msg.header == {"i": 9} and into.pending == 0
    out.close(0)
    into.close(0)


def test_a_plain_pyzmq_receiver_reads_batches_with_messages_of(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/plain"
    cfg = ChannelConfig(name="out", type="push", method="bind", address=address, batchUs=10**9)
    out = open_channel(ctx, cfg, "t")
    pull = ctx.socket(zmq.PULL)
    pull.connect(address)
    for i in range(5):
        out.send(data(i))
    out.flush()
    got: list[int] = []
    while len(got) < 5:
        assert pull.poll(5000)
        frames = pull.recv_multipart()
        got += [decode_message(m).header["i"] for m in coalesce.messages_of(frames)]
    assert got == [0, 1, 2, 3, 4]
    pull.close(0)
    out.close(0)


# --- devices: exact counts with batching on (the built-in default) -------------------


def cc(**keys: Any) -> tuple[str, str]:
    return ("--channel-config", json.dumps(keys))


def test_sampler_forward_sink_count_exactly_with_batches(tmp_path: Path) -> None:
    """sampler -> proxy -> sink, 1 kB messages: every message once, END exact, and the
    messages really went in batches (the stats say how many ZeroMQ messages)."""
    n = 20_000
    a, b = f"ipc://{tmp_path}/a", f"ipc://{tmp_path}/b"
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(start_device(
            "sink", "--id", "sink", "--stats-file", str(tmp_path / "sink.json"),
            *cc(name="data", type="pull", method="bind", address=b),
            *cc(name="data-ack", type="push", method="bind", address=b + "-ack"),
        ))  # fmt: skip
        procs.append(start_device(
            "proxy", "--id", "proxy", "--stats-file", str(tmp_path / "proxy.json"),
            *cc(name="data-in", type="pull", method="bind", address=a),
            *cc(name="data-in-ack", type="push", method="bind", address=a + "-ack"),
            *cc(name="data-out", type="push", method="connect", address=b),
            *cc(name="data-out-ack", type="pull", method="connect", address=b + "-ack"),
        ))  # fmt: skip
        procs.append(start_device(
            "sampler", "--id", "sampler", "--max-iterations", str(n), "--msg-size", "1000",
            "--stats-file", str(tmp_path / "sampler.json"),
            *cc(name="data", type="push", method="connect", address=a),
            *cc(name="data-ack", type="pull", method="connect", address=a + "-ack"),
        ))  # fmt: skip
        results = [finish(p, 120) for p in reversed(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [code for code, _, _ in results] == [0, 0, 0], [err[-1500:] for _, _, err in results]
    sink = read_stats(tmp_path / "sink.json")
    assert sink["sink"]["received"] == n and sink["sink"]["payload_bytes"] == n * 1000
    sent = read_stats(tmp_path / "sampler.json")
    assert sent["sampler"]["sent"] == n and sent["sampler"]["acked"] == 1
    channels = sent["channels"]["data[0]"]
    assert channels["messages_out"] == n + 1  # (and the END)
    assert channels["batches_out"] <= n // 10, channels  # 1 kB in 64 kB: ~60 per batch


def test_a_paced_sampler_and_an_idle_forwarder_hold_nothing_back(tmp_path: Path) -> None:
    """Batching must not delay a trickle: a sampler at 1 Hz goes through a proxy, and
    each message reaches a plain receiver long before the 8 that would end a batch by
    its age (5 s for what takes 1 s: the margin is for a loaded machine)."""
    a, b = f"ipc://{tmp_path}/a", f"ipc://{tmp_path}/b"
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(b)
    procs = [
        start_device(
            "proxy", "--id", "proxy",
            *cc(name="data-in", type="pull", method="bind", address=a),
            *cc(name="data-out", type="push", method="connect", address=b),
        ),
        start_device(
            "sampler", "--id", "sampler", "--rate", "1", "--max-iterations", "1000",
            *cc(name="data", type="push", method="connect", address=a),
        ),
    ]  # fmt: skip
    try:
        got = 0
        while got < 2:
            assert pull.poll(5_000), f"message {got + 1} held back (or never sent)"
            for frames in coalesce.messages_of(pull.recv_multipart()):
                assert decode_message(frames).type is MsgType.EVENTS
                got += 1
        assert all(p.poll() is None for p in procs)  # a trickle, long before the END
    finally:
        for p in procs:
            p.kill()
            p.communicate()
        pull.close(0)
        ctx.term()


def test_a_router_hands_out_each_message_of_a_batch_with_its_peer_identity(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """No evflow sender batches towards a router (dealer channels never batch), but
    what arrives is untrusted: a batch there is unpacked with the identity in front of
    each message, and a forged one is refused, not cut."""
    address = f"ipc://{tmp_path}/r"
    router = open_channel(
        ctx, ChannelConfig(name="r", type="router", method="bind", address=address), "t"
    )
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"peer-1")
    dealer.connect(address)
    dealer.send_multipart(coalesce.pack([data(1), data(2)]))
    dealer.send_multipart([coalesce.BATCH_TAG, b"\x05\x00\x00\x00", b"x"])
    first, second, forged = drain(router, 3)
    assert [f[0] for f in (first, second)] == [b"peer-1", b"peer-1"]
    assert [decode_message(f[1:]).header["i"] for f in (first, second)] == [1, 2]
    assert forged[:2] == [b"peer-1", coalesce.BATCH_TAG]  # as it came: the decoder refuses it
    assert router.messages_in == 3 and router.batches_in == 1
    dealer.close(0)
    router.close(0)


def test_held_messages_a_broken_socket_cannot_send_are_dropped_once(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """A flush that fails for good (not for room) drops what was held, so the device
    loop's next flush does not retry and log it for ever; the END count reports it."""
    out, into = pair_of(ctx, tmp_path, batch_us=10**9)
    out.send(data(1))
    out.socket.close(0)
    with pytest.raises(zmq.ZMQError):
        out.flush()
    assert out.held == 0
    out.flush()  # nothing left: no second error
    into.close(0)

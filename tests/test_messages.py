"""The wire protocol: framing, validation, HELLO versions, bad-message accounting, fuzzing."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from evflow.errors import CodecError, ProtocolError
from evflow.event import DataStore, EventMeta
from evflow.wire.codec import decode_batch, encode_batch, encode_event
from evflow.wire.messages import (
    PROTOCOL_VERSION,
    BadMessageCounter,
    Message,
    MsgType,
    check_hello,
    decode_message,
    encode_message,
    hello_header,
    split_identity,
)


def test_message_types_keep_their_numbers() -> None:
    # Renumbering breaks every peer of an older build; new members go at the end.
    expected = [
        "HELLO", "READY", "EVENTS", "CONFIRM", "WORKER_LOST", "KILL", "END", "STOP",
        "TERMINATE", "STATE", "METRICS", "COMMAND", "REPLY", "RESULT", "GOODBYE",
    ]  # fmt: skip
    for number, name in enumerate(expected, start=1):
        assert MsgType[name] == number
    assert all(0 < t < 256 for t in MsgType)
    assert len({int(t) for t in MsgType}) == len(MsgType)


@settings(max_examples=200, deadline=None)
@given(
    mtype=st.sampled_from(list(MsgType)),
    header=st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**64 - 1), max_size=4),
    payload=st.lists(st.binary(max_size=16), max_size=3),
)
def test_message_round_trip(mtype: MsgType, header: dict[str, int], payload: list[bytes]) -> None:
    frames = encode_message(mtype, header, payload)
    assert frames[0] == bytes([mtype])
    msg = decode_message(frames)
    assert msg == Message(mtype, header, payload)


def test_message_without_header_has_empty_map() -> None:
    frames = encode_message(MsgType.STOP)
    assert frames == [bytes([MsgType.STOP]), b"\x80"]
    assert decode_message(frames).header == {}


def test_events_message_carries_codec_frames_untouched() -> None:
    stores = [DataStore(EventMeta(i), {"x": np.arange(3000.0) * i}) for i in range(3)]
    body = encode_batch(stores)
    msg = decode_message([bytes(f) for f in encode_message(MsgType.EVENTS, {"n": 3}, body)])
    out = decode_batch(msg.payload)
    assert [s.meta.uid for s in out] == [0, 1, 2]
    assert np.array_equal(out[2]["x"], stores[2]["x"])


def test_messages_travel_over_a_real_router_dealer_pair() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    try:
        for s in (router, dealer):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 5000)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.setsockopt(zmq.IDENTITY, b"worker-1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart(encode_message(MsgType.HELLO, hello_header(node="w1")))
        ident, rest = split_identity(router.recv_multipart(copy=False))
        assert ident == b"worker-1"
        hello = decode_message(rest)
        assert hello.type is MsgType.HELLO and hello.header["node"] == "w1"
        check_hello(hello.header)
        event = encode_event(DataStore(EventMeta(7), {"x": np.arange(10000)}))
        router.send_multipart([ident, *encode_message(MsgType.EVENTS, None, event)], copy=False)
        msg = decode_message(dealer.recv_multipart())
        assert msg.type is MsgType.EVENTS
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_hello_of_another_version_is_refused_naming_both_versions() -> None:
    with pytest.raises(ProtocolError, match=f"version 99, we speak {PROTOCOL_VERSION}"):
        check_hello({"protocol": 99})
    with pytest.raises(ProtocolError, match="version None"):
        check_hello({})
    check_hello(hello_header())


@pytest.mark.parametrize(
    ("frames", "kind", "match"),
    [
        ([], "short", "0 frame"),
        ([b"\x01"], "short", "1 frame"),
        ([b"", b"\x80"], "bad-type", "0 bytes; expected 1"),
        ([b"\x01\x02", b"\x80"], "bad-type", "2 bytes"),
        ([b"\xfe", b"\x80"], "unknown-type", "unknown message type byte 254"),
        ([b"\x00", b"\x80"], "unknown-type", "byte 0"),
        ([b"\x01", b"\xc1"], "bad-header", "HELLO header is not valid msgpack"),
        ([b"\x03", msgpack.packb([1, 2])], "bad-header", "EVENTS header is a list, not a map"),
        ([b"\x03", b"\x81\xa1a"], "bad-header", "not valid msgpack"),
        ([b"\x03", b"\x80\x80"], "bad-header", "not valid msgpack"),
        (["x", b"\x80"], "bad-type", "not a byte buffer"),
    ],
)
def test_malformed_messages_raise_protocol_error_with_kind(
    frames: list[Any], kind: str, match: str
) -> None:
    with pytest.raises(ProtocolError, match=match) as info:
        decode_message(frames)
    assert info.value.kind == kind  # type: ignore[attr-defined]


def test_encode_message_refuses_unknown_types_and_unpackable_headers() -> None:
    with pytest.raises(ProtocolError, match="unknown message type 200"):
        encode_message(200)
    with pytest.raises(ProtocolError, match="cannot encode READY header"):
        encode_message(MsgType.READY, {"x": object()})


def test_split_identity_needs_identity_and_message() -> None:
    with pytest.raises(ProtocolError, match="identity first"):
        split_identity([b"only"])


def test_bad_message_counter_counts_per_kind_and_logs_first_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counter = BadMessageCounter("input/data")
    with caplog.at_level(logging.WARNING, logger="evflow.wire"):
        for _ in range(5):
            assert counter.decode([b"\xfe", b"\x80"]) is None
        for _ in range(3):
            assert counter.decode([b"\x01"]) is None
        good = counter.decode(encode_message(MsgType.READY, {"credit": 2}))
    assert good is not None and good.header == {"credit": 2}
    assert counter.counts == {"unknown-type": 5, "short": 3}
    assert counter.total == 8
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "input/data" in lines[0] and "unknown message type byte 254" in lines[0]
    counter.record_error(CodecError("bad event"))
    assert counter.counts["CodecError"] == 1
    assert "total=9" in repr(counter)


# --- fuzzing ---------------------------------------------------------------------------
def _valid_messages() -> list[list[bytes]]:
    event = encode_event(DataStore(EventMeta(3), {"x": np.arange(5, dtype="<i4"), "s": "a"}))
    return [
        [bytes(f) for f in frames]
        for frames in (
            encode_message(MsgType.HELLO, hello_header(node="n1")),
            encode_message(MsgType.READY, {"credit": 10}),
            encode_message(MsgType.CONFIRM, {"uids": [1, 2, 2**64 - 1]}),
            encode_message(MsgType.EVENTS, {"n": 1}, event),
            encode_message(MsgType.STOP),
        )
    ]


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    op = rng.randrange(6)
    if op == 0 and frames:
        del frames[rng.randrange(len(frames))]
    elif op == 1:
        frames.insert(rng.randrange(len(frames) + 1), rng.randbytes(rng.randrange(12)))
    elif frames:
        i = rng.randrange(len(frames))
        b = bytearray(frames[i])
        for _ in range(rng.randrange(1, 4)):
            if not b:
                b.append(rng.randrange(256))
            pos = rng.randrange(len(b))
            if rng.random() < 0.5:
                b[pos] ^= 1 << rng.randrange(8)
            elif rng.random() < 0.5:
                b[pos] = rng.randrange(256)
            else:
                del b[pos:]
        frames[i] = bytes(b)
    return frames


def test_fuzz_decode_message_raises_only_protocol_error() -> None:
    """10^5 random and mutated messages through the receive path (message, then codec)."""
    rng = random.Random(1122)
    corpus = _valid_messages()
    counter = BadMessageCounter("fuzz", logger=logging.getLogger("evflow.test.fuzz"))
    n_inputs = 100_000
    good = 0
    cpu0_s = time.process_time()  # CPU time: what the machine's load does not stretch
    for i in range(n_inputs):
        if i % 3 == 0:
            frames = [rng.randbytes(rng.randrange(1, 10)) for _ in range(rng.randrange(5))]
        else:
            frames = _mutate(rng, rng.choice(corpus))
        msg = counter.decode(frames)
        if msg is None:
            continue
        good += 1
        if msg.type is MsgType.EVENTS:
            try:
                decode_batch(msg.payload)
            except CodecError as exc:  # CodecError is a ProtocolError: counted the same way
                counter.record_error(exc)
    cpu_s = time.process_time() - cpu0_s
    assert good > 0 and counter.total > 0
    assert counter.total + good >= n_inputs
    assert cpu_s < 60, f"fuzzing {n_inputs} messages took {cpu_s:.1f} s of CPU"


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=32), max_size=5))
def test_random_frames_never_raise_anything_but_protocol_error(frames: list[bytes]) -> None:
    with contextlib.suppress(ProtocolError):
        decode_message(frames)

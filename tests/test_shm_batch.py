"""Batches on shm device channels (send_many / recv_many), with real processes
(tests/shm_peer.py): every message of every batch arrives once, in order, every byte
checked; the region is all free at the end; kill -9 of either side mid-batch; a
second receiver of one sender is refused and the sender says so."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from evflow.errors import ConfigurationError
from evflow.runtime.device import Device, Origin
from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel
from evflow.transport.shm_channel import InMessage, ShmChannel
from evflow.transport.shm_marker import INLINE, REGION, pack_marker
from evflow.transport.shm_region import _W_CLAIMED, _W_GIVEN
from evflow.wire.messages import Message, MsgType, decode_message, encode_message
from shm_peer import rings, sizes_of
from test_shm_zero_copy import Pair, finish, next_start_cleans

KB, MB = 1 << 10, 1 << 20
SIZES = "0,1,7,100,4000,40000,250000,1000000"


@pytest.fixture
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    p = Pair(tmp_path, re.sub(r"[^A-Za-z0-9]", "", request.node.name)[-24:])
    try:
        yield p
    finally:
        p.kill_all()


@pytest.mark.parametrize("receive", ["recv_many", "recv"])
def test_batches_arrive_whole_in_order_and_the_region_ends_free(pair: Pair, receive: str) -> None:
    """700 messages in batches of 7 (mixed sizes, zero-copy and copied frames, some
    over ZeroMQ when the 4 MB region is full): counts in = counts out, every byte right,
    and at the end the sender's region has no chunk out."""
    n = 700
    many = ["--many"] if receive == "recv_many" else []
    pair.start("recv", "r", "--count", str(n), "--views", "mixed", "--hold", "3", *many)
    # bound and reading (its first stats come when it is idle): else the sender, which
    # connects, may queue all 700 in ZeroMQ before the receiver runs and copy all but
    # the region's first 38 frames (seen on a loaded host)
    pair.wait_stats("r", lambda r: True)
    tx = pair.start(
        "send", "s", "--count", str(n), "--mode", "mixed", "--sizes", SIZES,
        "--shm-size", str(4 * MB), "--batch", "7",
    )  # fmt: skip
    finish(pair)
    r, s = pair.stats("r"), pair.stats("s")
    assert r["received"] == s["sent"] == n
    assert r["bad"] == r["gaps"] == r["held_bad"] == 0
    frames = sum(len(sizes_of(i, [int(x) for x in SIZES.split(",")])) for i in range(n))
    assert r["held_ok"] == r["in_region"] + r["over_zmq"] > 0
    assert r["frames_in"] == s["frames_out"] > n // 10  # each region frame claimed once
    assert frames > r["in_region"] + r["over_zmq"]  # the small ones came inline
    if many:
        assert r["batches"] == n // 7  # whole batches, never split
    assert s["in_use"] == 0 and s["reclaimed_dead"] == 0  # every chunk came back
    assert not rings(tx.pid)


def test_kill_9_of_the_receiver_mid_batch_leaks_no_chunk(pair: Pair, tmp_path: Path) -> None:
    """The receiver dies holding the views of a batch and with batches queued: the
    next receiver reads on in place, and at the end the region has every chunk back."""
    n = 3000
    common = ["--sizes", str(100 * KB), "--shm-size", str(8 * MB), "--batch", "8"]
    tx = pair.start("send", "s", *common, "--sndhwm", "4", "--count", str(n))
    rx1 = pair.start("recv", "r1", "--many", "--hold", "12", "--delay-ms", "1")
    pair.wait_stats("r1", lambda r: r["batches"] > 5)
    rx1.send_signal(signal.SIGKILL)
    rx1.wait(10)
    stop = tmp_path / "stop"
    rx2 = pair.start("recv", "r2", "--many", "--check-after", str(stop))
    pair.wait_stats("r2", lambda r: r.get("last") == n - 1)  # the last one came
    stop.touch()
    assert rx2.wait(30) == 0 and tx.wait(30) == 0
    r1, r2, s = pair.stats("r1"), pair.stats("r2"), pair.stats("s")
    assert r2["bad"] == 0 and r2["gaps"] == 1  # its first message is not 0: rx1 had those
    assert r2["in_region"] > 200 and r1["received"] + r2["received"] <= n
    assert s["in_use"] == 0 and s["reclaimed_dead"] > 0  # the dead one's taken back
    assert not rings(tx.pid)


def test_kill_9_of_the_sender_mid_batch(pair: Pair, tmp_path: Path) -> None:
    """The sender dies between batches (views of its region held by the receiver):
    they stay intact, and the next start removes the dead region."""
    stop = tmp_path / "stop"
    common = ["--sizes", str(200 * KB), "--shm-size", str(4 * MB), "--batch", "5"]
    tx = pair.start("send", "s", *common)
    rx = pair.start("recv", "r", "--many", "--hold", "6", "--check-after", str(stop))
    pair.wait_stats("r", lambda r: r["batches"] > 10)
    tx.send_signal(signal.SIGKILL)
    tx.wait(10)
    stop.touch()  # the receiver re-checks the views it holds of the dead region
    assert rx.wait(30) == 0
    r = pair.stats("r")
    assert r["bad"] == r["gaps"] == r["held_bad"] == 0 and r["held_ok"] > 0
    next_start_cleans(pair, tmp_path, tx.pid)


# --- in one process ----------------------------------------------------------------------
@pytest.fixture
def ctx() -> Any:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.term()


def _chan(ctx: Any, kind: str, method: str, addr: str, session: str) -> ShmChannel:
    (cfg,) = parse_channel_config(
        f"name=data,type={kind},method={method},address={addr},transport=shm,"
        f"shmSize={2 * MB},linger=0"
    )
    ch = open_channel(ctx, cfg, session)
    assert isinstance(ch, ShmChannel)
    return ch


def test_a_batch_is_all_or_none_and_its_rest_waits_in_the_channel(ctx: Any, tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/b"
    tx = _chan(ctx, "push", "bind", addr, "batch1")
    rx = None
    try:
        msgs = [tx.new_message(300 * KB) for _ in range(4)]
        for i, m in enumerate(msgs):
            m.array()[:] = i
        batch = [encode_message(MsgType.EVENTS, {"i": i}, [m]) for i, m in enumerate(msgs)]
        with pytest.raises(zmq.Again):  # no peer yet: nothing sent, buffers still ours
            tx.send_many(batch, zmq.NOBLOCK)
        assert all(m.in_region for m in msgs) and tx.messages_out == 0
        rx = _chan(ctx, "pull", "connect", addr, "batch1")
        tx.send_many(batch)  # the same buffers
        tx.send_many([encode_message(MsgType.END, {"count": 4})])  # a batch of one
        assert rx.poll(5000)
        first = decode_message(rx.recv(views=True))  # one message; three wait in rx
        assert first.header == {"i": 0} and rx.pending == 3 and rx.poll(0)
        rest = rx.recv_many(views=True)  # the pending ones, not the socket's END
        assert [decode_message(f).header["i"] for f in rest] == [1, 2, 3] and not rx.pending
        for i, frames in enumerate(rest, 1):
            got = decode_message(frames).payload[0]
            assert isinstance(got, InMessage) and (got.array() == i).all()
        assert decode_message(rx.recv_many()[0]).type is MsgType.END
        assert rx.messages_in == tx.messages_out == 5
        assert rx.shm_batches_in == tx.shm_batches_out == 1
        assert tx._region is not None and tx._region.in_use() == 4  # held by views
        del first, rest, frames, got
        assert tx._region.in_use() == 0
        with pytest.raises(ValueError, match="1 to"):
            tx.send_many([])
    finally:
        tx.close()
        if rx is not None:
            rx.close()


def _wait_handshakes(tx: Any, monitor: Any, n: int, timeout_s: float = 30.0) -> None:
    """Until ``n`` peers completed their handshake with ``tx`` (then stop monitoring)."""
    from zmq.utils.monitor import recv_monitor_message

    try:
        deadline = time.monotonic() + timeout_s
        for _ in range(n):
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and monitor.poll(left_ms), f"fewer than {n} peers connected"
            recv_monitor_message(monitor)
    finally:
        tx.socket.disable_monitor()
        monitor.close(0)


def test_a_second_receiver_is_refused_and_the_sender_says_so(ctx: Any, tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/two"
    tx = _chan(ctx, "push", "bind", addr, "tworx")
    handshakes = tx.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    rxs = [_chan(ctx, "pull", "connect", addr, "tworx") for _ in range(2)]
    try:
        _wait_handshakes(tx, handshakes, 2)  # both connected: PUSH deals to both in turn
        for i in range(6):
            tx.send(encode_message(MsgType.EVENTS, {"i": i}, [np.full(50 * KB, i, np.uint8)]))
        got: dict[int, list[Any]] = {0: [], 1: []}
        for k, rx in enumerate(rxs):
            while len(got[k]) < 3 and rx.poll(1000):
                got[k].append(rx.recv())
        consumer, refused = (0, 1) if rxs[1].shm_bad else (1, 0)
        assert rxs[refused].shm_bad == 3 and rxs[consumer].shm_bad == 0
        assert all(frames[0] == b"\x00" for frames in got[refused])  # dropped
        got[consumer] = [decode_message(frames) for frames in got[consumer]]
        assert "has another receiver" in rxs[refused].shm_last_bad
        assert all(m.type is MsgType.EVENTS for m in got[consumer])  # read intact
        assert all(bytes(m.payload[0]) == bytes([m.header["i"]]) * 50 * KB for m in got[consumer])
        with pytest.raises(ConfigurationError, match="one receiver per sender"):
            tx.send(encode_message(MsgType.EVENTS, {"i": 6}, [b"x" * 50 * KB]))
    finally:
        tx.close()
        for rx in rxs:
            rx.close()


def test_a_second_receiver_gets_messages_without_chunks_but_never_moves_claimed(
    ctx: Any, tmp_path: Path
) -> None:
    """Messages with no chunk (here all inline) name the region and carry a send
    sequence: the receiver that holds the region's lock marks them claimed; another
    one dealt some of them (a second PULL of one PUSH) gets them intact, but writes
    nothing in the region, so the sender never takes back chunks on their way to it."""
    addr = f"ipc://{tmp_path}/two"
    tx = _chan(ctx, "push", "bind", addr, "tworxcopy")
    handshakes = tx.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    rxs = [_chan(ctx, "pull", "connect", addr, "tworxcopy") for _ in range(2)]
    try:
        _wait_handshakes(tx, handshakes, 2)  # both connected: PUSH deals to both in turn
        for i in range(6):  # send sequences 1 to 6: one per message, no chunk
            tx.send(encode_message(MsgType.EVENTS, {"i": i}, [b"x" * 100]))
        assert tx._region is not None
        words = tx._region._w
        assert words[_W_GIVEN] == 6 and words[_W_CLAIMED] == 0
        got: list[list[int]] = [[], []]
        for k, rx in enumerate(rxs):  # rxs[0] first: it takes the region's lock
            while len(got[k]) < 3 and rx.poll(1000):
                got[k].append(decode_message(rx.recv()).header["i"])
        assert sorted(got[0] + got[1]) == list(range(6))
        assert rxs[0].shm_bad == rxs[1].shm_bad == 0
        assert words[_W_CLAIMED] == max(got[0]) + 1  # rxs[1]'s later ones: not claimed
        tx.send(encode_message(MsgType.EVENTS, {"i": 6}, [b"x" * 100]))  # no refusal
    finally:
        tx.close()
        for rx in rxs:
            rx.close()


def test_mutated_batch_markers_never_crash_nor_touch_the_region(ctx: Any, tmp_path: Path) -> None:
    """2000 markers of a genuine batch with random bytes changed, cut or appended, sent
    raw: each is dropped and counted, or (a change that still makes sense, e.g. in an
    inline frame) delivered; never an exception, and the held chunks stay held. Then
    500 of a batch with no chunk (whose send sequence the receiver marks claimed): the
    same, and the claimed sequence never goes beyond what the sender gave out."""
    addr = f"ipc://{tmp_path}/fuzz"
    tx = _chan(ctx, "push", "bind", addr, "fuzz")
    rx = _chan(ctx, "pull", "connect", addr, "fuzz")
    try:
        msgs = [tx.new_message(40 * KB) for _ in range(3)]
        for i, m in enumerate(msgs):
            m.array()[:] = i + 1
        tx.send_many([encode_message(MsgType.EVENTS, {"i": i}, [m]) for i, m in enumerate(msgs)])
        assert rx.poll(5000)
        held = rx.recv_many(views=True)  # the chunks are HELD now: a replay must be refused
        assert tx._region is not None and tx._region.in_use() == 3
        region = tx._region.name.encode()
        words = tx._region._w
        seq = int(words[_W_GIVEN])  # the batch's send sequence
        entries: list[int] = []
        for j, m in enumerate(held):
            got = m[2]
            assert isinstance(got, InMessage) and got._slot is not None
            entries += [INLINE, 2 * j, 1, 0, INLINE, 2 * j + 1, 1, 0]
            entries += [REGION, got._slot.offset, got.nbytes, got._slot.gen]
        genuine = pack_marker(region, [3, 3, 3], entries, [b"\x03", b"\x80"] * 3, seq)
        no_chunk = pack_marker(
            region, [2, 2, 2], [INLINE, 0, 1, 0, INLINE, 1, 1, 0] * 3, [b"\x03", b"\x80"], seq
        )
        rng = np.random.default_rng(15)
        bad = delivered = 0
        for k in range(2500):
            forged = bytearray(genuine if k < 2000 else no_chunk)
            for _ in range(int(rng.integers(1, 4))):
                forged[int(rng.integers(0, len(forged)))] = int(rng.integers(0, 256))
            if k % 10 == 0:
                forged = forged[: int(rng.integers(0, len(forged)))]
            elif k % 10 == 1:
                forged += rng.bytes(int(rng.integers(1, 40)))
            tx.socket.send(bytes(forged))
            assert rx.poll(5000)
            before = rx.shm_bad
            for frames in rx.recv_many(views=True):
                assert isinstance(frames, list)
            bad += rx.shm_bad - before
            delivered += rx.shm_bad == before
            assert words[_W_CLAIMED] <= words[_W_GIVEN] == seq
        assert bad + delivered == 2500 and bad > 1900 + 250
        for j, m in enumerate(held):  # untouched, still ours
            assert (m[2].array() == j + 1).all()
        assert tx._region.in_use() == 3
        del held, m, got
        assert tx._region.in_use() == 0
    finally:
        tx.close()
        rx.close()


class _Collect(Device):
    def init_task(self) -> None:
        self.got: list[int] = []
        self.on_data("data", self.handle, views=True)

    def handle(self, msg: Message, origin: Origin) -> bool:
        if msg.type is MsgType.END:
            return False
        self.got.append(msg.header["i"])
        return True


def test_the_data_loop_hands_over_a_batch_longer_than_one_drain(ctx: Any) -> None:
    """300 messages and END in one ZeroMQ message: the data loop drains 256 per poll,
    then must take the 45 still pending in the channel although the socket is quiet."""
    (cfg,) = parse_channel_config(
        "name=data,type=pull,method=bind,address=inproc://dl,transport=shm"
    )
    dev = _Collect("c", [cfg], context=ctx, session="dloop")
    tx = _chan(ctx, "push", "connect", "inproc://dl", "dloop")
    try:
        batch = [encode_message(MsgType.EVENTS, {"i": i}, [b"x" * 40 * KB]) for i in range(300)]
        tx.send_many([*batch, encode_message(MsgType.END, {"count": 300})])
        runner = threading.Thread(target=dev.run)
        runner.start()
        runner.join(20)
        hung = runner.is_alive()
        if hung:  # let it end: a message on the socket wakes the loop
            tx.send(encode_message(MsgType.END, {"count": 300}))
            runner.join(20)
        assert not hung, "the data loop left the rest of a batch in the channel"
        assert dev.got == list(range(300))
        assert tx._region is not None and tx._region.in_use() == 0
    finally:
        tx.close()


def test_frames_of_any_buffer_type_arrive_as_their_bytes(ctx: Any, tmp_path: Path) -> None:
    """Small (inline) and large (region) frames given as bytes, memoryviews, float
    arrays and zmq.Frames: the receiver gets exactly their bytes."""
    addr = f"ipc://{tmp_path}/types"
    tx = _chan(ctx, "push", "bind", addr, "types")
    rx = _chan(ctx, "pull", "connect", addr, "types")
    try:
        frames: list[Any] = []
        for n in (3, 100, 50_000):  # inline, inline, region
            values = np.arange(n, dtype=np.float64)
            frames += [values, memoryview(values), zmq.Frame(values.tobytes()), values.tobytes()]
        tx.send_many([frames, frames[::-1]])
        assert rx.poll(5000)
        got = rx.recv_many()
        assert len(got) == 2
        want = [memoryview(f).tobytes() if not isinstance(f, bytes) else f for f in frames]
        assert [bytes(f) for f in got[0]] == want
        assert [bytes(f) for f in got[1]] == want[::-1]
    finally:
        tx.close()
        rx.close()

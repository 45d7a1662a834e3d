"""Zero-copy shm device channels with real processes (tests/shm_peer.py): every byte of
every message checked, chunks reused under a slow receiver but never while a view of
them is held, kill -9 of either side while views are held, forged descriptors."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel
from evflow.transport.shm_channel import RING_PREFIX, InMessage, ShmChannel
from evflow.transport.shm_marker import INLINE, REGION, SOCKET, pack_marker
from evflow.transport.shm_region import _C_STATE, DATA_OFF, SENT
from evflow.wire.messages import MsgType, decode_message, encode_message
from shm_peer import pattern, pinned, rings, sizes_of

PEER = str(Path(__file__).with_name("shm_peer.py"))

KB, MB = 1 << 10, 1 << 20


class Pair:
    """Sender and receiver processes of one session, their stats files."""

    def __init__(self, tmp: Path, session: str) -> None:
        self.tmp, self.session = tmp, session
        self.address = f"ipc://{tmp}/c"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, role: str, name: str, *args: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            [
                *(sys.executable, PEER, role, "--session", self.session),
                *("--address", self.address, "--stats", str(self.tmp / f"{name}.json")),
                *("--done", str(self.tmp / "done")),
                *args,
            ]
        )
        self.procs.append(p)
        return p

    def stats(self, name: str) -> dict[str, int]:
        path = self.tmp / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def wait_stats(self, name: str, cond: Any, timeout_s: float = 60.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.stats(name)
            if got and cond(got):
                return got
            assert time.monotonic() < deadline, f"timed out; {name}: {got}"
            time.sleep(0.05)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(10)


@pytest.fixture
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    p = Pair(tmp_path, re.sub(r"[^A-Za-z0-9]", "", request.node.name)[-24:])
    try:
        yield p
    finally:
        p.kill_all()


def finish(pair: Pair, timeout_s: float = 120.0) -> None:
    for p in pair.procs:
        assert p.wait(timeout_s) == 0


def test_mixed_sizes_and_apis_arrive_intact_in_order(pair: Pair) -> None:
    n = 1500
    sizes = "0,1,7,100,4000,40000,250000,1000000,3000000"
    pair.start("recv", "r", "--count", str(n), "--views", "mixed", "--hold", "3")
    tx = pair.start(
        "send", "s", "--count", str(n), "--mode", "mixed", "--sizes", sizes,
        "--shm-size", str(16 * MB),
    )  # fmt: skip
    finish(pair)
    r, s = pair.stats("r"), pair.stats("s")
    assert r["received"] == s["sent"] == n
    assert r["bad"] == r["gaps"] == r["held_bad"] == 0
    assert r["held_ok"] == r["in_region"] + r["over_zmq"] > 0
    in_place = sum(len(sizes_of(i, [int(x) for x in sizes.split(",")])) for i in range(n) if i % 3)
    assert s["zero_copy"] + s["heap"] == in_place  # new_message() for 2 messages in 3
    assert s["zero_copy"] > in_place / 4  # most in the region (the rest: it was full)
    assert s["frames_out"] > s["zero_copy"]  # and the copying send used the region too
    assert not rings(tx.pid)


@pytest.mark.parametrize("full", ["fallback", "backpressure"])
def test_slow_receiver_holding_views_never_sees_its_chunks_reused(pair: Pair, full: str) -> None:
    """A 2 MB region, 200 kB messages, the receiver keeps the views of the last 6 and
    sleeps: the region fills; chunks are reused many times, never one still held."""
    n = 300
    pair.start("recv", "r", "--count", str(n), "--hold", "6", "--delay-ms", "3")
    wait = ["--wait-s", "10"] if full == "backpressure" else []
    pair.start(
        "send", "s", "--count", str(n), "--sizes", str(200 * KB), "--shm-size", str(2 * MB),
        "--sndhwm", "4", *wait,
    )  # fmt: skip
    finish(pair)
    r, s = pair.stats("r"), pair.stats("s")
    assert r["received"] == n and r["bad"] == r["gaps"] == 0
    frames = r["in_region"] + r["over_zmq"]
    assert frames == n + n // 4  # every 4th message has two frames
    assert r["held_ok"] == frames and r["held_bad"] == 0  # re-checked just before release
    capacity = (2 * MB - DATA_OFF) // (200 * KB + 128)
    assert capacity < 10
    if full == "fallback":  # over ZeroMQ when full: no wait, no loss
        assert s["copied"] > 0 and r["over_zmq"] == s["copied"]
        assert s["zero_copy"] > 2 * capacity  # chunks used again and again
    else:  # the sender waited for room: everything in place
        assert s["copied"] == 0 and s["zero_copy"] == frames == r["in_region"]


def test_kill_9_of_either_side_while_views_are_held(pair: Pair, tmp_path: Path) -> None:
    """The receiver dies holding every chunk: the sender takes them back and a new
    receiver reads in place again. Then the sender dies while that receiver holds
    views: they stay readable and intact; the next start removes the dead region."""
    common = ["--sizes", str(256 * KB), "--shm-size", str(4 * MB)]
    tx = pair.start("send", "s", *common, "--sndhwm", "8")  # for ever
    rx1 = pair.start("recv", "r1", "--hold", "100000")  # holds every view
    pair.wait_stats("r1", lambda r: r["over_zmq"] > 20)  # region full of held chunks
    in_region_1 = pair.stats("r1")["in_region"]
    assert 0 < in_region_1 <= 4 * MB // (128 * KB)  # the region, all held
    rx1.send_signal(signal.SIGKILL)
    rx1.wait(10)
    stop = tmp_path / "stop"
    rx2 = pair.start("recv", "r2", "--hold", "10", "--check-after", str(stop))
    r2 = pair.wait_stats("r2", lambda r: r["in_region"] > 30)  # chunks of the dead reused
    assert r2["bad"] == 0
    assert pair.wait_stats("s", lambda s: s["reclaimed_dead"] > 0)["reclaimed_dead"] <= 64
    tx.send_signal(signal.SIGKILL)
    tx.wait(10)
    assert rings(tx.pid)  # the dead sender's region, still mapped by rx2
    # rx2 reads on what the dead sender had queued (in its region) until nothing comes
    idle = pair.stats("r2")["idle"]
    pair.wait_stats("r2", lambda r: r["idle"] > idle)
    stop.touch()  # rx2 re-checks the views it holds of the dead sender's region
    assert rx2.wait(30) == 0
    r2 = pair.stats("r2")
    assert r2["bad"] == r2["held_bad"] == 0 and r2["held_ok"] >= r2["in_region"] > 30
    next_start_cleans(pair, tmp_path, tx.pid)


def test_kill_9_of_a_receiver_that_claimed_nothing_of_a_full_region(
    pair: Pair, tmp_path: Path
) -> None:
    """A receiver that reads nothing while the sender fills the whole region and queues
    copies behind it, then dies: every chunk went with it (none held: the old rule for
    the chunks of a dead receiver takes none back), and the next receiver gets only
    copies at first. Their send sequences tell the sender that the chunks are lost: it
    takes them back and sends in place again (it used to copy for ever, nothing newer
    ever being claimed in the region)."""
    n = 200
    ready = tmp_path / "ready"
    rx1 = pair.start("recv", "r1", "--stall", "--ready", str(ready), "--sndhwm", "16")
    tx = pair.start(
        "send", "s", "--sizes", str(200 * KB), "--shm-size", str(2 * MB), "--sndhwm", "16",
        "--count", str(n), "--stats-every", "1",
    )  # fmt: skip
    # the first ones filled the region (2 MB: at most 10 messages of 200 kB), copies
    # follow them. Message 26 went: the sender's queue holds at most 16 (its sndhwm),
    # so the markers of the region's chunks left it: they are in rx1's queue (16 more
    # fit there), and go with rx1
    pair.wait_stats("s", lambda s: s["sent"] >= 10 + 16 and s["heap"] > 0)
    assert ready.exists()
    rx1.send_signal(signal.SIGKILL)
    rx1.wait(10)
    stop = tmp_path / "stop"
    rx2 = pair.start("recv", "r2", "--check-after", str(stop))
    pair.wait_stats("r2", lambda r: r.get("last") == n - 1)
    stop.touch()
    assert rx2.wait(30) == 0 and tx.wait(30) == 0
    r2, s = pair.stats("r2"), pair.stats("s")
    assert r2["bad"] == 0 and r2["gaps"] == 1  # it starts after what rx1 had
    # copies first, then in place again: the 9 chunks of the region used over and over
    # (still with copies among them: the sender outruns this receiver)
    assert r2["over_zmq"] > 0 and r2["in_region"] > 20
    assert s["reclaimed_dead"] >= 9 and s["in_use"] == 0  # the lost ones taken back
    assert not rings(tx.pid)


def _wait_event(monitor: Any, event: int, timeout_s: float = 30.0) -> None:
    """Until the socket monitor reports ``event`` (other events are skipped)."""
    from zmq.utils.monitor import recv_monitor_message

    deadline = time.monotonic() + timeout_s
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0 and monitor.poll(left_ms), f"no socket event {event} came"
        if recv_monitor_message(monitor)["event"] == event:
            return


@pytest.mark.parametrize("ahead", [1, 4])
def test_a_region_full_of_chunks_lost_with_a_killed_receiver_is_used_again(
    pair: Pair, ahead: int
) -> None:
    """A receiver process SIGKILLed before it claimed anything, with every chunk of the
    region (and a copy after them) sent to it: the sender binds, so PUSH drops the dead
    peer's queue and the chunks are lost, all still SENT (none HELD: the rule for the
    chunks of a dead holder takes none back). A new receiver then gets every message
    sent after it came, in order, each once, every byte right; counted in messages, not
    time: the sender keeps ``ahead`` messages in flight, so the first ``ahead`` are
    copies (the region is full of lost chunks when they are sent), and every later one
    is in the region again: the first copy's send sequence told the sender that the
    chunks were lost. No chunk is left out at the end. (Before copies carried a send
    sequence, every message after the kill was a copy.)"""
    size, n = 200 * KB, 40
    ctx: zmq.Context[Any] = zmq.Context()
    (tx_cfg,) = parse_channel_config(
        f"name=data,type=push,method=bind,address={pair.address},transport=shm,"
        f"shmSize={2 * MB},linger=0"
    )
    (rx_cfg,) = parse_channel_config(
        f"name=data,type=pull,method=connect,address={pair.address},transport=shm,linger=0"
    )
    tx = open_channel(ctx, tx_cfg, pair.session)
    assert isinstance(tx, ShmChannel)
    rx: ShmChannel | None = None
    monitor = tx.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    sent_in_region: list[bool] = []

    def send(i: int) -> None:
        msg = tx.new_message(size)
        msg.array()[:] = pattern(size, i)
        sent_in_region.append(msg.in_region)
        tx.send(encode_message(MsgType.EVENTS, {"i": i}, [msg]))

    try:
        rx1 = pair.start("recv", "r1", "--stall", "--connect")
        _wait_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED)
        i = 0
        while not sent_in_region or sent_in_region[-1]:  # until one is a copy
            send(i)
            i += 1
        region = tx._region
        assert region is not None
        lost = region.in_use()
        assert lost == i - 1 >= 5 and region.reclaimed_dead == 0
        assert all(region._w[o // 8 + _C_STATE] == SENT for o in region._live)
        rx1.send_signal(signal.SIGKILL)
        rx1.wait(10)
        _wait_event(monitor, zmq.EVENT_DISCONNECTED)  # its queue is gone with it
        opened = open_channel(ctx, rx_cfg, pair.session)
        assert isinstance(opened, ShmChannel)
        rx = opened
        _wait_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED)
        first = i
        sent_in_region.clear()
        for k in range(first, first + ahead):
            send(k)
        got_in_region: list[bool] = []
        for k in range(first, first + n):
            assert rx.poll(30_000)
            got = decode_message(rx.recv(views=True))
            assert got.header == {"i": k}  # every one, in order, once
            with got.payload[0] as payload:
                assert isinstance(payload, InMessage)
                assert np.array_equal(payload.array(), pattern(size, k))
                got_in_region.append(payload.in_region)
            del got, payload  # the chunk goes back before the next send
            if k + ahead < first + n:
                send(k + ahead)
        assert sent_in_region == got_in_region == [False] * ahead + [True] * (n - ahead)
        assert not rx.poll(100)  # nothing more: what rx1 was sent went with it
        assert rx.shm_bad == 0
        assert region.reclaimed_dead == lost and region.in_use() == 0
    finally:
        tx.socket.disable_monitor()
        monitor.close(0)
        tx.close(0)
        if rx is not None:
            rx.close(0)
        ctx.term()
    assert not rings(os.getpid())


def test_kill_9_of_both_while_views_are_held(pair: Pair, tmp_path: Path) -> None:
    tx = pair.start("send", "s", "--sizes", str(300 * KB), "--shm-size", str(4 * MB))
    rx = pair.start("recv", "r", "--hold", "5", "--delay-ms", "2")
    pair.wait_stats("r", lambda r: r["in_region"] > 10)
    with pinned(tx.pid):
        rx.send_signal(signal.SIGKILL)
        tx.send_signal(signal.SIGKILL)
        rx.wait(10)
        tx.wait(10)
        assert rings(tx.pid)
    next_start_cleans(pair, tmp_path, tx.pid)


def next_start_cleans(pair: Pair, tmp_path: Path, dead_pid: int) -> None:
    nxt = Pair(tmp_path / "next", pair.session)
    (tmp_path / "next").mkdir()
    try:
        nxt.start("recv", "r", "--count", "50")
        tx = nxt.start("send", "s", "--count", "50", "--sizes", "100000")
        finish(nxt)
        assert nxt.stats("r")["received"] == 50 and nxt.stats("r")["bad"] == 0
        assert not rings(dead_pid)  # removed by the next start
        assert not rings(tx.pid)  # and the new pair left nothing either
    finally:
        nxt.kill_all()


# --- forged descriptors (in one process: the test writes the raw frames) ---------------
@pytest.fixture
def channels(tmp_path: Path) -> Any:
    ctx: zmq.Context[Any] = zmq.Context()
    addr = f"ipc://{tmp_path}/f"
    (tx_cfg,) = parse_channel_config(
        f"name=data,type=push,method=bind,address={addr},transport=shm,shmSize={2 * MB}"
    )
    (rx_cfg,) = parse_channel_config(
        f"name=data,type=pull,method=connect,address={addr},transport=shm"
    )
    tx = open_channel(ctx, tx_cfg, "forge")
    rx = open_channel(ctx, rx_cfg, "forge")
    assert isinstance(tx, ShmChannel) and isinstance(rx, ShmChannel)
    try:
        yield tx, rx
    finally:
        tx.close(0)
        rx.close(0)
        ctx.term()
    assert not rings(os.getpid())
    gc.collect()  # the test's views are gone: so are the mappings (not only the file)
    assert "evflow-dc-" not in Path("/proc/self/maps").read_text()


def _recv(rx: ShmChannel) -> list[Any]:
    assert rx.poll(5000)
    return rx.recv(views=True)


def _region_marker(
    region: str, offset: int, nbytes: int, gen: int, twice: bool = False, seq: int = 1
) -> bytes:
    """A marker of one EVENTS message whose payload frame is a chunk of ``region``."""
    entries = [INLINE, 0, 1, 0, INLINE, 1, 1, 0, REGION, offset, nbytes, gen]
    if twice:
        entries += [REGION, offset, nbytes, gen]
    return pack_marker(region.encode(), [len(entries) // 4], entries, [b"\x03", b"\x80"], seq)


def _inline_marker(region: str, seq: int) -> bytes:
    """A marker of one EVENTS message, all inline, naming ``region`` with send sequence
    ``seq`` (as every message of a sender with a region)."""
    entries = [INLINE, 0, 1, 0, INLINE, 1, 1, 0]
    return pack_marker(region.encode(), [2], entries, [b"\x03", b"\x80"], seq)


def test_forged_descriptors_are_refused_counted_and_harmless(channels: Any) -> None:
    tx, rx = channels
    msg = tx.new_message(1000)
    msg.array()[:] = 5
    tx.send(encode_message(MsgType.EVENTS, None, [msg]))
    held = decode_message(_recv(rx)).payload[0]
    assert isinstance(held, InMessage) and held.in_region
    region = tx._region
    assert region is not None
    slot_gen = held._slot.gen  # type: ignore[union-attr]
    at = held._slot.offset  # type: ignore[union-attr]
    name = region.name
    forged: list[tuple[Any, str]] = [
        (_region_marker(name, at, 1000, slot_gen), "not sent to us"),  # a replay of it
        (_region_marker(name, at, 1000, slot_gen + 1), "stale or forged"),  # generation
        (_region_marker(name, at, 999, slot_gen), "stale or forged"),  # wrong length
        (_region_marker(name, at + 64, 1000, slot_gen), "stale or forged"),  # inside it
        (_region_marker(name, at + 1, 1000, slot_gen), "no shared-memory chunk can be"),
        (_region_marker(name, 0, 100, 1), "no shared-memory chunk can be"),  # the header
        (_region_marker(name, 2 * MB - 64, 10**6, 1), "no shared-memory chunk can be"),
        (_region_marker(name, 2**64 - 64, 1, 1), "no shared-memory chunk can be"),  # huge
        (_region_marker(name, at, 1000, 0), "bad shared-memory descriptor"),  # generation 0
        (_region_marker("../../etc/passwd", 0, 10, 1), "not one of this session"),
        (_region_marker(f"{RING_PREFIX}1-other-x", DATA_OFF, 1, 1), "not one of this session"),
        (_region_marker(f"{RING_PREFIX}{os.getpid()}-forge-gone", DATA_OFF, 1, 1), "cannot open"),
        (_region_marker(name, at, 1000, slot_gen, twice=True), "twice"),  # one chunk twice
        (_region_marker("\u00e9t\u00e9", DATA_OFF, 1, 1), "not ASCII"),
    ]
    ok = _region_marker(name, at, 1000, slot_gen)
    markers = [*forged]
    markers += [
        (b"\xc1garbage", "bad shared-memory marker"),  # too short
        (msgpack.packb([[2, name, at, 1000, slot_gen]]), "first byte 0x91"),  # not a marker
        (ok[:-1], "its counts say"),  # truncated
        (ok + b"x", "its counts say"),  # trailing bytes
        (ok[:1] + b"\x09" + ok[2:], "version 9"),
        (pack_marker(b"", [], [], []), "0 messages"),
        (pack_marker(b"", [3], [INLINE, 0, 0, 0], []), "3 frames of 1"),  # counts
        (pack_marker(b"", [1], [7, 0, 0, 0], []), "unknown frame kind"),
        (pack_marker(b"", [1], [INLINE, 0, 100, 0], []), "inline frame beyond its bytes"),
        (pack_marker(b"", [1], [INLINE, 2**64 - 1, 1, 0], [b"x"]), "inline frame beyond"),
        (pack_marker(b"", [1], [SOCKET, 0, 0, 0], []), "0 frames on the socket"),
        (_region_marker(name, at, 1000, slot_gen, seq=0), "send sequence 0, region name"),
        (pack_marker(b"", [1], [INLINE, 0, 1, 0], [b"x"], 5), "send sequence 5, region name"),
        (_inline_marker(name, 2**63), "send sequence 9223372036854775808 is forged"),
    ]
    for marker, why in markers:
        tx.socket.send(marker)
        assert _recv(rx)[0] == b"\x00"  # dropped as an unknown message type
        assert why in rx.shm_last_bad
    assert rx.shm_bad == len(markers)
    # nothing was released or corrupted by them: the held view is intact and still ours
    assert (held.array() == 5).all() and region.in_use() == 1
    # a chunk on its way: a marker must give it a send sequence after the chunk's and
    # no later than what the sender gave out (read in the region), else it is refused
    spare = tx.new_message(1000)
    spare.array()[:] = 7
    slot = spare._slot
    assert slot is not None
    region.mark_sent(slot)  # as send() does, before its marker goes out
    given = region.stamp()  # the marker's send sequence, published in the region
    for seq in (given - 1, given + 1):
        tx.socket.send(_region_marker(name, slot.offset, 1000, slot.gen, seq=seq))
        assert _recv(rx)[0] == b"\x00" and "is forged" in rx.shm_last_bad
    assert rx.shm_bad == len(markers) + 2 and region.in_use() == 2
    tx.socket.send(_region_marker(name, slot.offset, 1000, slot.gen, seq=given))
    got = decode_message(_recv(rx)).payload[0]
    assert isinstance(got, InMessage) and got.in_region and (got.array() == 7).all()
    # a message without chunks naming a region that is gone (its sender closed it)
    # comes as it is: its sequence has nothing left to tell
    tx.socket.send(_inline_marker(f"{RING_PREFIX}{os.getpid()}-forge-gone", 1))
    assert decode_message(_recv(rx)).type is MsgType.EVENTS
    assert rx.shm_bad == len(markers) + 2
    del got, spare, slot
    held.release()
    assert region.in_use() == 0
    # a stale descriptor (the chunk was released, then reused by the next message)
    nxt = tx.new_message(1000)
    nxt.array()[:] = 6
    tx.send(encode_message(MsgType.EVENTS, None, [nxt]))
    tx.socket.send(_region_marker(name, at, 1000, slot_gen))
    got = decode_message(_recv(rx)).payload[0]
    assert (np.asarray(got) == 6).all()
    assert _recv(rx)[0] == b"\x00" and rx.shm_bad == len(markers) + 3
    assert "stale or forged" in rx.shm_last_bad
    # and the channel still works both ways
    tx.send(encode_message(MsgType.EVENTS, None, [b"y" * 100_000]))
    assert bytes(decode_message(_recv(rx)).payload[0]) == b"y" * 100_000


def test_views_keep_the_chunk_until_the_last_one_goes(channels: Any) -> None:
    tx, rx = channels
    msg = tx.new_message(64 * KB)
    msg.array(np.float64)[:] = 1.5
    tx.send(encode_message(MsgType.EVENTS, None, [msg]))
    with pytest.raises(ValueError, match="already sent"):
        tx.send(encode_message(MsgType.EVENTS, None, [msg]))
    region = tx._region
    with decode_message(_recv(rx)).payload[0] as got:
        view = got.array(np.float64)[10:20]
        mv = got.data
        assert not view.flags.writeable and mv.readonly
    with pytest.raises(ValueError, match="released"):
        got.array()
    assert region.in_use() == 1  # released, but two views are alive
    del view
    assert region.in_use() == 1
    mv.release()
    del mv
    assert region.in_use() == 0  # the last view went
    # garbage collection is the safety net: a message lost in a reference cycle
    tx.send(encode_message(MsgType.EVENTS, None, [tx.new_message(1000)]))
    cycle: list[Any] = [decode_message(_recv(rx)).payload[0]]
    cycle.append(cycle)
    del cycle
    assert region.in_use() == 1
    gc.collect()
    assert region.in_use() == 0
    # unsent buffers go back too; a full region gives heap buffers, sent over ZeroMQ
    big = [tx.new_message(700 * KB) for _ in range(3)]
    assert [m.in_region for m in big] == [True, True, False]
    assert tx.shm_copied == 1
    del big
    assert region.in_use() == 0
    heap = tx.new_message(3 * MB)
    assert not heap.in_region
    heap.array()[:] = 9
    tx.send(encode_message(MsgType.EVENTS, None, [heap]))
    got = decode_message(_recv(rx)).payload[0]
    assert isinstance(got, InMessage) and not got.in_region and len(got) == 3 * MB
    assert (got.array() == 9).all() and bytes(got)[:2] == b"\t\t"


def test_chunks_lost_with_a_receiver_are_taken_back_after_one_copy(channels: Any) -> None:
    """The messages of a whole region's chunks are lost on the way (taken off the
    socket here and dropped, as a receiver killed before it claims them): every chunk
    stays SENT, so the region is full and the next message is a copy. Its send
    sequence, marked claimed by the receiver, tells the sender those chunks are lost:
    the very next message is in the region again."""
    tx, rx = channels
    tx.send(encode_message(MsgType.EVENTS, {"i": -1}, [b"hello"]))  # all inline
    assert decode_message(_recv(rx)).header == {"i": -1}
    region = tx._region
    assert region is not None
    lost = 0
    while (msg := tx.new_message(200 * KB)).in_region:
        tx.send(encode_message(MsgType.EVENTS, {"i": lost}, [msg]))
        assert rx.socket.poll(5000)
        rx.socket.recv_multipart()  # lost: its chunk never claimed
        lost += 1
    assert lost == region.in_use() > 5
    got = []
    for i in range(lost, lost + 3):
        if i > lost:  # each new_message after the last message arrived
            msg = tx.new_message(200 * KB)
        msg.array()[:] = i % 251
        tx.send(encode_message(MsgType.EVENTS, {"i": i}, [msg]))
        frames = decode_message(_recv(rx))
        assert frames.header == {"i": i}
        with frames.payload[0] as payload:
            assert (payload.array() == i % 251).all()
            got.append(payload.in_region)
    assert got == [False, True, True]  # one copy, then in place
    assert region.reclaimed_dead == lost and region.in_use() == 0 and rx.shm_bad == 0


def test_a_failed_send_leaves_the_buffer_to_the_caller(tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    addr = f"ipc://{tmp_path}/a"
    (tx_cfg,) = parse_channel_config(
        f"name=data,type=push,method=bind,address={addr},transport=shm,shmSize={2 * MB}"
    )
    tx = open_channel(ctx, tx_cfg, "again")
    rx = None
    try:
        assert isinstance(tx, ShmChannel)
        msg = tx.new_message(100 * KB)
        msg.array()[:] = 3
        for payload in ([msg], [msg, b"z" * 100_000]):  # no peer yet: zmq.Again
            with pytest.raises(zmq.Again):
                tx.send(encode_message(MsgType.EVENTS, None, payload), zmq.NOBLOCK)
            assert msg.in_region and tx._region is not None
            assert tx._region.in_use() == 1  # the copied frame's chunk went back
        (rx_cfg,) = parse_channel_config(
            f"name=data,type=pull,method=connect,address={addr},transport=shm"
        )
        rx = open_channel(ctx, rx_cfg, "again")
        assert isinstance(rx, ShmChannel)
        tx.send(encode_message(MsgType.EVENTS, None, [msg]))  # the same buffer, now sent
        assert rx.poll(5000)
        got = decode_message(rx.recv()).payload[0]  # the copying recv: bytes
        assert got == b"\x03" * (100 * KB) and tx._region.in_use() == 0
        # the channel's byte counters include the region's bytes, not only descriptors
        assert tx.bytes_out > 100 * KB and rx.bytes_in > 100 * KB
        assert tx.shm_metrics() == {
            **dict.fromkeys(("frames_in", "bad", "copied", "chunks_in_use", "reclaimed_dead"), 0),
            **dict.fromkeys(("batches_in", "batches_out"), 0),
            "frames_out": 1,
            "zero_copy": 1,
        }
    finally:
        tx.close(0)
        if rx is not None:
            rx.close(0)
        ctx.term()


def test_a_reopened_sender_gets_a_new_region_and_old_views_stay(tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    addr = f"ipc://{tmp_path}/o"
    (tx_cfg,) = parse_channel_config(
        f"name=data,type=push,method=bind,address={addr},transport=shm,shmSize={2 * MB}"
    )
    (rx_cfg,) = parse_channel_config(
        f"name=data,type=pull,method=connect,address={addr},transport=shm"
    )
    rx = open_channel(ctx, rx_cfg, "reopen")
    senders = []
    try:
        got = []
        for value in (1, 2):  # the same channel, closed and opened again (a reset)
            tx = open_channel(ctx, tx_cfg, "reopen")
            senders.append(tx)
            msg = tx.new_message(1000)
            msg.array()[:] = value
            tx.send(encode_message(MsgType.EVENTS, None, [msg]))
            assert rx.poll(5000)
            got.append(decode_message(rx.recv(views=True)).payload[0])
            tx.close(0)
        assert (np.asarray(got[0]) == 1).all() and (np.asarray(got[1]) == 2).all()
        assert senders[0]._region.name != senders[1]._region.name  # type: ignore[attr-defined]
        assert rx.shm_bad == 0 and not rings(os.getpid())
    finally:
        for tx in senders:
            tx.close(0)
        rx.close(0)
        ctx.term()


def test_buffers_dropped_in_another_thread_do_not_corrupt_the_region(channels: Any) -> None:
    """A thread takes and drops unsent buffers while this one sends and checks: the
    free list stays whole (every chunk back at the end, no chunk given out twice)."""
    tx, rx = channels
    stop = threading.Event()
    churned = [0]

    def churn() -> None:
        while not stop.is_set():
            held = [tx.new_message(n) for n in (100, 5000, 64 * KB)]
            for m in held:
                if m.in_region:
                    m.array()[:] = 0xEE  # written by its owner only
            del held
            churned[0] += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        for i in range(400):
            msg = tx.new_message(20 * KB + i, wait_s=5)
            msg.array()[:] = i % 251
            tx.send(encode_message(MsgType.EVENTS, {"i": i}, [msg]))
            with decode_message(_recv(rx)).payload[0] as got:
                assert (got.array() == i % 251).all(), i
    finally:
        stop.set()
        t.join(10)
    assert churned[0] > 0 and rx.shm_bad == 0
    region = tx._region
    assert region.in_use() == 0
    assert region._free.starts == [DATA_OFF] and region._free.sizes == [region.size_b - DATA_OFF]

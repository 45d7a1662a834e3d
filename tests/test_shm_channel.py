"""Device channels with transport=shm: payloads through a ring in /dev/shm, and cleanup
after kill -9 of the sender, the receiver, or both."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from _wait import wait_until
from evflow.errors import ConfigurationError
from evflow.runtime.devices.sink import read_all
from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel
from evflow.transport.shm_channel import RING_PREFIX, ShmChannel, sweep_stale_rings
from evflow.transport.shm_marker import INLINE, REGION, pack_marker
from evflow.wire.messages import MsgType, decode_message, encode_message
from shm_peer import pinned, rings

KB, MB = 1 << 10, 1 << 20


def chan(kind: str, method: str, address: str, extra: str = "") -> str:
    return f"name=data,type={kind},method={method},address={address},transport=shm{extra}"


def sink(session: str, stats: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "evflow", "device", "sink", "--id", "sink", *extra),
            *("--session", session, "--stats-file", str(stats), "--severity", "warn"),
            *("--channel-config", chan("pull", "bind", "ipc://d")),
            *("--channel-config", "name=data-ack,type=push,method=bind,address=ipc://da"),
        ]
    )


def sampler(
    session: str, n: int, size: int = MB, zero: bool = False, *extra: str
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "evflow", "device", "sampler", "--id", "sampler", *extra),
            *("--session", session, "--max-iterations", str(n), "--msg-size", str(size)),
            *("--zero-copy", "true" if zero else "false"),
            *("--severity", "warn", "--ack-timeout-s", "5"),
            *("--channel-config", chan("push", "connect", "ipc://d", f",shmSize={8 * MB}")),
            *("--channel-config", "name=data-ack,type=pull,method=connect,address=ipc://da"),
        ]
    )


def mapped_by(pid: int, names: set[str]) -> bool:
    """Whether process ``pid`` maps one of the /dev/shm regions ``names``."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return any(f"/dev/shm/{name}" in maps for name in names)


def kill(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait(10)


def clean_run(session: str, tmp: Path) -> dict[str, int]:
    """A fresh pair (the "next start"): 200 messages of 1 MB, each written in place in
    the sender's region (``--zero-copy``) and counted in place by the sink."""
    s = sink(session, tmp / "ok.json")
    p = sampler(session, 200, zero=True)
    try:
        assert p.wait(60) == 0 and s.wait(60) == 0
    finally:
        kill(s, p)
    stats = json.loads((tmp / "ok.json").read_text())
    shm = stats["channels"]["data[0]"]["shm"]  # every payload came through the region
    assert shm["frames_in"] == 200 and shm["bad"] == 0
    assert stats["channels"]["data[0]"]["bytes_in"] >= 200 * MB
    return stats["sink"]


@pytest.mark.parametrize("read", ["true", "false"])
def test_batched_sampler_to_sink_every_message_counted_and_read(tmp_path: Path, read: str) -> None:
    """``--batch 7``: 301 iterations of 7 messages of 100 kB, each ZeroMQ message a
    batch; the sink's data loop hands every one over (the rest of a batch waits in the
    channel: 256 per drain is not a multiple of 7), reads every byte unless told not
    to, and names its rate for what it measured."""
    session = f"shmbatch{read}"
    s = sink(session, tmp_path / "k.json", "--read-payload", read)
    p = sampler(session, 301, 100 * KB, True, "--batch", "7")
    try:
        assert p.wait(60) == 0 and s.wait(60) == 0
    finally:
        kill(s, p)
    stats = json.loads((tmp_path / "k.json").read_text())
    got, shm = stats["sink"], stats["channels"]["data[0]"]["shm"]
    assert got["received"] == got["announced"] == 7 * 301 and got["ends"] == 1
    assert got["payload_bytes"] == 7 * 301 * 100 * KB
    assert shm["frames_in"] == 7 * 301 and shm["batches_in"] == 301 and shm["bad"] == 0
    assert got["payload_read"] is (read == "true")
    assert ("gb_per_s" in got) is (read == "true")
    assert ("received_gb_per_s" in got) is (read == "false")
    assert not rings()


def test_the_sink_reads_every_byte() -> None:
    data = np.random.default_rng(1).integers(0, 256, 1003, np.uint8)
    want = int(np.bitwise_xor.reduce(data[:1000].view(np.uint64)))
    for b in data[1000:].tolist():
        want ^= b
    assert want != 0
    for frame in (data.tobytes(), memoryview(data.tobytes()), zmq.Frame(data.tobytes()), data):
        assert read_all(frame) == want
    changed = data.copy()
    changed[1002] ^= 1  # the last byte counts too
    assert read_all(changed) == want ^ 1


@pytest.mark.parametrize("victim", ["sender", "receiver", "both"])
def test_kill_9_leaves_dev_shm_clean_after_the_next_start(tmp_path: Path, victim: str) -> None:
    session = f"shmk-{victim}"
    s = sink(session, tmp_path / "s.json")
    p = sampler(session, 0)  # for ever
    try:
        # the sender's ring is in use: the sink maps it once it took a message from it
        wait_until(lambda: mapped_by(s.pid, rings(p.pid)), 60, "the sink reading the ring", proc=s)
        with pinned(p.pid):
            if victim in ("sender", "both"):
                p.send_signal(signal.SIGKILL)
            if victim in ("receiver", "both"):
                s.send_signal(signal.SIGKILL)
            if victim == "receiver":
                p.send_signal(signal.SIGKILL)  # a sender without receiver would wait for ever
            kill(s, p)
            assert rings(p.pid)  # left behind by the dead owner ...
        got = clean_run(session, tmp_path)
        assert got["received"] == got["announced"] == 200
        assert got["payload_bytes"] == 200 * MB
        assert not rings(p.pid)  # ... removed by the next start
        assert not rings()  # and the new pair left nothing either
    finally:
        kill(s, p)


def test_full_ring_falls_back_to_copying_and_bad_markers_are_dropped(tmp_path: Path) -> None:
    ctx: zmq.Context[object] = zmq.Context()
    addr = f"ipc://{tmp_path}/r"
    (tx_cfg,) = parse_channel_config(chan("push", "bind", addr, f",shmSize={2 * MB}"))
    (rx_cfg,) = parse_channel_config(chan("pull", "connect", addr))
    tx = open_channel(ctx, tx_cfg, "shmfull")
    rx = open_channel(ctx, rx_cfg, "shmfull")
    try:
        assert isinstance(tx, ShmChannel) and isinstance(rx, ShmChannel)
        payload = bytes(range(256)) * 2048  # 512 kB
        for _ in range(8):  # 4 MB into a 2 MB ring, nothing read yet: half must be copied
            tx.send(encode_message(MsgType.EVENTS, None, [payload]))
        assert tx.shm_frames_out >= 3 and tx.shm_copied >= 4
        for _ in range(8):
            assert rx.poll(5000)
            msg = decode_message(rx.recv())
            assert bytes(msg.payload[0]) == payload
        assert rx.shm_frames_in == tx.shm_frames_out
        tx.send(encode_message(MsgType.EVENTS, None, [payload]))  # room again (consumed)
        assert rx.poll(5000) and bytes(decode_message(rx.recv()).payload[0]) == payload
        assert tx.shm_copied <= 5
        # a forged marker naming a foreign file: dropped as an unknown message, no crash
        for name in ("/etc/passwd", f"{RING_PREFIX}1-other-x"):
            entries = [INLINE, 0, 1, 0, INLINE, 1, 1, 0, REGION, 4096 * 17, 10, 64]
            tx.socket.send(pack_marker(name.encode(), [3], entries, [b"\x03", b"\x80"], 1))
            assert rx.poll(5000)
            assert rx.recv()[0] == b"\x00"
        assert rx.shm_bad == 2
    finally:
        tx.close(0)
        rx.close(0)
        ctx.term()
    assert not rings(os.getpid())


def test_shm_needs_a_one_to_one_socket_type() -> None:
    with pytest.raises(ConfigurationError, match="with transport shm"):
        parse_channel_config("name=x,type=router,method=bind,address=ipc://x,transport=shm")
    with pytest.raises(ConfigurationError, match="zmq or shm"):
        parse_channel_config("name=x,type=push,method=bind,address=ipc://x,transport=ofi")


def test_sweep_removes_only_dead_owners() -> None:
    live = Path("/dev/shm", f"{RING_PREFIX}{os.getpid()}-sweep-live")
    dead_pid = 2**22 + 12345  # above pid_max: never a live process
    dead = Path("/dev/shm", f"{RING_PREFIX}{dead_pid}-sweep-dead")
    live.write_bytes(b"x")
    dead.write_bytes(b"x")
    try:
        assert dead.name in sweep_stale_rings()
        assert live.exists() and not dead.exists()
    finally:
        live.unlink(missing_ok=True)
        dead.unlink(missing_ok=True)

"""A sender or a receiver on a ``transport=shm`` channel, for tests with real processes.

    python tests/shm_peer.py send|recv --session S --address ipc://... [options]

Message ``i`` carries ``{"i": i}`` and payload frames whose bytes are ``pattern(n, i)``;
the receiver checks every byte, in order, and re-checks each view it held just before
releasing it (a chunk reused while held would show there). Stats go to ``--stats``
(JSON, rewritten every 20 messages or ``--stats-every N``, when idle (the receiver's
``idle`` counts those times), and at the end). ``--batch N`` sends N messages per
``send_many``; ``--many`` receives with ``recv_many`` (else one ``recv`` at a time, the
rest of a batch pending in the channel).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import mmap
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel
from evflow.transport.shm_channel import RING_PREFIX, InMessage
from evflow.wire.messages import MsgType, decode_message, encode_message


def rings(pid: int | None = None) -> set[str]:
    """The device-channel regions in /dev/shm (of ``pid`` if given)."""
    names = {n for n in os.listdir("/dev/shm") if n.startswith(RING_PREFIX)}
    return {n for n in names if pid is None or n.startswith(f"{RING_PREFIX}{pid}-")}


@contextlib.contextmanager
def pinned(pid: int) -> Iterator[None]:
    """Keep ``pid``'s regions mapped here: the test sessions of other worktrees on this
    host remove new evflow segments that nobody maps when their tests end, and would
    take a dead owner's region before a test has seen it left behind."""
    maps = []
    for name in rings(pid):
        with open(Path("/dev/shm", name), "rb") as f:
            maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
    try:
        yield
    finally:
        for m in maps:
            m.close()


_BASE = np.tile(np.arange(256, dtype=np.uint8), 1 << 14)  # 4 MB


def pattern(n: int, i: int) -> np.ndarray:
    """``n`` bytes for message ``i``: a ramp shifted by ``i``, ``i`` itself in front."""
    reps = -(-n // len(_BASE))
    base = _BASE if reps == 1 else np.tile(_BASE, reps)
    out = base[:n] + np.uint8(i % 251)
    if n >= 8:
        out[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    return out


def sizes_of(i: int, sizes: list[int]) -> list[int]:
    n = sizes[(i * 7) % len(sizes)]
    return [n // 2, n - n // 2] if i % 4 == 3 else [n]  # every 4th: two frames


def write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(data))
    os.replace(tmp, path)


def send(a: argparse.Namespace, ch: Any) -> None:
    sizes = [int(s) for s in a.sizes.split(",")]
    stats: dict[str, int] = {"sent": 0, "heap": 0}
    i = 0
    batch: list[list[Any]] = []
    while (a.count == 0 or i < a.count) and not (a.batch_stop and os.path.exists(a.done)):
        frames: list[Any] = []
        zero = a.mode == "zero" or (a.mode == "mixed" and i % 3 != 0)
        for n in sizes_of(i, sizes):
            if zero:
                msg = ch.new_message(n, wait_s=a.wait_s)
                stats["heap"] += not msg.in_region
                msg.array()[:] = pattern(n, i)
                frames.append(msg)
            else:
                frames.append(pattern(n, i).data)
        batch.append(encode_message(MsgType.EVENTS, {"i": i}, frames))
        i += 1
        if len(batch) < a.batch and i != a.count:
            continue
        ch.send_many(batch) if a.batch > 1 else ch.send(batch[0])
        batch = []
        stats["sent"] = i
        if i % a.stats_every < a.batch or i == a.count:
            region = ch._region
            stats.update(
                zero_copy=ch.shm_zero_copy,
                frames_out=ch.shm_frames_out,
                copied=ch.shm_copied,
                reclaimed_dead=region.reclaimed_dead if region else 0,
                allocated=region.allocated if region else 0,
            )
            write_json(a.stats, stats)
    deadline = time.monotonic() + 60  # a closing PUSH can lose its last messages
    while not os.path.exists(a.done) and time.monotonic() < deadline:
        time.sleep(0.01)
    region = ch._region
    if region is not None:  # every chunk back? (dead receivers' ones taken back first)
        region.reclaim()
        stats.update(in_use=region.in_use(), reclaimed_dead=region.reclaimed_dead)
    write_json(a.stats, stats)


def recv(a: argparse.Namespace, ch: Any) -> None:
    stats: dict[str, int] = dict.fromkeys(
        (
            *("received", "bad", "gaps", "in_region", "over_zmq", "held_ok", "held_bad"),
            *("batches", "idle"),
        ),
        0,
    )
    held: collections.deque[tuple[int, list[InMessage], list[np.ndarray]]] = collections.deque()
    last = -1

    def check_held(i: int, msgs: list[InMessage], views: list[np.ndarray]) -> None:
        for v in views:
            ok = np.array_equal(v, pattern(len(v), i))
            stats["held_ok" if ok else "held_bad"] += 1
        for m in msgs:
            m.release()

    def check(i: int, payload: Sequence[Any]) -> tuple[list[np.ndarray], list[InMessage]]:
        """Every frame's bytes checked; their arrays, and the frames read in place.
        (A function: no loop variable keeps the last view of a chunk alive after the
        receiver says it is done, when the sender counts the chunks still out.)"""
        arrays, msgs = [], []
        for f in payload:
            if isinstance(f, InMessage):
                stats["in_region" if f.in_region else "over_zmq"] += 1
                msgs.append(f)
                arr = f.array()
            else:
                arr = np.frombuffer(f, np.uint8)
            stats["bad"] += not np.array_equal(arr, pattern(len(arr), i))
            arrays.append(arr)
        return arrays, msgs

    if a.stall:  # a receiver that hangs: bound, reads nothing, its queue fills
        if a.ready:
            Path(a.ready).touch()
        time.sleep(3600)
        return
    got = 0
    ready: list[list[Any]] = []  # recv_many: the rest of a batch
    while a.count == 0 or got < a.count:
        if a.check_after and os.path.exists(a.check_after):
            break
        views = a.views == "yes" or (a.views == "mixed" and got % 2 == 0)
        if not ready:
            if not ch.poll(100):
                stats["idle"] += 1  # nothing came for 100 ms: all that was queued is read
                stats["frames_in"] = ch.shm_frames_in
                write_json(a.stats, stats)  # idle: up to date
                continue
            if a.many:
                ready = ch.recv_many(views=views)[::-1]
                stats["batches"] += len(ready) > 1
            else:
                ready = [ch.recv(views=views)]
        msg = decode_message(ready.pop())
        got += 1
        i = msg.header["i"]
        stats["gaps"] += i != last + 1
        last = stats["last"] = i
        arrays, msgs = check(i, msg.payload)
        stats["received"] = got
        if a.hold and msgs:
            held.append((i, msgs, arrays))
            while len(held) > a.hold:
                check_held(*held.popleft())
        else:
            for m in msgs:
                m.release()
        del arrays, msgs
        if got == 1 and a.ready:
            Path(a.ready).touch()
        if got % 20 == 0:
            stats["frames_in"] = ch.shm_frames_in
            write_json(a.stats, stats)
        if a.delay_ms:
            time.sleep(a.delay_ms / 1000)
    while held:
        check_held(*held.popleft())
    ready.clear()  # stopped mid-batch: what it did not read goes back too
    stats["frames_in"] = ch.shm_frames_in
    write_json(a.stats, stats)
    Path(a.done).touch()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("send", "recv"))
    ap.add_argument("--session", required=True)
    ap.add_argument("--address", required=True)
    ap.add_argument("--stats", required=True)
    ap.add_argument("--done", required=True, help="the receiver touches it when finished")
    ap.add_argument("--count", type=int, default=0, help="0: for ever")
    ap.add_argument("--sizes", default="100000")
    ap.add_argument("--mode", choices=("zero", "copy", "mixed"), default="zero")
    ap.add_argument("--wait-s", type=float, default=0.0)
    ap.add_argument("--shm-size", type=int, default=16 << 20)
    ap.add_argument("--views", choices=("yes", "no", "mixed"), default="yes")
    ap.add_argument("--hold", type=int, default=0, help="keep the views of the last N")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--ready", default="")
    ap.add_argument("--check-after", default="", help="stop when this file appears")
    ap.add_argument("--sndhwm", type=int, default=1000, help="and rcvBufSize")
    ap.add_argument("--batch", type=int, default=1, help="send_many of N messages")
    ap.add_argument("--stats-every", type=int, default=20, help="send: write stats every N")
    ap.add_argument("--batch-stop", action="store_true", help="stop sending at --done")
    ap.add_argument("--many", action="store_true", help="receive with recv_many")
    ap.add_argument("--stall", action="store_true", help="receive nothing (until killed)")
    ap.add_argument("--connect", action="store_true", help="the receiver connects (not binds)")
    a = ap.parse_args()
    kind, method = ("push", "connect") if a.role == "send" else ("pull", "bind")
    if a.connect:
        method = "connect"
    (cfg,) = parse_channel_config(
        f"name=data,type={kind},method={method},address={a.address},transport=shm,"
        f"shmSize={a.shm_size},sndBufSize={a.sndhwm},rcvBufSize={a.sndhwm},linger=0"
    )
    ctx: zmq.Context[Any] = zmq.Context()
    ch = open_channel(ctx, cfg, a.session)
    try:
        (send if a.role == "send" else recv)(a, ch)
    finally:
        ch.close()
        ctx.term()


if __name__ == "__main__":
    main()

"""Why CURVE stays near half of plain tcp here: the cipher's own speed, and what libzmq knobs do.

Run: python benchmarks/bench_curve_ceiling.py [--quick]

1. libsodium's ``crypto_box_afternm`` / ``crypto_box_open_afternm`` (XSalsa20-Poly1305
   with a precomputed key: what libzmq's CURVE runs on every message frame), called
   through ctypes on the libsodium that pyzmq's libzmq is linked with, against
   ``memcpy``; CPU time on one core, GB/s.
2. raw pyzmq PUSH -> PULL over tcp on loopback (two processes), plain and CURVE side by
   side for each libzmq setting: defaults, ``io_threads=2`` on both sides, 4 MB kernel
   socket buffers (SNDBUF/RCVBUF), zero-copy sends, and 2 or 4 connections (one PUSH
   socket each) with 2 I/O threads. MB/s is the best of the repeats; the ratio is
   CURVE / plain.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import zmq

_ZEROBYTES = 32  # crypto_box_ZEROBYTES: the padded API libzmq 4.3 uses

SETTINGS: dict[str, dict[str, int]] = {
    "defaults": {},
    "io_threads=2": {"io": 2},
    "SNDBUF/RCVBUF 4 MB": {"buf": 4 << 20},
    "zero-copy send": {"zero_copy": 1},
    "2 connections, io=2": {"conns": 2, "io": 2},
    "4 connections, io=2": {"conns": 4, "io": 2},
}


def _libsodium() -> ctypes.CDLL:
    libs = Path(zmq.__file__).parent.parent / "pyzmq.libs"
    found = glob.glob(str(libs / "libsodium*.so*")) or ["libsodium.so.23"]
    lib = ctypes.CDLL(found[0])
    if lib.sodium_init() < 0:
        raise SystemExit("libsodium: sodium_init failed")
    return lib


def _cpu_rate(fn: Callable[[], Any], nbytes: int, reps: int) -> float:
    fn()
    start = time.process_time()
    for _ in range(reps):
        fn()
    return nbytes * reps / (time.process_time() - start) / 1e9


def cipher_table(sizes: list[int], budget_bytes: int) -> None:
    lib = _libsodium()
    libc = ctypes.CDLL(None)
    key = ctypes.create_string_buffer(32)
    public, secret = ctypes.create_string_buffer(32), ctypes.create_string_buffer(32)
    lib.crypto_box_keypair(public, secret)
    lib.crypto_box_beforenm(key, public, secret)
    nonce = ctypes.create_string_buffer(24)
    print("size      crypto_box_afternm  open_afternm  memcpy   (GB/s of CPU time, one core)")
    for size in sizes:
        plain = ctypes.create_string_buffer(size + _ZEROBYTES)
        boxed = ctypes.create_string_buffer(size + _ZEROBYTES)
        copy = ctypes.create_string_buffer(size)
        n = ctypes.c_ulonglong(size + _ZEROBYTES)
        reps = max(20, budget_bytes // size)
        seal = _cpu_rate(partial(lib.crypto_box_afternm, boxed, plain, n, nonce, key), size, reps)
        lib.crypto_box_afternm(boxed, plain, n, nonce, key)
        opened = _cpu_rate(
            partial(lib.crypto_box_open_afternm, plain, boxed, n, nonce, key), size, reps
        )
        memcpy = _cpu_rate(partial(libc.memcpy, copy, plain, ctypes.c_size_t(size)), size, reps)
        print(f"{size:>9} {seal:>14.2f} {opened:>13.2f} {memcpy:>8.1f}")


def _receiver(conf: dict[str, int], keys: tuple[bytes, ...] | None, n: int, out: Any) -> None:
    context = zmq.Context(io_threads=conf.get("io", 1))
    sock = context.socket(zmq.PULL)
    if conf.get("buf"):
        sock.setsockopt(zmq.RCVBUF, conf["buf"])
    if keys:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = keys[0], keys[1]
    sock.bind("tcp://127.0.0.1:0")
    out.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    sock.recv(copy=False)
    start = time.perf_counter()
    for _ in range(n - 1):
        sock.recv(copy=False)
    out.put(time.perf_counter() - start)
    sock.close(0)
    context.term()


def _sender(conf: dict[str, int], keys: tuple[bytes, ...] | None, n: int, size: int,
            endpoint: str) -> None:  # fmt: skip
    context = zmq.Context(io_threads=conf.get("io", 1))
    socks = []
    for _ in range(conf.get("conns", 1)):
        sock = context.socket(zmq.PUSH)
        if conf.get("buf"):
            sock.setsockopt(zmq.SNDBUF, conf["buf"])
        if keys:
            sock.curve_serverkey = keys[0]
            sock.curve_publickey, sock.curve_secretkey = keys[2], keys[3]
        sock.connect(endpoint)
        socks.append(sock)
    payload = os.urandom(size)
    copy = not conf.get("zero_copy")
    for i in range(n):
        socks[i % len(socks)].send(payload, 0, copy)
    for sock in socks:
        sock.close(-1)
    context.term()


def hop_mb_s(conf: dict[str, int], curve: bool, size: int, n: int) -> float:
    keys = None
    if curve:
        server, client = zmq.curve_keypair(), zmq.curve_keypair()
        keys = (*server, *client)
    out: Any = mp.Queue()
    receiver = mp.Process(target=_receiver, args=(conf, keys, n, out))
    receiver.start()
    endpoint = out.get(timeout=30)
    sender = mp.Process(target=_sender, args=(conf, keys, n, size, endpoint))
    sender.start()
    seconds = out.get(timeout=300)
    receiver.join()
    sender.join()
    return (n - 1) * size / seconds / 1e6


def hop_table(size: int, n: int, repeat: int) -> None:
    print(f"\nraw pyzmq PUSH -> PULL over loopback tcp, {size} B messages, {n} per run")
    print(f"{'setting':<22} {'plain MB/s':>10} {'CURVE MB/s':>10} {'ratio':>6}")
    for name, conf in SETTINGS.items():
        best = {False: 0.0, True: 0.0}
        for _ in range(repeat):
            for curve in (False, True):  # alternated: the machine is shared
                best[curve] = max(best[curve], hop_mb_s(conf, curve, size, n))
        ratio = best[True] / best[False]
        print(f"{name:<22} {best[False]:>10.0f} {best[True]:>10.0f} {ratio:>6.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages, one repeat")
    parser.add_argument("--size", type=int, default=100_000)
    args = parser.parse_args()
    print(f"load average at the start: {os.getloadavg()}")
    cipher_table([1000, 100_000, 1_000_000], 20_000_000 if args.quick else 200_000_000)
    n = max(50, (300_000_000 if args.quick else 600_000_000) // args.size)
    hop_table(args.size, n, 1 if args.quick else 2)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()

"""Spawn latency of the zygote against multiprocessing's fork and subprocess.

Run: python benchmarks/bench_zygote.py
Prints, for 32 children of a trivial function: time until every pid is known, time
until every exit was noticed, per child; the zygote's parent holds numpy and awkward
imported (a realistic worker footprint), as do the comparisons.
"""

from __future__ import annotations

import multiprocessing as mp
import selectors
import subprocess
import sys
import time

import awkward  # noqa: F401  (realistic imports inherited by every fork)
import numpy  # noqa: F401

from evflow.runtime.zygote import Zygote

N = 32


def _noop() -> int:
    return 0


def bench_zygote() -> tuple[float, float]:
    zygote = Zygote().start()
    try:
        zygote.spawn(_noop)  # warm up: first unpickle imports this module in the zygote
        sel = selectors.DefaultSelector()
        sel.register(zygote.fileno(), selectors.EVENT_READ)
        got = 0
        while got < 1:
            sel.select(5)
            got += len(zygote.exits())
        start = time.perf_counter()
        for i in range(N):
            zygote.spawn(_noop, name=f"w{i}")
        spawned = time.perf_counter()
        got = 0
        while got < N:
            sel.select(5)
            got += len(zygote.exits())
        done = time.perf_counter()
        sel.close()
        return spawned - start, done - start
    finally:
        zygote.stop()


def bench_mp_fork() -> tuple[float, float]:
    ctx = mp.get_context("fork")
    start = time.perf_counter()
    procs = [ctx.Process(target=_noop) for _ in range(N)]
    for p in procs:
        p.start()
    spawned = time.perf_counter()
    for p in procs:
        p.join()
    return spawned - start, time.perf_counter() - start


def bench_subprocess() -> tuple[float, float]:
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(N)]
    spawned = time.perf_counter()
    for p in procs:
        p.wait()
    return spawned - start, time.perf_counter() - start


def main() -> None:
    rows = [
        ("zygote.spawn", bench_zygote()),
        ("multiprocessing fork", bench_mp_fork()),
        ("subprocess python -c pass", bench_subprocess()),
    ]
    base = rows[0][1][1]
    print(f"{N} children of a no-op function, parent has numpy + awkward imported")
    head = ("method", "spawned ms", "per child ms", "all exited ms", "ratio")
    print(f"{head[0]:28s} {head[1]:>11s} {head[2]:>13s} {head[3]:>14s} {head[4]:>6s}")
    for name, (spawned, done) in rows:
        print(
            f"{name:28s} {spawned * 1e3:11.1f} {spawned * 1e3 / N:13.2f} "
            f"{done * 1e3:14.1f} {done / base:6.2f}"
        )


if __name__ == "__main__":
    main()

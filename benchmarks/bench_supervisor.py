"""Death notice and restart latency of the supervisor (SIGKILL -> event -> new pid).

Run: python benchmarks/bench_supervisor.py
For 30 SIGKILLs of a supervised worker (restart on-failure, backoff 0) prints the time
from the kill to the ExitEvent and to the replacement's pid, and, side by side, the
same with multiprocessing (Process.sentinel + a new Process).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import statistics
import time
from multiprocessing.connection import wait
from typing import Any

import numpy  # noqa: F401  (a realistic worker footprint)

from evflow.runtime.supervisor import Supervisor

N = 30


def _sleep() -> None:
    time.sleep(60)


def bench_supervisor() -> tuple[list[float], list[float]]:
    notice, restart = [], []
    with Supervisor() as sup:
        proc = sup.add_function("w", _sleep, restart="on-failure", max_restarts=N, backoff_s=0)
        for _ in range(N):
            old = proc.pid
            assert old is not None
            t0 = time.perf_counter()
            os.kill(old, signal.SIGKILL)
            events: list[Any] = []
            while not events:
                events = sup.poll(1.0)
            t1 = time.perf_counter()
            sup.poll(0)  # starts the due restart
            t2 = time.perf_counter()
            assert proc.pid != old and proc.alive
            notice.append(t1 - t0)
            restart.append(t2 - t0)
    return notice, restart


def bench_multiprocessing() -> tuple[list[float], list[float]]:
    ctx = mp.get_context("fork")
    notice, restart = [], []
    p = ctx.Process(target=_sleep)
    p.start()
    for _ in range(N):
        t0 = time.perf_counter()
        os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
        wait([p.sentinel])
        p.join()
        t1 = time.perf_counter()
        p = ctx.Process(target=_sleep)
        p.start()
        t2 = time.perf_counter()
        notice.append(t1 - t0)
        restart.append(t2 - t0)
    p.kill()
    p.join()
    return notice, restart


def main() -> None:
    logging.basicConfig(level=logging.ERROR)  # one warning per restart otherwise
    rows = [
        ("supervisor (zygote)", bench_supervisor()),
        ("multiprocessing", bench_multiprocessing()),
    ]
    print(f"{N} SIGKILLs of one worker, median (max) in ms")
    print(f"{'method':22s} {'kill->notice':>18s} {'kill->new pid':>18s}")
    for name, (notice, restart) in rows:
        print(
            f"{name:22s} {statistics.median(notice) * 1e3:8.2f} ({max(notice) * 1e3:6.2f})"
            f"  {statistics.median(restart) * 1e3:8.2f} ({max(restart) * 1e3:6.2f})"
        )


if __name__ == "__main__":
    main()

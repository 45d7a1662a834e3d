"""What a wake-up costs here: the same small piece of framework-like work, timed in
thread CPU right after sleeps of different lengths.

    python benchmarks/bench_wake_tax.py [--rounds N] [--busy] [--spin]

The work is what a paced chain does per tick: a few numpy calls on small arrays, a
msgpack header, a dict, and one ZeroMQ send over ipc to a reader thread. On a machine
whose idle cores are parked (a VM's vCPU halts and the host runs others on that core:
caches, TLBs and branch predictors come back cold) the same work costs many times more
after a long sleep than in a loop. A paced chain (replay at 1 kHz in 32 ms ticks) pays
this on every process at every tick; a loaded one (as fast as possible) does not. The
ratio says how much of a paced framework CPU share is the machine's and not evflow's.

``--busy`` keeps the other core busy meanwhile (a farm node under load). ``--spin``
burns this thread's CPU (``burn_cpu``, the benchmarks' 1 ms/event work) for the same
times instead of sleeping: if the work is as slow after spinning as after sleeping, the
tax is the time since the code last ran, not the wake-up (a busy path between two
ticks pays it as well as an idle one).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import threading
import time
from typing import Any

import msgpack
import numpy as np
import zmq

from evflow.io.generators import burn_cpu

SLEEPS_MS = (0.0, 1.0, 10.0, 32.0, 100.0)


def _work(sock: zmq.Socket[Any], k: int) -> None:
    ids = np.arange(k, k + 32, dtype=np.int64)
    lens = np.full(32, 100, np.int64)
    header = {"s": 1, "e": ids.astype("<u8").tobytes(), "n": lens.astype("<u4").tobytes()}
    table = {str(i): i for i in range(32)}
    offs = np.cumsum(lens) - lens
    sock.send_multipart([b"\x03", msgpack.packb(header), bytes(int(offs[-1]) + len(table))])


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def measure(rounds: int, spin: bool = False) -> dict[float, list[float]]:
    ctx: zmq.Context[Any] = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="benchwake-") as d:
        addr = f"ipc://{d}/s"
        pull = ctx.socket(zmq.PULL)
        pull.bind(addr)
        push = ctx.socket(zmq.PUSH)
        push.connect(addr)
        stop = threading.Event()

        def drain() -> None:
            while not stop.is_set():
                if pull.poll(50):
                    pull.recv_multipart()

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        out: dict[float, list[float]] = {s: [] for s in SLEEPS_MS}
        k = 0
        for _ in range(rounds):  # interleaved, so that drifts hit every setting alike
            for s in SLEEPS_MS:
                if s and spin:
                    burn_cpu(s)
                elif s:
                    time.sleep(s / 1e3)
                else:  # hot: the same work just ran (a loop, as fast as possible)
                    for _ in range(5):
                        _work(push, k)
                t0 = time.thread_time_ns()
                _work(push, k)
                out[s].append((time.thread_time_ns() - t0) / 1e3)
                k += 32
        stop.set()
        reader.join()
        push.close(0)
        pull.close(0)
    ctx.term()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--busy", action="store_true", help="keep the other core busy")
    ap.add_argument("--spin", action="store_true", help="burn CPU instead of sleeping")
    a = ap.parse_args()
    busy = None
    if a.busy:
        busy = multiprocessing.Process(target=_spin, args=(3600.0,), daemon=True)
        busy.start()
    try:
        out = measure(a.rounds, a.spin)
    finally:
        if busy is not None:
            busy.terminate()
            busy.join()
    hot = statistics.median(out[0.0])
    print(
        f"bench_wake_tax {time.strftime('%Y-%m-%d %H:%M')}, {a.rounds} rounds"
        f"{', other core busy' if a.busy else ''}: thread CPU of the same work (us)"
    )
    print(f"{'after spin' if a.spin else 'after sleep':>12} {'median':>8} {'p90':>8} {'x hot':>7}")
    for s, xs in out.items():
        xs.sort()
        med, p90 = statistics.median(xs), xs[int(0.9 * (len(xs) - 1))]
        print(f"{s:>10.0f}ms {med:>8.1f} {p90:>8.1f} {med / hot:>6.1f}x")


if __name__ == "__main__":
    main()

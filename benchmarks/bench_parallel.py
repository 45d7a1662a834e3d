"""Parallel processing: speedup, serial cost, chain throughput and start-up, one run.

    python benchmarks/bench_parallel.py [--quick] [--serial | --speedup] [--repeat N] [--plots DIR]

- speedup: eta(p) = T(1) / T(p) for 1 ms and 10 ms of CPU work per event (BusyWork),
  p = 1 .. 4 (2 cores here, so 3 and 4 oversubscribe), T = the run's wall time from
  the call to the last event written (start-up included); plot with the ideal line;
- serial cost: CPU microseconds per event spent by the input and the output process
  (``time.process_time`` in each, reported in the summary) for 1 kB, 100 kB and 1 MB
  events with no-op workers;
- chain throughput: events/s and GB/s through input -> 2 no-op workers -> output,
  side by side with a raw pyzmq ROUTER -> DEALER -> PUSH/PULL chain (same processes,
  same payload bytes, one message per event, credit 4, nothing else); each size runs
  twice, interleaved: without (EVFLOW_NO_FASTPATH=1) and with the encoded-event fast
  path, and the fast path with transport="shm", so that the ratios are measured under
  the same load (``--serial``: only this);
- start-up: seconds from ``run_parallel`` to the first event processed and to every
  worker's HELLO, for 2, 8 and 32 workers (in-process; the python interpreter's own
  start and imports are measured separately).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path as FsPath
from typing import Any

import zmq

import evflow
from evflow.io import BusyWork, ToyGenerator
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import run_parallel
from evflow.processing.parallel.input.fastpath import ENV_DISABLE


def run(n: int, payload: int, work_ms: float, workers: int, transport: str = "zmq") -> Any:
    path = evflow.Path([ToyGenerator(n_events=n, payload_bytes=payload), BusyWork(work_ms=work_ms)])
    return run_parallel(path, ProcessOptions(workers=workers, quiet=True, transport=transport))


# --- speedup --------------------------------------------------------------------------------
def speedup(quick: bool, repeat: int = 3) -> dict[float, dict[int, float]]:
    """T(p) for p = 1..4, the best of ``repeat`` rounds (p = 1..4 in each round, so
    that a slow minute of the VM does not stretch one p alone: T(1) moved by 1.8x
    between single runs here)."""
    results: dict[float, dict[int, float]] = {}
    for work_ms, n in ((1.0, 1500 if quick else 4000), (10.0, 150 if quick else 400)):
        times: dict[int, float] = {}
        for _ in range(repeat):
            for p in (1, 2, 3, 4):
                t = run(n, 1024, work_ms, p).wall_s
                times[p] = min(t, times.get(p, t))
        results[work_ms] = times
        t1 = times[1]
        print(
            f"\nspeedup, {work_ms:g} ms/event, {n} events, best of {repeat} "
            "(ideal eta(p) = min(p, 2 cores))"
        )
        print(" p   T(p) s   eta(p)   eta/p")
        for p, t in times.items():
            print(f"{p:2d} {t:8.3f} {t1 / t:8.3f} {t1 / t / p:7.3f}")
    return results


def plot_speedup(results: dict[float, dict[int, float]], out: FsPath) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    ps = [1, 2, 3, 4]
    ax.plot(ps, ps, "k--", label="ideal (p)")
    ax.plot(ps, [min(p, os.cpu_count() or 2) for p in ps], "k:", label="ideal on 2 cores")
    for work_ms, times in results.items():
        ax.plot(ps, [times[1] / times[p] for p in ps], "o-", label=f"{work_ms:g} ms/event")
    ax.set_xlabel("worker processes p")
    ax.set_ylabel("speedup T(1)/T(p)")
    ax.set_title("evflow parallel speedup (2-core machine)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"plot: {out}")


# --- serial cost and chain throughput -------------------------------------------------------
SIZES = ((1024, 100_000), (100_000, 10_000), (1_000_000, 2_000))


def _evflow_row(n: int, size: int, fast: bool, transport: str = "zmq") -> dict[str, float]:
    """One no-op chain run; ``fast=False`` sets EVFLOW_NO_FASTPATH (the old path)."""
    if fast:
        os.environ.pop(ENV_DISABLE, None)
    else:
        os.environ[ENV_DISABLE] = "1"
    try:
        s = run(n, size, 0.0, 2, transport)
    finally:
        os.environ.pop(ENV_DISABLE, None)
    return {
        "rate": n / s.wall_s,
        "gbs": n * size / s.wall_s / 1e9,
        "in_us": 1e6 * s.counters["input CPU (s)"] / n,
        "out_us": 1e6 * s.counters["output CPU (s)"] / n,
        "work_us": 1e6 * s.counters.get("workers CPU (s)", 0.0) / n,
    }


def serial_and_chain(quick: bool) -> list[dict[str, Any]]:
    """Per size: the old path (EVFLOW_NO_FASTPATH=1), the fast path, the raw chain,
    interleaved twice so that both see the same machine load."""
    rows: list[dict[str, Any]] = []
    for size, n in SIZES:
        n = n // 4 if quick else n
        for rep in (1, 2):
            before = _evflow_row(n, size, fast=False)
            after = _evflow_row(n, size, fast=True)
            shm = _evflow_row(n, size, fast=True, transport="shm")
            raw_s = raw_chain(n, size, workers=2)
            rows.append(
                {"size": size, "n": n, "rep": rep, "before": before, "after": after, "shm": shm,
                 "raw_rate": n / raw_s, "raw_gbs": n * size / raw_s / 1e9}
            )  # fmt: skip
    print("\nchain with 2 no-op workers vs raw pyzmq (same bytes), serial CPU per event;")
    print("before = EVFLOW_NO_FASTPATH=1 (input encodes stores, workers decode every event)")
    print("shm = the fast path with transport='shm' (large events through shared memory)")
    print(
        " size     rep  path      ev/s      GB/s   raw ev/s  raw GB/s  /raw"
        "  input us/ev  output us/ev  workers us/ev"
    )
    for r in rows:
        for label in ("before", "after", "shm"):
            e = r[label]
            print(
                f"{r['size']:>9,} {r['rep']:>2}  {label:<6} {e['rate']:>10,.0f} {e['gbs']:6.3f} "
                f"{r['raw_rate']:>10,.0f} {r['raw_gbs']:6.3f} {e['rate'] / r['raw_rate']:6.2f}"
                f" {e['in_us']:11.1f} {e['out_us']:12.1f} {e['work_us']:13.1f}"
            )
        b, a, m = r["before"], r["after"], r["shm"]
        print(
            f"{'':>9}     after/before: rate x{a['rate'] / b['rate']:.2f}, "
            f"input CPU x{a['in_us'] / b['in_us']:.2f}; "
            f"shm/after: rate x{m['rate'] / a['rate']:.2f}"
        )
    return rows


def _raw_worker(n_credit: int) -> None:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect("ipc:///tmp/evflow-bench-raw-in")
    push = ctx.socket(zmq.PUSH)
    push.connect("ipc:///tmp/evflow-bench-raw-out")
    dealer.send(b"R" * n_credit)  # initial credit
    while True:
        frame = dealer.recv(copy=False)
        if len(frame) == 0:
            break
        push.send(frame, copy=False)
        dealer.send(b"R")
    for s in (dealer, push):
        s.close(linger=0)  # the output has counted everything before END is sent
    ctx.term()


def _raw_output(total: int) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("ipc:///tmp/evflow-bench-raw-out")
    got = 0
    while got < total:
        pull.recv(copy=False)
        got += 1
    pull.close(linger=0)
    ctx.term()


def raw_chain(n: int, size: int, workers: int) -> float:
    """A bare ROUTER -> DEALER -> PUSH/PULL chain moving ``n`` messages of ``size`` bytes.

    Runs in a forked helper so that this process never creates a zmq context (the
    zygote of the evflow runs must be started before one).
    """
    import multiprocessing as mp

    fork = mp.get_context("fork")
    parent_end, child_end = fork.Pipe()
    helper = fork.Process(target=_raw_router, args=(n, size, workers, child_end))
    helper.start()
    elapsed = float(parent_end.recv())
    helper.join()
    return elapsed


def _raw_router(n: int, size: int, workers: int, result: Any) -> None:
    import multiprocessing as mp

    fork = mp.get_context("fork")
    out = fork.Process(target=_raw_output, args=(n,))
    out.start()
    ws = [fork.Process(target=_raw_worker, args=(4,)) for _ in range(workers)]
    for w in ws:
        w.start()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("ipc:///tmp/evflow-bench-raw-in")
    payload = os.urandom(size)
    t0 = time.monotonic()
    sent = 0
    idents = set()
    while sent < n:
        ident, credit = router.recv_multipart()
        idents.add(ident)
        for _ in range(len(credit)):
            if sent < n:
                router.send_multipart([ident, payload], copy=size < 65536)
                sent += 1
    out.join()
    elapsed = time.monotonic() - t0
    while len(idents) < workers:
        idents.add(router.recv_multipart()[0])
    for ident in idents:
        router.send_multipart([ident, b""])
    for w in ws:
        w.join()
    router.close(linger=0)
    ctx.term()
    for f in ("in", "out"):
        FsPath(f"/tmp/evflow-bench-raw-{f}").unlink(missing_ok=True)
    result.send(elapsed)


# --- start-up -------------------------------------------------------------------------------
def startup() -> list[tuple[int, float, float]]:
    rows = []
    for p in (2, 8, 32):
        s = run(4 * p, 1024, 0.0, p)
        rows.append(
            (
                p,
                s.counters["start-up to first event (s)"],
                s.counters["start-up of all workers (s)"],
            )
        )
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", "import evflow.io, evflow.processing.parallel.run.engine"]
    )
    interp = time.monotonic() - t0
    print("\nstart-up (from run_parallel(); the interpreter + imports take", f"{interp:.2f} s)")
    print(" workers  first event s  all workers HELLO s")
    for p, first, ready in rows:
        print(f"{p:8d} {first:14.3f} {ready:19.3f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events (a smoke run)")
    parser.add_argument("--plots", default=str(FsPath(__file__).parent / "plots"))
    parser.add_argument(
        "--serial", action="store_true", help="only the serial-cost and chain measurements"
    )
    parser.add_argument(
        "--speedup", action="store_true", help="only the speedup measurement and its plot"
    )
    parser.add_argument("--repeat", type=int, default=3, help="speedup rounds (best of)")
    args = parser.parse_args()
    print(f"bench_parallel, {os.cpu_count()} cores, pyzmq {zmq.__version__}")
    if args.serial:
        serial_and_chain(args.quick)
        return
    results = speedup(args.quick, args.repeat)
    plots = FsPath(args.plots)
    plots.mkdir(parents=True, exist_ok=True)
    plot_speedup(results, plots / "parallel_speedup.png")
    if args.speedup:
        return
    serial_and_chain(args.quick)
    startup()


if __name__ == "__main__":
    main()

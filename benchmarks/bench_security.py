"""The cost of the connection check (ZAP, transport/security.py): A/B in one run.

    python benchmarks/bench_security.py [--quick] [--rounds N]

Each round runs, interleaved so that both see the same machine load:

- the 1 kB chain: ``n`` toy events of 1 kB through input -> 2 no-op workers ->
  output, with ``ipc_auth`` off (NULL mechanism, no ZAP handler) and on (PLAIN with
  the run's secret, a ZAP handler thread in the parent, the input and the output);
  events/s and the input's and output's CPU per event;
- start-up with 2 and 8 workers: seconds from ``run_parallel`` to the first event
  processed and to every worker's HELLO (each connection is one ZAP round trip);
- the handshake alone: milliseconds from ``connect`` to the first message received
  over ipc, NULL vs PLAIN checked by the ZAP handler (peer credentials included).

Reports the median of the rounds per figure and the ratio on/off.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import zmq

import evflow
from evflow.io import BusyWork, ToyGenerator
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import run_parallel
from evflow.transport.security import RunAuth


def run(n: int, workers: int, auth: bool) -> Any:
    path = evflow.Path([ToyGenerator(n_events=n, payload_bytes=1024), BusyWork(work_ms=0.0)])
    options = ProcessOptions(workers=workers, quiet=True, extra={"ipc_auth": auth})
    return run_parallel(path, options)


def chain_row(n: int, auth: bool) -> dict[str, float]:
    s = run(n, 2, auth)
    return {
        "events/s": n / s.wall_s,
        "input us/event": 1e6 * s.counters["input CPU (s)"] / n,
        "output us/event": 1e6 * s.counters["output CPU (s)"] / n,
    }


def startup_row(workers: int, auth: bool) -> dict[str, float]:
    s = run(4 * workers, workers, auth)
    return {
        f"first event s (p={workers})": s.counters["start-up to first event (s)"],
        f"all HELLO s (p={workers})": s.counters["start-up of all workers (s)"],
    }


def handshake_ms(auth: bool, n: int = 200) -> float:
    """Mean ms from a PUSH's connect to its first message arriving at a PULL (ipc)."""
    ctx = zmq.Context()
    run_auth = RunAuth.generate(zygote_pid=0)
    handler = run_auth.handler(ctx, "bench", {}) if auth else None
    with tempfile.TemporaryDirectory() as tmp:
        server = ctx.socket(zmq.PULL)
        if auth:
            run_auth.server(server, "ctl")
        server.bind(f"ipc://{tmp}/s")
        t0 = time.perf_counter()
        for _ in range(n):
            client = ctx.socket(zmq.PUSH)
            if auth:
                run_auth.client(client, "worker-0")
            client.connect(f"ipc://{tmp}/s")
            client.send(b"x")
            server.recv()
            client.close(linger=0)
        elapsed = time.perf_counter() - t0
        server.close(linger=0)
    if handler is not None:
        handler.close()
    ctx.term()
    return 1000 * elapsed / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events (a smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n = 25_000 if args.quick else 100_000
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for auth in (False, True):
            row = chain_row(n, auth)
            for p in (2, 8):
                row.update(startup_row(p, auth))
            row["handshake ms"] = handshake_ms(auth)
            rows[auth].append(row)
    print(f"\nconnection check off vs on: median of {args.rounds} rounds, 1 kB chain of {n}")
    print(f"{'figure':28s} {'off':>10s} {'on':>10s} {'on/off':>8s}")
    for key in rows[False][0]:
        off = statistics.median(r[key] for r in rows[False])
        on = statistics.median(r[key] for r in rows[True])
        print(f"{key:28s} {off:10.4g} {on:10.4g} {on / off:8.3f}")


if __name__ == "__main__":
    main()

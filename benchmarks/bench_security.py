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

``--base-src DIR`` instead compares two source trees (e.g. ``git archive`` of the
commit before the hostile-input work, unpacked): the 1 kB chain in subprocesses,
alternating the base tree and this one, with each tree's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
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


_CHAIN = """
import json, evflow
from evflow.io import BusyWork, ToyGenerator
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import run_parallel
n = 100000
p = evflow.Path([ToyGenerator(n_events=n, payload_bytes=1024), BusyWork(work_ms=0.0)])
s = run_parallel(p, ProcessOptions(workers=2, quiet=True))
c = s.counters
print(json.dumps({"events/s": n / s.wall_s, "input us/event": 1e6 * c["input CPU (s)"] / n,
                  "output us/event": 1e6 * c["output CPU (s)"] / n,
                  "first event s": c["start-up to first event (s)"]}))
"""


def compare_trees(base_src: str, rounds: int) -> None:
    this_src = str(Path(__file__).resolve().parents[1] / "src")
    rows: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    for _ in range(rounds):
        for label, src in (("base", base_src), ("this", this_src)):
            env = {**os.environ, "PYTHONPATH": src}
            out = subprocess.run(
                [sys.executable, "-c", _CHAIN], env=env, capture_output=True, text=True, check=True
            ).stdout
            rows[label].append(json.loads(out.strip().splitlines()[-1]))
    print(f"\nbase tree vs this one: median of {rounds} rounds, 1 kB chain of 100000")
    print(f"{'figure':28s} {'base':>10s} {'this':>10s} {'this/base':>9s}")
    for key in rows["base"][0]:
        base = statistics.median(r[key] for r in rows["base"])
        this = statistics.median(r[key] for r in rows["this"])
        print(f"{key:28s} {base:10.4g} {this:10.4g} {this / base:9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events (a smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base-src", help="compare this source tree with another one")
    args = parser.parse_args()
    if args.base_src:
        compare_trees(args.base_src, args.rounds)
        return
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

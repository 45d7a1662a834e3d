"""A local ``-p N`` run before and after a change, side by side: start-up, chain, speedup.

    python benchmarks/bench_one_runtime.py --base SRC_DIR [--new SRC_DIR] [--quick] [--rounds N]
        [--only startup|chain|speedup]

Every measurement runs in a fresh interpreter with ``PYTHONPATH`` set to one source tree
(``--base``: e.g. a worktree of the commit before; ``--new``: this tree's ``src``), and
the two trees alternate measurement by measurement (base, new, base, new, ...) so that
both see the same load of a shared machine. Both trees are byte-compiled first (with
``PYTHONDONTWRITEBYTECODE`` set, a tree without ``__pycache__`` would pay the compile
in every probe). Printed per tree, the median of the rounds:

- start-up of 32 workers: seconds from ``run_parallel`` to the first event and to
  every worker's HELLO (the summary's own figures), and the whole process's wall time
  (interpreter, imports, the 128-event run, exit) and the calling process's CPU
  seconds for the run (CPU time: less at the mercy of the machine's load);
- chain: events/s of 1 kB events through input -> 2 no-op workers -> output, and the
  calling process's CPU microseconds per event (its watch loop: the part a change of
  the process management touches), with the run's total CPU per event;
- speedup T(1)/T(2) of 10 ms and 1 ms of CPU work per event (2 cores: at most 2).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROBE = r"""
import json, resource, sys, time
import evflow
from evflow.io import BusyWork, ToyGenerator
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import run_parallel
import evflow.processing.parallel.run.engine  # its import: in the process time, not the run's

kind, n, payload, work_ms, workers = sys.argv[1], *map(float, sys.argv[2:6])
path = evflow.Path([ToyGenerator(n_events=int(n), payload_bytes=int(payload)),
                    BusyWork(work_ms=work_ms)])
c0 = resource.getrusage(resource.RUSAGE_SELF)
s = run_parallel(path, ProcessOptions(workers=int(workers), quiet=True))
c1 = resource.getrusage(resource.RUSAGE_SELF)
parent_cpu = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
roles_cpu = sum(float(s.counters.get(k, 0.0))
                for k in ("input CPU (s)", "output CPU (s)", "workers CPU (s)"))
print(json.dumps({"wall_s": s.wall_s, "written": s.events_written,
                  "first_s": s.counters.get("start-up to first event (s)"),
                  "ready_s": s.counters.get("start-up of all workers (s)"),
                  "parent_cpu_s": parent_cpu, "roles_cpu_s": roles_cpu}))
"""


def probe(src: str, n: int, payload: int, work_ms: float, workers: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": src}
    args = [sys.executable, "-c", PROBE, "x", str(n), str(payload), str(work_ms), str(workers)]
    t0 = time.monotonic()
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    process_s = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"probe failed with {src}:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = process_s
    if result["written"] != n:
        raise SystemExit(f"{src}: {result['written']} of {n} events written")
    return result


def measure(src: str, quick: bool, only: str = "") -> dict[str, float]:
    """One round of every figure for the tree ``src`` (``only``: startup, chain, speedup)."""
    row: dict[str, float] = {}
    if only in ("", "startup"):
        up = probe(src, 128, 1024, 0.0, 32)
        row["startup32_first_s"] = up["first_s"]
        row["startup32_all_s"] = up["ready_s"]
        row["startup32_process_s"] = up["process_s"]  # interpreter, imports, run, exit
        row["startup32_parent_cpu_s"] = up["parent_cpu_s"]  # the caller's CPU for the run
    if only in ("", "chain"):
        chain_n = 20_000 if quick else 100_000
        chain = probe(src, chain_n, 1024, 0.0, 2)
        row.update(chain_row(chain, chain_n))
    if only in ("", "speedup"):
        for work_ms, n in ((10.0, 100 if quick else 300), (1.0, 1000 if quick else 3000)):
            t1 = probe(src, n, 1024, work_ms, 1)["wall_s"]
            t2 = probe(src, n, 1024, work_ms, 2)["wall_s"]
            row[f"speedup_{work_ms:g}ms"] = t1 / t2
    return row


def chain_row(chain: dict[str, Any], chain_n: int) -> dict[str, float]:
    return {
        "chain_ev_s": chain_n / chain["wall_s"],
        "chain_parent_us_ev": 1e6 * chain["parent_cpu_s"] / chain_n,
        "chain_total_us_ev": 1e6 * (chain["parent_cpu_s"] + chain["roles_cpu_s"]) / chain_n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="source dir of the 'before' tree")
    parser.add_argument("--new", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--quick", action="store_true", help="fewer events, 2 rounds (< 1 min)")
    parser.add_argument("--rounds", type=int, default=0, help="alternated rounds (default 3)")
    parser.add_argument("--only", choices=("startup", "chain", "speedup"), default="")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    trees = {"before": args.base, "after": args.new}
    for src in trees.values():  # both with bytecode (PYTHONDONTWRITEBYTECODE may be set)
        compileall.compile_dir(src, quiet=1)
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for r in range(rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for label in order:
            rows[label].append(measure(trees[label], args.quick, args.only))
    print(f"one runtime A/B, {rounds} alternated rounds, medians; load: {os.getloadavg()}")
    keys = list(rows["before"][0])
    print(f"{'figure':<22} {'before':>10} {'after':>10} {'after/before':>13}   rounds b | a")
    for key in keys:
        b = statistics.median(x[key] for x in rows["before"])
        a = statistics.median(x[key] for x in rows["after"])
        each = " ".join(f"{x[key]:.3g}" for x in rows["before"]) + " | "
        each += " ".join(f"{x[key]:.3g}" for x in rows["after"])
        print(f"{key:<22} {b:10.4g} {a:10.4g} {a / b:13.3f}   {each}")


if __name__ == "__main__":
    main()

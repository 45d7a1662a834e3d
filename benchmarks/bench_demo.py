"""`evflow demo` sequential (-p 0) against parallel (-p N), side by side in one run.

    python benchmarks/bench_demo.py [--repeat 3] [--workers 2]

Runs the whole command (imports, reading, fits, ROOT output, plot) alternately and
reports per run: the command's wall time, the run's wall time (reading to last event
written, from the summary line), the CPU time of the command and all its processes
(user + sys, from getrusage of the reaped children), and the load average, since on
a shared machine other processes take cores. Medians and the speedup at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

RUN_LINE = re.compile(r"events in ([0-9.]+) s \(([0-9,]+) events/s")


def run_once(workers: int, out: str) -> dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "evflow", "demo", "-p", str(workers), "-o", out],
        capture_output=True,
        text=True,
        check=True,
    )
    wall_s = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    match = RUN_LINE.search(proc.stdout)
    assert match, proc.stdout[:500]
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "command_s": wall_s,
        "run_s": float(match.group(1)),
        "cpu_s": cpu_s,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    results: dict[int, list[dict[str, float]]] = {0: [], args.workers: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for workers in results:
                r = run_once(workers, os.path.join(tmp, f"p{workers}"))
                results[workers].append(r)
                print(
                    f"-p {workers}: command {r['command_s']:6.2f} s  run {r['run_s']:6.2f} s  "
                    f"CPU {r['cpu_s']:6.2f} s  load {r['load']:.2f}",
                    flush=True,
                )
    med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in results.items()}
    seq, par = med[0], med[args.workers]
    print(f"\nmedians of {args.repeat} ({os.cpu_count()} cores)")
    print("| mode | command (s) | run (s) | CPU, all processes (s) |")
    print("|---|---|---|---|")
    for w, m in med.items():
        name = "sequential (-p 0)" if w == 0 else f"parallel (-p {w})"
        print(f"| {name} | {m['command_s']:.2f} | {m['run_s']:.2f} | {m['cpu_s']:.2f} |")
    print(
        f"speedup of the run: {seq['run_s'] / par['run_s']:.2f}x, of the command: "
        f"{seq['command_s'] / par['command_s']:.2f}x; parallel CPU overhead: "
        f"{par['cpu_s'] / seq['cpu_s']:.2f}x"
    )


if __name__ == "__main__":
    main()

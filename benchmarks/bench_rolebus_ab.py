"""A/B: the 1 kB no-op event chain with and without the roles on the control bus.

    python benchmarks/bench_rolebus_ab.py [--base REV] [--repeats 5] [--events 100000]
    python benchmarks/bench_rolebus_ab.py --startup [--base REV] [--repeats 10]

A is the tree at git revision ``--base`` (default ``HEAD~1``, extracted with
``git archive`` into a temporary directory), B is this checkout's ``src``. Each run is
a fresh ``python`` process with that ``src`` on PYTHONPATH running ToyGenerator(1 kB)
-> BusyWork(0 ms) on 2 workers; runs alternate A, B, A, B, ... so both see the same
machine load. Reported: best-of-N events/s, the input's and the output's CPU per
event (lowest of N), their ratios B / A, and the median of the per-repeat rate ratios.
``--startup``: 32 workers (each now opens a bus client), 2000 events; the medians of
"start-up to first event" and "start-up of all workers" (every worker's HELLO).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys
import evflow
from evflow.io import BusyWork, ToyGenerator
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import run_parallel

n = int(sys.argv[1])
path = evflow.Path([ToyGenerator(n_events=n, payload_bytes=1024), BusyWork(work_ms=0.0)])
s = run_parallel(path, ProcessOptions(workers=2, quiet=True))
assert s.events_written == n, s.events_written
print(json.dumps({
    "rate": n / s.wall_s,
    "in_us": 1e6 * s.counters["input CPU (s)"] / n,
    "out_us": 1e6 * s.counters["output CPU (s)"] / n,
    "src": evflow.__file__,
}))
"""


CHILD_STARTUP = """
import json
import evflow
from evflow.io import BusyWork, ToyGenerator
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import run_parallel

path = evflow.Path([ToyGenerator(n_events=2000, payload_bytes=1024), BusyWork(work_ms=0.0)])
s = run_parallel(path, ProcessOptions(workers=32, quiet=True))
print(json.dumps({
    "first_s": s.counters["start-up to first event (s)"],
    "all_s": s.counters["start-up of all workers (s)"],
    "src": evflow.__file__,
}))
"""


def extract(rev: str, into: Path) -> Path:
    """``src`` of git revision ``rev`` under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src"],
        check=True,
        capture_output=True,
    ).stdout
    tar_path = into / "src.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def one(src: Path, n: int, code: str = CHILD) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", code, str(n)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    row = json.loads(out.strip().splitlines()[-1])
    assert str(row.pop("src")).startswith(str(src)), "ran the wrong evflow"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD~1", help="git revision of A (default HEAD~1)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--startup", action="store_true", help="start-up of 32 workers")
    args = parser.parse_args()
    if args.startup:
        startup(args.base, args.repeats)
        return
    with tempfile.TemporaryDirectory() as tmp:
        a_src = extract(args.base, Path(tmp))
        b_src = ROOT / "src"
        rows: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for i in range(args.repeats):
            for label, src in (
                (("A", a_src), ("B", b_src))
                if i % 2 == 0
                else (
                    ("B", b_src),
                    ("A", a_src),
                )
            ):
                rows[label].append(one(src, args.events))
                r = rows[label][-1]
                print(
                    f"rep {i + 1} {label}: {r['rate']:>10,.0f} ev/s  input {r['in_us']:.2f} "
                    f"us/ev  output {r['out_us']:.2f} us/ev",
                    flush=True,
                )
    # each repeat ran A and B back to back: their ratio sees the same machine load
    pair = sorted(b["rate"] / a["rate"] for a, b in zip(rows["A"], rows["B"], strict=True))
    best = {k: max(v, key=lambda r: r["rate"]) for k, v in rows.items()}
    low = {k: {m: min(r[m] for r in v) for m in ("in_us", "out_us")} for k, v in rows.items()}
    print(f"\n1 kB no-op chain, 2 workers, {args.events} events, best of {args.repeats}")
    print(f"A = {args.base} (roles not on the bus), B = this tree")
    print("       ev/s (best)  input us/ev (min)  output us/ev (min)")
    for k in ("A", "B"):
        print(f"  {k}  {best[k]['rate']:>12,.0f} {low[k]['in_us']:18.2f} {low[k]['out_us']:19.2f}")
    print(f"  B/A  rate per repeat (A, B back to back): median x{pair[len(pair) // 2]:.3f}")
    print(
        f"  B/A  rate x{best['B']['rate'] / best['A']['rate']:.3f}, input CPU "
        f"x{low['B']['in_us'] / low['A']['in_us']:.3f}, output CPU "
        f"x{low['B']['out_us'] / low['A']['out_us']:.3f}"
    )


def startup(base: str, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {"A": extract(base, Path(tmp)), "B": ROOT / "src"}
        rows: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for i in range(repeats):
            for label in ("A", "B") if i % 2 == 0 else ("B", "A"):
                rows[label].append(one(srcs[label], 0, CHILD_STARTUP))
    print(f"\nstart-up, 32 workers, {repeats} runs each, interleaved; A = {base}, B = this tree")
    print("     first event s (median)  all workers s (median)   all workers s (each)")
    for k in ("A", "B"):
        first = sorted(r["first_s"] for r in rows[k])
        every = sorted(r["all_s"] for r in rows[k])
        each = " ".join(f"{x:.2f}" for x in every)
        print(f"  {k}  {first[len(first) // 2]:22.3f} {every[len(every) // 2]:22.3f}   {each}")


if __name__ == "__main__":
    main()

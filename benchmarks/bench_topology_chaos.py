"""A chaos campaign against whole ``evflow up`` topologies: N runs per kind.

    python benchmarks/bench_topology_chaos.py [--runs 50] [--kinds data,qc,trigger]
        [--seed 1000] [--budget-s 1200] [--no-hostile] [--no-controller] [--all-victims]

Each run is one seeded plan of tests/_topo_chaos.py (the harness of
tests/test_topology_chaos.py): devices SIGKILLed at random moments (each kind's
devices have ``restart = "on-failure"``), hostile messages on the bus and on every
channel, and in about one run of four the controller SIGINTed or SIGKILLed. A run
ends within the harness's bound or counts as a hang. Printed: one line per run (a
failed one with what it did and evflow up's last lines) and a table per kind: runs,
device kills, controller SIGINTs and SIGKILLs, hostile messages, and the outcomes:
passed (exact counts), clear error (one error line naming a device), hang, wrong
result (exit 0, counts or QC objects wrong), unclear error, runs with leftovers.
``--all-victims`` also kills and attacks the devices of open defects the harness
found (``EXCLUDED`` and ``SPARED`` in tests/_topo_chaos.py, each with its reason).
Kinds take turns run by run, so that a budget cut leaves them even; no new run starts
after ``--budget-s``.
Replay one run: ``--kinds K --seed S --runs 1``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import _topo_chaos
from _topo_chaos import KINDS, Outcome, plan_run, run_once

RESULTS = ("passed", "clear error", "hang", "wrong result", "unclear error")


def table(done: dict[str, list[Outcome]]) -> str:
    head = (
        f"{'kind':8} {'runs':>5} {'kills':>6} {'SIGINT':>7} {'SIGKILL':>8} {'hostile':>8} "
        + " ".join(f"{r:>13}" for r in RESULTS)
        + f" {'leftovers':>10}"
    )
    rows = [head, "-" * len(head)]
    for kind, outs in done.items():
        res = Counter(o.result for o in outs)
        ctl = Counter(o.controller for o in outs)
        rows.append(
            f"{kind:8} {len(outs):>5} {sum(o.kills for o in outs):>6} {ctl['SIGINT']:>7} "
            f"{ctl['SIGKILL']:>8} {sum(o.hostile for o in outs):>8} "
            + " ".join(f"{res[r]:>13}" for r in RESULTS)
            + f" {sum(1 for o in outs if o.leftovers):>10}"
        )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="runs per kind")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--seed", type=int, default=1000, help="first seed (then +1 per run)")
    ap.add_argument("--budget-s", type=float, default=1200.0, help="no new run after this")
    ap.add_argument("--no-hostile", action="store_true", help="no hostile messages")
    ap.add_argument("--no-controller", action="store_true", help="never signal the controller")
    ap.add_argument(
        "--all-victims",
        action="store_true",
        help="also kill and attack the devices of open defects (EXCLUDED, SPARED)",
    )
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if args.all_victims:
        _topo_chaos.SPARED.clear()
    hostile = () if args.no_hostile else ("bus", "channels")
    t0 = time.monotonic()
    done: dict[str, list[Outcome]] = defaultdict(list)
    print(f"topology chaos: {args.runs} runs per kind of {kinds}, seeds from {args.seed}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    for i in range(args.runs):
        for kind in kinds:
            if time.monotonic() - t0 > args.budget_s:
                break
            plan = plan_run(
                kind,
                args.seed + i,
                hostile=hostile,
                controller=not args.no_controller,
                all_victims=args.all_victims,
            )
            out = run_once(plan)
            done[kind].append(out)
            print(out.line() if out.ok else out.report(), flush=True)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')} UTC, {time.monotonic() - t0:.0f} s, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print(table(done))
    bad = sum(1 for outs in done.values() for o in outs if not o.ok)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

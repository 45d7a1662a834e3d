"""The floor under ``evflow demo -p 2 --chaos``: its wall time for a framework that
costs nothing, set by the demo's own fault mix.

A model, not a run. Two workers take 20 000 events of 0.115 ms each (the demo's 2.3 s
of work); every attempt hangs with probability 1 % until the killer happens to pick
that worker or the 1 s event timeout fires; every U(0.1, 0.3) s the killer SIGKILLs a
random live worker, which is back ``--restart-ms`` later. Only the event a worker was
on is redone: no re-sends, no backoff, no framework CPU. A hung worker stays hung for
the killer's residual interval plus a geometric number of its picks, about 0.3 s with
two workers, so 200 hangs cost about 60 worker-seconds: the floor is near the 40 s that
the demo takes, whatever the framework does, unless a hang is found sooner than the
killer or the timeout finds it.

    python benchmarks/chaos_floor.py [--runs 20] [--workers 2] [--timeout-s 1.0]
"""

from __future__ import annotations

import argparse
import random
import statistics


def one_run(
    seed: int,
    *,
    events: int = 20_000,
    work_s: float = 2.3 / 20_000,
    workers: int = 2,
    hang_p: float = 0.01,
    timeout_s: float = 1.0,
    kill_s: tuple[float, float] = (0.1, 0.3),
    restart_s: float = 0.02,
) -> tuple[float, int, int]:
    """(wall time s, hangs, kills) of one simulated run."""
    rng = random.Random(seed)
    free_at = [0.0] * workers  # when each worker's current activity ends
    doing = ["idle"] * workers  # idle | work | hang | restart
    next_kill = rng.uniform(*kill_s)
    done = hangs = kills = 0
    now = 0.0
    while done < events:
        w = min(range(workers), key=free_at.__getitem__)
        if next_kill < free_at[w]:
            now = next_kill
            live = [k for k in range(workers) if doing[k] != "restart"]
            if live:
                k = rng.choice(live)
                doing[k], free_at[k] = "restart", now + restart_s
                kills += 1
            next_kill = now + rng.uniform(*kill_s)
            continue
        now = free_at[w]
        if doing[w] == "work":
            done += 1
        if rng.random() < hang_p:
            doing[w], free_at[w] = "hang", now + timeout_s
            hangs += 1
        else:
            doing[w], free_at[w] = "work", now + work_s
    return now, hangs, kills


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=1.0)
    parser.add_argument("--hang-p", type=float, default=0.01)
    parser.add_argument("--restart-ms", type=float, default=20.0)
    args = parser.parse_args()
    runs = [
        one_run(
            seed,
            workers=args.workers,
            timeout_s=args.timeout_s,
            hang_p=args.hang_p,
            restart_s=args.restart_ms / 1000,
        )
        for seed in range(args.runs)
    ]
    walls = [r[0] for r in runs]
    print(
        f"floor of the chaos demo ({args.workers} workers, {args.hang_p:.1%} hangs, "
        f"timeout {args.timeout_s:g} s, {args.runs} runs): wall median "
        f"{statistics.median(walls):.1f} s (min {min(walls):.1f}, max {max(walls):.1f}); "
        f"hangs {statistics.median(r[1] for r in runs):.0f}, "
        f"kills {statistics.median(r[2] for r in runs):.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Reliability figures: ledger on/off throughput, recovery times, the chaos run.

    python benchmarks/bench_reliability.py [--quick] [--only goodput]

1. Throughput of a parallel chain (source -> no-op workers -> output without writer)
   with the input's Ledger as it is and with a do-nothing ledger, side by side in one
   run (alternating, best of 3), for 1 kB and 1 MB events.
2. Recovery: time from a worker SIGKILL to its replacement's first event, and from an
   output SIGKILL to the output writing again.
3. The chaos run of tests/test_chaos.py as a table: events, kills, timeouts, lost,
   duplicates.
4. Goodput under faults: one run (4 workers, 1 kB events, 2 ms of CPU per event)
   without faults and with a worker SIGKILLed every 100 ms, alternating, side by
   side: wall-time ratio, input CPU per event, retries per kill.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import psutil

import evflow
from evflow import DataStore, Module, Path
from evflow.event import FLAG_QUARANTINED
from evflow.io.generators import BusyWork, ToyGenerator
from evflow.io.records import RecordOutput, RecordReader, decode_record
from evflow.processing.faults import FaultInjector
from evflow.processing.parallel.input import input as input_role
from evflow.processing.parallel.input.ledger import Ledger


class NullLedger(Ledger):
    """Records nothing: what the input costs without a ledger (benchmark only)."""

    def add_batch(self, events: Any, worker: Any, now: float | None = None) -> int:
        return 0

    def add_lists(
        self, uids: Any, positions: Any, frames: Any, worker: Any, now: Any = None
    ) -> int:
        return 0

    def confirm(self, uids: Any) -> int:
        return 0

    def progress(self, worker: Any, now: float | None = None, n_events: int | None = None) -> None:
        return None


def throughput(payload_b: int, n: int, workers: int, null: bool) -> tuple[float, float]:
    """(events/s, input CPU us/event) of one run."""
    input_role.Ledger = NullLedger if null else Ledger  # type: ignore[misc]
    try:
        path = Path([ToyGenerator(n_events=n, payload_bytes=payload_b), BusyWork(work_ms=0.0)])
        summary = evflow.process(path, workers=workers, quiet=True)
    finally:
        input_role.Ledger = Ledger  # type: ignore[misc]
    assert summary.events_read == n
    return n / summary.wall_s, summary.counters["input CPU (s)"] / n * 1e6


class Stamp(Module):
    """Appends 'pid monotonic_s' per event to a file per process (recovery timing)."""

    parallel = True

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory
        self._f: Any = None

    def event(self, store: DataStore) -> bool | None:
        if self._f is None:
            self._f = open(os.path.join(self.directory, f"{os.getpid()}.txt"), "a")  # noqa: SIM115
        self._f.write(f"{time.monotonic()}\n")
        self._f.flush()
        return None


def _children(name: str) -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith(name) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def worker_recovery_s(tmp: str) -> float:
    """SIGKILL one of 2 workers mid-run; seconds until a new pid processes an event."""
    stamps = os.path.join(tmp, "stamps")
    os.makedirs(stamps, exist_ok=True)
    killed: dict[str, Any] = {}

    def kill_later() -> None:
        time.sleep(1.0)
        victim = _children("worker")[0]
        killed["at"], killed["pids"] = time.monotonic(), {p.pid for p in _children("worker")}
        victim.send_signal(signal.SIGKILL)

    t = threading.Thread(target=kill_later, daemon=True)
    t.start()
    path = Path([ToyGenerator(n_events=3000), BusyWork(work_ms=1.0), Stamp(stamps)])
    evflow.process(path, workers=2, quiet=True)
    t.join()
    firsts = []
    for name in os.listdir(stamps):
        pid = int(name.split(".")[0])
        if pid not in killed["pids"]:
            with open(os.path.join(stamps, name)) as f:
                firsts.append(float(f.readline()))
    return min(firsts) - killed["at"]


def output_recovery_s(tmp: str) -> float:
    """SIGKILL the output mid-run; seconds until the output file grows again."""
    out = os.path.join(tmp, "rec.evr")
    result: dict[str, float] = {}

    def kill_and_watch() -> None:
        while not (os.path.exists(out) and os.path.getsize(out) > 500_000):
            time.sleep(0.005)
        (victim,) = _children("output")
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        victim.wait(5)
        size = os.path.getsize(out)
        while time.monotonic() - killed_at < 20:
            # the new output truncates a torn tail, then appends: watch for growth
            now_size = os.path.getsize(out) if os.path.exists(out) else 0
            if now_size > size:
                result["s"] = time.monotonic() - killed_at
                return
            size = min(size, now_size)
            time.sleep(0.002)

    t = threading.Thread(target=kill_and_watch, daemon=True)
    t.start()
    path = Path(
        [ToyGenerator(n_events=6000, payload_bytes=500), BusyWork(work_ms=0.5),
         RecordOutput(file=out, fsync=False)]
    )  # fmt: skip
    summary = evflow.process(path, workers=2, quiet=True)
    t.join()
    assert summary.counters["output restarts"] == 1
    return result["s"]


def chaos(tmp: str, n: int) -> dict[str, Any]:
    """The chaos run of tests/test_chaos.py; returns its figures."""
    poison = [1234, 5000, 9999, 15000, min(19998, n - 2)]
    out = os.path.join(tmp, "chaos.evr")
    path = Path(
        [
            ToyGenerator(n_events=n, payload_bytes=256, seed=3),
            FaultInjector(name="hangs", mode="hang", probability=0.01, seed=11),
            FaultInjector(name="poison", mode="segfault", uids=poison, poison=True),
            RecordOutput(file=out, fsync=False),
        ]
    )
    stop = threading.Event()
    kills = [0]

    def killer() -> None:
        rng = random.Random(1)
        while not stop.wait(0.1 * rng.uniform(0.5, 1.5)):
            live = _children("worker")
            if live:
                try:
                    os.kill(rng.choice(live).pid, signal.SIGKILL)
                    kills[0] += 1
                except ProcessLookupError:
                    pass

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        summary = evflow.process(
            path, workers=4, quiet=True, event_timeout_s=0.5, extra={"max_restarts": 10**6}
        )
    finally:
        stop.set()
        t.join()
    counts: collections.Counter[int] = collections.Counter()
    quarantined = set()
    with RecordReader(out) as reader:
        for record in reader:
            meta = decode_record(out, record).meta
            counts[meta.uid] += 1
            if meta.flags & FLAG_QUARANTINED:
                quarantined.add(meta.uid)
    c = summary.counters
    return {
        "events": n,
        "wall (s)": round(summary.wall_s, 1),
        "worker SIGKILLs": kills[0],
        "hangs killed by timeout": c["timeouts"],
        "workers lost and replaced": c["workers lost"],
        "retries": c["retries"],
        "quarantined (poison: 5)": len(quarantined),
        "duplicates dropped at the output": c["duplicates dropped"],
        "lost (uids missing in the output)": len(set(range(n)) - set(counts)),
        "duplicates in the output": sum(v - 1 for v in counts.values()),
    }


def _kill_every(interval_s: float, stop: threading.Event, kills: list[int]) -> None:
    """SIGKILL a random live worker every ``interval_s`` until ``stop``."""
    rng = random.Random(7)
    while not stop.wait(interval_s):
        live = _children("worker")
        if live:
            try:
                os.kill(rng.choice(live).pid, signal.SIGKILL)
                kills[0] += 1
            except ProcessLookupError:
                pass


def goodput_run(n: int, kill_interval_s: float | None) -> dict[str, float]:
    """One run of ``n`` 1 kB events at 2 ms/event on 4 workers, SIGKILLing a worker
    every ``kill_interval_s`` (None: no faults). Wall, input CPU/event, retries, kills."""
    path = Path([ToyGenerator(n_events=n, payload_bytes=1024, seed=5), BusyWork(work_ms=2.0)])
    stop, kills = threading.Event(), [0]
    t = None
    if kill_interval_s is not None:
        t = threading.Thread(target=_kill_every, args=(kill_interval_s, stop, kills))
        t.daemon = True
        t.start()
    try:
        summary = evflow.process(path, workers=4, quiet=True, extra={"max_restarts": 10**6})
    finally:
        stop.set()
        if t is not None:
            t.join()
    c = summary.counters
    assert summary.events_read == n and c.get("events lost", 0) == 0, c
    return {
        "wall_s": summary.wall_s,
        "cpu_us_per_event": c["input CPU (s)"] / n * 1e6,
        "retries": float(c.get("retries", 0)),
        "kills": float(kills[0]),
    }


def goodput(n: int, repeats: int) -> None:
    """Section 4: fault-free and chaos runs alternating; medians side by side."""
    free, chaos_runs = [], []
    for _ in range(repeats):
        free.append(goodput_run(n, None))
        chaos_runs.append(goodput_run(n, 0.1))

    def median(runs: list[dict[str, float]], key: str) -> float:
        values = sorted(r[key] for r in runs)
        return values[len(values) // 2]

    wall_f, wall_c = median(free, "wall_s"), median(chaos_runs, "wall_s")
    cpu_f, cpu_c = median(free, "cpu_us_per_event"), median(chaos_runs, "cpu_us_per_event")
    kills = sum(r["kills"] for r in chaos_runs)
    retries = sum(r["retries"] for r in chaos_runs)
    print(f"{'':<28}{'fault-free':>12}{'SIGKILL/100ms':>15}{'ratio':>8}")
    print(f"{'wall (s)':<28}{wall_f:>12.2f}{wall_c:>15.2f}{wall_c / wall_f:>8.2f}")
    print(f"{'input CPU (us/event)':<28}{cpu_f:>12.1f}{cpu_c:>15.1f}{cpu_c / cpu_f:>8.2f}")
    print(f"{'kills per run':<28}{'0':>12}{kills / repeats:>15.1f}")
    print(f"{'retries per kill':<28}{'-':>12}{retries / max(kills, 1):>15.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer events (a smoke run)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", choices=["goodput"], help="run only that section")
    ap.add_argument("--repeats", type=int, default=3, help="goodput: runs of each kind")
    a = ap.parse_args()
    n_goodput = 2000 if a.quick else 10_000
    if a.only == "goodput":
        print(f"# 4. goodput under faults ({n_goodput} events, 4 workers, 1 kB, 2 ms/event, "
              f"median of {a.repeats})")  # fmt: skip
        goodput(n_goodput, a.repeats)
        return
    small_n, big_n = (20_000, 100) if a.quick else (200_000, 600)
    print(f"# 1. throughput with and without the ledger ({a.workers} no-op workers, best of 3)")
    print(
        f"{'size':<6}{'events':>8}{'on (ev/s)':>11}{'off (ev/s)':>11}{'cost':>7}"
        f"{'input CPU on (us/ev)':>22}{'off':>7}{'cost':>7}"
    )
    for size, n in ((1024, small_n), (1 << 20, big_n)):
        on, off = [], []
        for _ in range(3):
            on.append(throughput(size, n, a.workers, null=False))
            off.append(throughput(size, n, a.workers, null=True))
        rate_on, rate_off = max(r for r, _ in on), max(r for r, _ in off)
        cpu_on, cpu_off = min(c for _, c in on), min(c for _, c in off)
        label = "1 kB" if size == 1024 else "1 MB"
        print(
            f"{label:<6}{n:>8}{rate_on:>11,.0f}{rate_off:>11,.0f}{1 - rate_on / rate_off:>7.1%}"
            f"{cpu_on:>22.1f}{cpu_off:>7.1f}{cpu_on / cpu_off - 1:>7.1%}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        print("\n# 2. recovery")
        w = [worker_recovery_s(os.path.join(tmp, f"w{i}")) for i in range(3)]
        print(f"worker SIGKILL -> replacement's first event: {min(w)*1e3:.0f} ms "
              f"(median {sorted(w)[1]*1e3:.0f} ms of 3)")  # fmt: skip
        for i in range(3):
            os.makedirs(os.path.join(tmp, f"o{i}"))
        o = [output_recovery_s(os.path.join(tmp, f"o{i}")) for i in range(3)]
        print(f"output SIGKILL -> output writing again: {min(o)*1e3:.0f} ms "
              f"(median {sorted(o)[1]*1e3:.0f} ms of 3)")  # fmt: skip
        print("\n# 3. chaos run")
        for key, value in chaos(tmp, 2000 if a.quick else 20_000).items():
            print(f"| {key} | {value} |")
    print(f"\n# 4. goodput under faults ({n_goodput} events, 4 workers, 1 kB, 2 ms/event, "
          f"median of {a.repeats})")  # fmt: skip
    goodput(n_goodput, a.repeats)


if __name__ == "__main__":
    if "EVFLOW_RUNTIME_DIR" in os.environ:
        main()
        sys.exit(0)
    # a private runtime dir, removed afterwards: a benchmark leaves nothing behind
    with tempfile.TemporaryDirectory(prefix="evflow-bench-") as runtime_dir:
        os.environ["EVFLOW_RUNTIME_DIR"] = runtime_dir
        main()

"""Where the sequential HLT chain's framework CPU goes, per call, paced and unpaced.

    python benchmarks/bench_hlt_split.py [--events N] [--rounds R]

Runs ``bench_hlt.py``'s cpu chain (replay device, 4 streams -> EventBuilderInput ->
1 ms/event -> RecordOutput) sequentially in this process, with the builder side's
functions wrapped to add up this thread's CPU per call: the receiver's poll, recv,
decode + build (``_handle``, of which the builder's ``_feed``), the re-heading of each
built batch (``joined``), credits. Paced at 1 kHz (ticks of ~32 events) and as fast as
possible, alternated. What a call costs here against what it costs in a loop
(``bench_hlt.py --only core``: 14 us for a 32-fragment message warm) says how much of
the paced chain's CPU is code run cold once per tick (``bench_wake_tax.py``).

The wrappers cost about 1 us per call; start-up and end are in the figures too.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_hlt

from evflow.hlt import builder_device, links
from evflow.transport import channel

CPU_NS: dict[str, int] = defaultdict(int)
CALLS: dict[str, int] = defaultdict(int)


def _timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            CPU_NS[key] += time.thread_time_ns() - t0
            CALLS[key] += 1

    return wrapper


def _wrap() -> None:
    r = links.FragmentReceiver
    for name in ("pump", "_handle", "_feed", "_give_credits"):
        setattr(r, name, _timed(name, getattr(r, name)))
    for name, key in (("poll", "poll"), ("recv", "recv"), ("readable", "readable")):
        setattr(channel.Channel, name, _timed(key, getattr(channel.Channel, name)))
    builder_device.joined_from_batch = _timed("joined", builder_device.joined_from_batch)


def one(rate: float, tick_ms: float, n: int) -> dict[str, tuple[float, float, int]]:
    CPU_NS.clear()
    CALLS.clear()
    with tempfile.TemporaryDirectory(prefix="benchsplit-") as d:
        t0 = time.thread_time_ns()
        bench_hlt._cpu_chain(0, n, rate, tick_ms, d, "builder")
        total = time.thread_time_ns() - t0
    out = {k: (CPU_NS[k] / n / 1e3, CPU_NS[k] / CALLS[k] / 1e3, CALLS[k]) for k in CPU_NS}
    out["main thread, all"] = (total / n / 1e3, 0.0, 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    _wrap()
    print(
        f"bench_hlt_split {time.strftime('%Y-%m-%d %H:%M')}: sequential chain, "
        f"{a.events} events, this thread's CPU (us) per event / per call (calls)"
    )
    for r in range(a.rounds):
        for label, rate, tick in (("1 kHz, auto tick", 1000.0, -1.0), ("max", 0.0, 0.0)):
            res = one(rate, tick, a.events)
            parts = "  ".join(
                f"{k} {per_ev:.1f}/{per_call:.0f} ({calls})"
                for k, (per_ev, per_call, calls) in sorted(res.items())
                if calls
            )
            print(f"round {r + 1}, {label:>16}: main thread {res['main thread, all'][0]:.0f}")
            print(f"    {parts}")


if __name__ == "__main__":
    main()

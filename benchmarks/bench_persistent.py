"""Cost of per-batch persistent-object deltas (a 100-bin histogram) in no-op parallel runs.

    python benchmarks/bench_persistent.py [--quick]

Three variants of the same run (ToyGenerator -> 2 no-op workers -> output), side by
side, interleaved twice so that they see the same machine load:

- ``none``: no persistent object at all (the delta code must cost nothing here);
- ``end only``: a module fills a 100-bin histogram per event (through a kept view, so
  the fill itself is ~0.3 us), deltas switched off (``DeltaEncoder.take`` returns
  nothing): the histogram travels once at the end, as before deltas;
- ``deltas``: the same with deltas: one delta per batch, merged by the output.

Printed: events/s, output CPU us/event (the serial part), and the micro costs of one
delta (encode + reset in the worker, decide + merge in the output).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path as FsPath
from typing import Any

import hist
import numpy as np

import evflow
from evflow import DataStore, Module
from evflow.io import BusyWork, ToyGenerator
from evflow.processing.parallel.deltas import DeltaEncoder
from evflow.processing.parallel.output.dedup import WrittenUids
from evflow.processing.parallel.output.fills import Fills

ORIGINAL_TAKE: Any = DeltaEncoder.take


class Touch(Module):
    """Counts every event in a 100-bin histogram (bin = uid % 100) through a kept view."""

    parallel = True

    def initialize(self) -> None:
        self.view: Any = None

    def event(self, store: DataStore) -> bool | None:
        p = store.persistent
        if self.view is None:
            p["h100"] = hist.Hist.new.Reg(100, 0, 100, name="x").Double()
            self.view = p["h100"].view()  # no growing axis: the bins never move
        self.view[store.meta.uid % 100] += 1.0
        return None


def one_run(variant: str, n: int, size: int) -> dict[str, float]:
    DeltaEncoder.take = ORIGINAL_TAKE if variant == "deltas" else (lambda self, o: None)  # type: ignore[method-assign, assignment]
    modules: list[Module] = [ToyGenerator(n_events=n, payload_bytes=size), BusyWork(work_ms=0.0)]
    if variant != "none":
        modules.append(Touch())
    try:
        s = evflow.process(evflow.Path(modules), workers=2, quiet=True)
    finally:
        DeltaEncoder.take = ORIGINAL_TAKE  # type: ignore[method-assign]
    if variant != "none":
        assert s.persistent["h100"].sum() == n, "merged histogram is not complete"
    return {"rate": n / s.wall_s, "out_us": 1e6 * s.counters["output CPU (s)"] / n}


def micro() -> tuple[float, float]:
    """(worker us per delta: encode + reset, output us per delta: decide, journal, merge)."""
    h = hist.Hist.new.Reg(100, 0, 100, name="x").Double()
    view = h.view()
    seen = WrittenUids()
    n = 5000
    t_take = t_merge = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        encoder, fills = DeltaEncoder(), Fills(FsPath(tmp), ordered=False)
        for i in range(n):
            uids = list(range(256 * i, 256 * (i + 1)))
            raw = np.array(uids, dtype=np.uint64).tobytes()
            view[7] += 1.0
            t0 = time.perf_counter()
            frames = encoder.take({"h": h}) or []
            t1 = time.perf_counter()
            fills.accept(frames, raw, uids, seen, 0)
            t_take += t1 - t0
            t_merge += time.perf_counter() - t1
            if i % 16 == 15:  # a confirm every 16 batches (a snapshot at most every 1 s)
                fills.confirmed(np.array(uids, dtype=np.uint64))
        fills.remove_files()
    assert fills.merged["h"].sum() == n
    return 1e6 * t_take / n, 1e6 * t_merge / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events")
    args = parser.parse_args()
    sizes = ((1024, 20_000 if args.quick else 100_000), (100_000, 1000 if args.quick else 4000))
    print("no-op runs, 2 workers; rate = events/s; output = output CPU us/event")
    print(f"{'size B':>8} rep  {'variant':<9} {'ev/s':>10} {'output us/ev':>13}  /none")
    for size, n in sizes:
        for rep in (1, 2):
            rows = {v: one_run(v, n, size) for v in ("none", "end only", "deltas")}
            for v, r in rows.items():
                ratio = r["rate"] / rows["none"]["rate"]
                rate, out_us = r["rate"], r["out_us"]
                print(f"{size:>8} {rep:>3}  {v:<9} {rate:>10,.0f} {out_us:>13.2f} {ratio:6.2f}")
    take_us, merge_us = micro()
    print(
        f"\none delta of a 100-bin histogram (batch of 256 uids): worker {take_us:.1f} us "
        f"(encode + reset), output {merge_us:.1f} us (duplicate check, journal append, merge)"
    )


if __name__ == "__main__":
    main()

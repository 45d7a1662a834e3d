"""``evflow demo --chaos``: a parallel run that survives kills, hangs, crashes and errors.

Toy events go through a worker path with fault injectors (1 % hangs, 0.5 % module
exceptions, a few poison events that segfault every time) while a thread SIGKILLs a
random worker every ``kill_interval_s``. At the end the output file is read back: every
uid must be there exactly once, processed or quarantined.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path as FsPath

import psutil

from evflow.event import FLAG_QUARANTINED
from evflow.processing.faults import FaultInjector
from evflow.processing.path import Path
from evflow.processing.summary import RunSummary


@dataclass(frozen=True, slots=True)
class ChaosResult:
    summary: RunSummary
    output: FsPath
    kills: int
    missing: int  # uids not in the output (must be 0)
    duplicates: int  # extra copies in the output (must be 0)
    quarantined: int

    @property
    def ok(self) -> bool:
        return self.missing == 0 and self.duplicates == 0


def _kill_workers(stop: threading.Event, interval_s: float, kills: list[int]) -> None:
    rng = random.Random(1)
    me = psutil.Process()
    while not stop.wait(interval_s * rng.uniform(0.5, 1.5)):
        live = []
        for p in me.children(recursive=True):
            try:
                if p.name().startswith("worker") and p.status() != psutil.STATUS_ZOMBIE:
                    live.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        if live:
            try:
                os.kill(rng.choice(live), signal.SIGKILL)
                kills[0] += 1
            except ProcessLookupError:
                pass


def run_chaos_demo(
    output_dir: str | os.PathLike[str] = "demo-output",
    n_events: int = 20_000,
    workers: int = 4,
    kill_interval_s: float = 0.2,
    quiet: bool = False,
) -> ChaosResult:
    """Run the chaos demo; write ``chaos.evr`` to ``output_dir`` and check it."""
    from evflow.io.generators import BusyWork, ToyGenerator
    from evflow.io.records import RecordOutput, RecordReader, decode_record
    from evflow.processing.api import process

    out_dir = FsPath(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "chaos.evr"
    poison = [n_events // 7, n_events // 3, n_events // 2 + 1]
    path = Path(
        [
            ToyGenerator(n_events=n_events, payload_bytes=512, seed=1),
            BusyWork(work_ms=0.05),
            FaultInjector(name="hang 1%", mode="hang", probability=0.01, seed=2),
            FaultInjector(name="raise 0.5%", mode="raise", probability=0.005, seed=3),
            FaultInjector(name="poison", mode="segfault", uids=poison, poison=True),
            RecordOutput(file=str(out), fsync=False),
        ]
    )
    stop, kills = threading.Event(), [0]
    killer = threading.Thread(target=_kill_workers, args=(stop, kill_interval_s, kills))
    killer.daemon = True
    killer.start()
    try:
        summary = process(
            path,
            workers=workers,
            quiet=quiet,
            event_timeout_s=1.0,
            extra={"max_restarts": 1_000_000},
        )
    finally:
        stop.set()
        killer.join()
    counts: collections.Counter[int] = collections.Counter()
    quarantined = 0
    with RecordReader(str(out)) as reader:
        for record in reader:
            meta = decode_record(str(out), record).meta
            counts[meta.uid] += 1
            quarantined += bool(meta.flags & FLAG_QUARANTINED)
    result = ChaosResult(
        summary,
        out,
        kills[0],
        missing=len(set(range(n_events)) - set(counts)),
        duplicates=sum(c - 1 for c in counts.values()),
        quarantined=quarantined,
    )
    if not quiet:
        verdict = "OK" if result.ok else "FAILED"
        print(
            f"chaos: {kills[0]} workers SIGKILLed, {summary.counters.get('timeouts', 0)} "
            f"hangs killed, {quarantined} events quarantined (poison uids {poison}); "
            f"output {out}: {len(counts)} uids, missing {result.missing}, "
            f"duplicates {result.duplicates}: {verdict}",
            file=sys.stderr,
        )
    return result

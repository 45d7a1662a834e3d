"""Ledger cost per event: add + confirm against a bare dict insert + delete, same run.

    python benchmarks/bench_ledger.py [--events N] [--batch B] [--workers W]

Simulates the input's steady state: events are added round-robin to W workers while
confirms arrive in batches of B uids (as the output sends them), and the checkpoint
position is read once per confirm batch. Prints microseconds per event and the ratio.
"""

from __future__ import annotations

import argparse
import time

from evflow.processing.parallel.input.ledger import Ledger


def bare_dict(n: int, batch: int, workers: int) -> float:
    frames = (b"x",)
    d: dict[int, tuple[int, int, float, tuple[bytes, ...]]] = {}
    pending: list[int] = []
    t0 = time.perf_counter()
    for i in range(n):
        d[i] = (i, i % workers, 0.0, frames)
        pending.append(i)
        if len(pending) >= batch:
            for uid in pending:
                del d[uid]
            pending.clear()
    return time.perf_counter() - t0


def ledger(n: int, batch: int, workers: int, in_flight: int) -> float:
    frames = (b"x",)
    led = Ledger(event_timeout_s=60.0)
    pending: list[int] = []
    names = [f"w{i}".encode() for i in range(workers)]
    t0 = time.perf_counter()
    for i in range(n):
        led.add(i, i, names[i % workers], frames)
        if i >= in_flight:  # confirms lag in_flight events behind the sends
            pending.append(i - in_flight)
            if len(pending) >= batch:
                led.confirm(pending)
                led.checkpoint_position()
                pending.clear()
    return time.perf_counter() - t0


def ledger_batched(n: int, batch: int, workers: int, in_flight: int, send_batch: int) -> float:
    """Small events: one message (add_lists) per ``send_batch`` events, as the input does."""
    frames = (b"x",)
    led = Ledger(event_timeout_s=60.0)
    pending: list[int] = []
    names = [f"w{i}".encode() for i in range(workers)]
    t0 = time.perf_counter()
    for start in range(0, n, send_batch):
        stop = min(n, start + send_batch)
        worker = names[(start // send_batch) % workers]
        ids = list(range(start, stop))  # the input has these lists already
        led.add_lists(ids, ids, [frames] * len(ids), worker)
        led.progress(worker, n_events=len(ids))
        pending.extend(range(max(0, start - in_flight), max(0, stop - in_flight)))
        if len(pending) >= batch:
            led.confirm(pending)
            led.checkpoint_position()
            pending.clear()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=256, help="uids per confirm message")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--in-flight", type=int, default=1000, help="unconfirmed events")
    ap.add_argument("--send-batch", type=int, default=64, help="events per EVENTS message")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    best_dict = min(bare_dict(a.events, a.batch, a.workers) for _ in range(a.repeat))
    best_ledger = min(ledger(a.events, a.batch, a.workers, a.in_flight) for _ in range(a.repeat))
    best_batched = min(
        ledger_batched(a.events, a.batch, a.workers, a.in_flight, a.send_batch)
        for _ in range(a.repeat)
    )
    us_batched = best_batched / a.events * 1e6
    us_dict = best_dict / a.events * 1e6
    us_ledger = best_ledger / a.events * 1e6
    print(
        f"events={a.events} confirm batch={a.batch} workers={a.workers} "
        f"in flight={a.in_flight} (best of {a.repeat})"
    )
    print(f"{'what':<34}{'us/event':>10}")
    print(f"{'bare dict insert + delete':<34}{us_dict:>10.3f}")
    print(f"{'Ledger add + confirm + checkpoint':<34}{us_ledger:>10.3f}")
    print(f"{'Ledger add_batch + confirm + ckpt':<34}{us_batched:>10.3f}")
    print(
        f"ratio to the bare dict: add {us_ledger / us_dict:.1f}x, "
        f"add_batch({a.send_batch}) {us_batched / us_dict:.1f}x; at 200 000 events/s "
        f"the ledger takes {us_batched * 0.2 * 100:.0f} % of one core (add_batch)"
    )


if __name__ == "__main__":
    main()

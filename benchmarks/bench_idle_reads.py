"""CPU cost of the parallel caller's reads of sockets that have nothing for it.

    python benchmarks/bench_idle_reads.py [--calls N] [--rounds R]

At every wake-up the caller of a parallel run drains its ``ctl`` ROUTER
(``Parent._drain_ctl``) and ticks its bus client (``BusClient.poll``); mostly
neither has a message. Printed: CPU microseconds per call (``time.process_time``,
median of the rounds) on an empty ROUTER and an unconnected bus client. Compare two
trees by running this with PYTHONPATH pointing at each, alternated.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import zmq

from evflow.processing.parallel.run.engine import Parent
from evflow.runtime.busclient import BusClient


class _Parent(Parent):
    def __init__(self) -> None:  # (only its ctl socket, set below: not a run's parent)
        pass


def _cpu_us(call: Callable[[], Any], calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    ctx: zmq.Context[Any] = zmq.Context()
    parent = _Parent()
    parent.ctl = ctx.socket(zmq.ROUTER)
    parent.ctl.bind("inproc://bench-ctl")
    bus = BusClient(ctx, "bench", "tcp://127.0.0.1:9,tcp://127.0.0.1:10")  # no proxy
    try:
        drain = [_cpu_us(parent._drain_ctl, args.calls) for _ in range(args.rounds)]
        poll = [_cpu_us(bus.poll, args.calls) for _ in range(args.rounds)]
    finally:
        bus.close()
        parent.ctl.close(0)
        ctx.term()
    print(
        f"empty reads, CPU us per call (median of {args.rounds} x {args.calls}): "
        f"ctl drain {statistics.median(drain):.2f}  bus poll {statistics.median(poll):.2f}"
    )


if __name__ == "__main__":
    main()

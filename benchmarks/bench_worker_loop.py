"""CPU per event of the worker's batch loop and of the input's batch path, in-process.

    python benchmarks/bench_worker_loop.py [--against OTHER_SRC] [--repeats N]

No sockets: the roles' own code runs on packed 1 kB toy batches with stand-in sockets
that drop what is sent, so the figures are the Python cost per event without the
transport (pyzmq copies, the kernel), measured as ``time.process_time`` per event.

- worker: ``_Worker._process`` on 20 packed batches of 922 events (the batch size the
  input chooses for 1 kB events), with 1 and with 3 no-op modules (``BusyWork(0)``),
  scoreboard on;
- input: ``_read_batch`` + ``_send`` + ``Ledger.add_lists`` + READY/CONFIRM handling
  (``progress``, ``confirm``) for 100 000 events from the toy source's fast path;
- chunk: the toy source building 4096-event chunks (6 alive, as in the ledger).

``--against`` runs the same measurements with another checkout's ``src`` (e.g. a
``git worktree`` of the commit before) in alternation with this one, best of N each,
and prints the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path as FsPath
from typing import Any

BATCH = 922
MODULES = (1, 3)


class _Null:
    def send_multipart(self, frames: Any, copy: bool = True) -> None:
        pass


class _Frame:  # what recv_multipart(copy=False) returns: objects with .buffer
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def _worker_messages(n_batches: int) -> list[tuple[dict[str, Any], list[Any]]]:
    from evflow.io import ToyGenerator
    from evflow.io._encoded_toy import encoded_toy_batches
    from evflow.processing.parallel.batching import pack_batch, u64
    from evflow.wire.messages import MsgType, decode_message, encode_message

    gen = ToyGenerator(n_events=n_batches * BATCH, payload_bytes=1024)
    frames: list[Any] = []
    for _, _, _, chunk in encoded_toy_batches(gen, 0, 4096):
        frames += [list(f) for f in chunk]
    messages = []
    for b in range(n_batches):
        uids = range(b * BATCH, (b + 1) * BATCH)
        header = {"b": b, "a": 1, "u": u64(uids), "s": u64(uids)}
        payload = pack_batch(frames[b * BATCH : (b + 1) * BATCH], header, True)
        msg = decode_message([bytes(f) for f in encode_message(MsgType.EVENTS, header, payload)])
        messages.append((msg.header, [_Frame(bytes(f)) for f in msg.payload]))
    return messages


def _worker(n_modules: int) -> Any:
    from evflow.io import BusyWork
    from evflow.processing.chain import ModuleChain
    from evflow.processing.parallel.deltas import DeltaEncoder
    from evflow.processing.parallel.scoreboard import Scoreboard
    from evflow.processing.parallel.worker import worker as role
    from evflow.wire.messages import BadMessageCounter

    w = object.__new__(role._Worker)
    w.name = "worker-0"
    modules = [BusyWork(name=f"noop{i}", work_ms=0.0) for i in range(n_modules)]
    w.chain = ModuleChain(modules, process=w.name)
    w.chain.initialize()
    null: Any = _Null()  # a socket that takes everything and sends nothing
    w.dealer, w.push, w.ctl = null, null, null
    w.event_buffer, w.events_in, w.events_kept, w.first_event_at = 10, 0, 0, 0.0
    w.bad, w.deltas, w.memory_limit_b, w.eager = BadMessageCounter("b"), DeltaEncoder(), 0, False
    w.board, w.slot = Scoreboard(1), 0
    return w


def worker_us(n_modules: int, repeats: int) -> float:
    messages = _worker_messages(20)
    w = _worker(n_modules)
    n = BATCH * len(messages)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for header, payload in messages:
            w._process(header, payload)
        best = min(best, time.process_time() - t0)
    return 1e6 * best / n


def input_us(repeats: int, n_events: int = 100_000) -> float:
    from evflow.io import ToyGenerator
    from evflow.processing.chain import ModuleChain
    from evflow.processing.parallel.batching import BatchSizer, from_u64, u64
    from evflow.processing.parallel.input import input as role
    from evflow.processing.parallel.input.fastpath import encoded_source
    from evflow.processing.parallel.input.input import WorkerSlot
    from evflow.processing.parallel.input.ledger import Ledger
    from evflow.wire.messages import MsgType, decode_message, encode_message

    best = float("inf")
    for _ in range(repeats):
        r = object.__new__(role._Input)
        null: Any = _Null()
        r.router = r.back = r.ctl = null
        r.max_events, r.ordered = 0, False
        r.chain = ModuleChain([ToyGenerator(n_events=n_events, payload_bytes=1024)], "input")
        r.chain.initialize()
        r.source = r.chain.modules[0]
        r.sizer = BatchSizer()
        r.sizer.observe_work(1e-6)  # as after the first READY: ~922-event batches
        r.start_position = r.start_seq = r.next_bid = r.next_seq = r.read = r.dropped = 0
        r.ledger = Ledger(max_attempts=3, event_timeout_s=None, start_position=0)
        r.seq_of, r.exhausted = {}, False
        r.it, r.encoded = encoded_source(r.chain, 0), True
        r.to_read, r.n_workers, r.workers, r.shm = None, 1, {}, None  # set by __init__
        slot = WorkerSlot("worker-0", 1)
        slot.buffer = 10
        t0 = time.process_time()
        while True:
            batch = r._read_batch(r.sizer.size())
            if batch is None:
                break
            r._send(b"id", slot, batch)
            r.ledger.add_lists(batch.uids, batch.positions, batch.enc, slot.name, 0.0)
            ready = decode_message(encode_message(MsgType.READY, {"credit": batch.n, "t": 1e-6}))
            slot.inflight -= int(ready.header["credit"])
            r.sizer.observe_work(float(ready.header["t"]))
            r.ledger.progress(slot.name, n_events=batch.n)
            confirm = decode_message(encode_message(MsgType.CONFIRM, {}, [u64(batch.uids)]))
            r.ledger.confirm(from_u64(confirm.payload[0]).tolist())
        best = min(best, time.process_time() - t0)
        assert r.read == n_events
    return 1e6 * best / n_events


def chunk_us(repeats: int) -> float:
    from evflow.io import ToyGenerator
    from evflow.io._encoded_toy import ToyEncoder

    encoder = ToyEncoder(ToyGenerator(n_events=10**7, payload_bytes=1024), 4096)
    alive: list[Any] = []
    best = float("inf")
    position = 70_000
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(10):
            alive.append(encoder.chunk(position, position + 4096))
            position += 4096
            if len(alive) > 6:
                alive.pop(0)
        best = min(best, time.process_time() - t0)
    return 1e6 * best / (10 * 4096)


def child(repeats: int) -> dict[str, float]:
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)  # as the roles run (common.GC_THRESHOLDS)
    out = {f"worker, {m} no-op module(s)": worker_us(m, repeats) for m in MODULES}
    out["input (read, send, ledger)"] = input_us(repeats)
    out["toy chunk (4096 events)"] = chunk_us(repeats)
    return out


def run_child(src: str, repeats: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [sys.executable, __file__, "--child", "--repeats", str(repeats)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", help="another checkout's src directory (the 'before')")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternations with --against")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.repeats)))
        return
    here = str(FsPath(__file__).resolve().parents[1] / "src")
    trees = {"this": here} if not args.against else {"before": args.against, "this": here}
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for r in range(args.rounds if args.against else 1):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            for key, us in run_child(trees[name], args.repeats).items():
                best[name][key] = min(us, best[name].get(key, float("inf")))
    print("CPU us per 1 kB event, in-process (best of runs)")
    if not args.against:
        for key, us in best["this"].items():
            print(f"  {key:32s} {us:6.2f}")
        return
    print(f"  {'':32s} {'before':>7s} {'this':>7s} {'before/this':>11s}")
    for key, us in best["this"].items():
        old = best["before"][key]
        print(f"  {key:32s} {old:7.2f} {us:7.2f} {old / us:11.2f}")


if __name__ == "__main__":
    main()

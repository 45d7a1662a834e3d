"""Record-file write and read throughput against raw file I/O of the same bytes.

Run: ``python benchmarks/bench_records.py [--total-mb 128] [--repeats 3] [--fsync]``

For events of 1 kB, 100 kB and 1 MB (``ToyGenerator`` payloads, encoded with the
default codec), in one run:

- write: ``file.write`` of each encoded event (buffered file, no framing) against
  ``RecordWriter.write_record`` of the same bytes (framing + CRC32 + buffering) and
  against ``RecordOutput.event`` (codec encode + record write, the full path);
- read: ``readinto`` of the raw file in 4 MB blocks against ``RecordReader``
  (records with CRC checked, payload views) and ``RecordInput.events`` (decode too).

GB/s counts encoded event bytes. Files live in a temporary directory (page cache; the
disk is only involved with ``--fsync``, which adds an fsync to every writer's close).
The best of ``--repeats`` runs is reported.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

from evflow.io.generators import ToyGenerator
from evflow.io.records import RecordInput, RecordOutput, RecordReader, RecordWriter
from evflow.wire.codec import encode_event, pack_frames


def best_s(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_size(payload_bytes: int, total_bytes: int, repeats: int, fsync: bool, tmp: str) -> dict:
    n = max(1, total_bytes // payload_bytes)
    gen = ToyGenerator(n_events=n, payload_bytes=payload_bytes, seed=1)
    stores = list(gen.events())
    payloads = [pack_frames(encode_event(s)) for s in stores]
    nbytes = sum(len(p) for p in payloads)
    raw_path = os.path.join(tmp, "raw.bin")
    rec_path = os.path.join(tmp, "rec.evr")
    full_path = os.path.join(tmp, "full.evr")

    def raw_write() -> None:
        with open(raw_path, "wb") as f:
            for p in payloads:
                f.write(p)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    def rec_write() -> None:
        with RecordWriter(rec_path, fsync=fsync) as w:
            for s, p in zip(stores, payloads, strict=True):
                w.write_record(s.meta.uid, 0, p)

    def full_write() -> None:
        out = RecordOutput(file=full_path, fsync=fsync)
        out.initialize()
        for s in stores:
            out.event(s)
        out.terminate()

    def raw_read() -> None:
        buf = bytearray(4 << 20)
        with open(raw_path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    def rec_read() -> None:
        with RecordReader(rec_path) as r:
            count = sum(1 for _ in r)
        assert count == n

    def full_read() -> None:
        count = sum(1 for _ in RecordInput(file=full_path).events())
        assert count == n

    result: dict[str, float] = {"size": payload_bytes, "n": n, "bytes": nbytes}
    for key, fn in [
        ("raw_w", raw_write),
        ("rec_w", rec_write),
        ("full_w", full_write),
        ("raw_r", raw_read),
        ("rec_r", rec_read),
        ("full_r", full_read),
    ]:
        result[key] = nbytes / best_s(fn, repeats) / 1e9
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mb", type=int, default=128, help="data per event size, MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fsync", action="store_true", help="fsync at every writer's close")
    args = parser.parse_args()
    sizes = [1_000, 100_000, 1_000_000]
    print(
        f"record files vs raw file I/O, {args.total_mb} MB per size, best of {args.repeats}"
        f"{', fsync on close' if args.fsync else ', page cache'}; GB/s of encoded events"
    )
    head = (
        f"{'event':>8} {'n':>7} | {'raw write':>9} {'record':>7} {'ratio':>6} {'+encode':>8} |"
        f" {'raw read':>8} {'record':>7} {'ratio':>6} {'+decode':>8}"
    )
    print(head)
    print("-" * len(head))
    with tempfile.TemporaryDirectory(prefix="evflow-bench-") as tmp:
        for size in sizes:
            r = bench_size(size, args.total_mb << 20, args.repeats, args.fsync, tmp)
            label = f"{size // 1000} kB" if size < 1_000_000 else "1 MB"
            print(
                f"{label:>8} {r['n']:>7} | {r['raw_w']:>9.2f} {r['rec_w']:>7.2f} "
                f"{r['rec_w'] / r['raw_w']:>6.2f} {r['full_w']:>8.2f} | {r['raw_r']:>8.2f} "
                f"{r['rec_r']:>7.2f} {r['rec_r'] / r['raw_r']:>6.2f} {r['full_r']:>8.2f}"
            )


if __name__ == "__main__":
    main()

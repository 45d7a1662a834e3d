"""QC repository: stores per second, read latency, readers beside a writer, check cost.

    python benchmarks/bench_qc_repository.py [--quick]

Histograms of 1 kB, 40 kB and 500 kB (Double storage, 128 / 5000 / 62500 bins) with
new contents every version (no hash sharing). "store" is ``Repository.store`` (one
transaction, WAL, synchronous=NORMAL) with a keep-last-100 retention; "latest" is
``Repository.latest`` (read and decode) from a read-only connection; "latest, writer
busy" is the same while another process stores as fast as it can. The writer row with
readers runs 2 reader processes looping on ``latest`` beside it. "checks" is a
CheckSuite of mean, empty bins, chi2 and KS against a reference on the 1 kB object.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import hist
import numpy as np

from evflow.qc.checks import Chi2Reference, EmptyBinFraction, KolmogorovReference, MeanInRange
from evflow.qc.checksuite import CheckSuite
from evflow.qc.objects import encode_object
from evflow.qc.publication import PublishedObject
from evflow.qc.repository import Repository

SIZES = {"1 kB": 128, "40 kB": 5000, "500 kB": 62500}


def make(bins: int, seed: int) -> hist.Hist:
    h = hist.Hist.new.Reg(bins, 0, 1).Double()
    h.view()[...] = np.random.default_rng(seed).random(bins)
    return h


def pub(path: str, obj: hist.Hist, cycle: int) -> PublishedObject:
    return PublishedObject(
        path=path,
        task="bench",
        name=path.rsplit("/", 1)[-1],
        run=1,
        cycle=cycle,
        obj=obj,
        completeness={},
        created=time.time(),
        sequence=cycle,
        event_count=0,
        metadata={},
    )


def store_rate(db: Path, bins: int, seconds: float) -> float:
    objs = [make(bins, i) for i in range(50)]
    with Repository(db, retention={"keep_last": 100}) as repo:
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            repo.store(pub("qc/bench/h", objs[n % 50], n))
            n += 1
        return n / (time.perf_counter() - start)


def latest_ms(db: Path, seconds: float) -> float:
    with Repository(db, readonly=True) as repo:
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            assert repo.latest("qc/bench/h") is not None
            n += 1
        return (time.perf_counter() - start) / n * 1e3


def _writer(db: str, bins: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    out.put(("writer", store_rate(Path(db), bins, seconds)))


def _reader(db: str, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    out.put(("reader", latest_ms(Path(db), seconds)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    seconds = 1.0 if parser.parse_args().quick else 3.0
    ctx = mp.get_context("spawn")
    print(
        f"{'object':>8} {'bytes':>8} {'store/s':>9} {'store/s +2 readers':>19} "
        f"{'latest ms':>10} {'latest ms, writer busy':>23}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for label, bins in SIZES.items():
            db = Path(tmp) / f"{bins}.sqlite"
            alone = store_rate(db, bins, seconds)
            quiet = latest_ms(db, seconds)
            q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
            readers = [ctx.Process(target=_reader, args=(str(db), seconds, q)) for _ in range(2)]
            writer = ctx.Process(target=_writer, args=(str(db), bins, seconds, q))
            for p in [*readers, writer]:
                p.start()
            results = [q.get(timeout=120) for _ in range(3)]
            for p in [*readers, writer]:
                p.join()
            busy_read = [v for role, v in results if role == "reader"]
            with_readers = next(v for role, v in results if role == "writer")
            size = len(encode_object(make(bins, 0)))
            print(
                f"{label:>8} {size:>8} {alone:>9.0f} {with_readers:>19.0f} "
                f"{quiet:>10.3f} {np.mean(busy_read):>23.3f}"
            )
    ref = make(128, 99) * 1000
    suite = CheckSuite(
        [
            MeanInRange("mean", min=0, max=1),
            EmptyBinFraction("empty"),
            Chi2Reference("chi2", reference=ref),
            KolmogorovReference("ks", reference=ref),
        ]
    )
    obj = pub("qc/bench/h", make(128, 1) * 100, 0)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        suite.run(obj)
        n += 1
    print(
        f"checks (mean, empty bins, chi2, KS) on a 1 kB histogram: "
        f"{(time.perf_counter() - start) / n * 1e3:.3f} ms per object"
    )


if __name__ == "__main__":
    main()

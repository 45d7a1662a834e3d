"""Codec cost per event against pickle protocol 5 with out-of-band buffers, same run.

    python benchmarks/bench_codec.py [--quick]

Each store holds one float64 numpy array (the payload size) plus a few scalars and a
string, like a small reconstructed event. "evflow" is ``encode_event`` +
``decode_event`` (the decoded DataStore included); "pickle" is
``pickle.dumps((meta, objects), protocol=5, buffer_callback=...)`` +
``pickle.loads(..., buffers=...)``. Times are the best of several repeats of the mean
per event, in microseconds; the ratio is evflow / pickle (below 1: evflow is faster).
The batch row encodes 100 events of 1 kB in one message (``encode_batch``); the join
row encodes them one by one and joins the encoded events (``join_events``), as the
parallel input does (its decode column is the batch row's).
"""

from __future__ import annotations

import argparse
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from evflow.event import DataStore, EventMeta
from evflow.wire.codec import (
    decode_batch,
    decode_event,
    encode_batch,
    encode_event,
    join_events,
    peek_meta,
)
from evflow.wire.messages import MsgType, decode_message, encode_message


def make_store(payload_bytes: int, uid: int = 12345678901) -> DataStore:
    arr = np.random.default_rng(uid).random(payload_bytes // 8)
    objects = {"tracks": arr, "n_tracks": len(arr), "weight": 0.75, "trigger": "hlt_mu"}
    return DataStore(EventMeta(uid, experiment=1, run=42, event=uid % 100000), objects)


def per_call_us(funcs: dict[str, Callable[[], Any]], n: int, repeats: int) -> dict[str, float]:
    """Best over ``repeats`` of the mean time of ``n`` calls of each func, in µs.

    The funcs take turns within each repeat, so that load from other processes on the
    machine hits all of them alike and the ratios stay meaningful.
    """
    best = dict.fromkeys(funcs, float("inf"))
    for _ in range(repeats):
        for name, func in funcs.items():
            start = time.perf_counter()
            for _ in range(n):
                func()
            best[name] = min(best[name], (time.perf_counter() - start) / n * 1e6)
    return best


def pickle_encode(store: DataStore) -> list[Any]:
    buffers: list[Any] = []
    m = store.meta
    body = pickle.dumps(
        ((m.uid, m.experiment, m.run, m.event, m.flags, m.attempt), store.objects),
        protocol=5,
        buffer_callback=buffers.append,
    )
    return [body, *(b.raw() for b in buffers)]


def pickle_decode(frames: list[Any]) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args()
    scale = 0.1 if args.quick else 1.0
    repeats = 3 if args.quick else 7
    rows: list[tuple[str, float, float, float, float]] = []
    for label, size, n in (("1 kB", 1024, 20000), ("100 kB", 100 * 1024, 5000),
                           ("1 MB", 1024 * 1024, 1000)):  # fmt: skip
        n = max(10, int(n * scale))
        store = make_store(size)
        ev_frames = encode_event(store)
        pk_frames = pickle_encode(store)
        t = per_call_us(
            {
                "enc": lambda: encode_event(store),  # noqa: B023
                "dec": lambda: decode_event(ev_frames),  # noqa: B023
                "penc": lambda: pickle_encode(store),  # noqa: B023
                "pdec": lambda: pickle_decode(pk_frames),  # noqa: B023
            },
            n // 5,
            repeats * 5,
        )
        rows.append((label, t["enc"], t["dec"], t["penc"], t["pdec"]))

    batch = [make_store(1024, uid) for uid in range(100)]
    batch_frames = encode_batch(batch)
    pk_batch = [pickle_encode(s) for s in batch]
    nb = max(2, int(60 * scale))
    t = per_call_us(
        {
            "enc": lambda: encode_batch(batch),
            "dec": lambda: decode_batch(batch_frames),
            "penc": lambda: [pickle_encode(s) for s in batch],
            "pdec": lambda: [pickle_decode(f) for f in pk_batch],
        },
        nb,
        repeats * 5,
    )
    k = len(batch)
    rows.append(("1 kB x100 batch", t["enc"] / k, t["dec"] / k, t["penc"] / k, t["pdec"] / k))
    # What the parallel input does: encode each event (kept in the ledger), then join.
    t = per_call_us(
        {
            "enc": lambda: join_events([encode_event(s) for s in batch]),
            "penc": lambda: [pickle_encode(s) for s in batch],
        },
        nb,
        repeats * 5,
    )
    rows.append(("1 kB x100 join", t["enc"] / k, rows[-1][2], t["penc"] / k, rows[-1][4]))

    print(f"{'event':<16} {'encode':>8} {'decode':>8} {'evflow':>8} "
          f"{'pk enc':>8} {'pk dec':>8} {'pickle':>8} {'ratio':>6}   (µs per event)")  # fmt: skip
    for label, enc, dec, penc, pdec in rows:
        ratio = (enc + dec) / (penc + pdec)
        print(f"{label:<16} {enc:8.2f} {dec:8.2f} {enc + dec:8.2f} "
              f"{penc:8.2f} {pdec:8.2f} {penc + pdec:8.2f} {ratio:6.2f}")  # fmt: skip

    small = encode_event(make_store(1024))
    msg = encode_message(MsgType.EVENTS, {"n": 1}, small)
    t = per_call_us(
        {
            "peek": lambda: peek_meta(small),
            "menc": lambda: encode_message(MsgType.EVENTS, {"n": 1}, small),
            "mdec": lambda: decode_message(msg),
        },
        4000,
        repeats * 5,
    )
    print(
        f"\npeek_meta (1 kB event): {t['peek']:.2f} µs; encode_message: {t['menc']:.2f} µs; "
        f"decode_message: {t['mdec']:.2f} µs"
    )


if __name__ == "__main__":
    main()

"""Synthetic fragment senders (tests, benchmarks): one process serves several sources.

Fragment ``(event, source)`` holds ``frag_bytes`` bytes whose first 16 are the event id
and the source id (u64 each), so a receiver can check every byte it builds
(:func:`check_built`). Run as a program::

    python -m evflow.hlt.synthetic ADDRESS --sources 0,1,2 --events 100000 --batch 256
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from evflow.hlt.eventbuilder import BuiltBatch
from evflow.hlt.links import FragmentSender, wait_acked

__all__ = ["check_built", "fragment_block", "send_synthetic"]


def fragment_block(source: int, ids: np.ndarray, frag_bytes: int) -> bytes:
    """The fragments of ``source`` for ``ids``, back to back (at least 16 bytes each)."""
    rows = np.zeros((len(ids), max(frag_bytes, 16)), np.uint8)
    rows[:, :8] = ids.astype("<u8").view(np.uint8).reshape(-1, 8)
    rows[:, 8:16] = np.frombuffer(np.uint64(source).astype("<u8").tobytes(), np.uint8)
    return rows.tobytes()


def check_built(batch: BuiltBatch) -> int:
    """Check every present fragment carries its event and source id; return bad ones."""
    data = np.frombuffer(batch.packed(), np.uint8)
    lens = batch.lengths
    starts = np.cumsum(lens.ravel()) - lens.ravel()
    present = lens.ravel() > 0
    ev = np.repeat(batch.ids, len(batch.sources))[present]
    src = np.tile(np.array(batch.sources, np.uint64), len(batch.ids))[present]
    at = starts[present]
    idx8 = at[:, None] + np.arange(8)[None, :]
    got_ev = data[idx8].copy().view("<u8").ravel()
    got_src = data[idx8 + 8].copy().view("<u8").ravel()
    return int(((got_ev != ev.astype(np.uint64)) | (got_src != src)).sum())


def send_synthetic(
    address: str,
    sources: Sequence[int],
    n_events: int,
    *,
    batch: int = 256,
    frag_bytes: int = 16,
    first: int = 0,
    session: str = "default",
    rate_hz: float = 0.0,
) -> int:
    """Send events ``first .. first+n_events-1`` for every source in ``sources``."""
    ctx: zmq.Context[Any] = zmq.Context()
    senders = [FragmentSender(ctx, address, s, session=session) for s in sources]
    try:
        size = max(frag_bytes, 16)
        t0 = time.monotonic()
        for start in range(first, first + n_events, batch):
            ids = np.arange(start, min(start + batch, first + n_events), dtype=np.int64)
            for s, sender in zip(sources, senders, strict=True):
                lens = np.full(len(ids), size, np.int64)
                sender.send_batch(ids, (lens, fragment_block(s, ids, size)))
            if rate_hz:
                delay = t0 + (start - first + len(ids)) / rate_hz - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        for sender in senders:  # every END first: a builder device acknowledges one
            sender.send_end()  # once its stream is built, which may need the others'
        ok = not wait_acked(senders, 10.0)
    finally:
        for sender in senders:
            sender.close()
        ctx.term()
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evflow.hlt.synthetic")
    p.add_argument("address")
    p.add_argument("--sources", required=True, help="comma-separated source ids")
    p.add_argument("--events", type=int, required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--frag-bytes", type=int, default=16)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--session", default="default")
    p.add_argument("--rate", type=float, default=0.0, help="events per second (0: no limit)")
    a = p.parse_args(argv)
    srcs = [int(x) for x in a.sources.split(",") if x]
    return send_synthetic(
        a.address,
        srcs,
        a.events,
        batch=a.batch,
        frag_bytes=a.frag_bytes,
        first=a.first,
        session=a.session,
        rate_hz=a.rate,
    )


if __name__ == "__main__":
    sys.exit(main())

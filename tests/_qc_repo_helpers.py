"""Small builders shared by the QC checks/repository tests."""

from __future__ import annotations

import time
from typing import Any

import hist
import numpy as np

from evflow.qc.publication import PublishedObject


def published(
    path: str,
    obj: Any,
    *,
    run: int = 1,
    cycle: int = 0,
    created: float | None = None,
    seen: int = 2,
    expected: int = 2,
    metadata: dict[str, Any] | None = None,
) -> PublishedObject:
    """A merger's publication of ``obj`` at ``path`` with a completeness record."""
    task, name = path.split("/")[1], path.split("/")[-1]
    sources = [f"src{i}" for i in range(expected)]
    return PublishedObject(
        path=path,
        task=task,
        name=name,
        run=run,
        cycle=cycle,
        obj=obj,
        completeness={
            "seen": sources[:seen],
            "expected": sources,
            "missing": sources[seen:],
        },
        created=time.time() if created is None else created,
        sequence=cycle,
        event_count=int(np.sum(obj.values(flow=True))) if hasattr(obj, "axes") else 0,
        metadata=metadata or {},
    )


def gauss_hist(n: int, *, loc: float = 5.0, scale: float = 2.0, seed: int = 0) -> hist.Hist:
    """A 1D histogram of ``n`` gaussian values on [0, 10) in 40 bins."""
    h = hist.Hist.new.Reg(40, 0, 10, name="x").Double()
    h.fill(np.random.default_rng(seed).normal(loc, scale, n))
    return h

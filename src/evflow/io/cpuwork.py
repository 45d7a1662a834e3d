"""CPU work on demand: the toy source's and ``BusyWork``'s stand-in for reconstruction."""

from __future__ import annotations

import time

__all__ = ["burn_cpu"]


def burn_cpu(work_ms: float) -> None:
    """Busy-loop until this thread has used ``work_ms`` milliseconds of CPU time.

    CPU time, not wall time: on an oversubscribed machine a wall-clock loop would
    finish early in CPU terms and make parallel speedups look better than they are.
    """
    if work_ms <= 0:
        return
    deadline_ns = time.thread_time_ns() + int(work_ms * 1e6)
    x = 0
    while time.thread_time_ns() < deadline_ns:
        for i in range(200):  # real arithmetic between clock reads
            x = (x * 31 + i) & 0xFFFF

"""What the caller of a parallel run tells the user at once on stderr: too many
workers for the cores, and what a stop signal waits for."""

from __future__ import annotations

import os
import signal
import sys

#: more workers than this many per core get a warning (start-up, memory, contention)
WORKERS_PER_CORE_WARN = 4


def say(line: str) -> None:
    """One line on stderr, at once (the user waits for it)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def warn_many_workers(n_workers: int) -> None:
    """A warning on stderr when ``n_workers`` is far above the cores this process may use."""
    n = cores()
    if n_workers > WORKERS_PER_CORE_WARN * n:
        say(
            f"evflow: warning: {n_workers} workers on {n} core{'s' if n != 1 else ''} "
            f"(more than {WORKERS_PER_CORE_WARN} per core): each worker costs start-up time "
            f"and memory and they only take turns on the cores; -p {n} is usually fastest"
        )


def stopping_line(signum: int, grace_s: float, busy: int) -> str:
    """The line of the first stop signal: what the shutdown waits for, how long."""
    what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    return (
        f"evflow: stopping ({what}): no new events are read; waiting up to {grace_s:g} s "
        f"for the events in flight on {busy} busy worker{'s' if busy != 1 else ''} to be "
        "written (Ctrl-C again: stop now)"
    )

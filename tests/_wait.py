"""Waiting on conditions in tests: poll with a deadline, never sleep a guessed time.

A fixed ``time.sleep(0.3)`` before acting on a process holds on an idle machine and
fails on a loaded one (the suite shares 2 cores with other work). These helpers wait
for what the test needs to be true, for as long as a loaded machine may take, and fail
with a sentence that says what never happened.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.02,
    proc: subprocess.Popen[bytes] | subprocess.Popen[str] | None = None,
) -> T:
    """Poll ``predicate`` until it returns something true; return that value.

    Fails with ``timed out after N s waiting for <what>`` once ``timeout_s`` passed, and
    at once if ``proc`` (the process the condition depends on) has exited meanwhile.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def poll_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout_s`` passed (False).

    For a test that then asserts the condition itself, with its own detailed message.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def size_of(path: Path) -> int:
    """The size of ``path`` in bytes; 0 while it does not exist (yet, or any more)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _signal_set(pid: int, field: str) -> int:
    """The ``SigIgn``/``SigCgt`` mask of ``pid`` (/proc/PID/status): bit n-1 is signal n."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def signal_ignored(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig`` now (a signal sent then is discarded)."""
    return bool(_signal_set(pid, "SigIgn") & (1 << (sig - 1)))


def signal_caught(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` installed now."""
    return bool(_signal_set(pid, "SigCgt") & (1 << (sig - 1)))

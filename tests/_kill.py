"""Kill one role of a parallel run mid-run, whatever the load of the machine.

``RoleKiller`` is a thread that SIGKILLs the test's process named ``name`` (``input``,
``output``) once ``ready()`` holds. Two things made the old helper flaky on a loaded
machine: a ``ready()`` that raised (``out.stat()`` before the output file existed)
killed the thread silently, and a run could end before the thread got to the kill;
either way the test saw 0 restarts and no reason. Here a missing file is "not ready",
:meth:`RoleKiller.finish` fails with what went wrong, and a run can be held back with
:class:`HoldUntil` so that it cannot finish before the kill.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path as FsPath

import psutil

from evflow import DataStore, Module, Param


class HoldUntil(Module):
    """A worker module: events from uid ``from_uid`` on wait until file ``gate`` exists.

    With a :class:`RoleKiller` that creates ``gate`` after its kill, the run cannot
    finish (nor get past ``from_uid``) before the kill, however slow the test thread is.
    The wait is bounded by ``max_wait_s``; past it the run goes on (the test then fails
    on the missing kill, not on a hang).
    """

    parallel = True
    gate = Param(str, "")
    from_uid = Param(int, 0)
    max_wait_s = Param(float, 60.0)

    def event(self, store: DataStore) -> bool | None:
        if store.meta.uid >= self.from_uid:
            deadline = time.monotonic() + self.max_wait_s
            while not FsPath(self.gate).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return None


class RoleKiller(threading.Thread):
    """SIGKILL this test's process named ``name`` once ``ready()``; then create ``gate``."""

    def __init__(
        self,
        name: str,
        ready: Callable[[], bool],
        timeout_s: float = 60.0,
        gate: FsPath | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.name_ = name
        self.ready = ready
        self.timeout_s = timeout_s
        self.gate = gate
        self.killed_pid: int | None = None
        self.failure = ""

    def _ready(self) -> bool:
        try:
            return bool(self.ready())
        except FileNotFoundError:  # a file the condition looks at is not there yet
            return False

    def _find(self) -> psutil.Process | None:
        for p in psutil.Process().children(recursive=True):
            try:
                if p.name() == self.name_ and p.status() != psutil.STATUS_ZOMBIE:
                    return p
            except psutil.NoSuchProcess:
                pass
        return None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                target = self._find() if self._ready() else None
                if target is not None:
                    try:
                        target.send_signal(signal.SIGKILL)
                    except psutil.NoSuchProcess:
                        continue  # it went away between the look and the kill: look again
                    self.killed_pid = target.pid
                    return
                time.sleep(0.01)
            self.failure = (
                f"no {self.name_!r} process to kill"
                if self._ready()
                else f"the condition to kill {self.name_!r} never held"
            ) + f" within {self.timeout_s:g} s"
        except Exception as exc:  # reported by finish(), not lost with the thread
            self.failure = f"the killer of {self.name_!r} failed: {exc!r}"
        finally:
            if self.gate is not None:
                self.gate.touch()

    def finish(self, timeout_s: float = 60.0) -> int:
        """Join the thread; fail the test unless it killed; return the killed pid."""
        self.join(timeout=timeout_s)
        assert not self.is_alive(), f"the killer of {self.name_!r} is still waiting"
        assert self.killed_pid is not None, self.failure or f"{self.name_!r} was not killed"
        return self.killed_pid


def kill_role_when(
    name: str,
    ready: Callable[[], bool],
    timeout_s: float = 60.0,
    gate: FsPath | None = None,
) -> RoleKiller:
    """Start a :class:`RoleKiller`; call its ``finish()`` once the run returned."""
    killer = RoleKiller(name, ready, timeout_s, gate)
    killer.start()
    return killer

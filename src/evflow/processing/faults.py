"""Fault injection for tests, demos and drills: a module that fails on purpose.

Put a ``FaultInjector`` in the worker path and the run must still write every event
exactly once (processed, or quarantined after ``max_attempts`` failures)::

    path.add(FaultInjector(mode="segfault", uids=[17, 4711], poison=True))
    path.add(FaultInjector(name="hangs", mode="hang", probability=0.01, seed=7))

Which events fail:
- ``uids``: these uids fail on their first ``fail_attempts`` attempts (default 1, so a
  retry succeeds), or on every attempt with ``poison=True``. With ``once_dir`` each
  listed uid fails exactly once, the first time a process gets to it, whatever its
  attempt (an event that waited in a worker killed for another one comes back with
  attempt 2, unprocessed): a marker file per uid in that directory says it happened.
- ``probability``: any event fails with this probability, decided by a hash of
  ``(seed, uid, attempt)``: the same run fails the same events on the same attempts,
  and a retry (a new attempt) rolls again. With ``poison=True`` the roll ignores the
  attempt, so an event that fails once fails every time.

Modes: ``raise`` (a Python exception: an event failure, the worker survives), ``hang``
(sleep ``hang_s``), ``segfault`` (SIGSEGV: ``os.kill`` or a NULL read through ctypes),
``exit`` (``os._exit(exit_code)``), ``memory`` (allocate and touch ``memory_mb`` MB that
stay allocated), ``slow`` (sleep ``slow_s`` and go on).
"""

from __future__ import annotations

import ctypes
import faulthandler
import hashlib
import os
import signal
import struct
import time
from typing import ClassVar

from evflow.errors import ParameterError
from evflow.event import DataStore
from evflow.processing.module import Module, Param

MODES = ("raise", "hang", "segfault", "exit", "memory", "slow")


class InjectedFault(RuntimeError):
    """What ``FaultInjector(mode="raise")`` raises (a deliberate, recognisable failure)."""


def roll(seed: int, uid: int, attempt: int) -> float:
    """A reproducible number in [0, 1) for (seed, uid, attempt): same inputs, same roll."""
    digest = hashlib.blake2b(struct.pack("<qQq", seed, uid & (2**64 - 1), attempt), digest_size=8)
    return int.from_bytes(digest.digest(), "little") / 2.0**64


class FaultInjector(Module):
    """Fails chosen events in a chosen way (see the module docstring)."""

    parallel: ClassVar[bool] = True

    mode = Param(str, "raise", "what to do to a chosen event", choices=MODES)
    uids = Param(list, [], "uids that fail (see fail_attempts and poison)")
    probability = Param(float, 0.0, "chance that any event fails, in [0, 1]")
    seed = Param(int, 0, "seed of the reproducible per-(uid, attempt) roll")
    poison = Param(bool, False, "fail on every attempt, so the event ends quarantined")
    fail_attempts = Param(int, 1, "listed uids fail on attempts 1..fail_attempts")
    once_dir = Param(str, "", "listed uids fail once per run, marked in this directory")
    hang_s = Param(float, 3600.0, "hang: seconds to sleep (the timeout should fire first)")
    slow_s = Param(float, 0.1, "slow: seconds to sleep before going on")
    exit_code = Param(int, 3, "exit: the os._exit code")
    memory_mb = Param(int, 256, "memory: megabytes allocated, touched and kept")
    segfault_via = Param(str, "kill", "segfault: 'kill' (SIGSEGV to self) or 'null'",
                         choices=("kill", "null"))  # fmt: skip

    def __init__(self, name: str | None = None, **params: object) -> None:
        super().__init__(name, **params)
        if not 0.0 <= self.probability <= 1.0:
            raise ParameterError(
                f"module {self.name!r}: parameter 'probability' must be in [0, 1], "
                f"got {self.probability}"
            )
        bad = [u for u in self.uids if isinstance(u, bool) or not isinstance(u, int)]
        if bad:
            raise ParameterError(
                f"module {self.name!r}: parameter 'uids' must be a list of ints, got {bad[0]!r}"
            )
        self._uids = frozenset(self.uids)
        self._hoard: list[bytearray] = []  # memory mode: kept so RSS stays up
        self.injected = 0

    def chosen(self, uid: int, attempt: int) -> bool:
        """Whether the event ``uid`` fails on ``attempt`` (pure; for tests and drills)."""
        if uid in self._uids and (self.poison or attempt <= self.fail_attempts):
            return True
        if self.probability > 0.0:
            return roll(self.seed, uid, 0 if self.poison else attempt) < self.probability
        return False

    def event(self, store: DataStore) -> bool | None:
        meta = store.meta
        if self.once_dir and meta.uid in self._uids:
            fails = self._first_time(meta.uid)
        else:
            fails = self.chosen(meta.uid, meta.attempt)
        if fails:
            self.injected += 1
            self._inject(meta.uid, meta.attempt)
        return None

    def _first_time(self, uid: int) -> bool:
        """Mark ``uid`` done in ``once_dir``; False if a process did so before."""
        marker = os.path.join(self.once_dir, f"{self.name}-{uid}.injected")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return False
        return True

    def _inject(self, uid: int, attempt: int) -> None:
        mode = self.mode
        if mode == "raise":
            raise InjectedFault(f"injected fault on uid={uid} attempt={attempt}")
        if mode in ("hang", "slow"):
            deadline = time.monotonic() + (self.hang_s if mode == "hang" else self.slow_s)
            while (left := deadline - time.monotonic()) > 0:
                time.sleep(min(left, 1.0))
        elif mode == "segfault":
            faulthandler.disable()  # a deliberate crash needs no traceback dump
            if self.segfault_via == "null":
                ctypes.string_at(0)
            os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(10)  # the signal is delivered before this returns
        elif mode == "exit":
            os._exit(self.exit_code)
        elif mode == "memory":
            block = bytearray(self.memory_mb * 1024 * 1024)
            block[::4096] = b"\1" * len(block[::4096])  # touch every page so RSS grows
            self._hoard.append(block)

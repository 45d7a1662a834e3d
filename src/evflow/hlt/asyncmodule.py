"""``AsyncTaskModule``: a path module that feeds an :class:`AsyncTask` and applies its results.

Subclass it and define:

- ``task(arrays) -> dict`` (a ``staticmethod``): runs in the isolated process; gets the
  arrays ``inputs`` gave, returns constants (numpy arrays, numbers, strings);
- ``inputs(store) -> dict[str, np.ndarray] | None``: what to hand over for this event
  (None: nothing this time);
- ``apply(store, constants) -> bool | None``: use the current constants (None until
  the first result came back); its return value is the module's (False drops the event).

Per event the module first picks up finished results (never waits), then applies the
newest constants, then hands this event's input over. Every event gets
``<name>_version`` (0 before any result; then 1, 2, ... per process) and the first
event a version is applied to also gets ``<name>_from_event`` (the event whose input
produced it), ``<name>_process`` (the pid that applied it) and ``<name>_first`` =
True: the update is recorded with the event number it was first applied to
(``updates`` holds the same, per process). Counters
go to ``store.persistent`` (summed over workers in a parallel run): ``<name>_calls``,
``_results``, ``_failures``, ``_restarts``, ``_skipped``. Each process (the sequential
run, or every parallel worker) has its own task process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from evflow.event import DataStore
from evflow.hlt.asynctask import POLICIES, AsyncTask, TaskResult
from evflow.params import Param
from evflow.processing.module import Module

__all__ = ["AppliedUpdate", "AsyncTaskModule"]


@dataclass
class AppliedUpdate:
    version: int
    from_event: int  # the event whose input the task used
    first_event: int  # the first event the result was applied to
    pid: int  # the process that applied it (a worker in a parallel run)
    runtime_s: float
    constants: dict[str, Any]


class AsyncTaskModule(Module):
    parallel: ClassVar[bool] = True
    policy = Param(str, "replace", "input while the task is busy", POLICIES)
    queue_size = Param(int, 4, "inputs kept while busy (policy 'queue')")
    timeout_s = Param(float, 60.0, "a call running longer is killed and the task restarted")
    buffer_mb = Param(int, 16, "shared-memory buffer for the input arrays")
    memory_mb = Param(int, 0, "address-space limit of the task process (0: none)")

    @staticmethod
    def task(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        raise NotImplementedError("define task(arrays) -> dict as a staticmethod")

    def inputs(self, store: DataStore) -> dict[str, np.ndarray] | None:
        return None

    def apply(self, store: DataStore, constants: dict[str, Any] | None) -> bool | None:
        return None

    # --- framework ------------------------------------------------------------------------
    def initialize(self) -> None:
        self.runner = AsyncTask(
            type(self).task,
            name=self.name,
            policy=self.policy,
            queue_size=self.queue_size,
            timeout_s=self.timeout_s,
            buffer_bytes=self.buffer_mb << 20,
            memory_mb=self.memory_mb,
        )
        self.constants: dict[str, Any] | None = None
        self.version = 0
        self.updates: list[AppliedUpdate] = []
        self._pending: TaskResult | None = None
        self._reported = (0, 0, 0, 0, 0)

    def event(self, store: DataStore) -> bool | None:
        runner = self.runner
        results = runner.poll()
        prefix = self.name
        if results:
            newest = results[-1]
            self.version += 1
            self.constants = newest.result
            self.updates.append(
                AppliedUpdate(
                    self.version,
                    newest.tag,
                    store.meta.event,
                    os.getpid(),
                    newest.runtime_s,
                    newest.result,
                )
            )
            store[f"{prefix}_first"] = True
            store[f"{prefix}_from_event"] = int(newest.tag)
            store[f"{prefix}_process"] = os.getpid()
        store[f"{prefix}_version"] = self.version
        keep = self.apply(store, self.constants)
        data = self.inputs(store)
        if data is not None:
            runner.submit(data, tag=store.meta.event)
        self._count(store)
        return keep

    def _count(self, store: DataStore) -> None:
        s = self.runner.stats
        now = (s.submitted, s.completed, s.failed, s.restarts, s.skipped + s.replaced)
        names = ("calls", "results", "failures", "restarts", "skipped")
        p = store.persistent
        for name, new, old in zip(names, now, self._reported, strict=True):
            if new != old:
                key = f"{self.name}_{name}"
                p[key] = p.get(key, 0) + (new - old)
        self._reported = now

    def terminate(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()

"""Small sources and modules shared by the processing, steering and CLI tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from evflow import DataStore, EventMeta, Module, Param, RunMeta, Source


class ListSource(Source):
    """Events with uids 0..n-1; ``runs`` gives (experiment, run) per event (default 0, 0)."""

    n = Param(int, 10, "number of events")

    def __init__(
        self, name: str | None = None, runs: Sequence[tuple[int, int]] | None = None, **params: Any
    ) -> None:
        super().__init__(name, **params)
        self.runs = list(runs) if runs is not None else [(0, 0)] * self.n
        self.produced = 0  # how many events the processor pulled

    def total(self) -> int:
        return self.n

    def events(self, start: int = 0) -> Iterator[DataStore]:
        for i in range(start, self.n):
            exp, run = self.runs[i]
            self.produced += 1
            yield DataStore(EventMeta(uid=i, experiment=exp, run=run, event=i), {"x": i})


class Recorder(Module):
    """Logs every hook call into a shared list as (name, hook, detail)."""

    def __init__(self, name: str, log: list[tuple[str, str, Any]], drop_if=None) -> None:
        super().__init__(name)
        self.log = log
        self.drop_if = drop_if

    def initialize(self) -> None:
        self.log.append((self.name, "initialize", None))

    def begin_run(self, run: RunMeta) -> None:
        self.log.append((self.name, "begin_run", (run.experiment, run.run)))

    def event(self, store: DataStore) -> bool | None:
        self.log.append((self.name, "event", store.meta.uid))
        if self.drop_if is not None and self.drop_if(store):
            return False
        return None

    def end_run(self, run: RunMeta) -> None:
        self.log.append((self.name, "end_run", (run.experiment, run.run)))

    def terminate(self) -> None:
        self.log.append((self.name, "terminate", None))


def fail_on_uid(uid: int) -> None:
    """A user function two calls deep, so tracebacks have user frames to show."""
    raise ValueError(f"bad value in event {uid}")


class Exploder(Module):
    """Raises ValueError in ``event`` for uid ``at`` (or in the hook named by ``hook``)."""

    at = Param(int, 3, "uid that fails")
    hook = Param(str, "event", "hook that fails", ("initialize", "event", "begin_run"))

    def initialize(self) -> None:
        if self.hook == "initialize":
            raise RuntimeError("cannot load calibration")

    def begin_run(self, run: RunMeta) -> None:
        if self.hook == "begin_run":
            raise RuntimeError("no conditions for this run")

    def event(self, store: DataStore) -> bool | None:
        if self.hook == "event" and store.meta.uid == self.at:
            fail_on_uid(store.meta.uid)
        return None

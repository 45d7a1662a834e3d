"""Devices written as a user would, with the public API only (``evflow``,
``evflow.runtime.devices``)
(run as ``_file_devices:Class`` with tests/ on PYTHONPATH)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from evflow import DataStore, EventMeta, Param
from evflow.runtime.devices import SinkDevice, SourceDevice


class Squares(SourceDevice):
    """Events 0 .. n-1 (this instance's share), each with x = i * i."""

    n = Param(int, 1000, "events of the whole stream")

    def events(self) -> Iterator[DataStore]:
        for i in self.share(self.n):
            store = DataStore(EventMeta(uid=i, event=i))
            store["x"] = i * i
            yield store


class TalkingSquares(Squares):
    """Squares that says on stdout when it reaches event 10 and what it sent by each
    end of its RUNNING loop (``SENT k``, then ``POST_RUN``)."""

    def events(self) -> Iterator[DataStore]:
        for store in super().events():
            if store.meta.uid == 10:
                print("AT 10", flush=True)
            yield store

    def post_run(self) -> None:
        print(f"SENT {self.events_sent}\nPOST_RUN", flush=True)
        super().post_run()


class SumSink(SinkDevice):
    """Sums the integer ``field`` and notes every uid; both in its summary."""

    field = Param(str, "x", "the integer object to add up")

    def init_task(self) -> None:
        super().init_task()
        self.total = 0
        self.uids: list[int] = []

    def event(self, store: DataStore) -> None:
        self.total += int(store[self.field])
        self.uids.append(store.meta.uid)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        uids = getattr(self, "uids", [])
        out["sum"] = {"total": int(getattr(self, "total", 0)), "uids": len(uids),
                      "distinct": len(set(uids)), "min": min(uids, default=-1),
                      "max": max(uids, default=-1)}  # fmt: skip
        return out

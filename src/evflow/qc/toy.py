"""A toy QC chain for topology files: an event source device and a QC task.

``evflow.qc.toy:ToyEvents`` sends deterministic events (``toy_event(i)``: four
coordinates ``x, y, z, w`` in [0, 1) and the event number ``i``) as EVENTS batches on
``data``, then END with the count. Several copies share one stream: instance ``NAME_k``
of ``copies`` sends events ``k, k + copies, k + 2 copies, ...`` below ``n_events``, so
all of them together send every event once. ``ToyQc`` fills a 1D, a weighted 2D, a 3D
and a 4D histogram, a counter, a numpy array and a record batch from them (only the
histograms with ``hists_only``: the merger's stacked fast path).

Filled sequentially over ``range(n_events)``, ``ToyQc`` gives what the merger layers of
``examples/topologies/qc_layers.toml`` must publish at the top, bin by bin: every
coordinate is a multiple of 2**-12, so sums are exact in any order.
"""

from __future__ import annotations

import itertools
import logging
import re

import boost_histogram as bh
import hist
import numpy as np

from evflow.event import DataStore, EventMeta
from evflow.params import Param
from evflow.qc.producer import QcTask
from evflow.qc.recordbatch import RecordBatch
from evflow.runtime.device import Device
from evflow.runtime.devices.stream import end_and_wait
from evflow.runtime.loops import send_when_ready
from evflow.wire.codec import encode_batch
from evflow.wire.messages import MsgType, encode_message

__all__ = ["ToyEvents", "ToyQc", "toy_event"]

log = logging.getLogger("evflow.qc")
_INDEX = re.compile(r"_(\d+)$")


def toy_event(i: int, run: int = 0) -> DataStore:
    """Event ``i``: four coordinates in [0, 1) from a multiplicative hash (no RNG)."""
    vals = [((i * k + 17) * 2654435761 % 2**32 >> 20) / 2**12 for k in (1, 3, 7, 11)]
    store = DataStore(EventMeta(uid=i, run=run, event=i))
    store["x"], store["y"], store["z"], store["w"] = vals
    store["i"] = i
    return store


class ToyEvents(Device):
    description = "toy event source: its share of toy_event(0 .. n_events-1), then END"

    n_events = Param(int, 10_000, "events of the whole stream (all copies together)")
    copies = Param(int, 1, "sources sharing the stream (instance NAME_k sends k, k+copies, ...)")
    batch = Param(int, 100, "events per EVENTS message")
    run_number = Param(int, 0, "run number of the events")
    channel_name = Param(str, "data", "output channel")
    ack_timeout_s = Param(
        float, 30.0, "how long to wait for the END acknowledgement once the producer left (s)"
    )

    def init_task(self) -> None:
        if self.copies < 1 or self.batch < 1:
            raise ValueError(f"copies and batch must be >= 1, got {self.copies}, {self.batch}")
        match = _INDEX.search(self.id)
        self.index = int(match.group(1)) if match else 0
        if self.index >= self.copies:
            raise ValueError(
                f"device {self.id!r} is copy {self.index} but copies = {self.copies}; "
                "set copies to the number of instances"
            )
        self._out = self.channel(self.channel_name)
        self._todo = iter(range(self.index, self.n_events, self.copies))
        self.sent = 0
        self.messages = 0
        self.acked = False

    def conditional_run(self) -> bool:
        events = [toy_event(i, self.run_number) for i in itertools.islice(self._todo, self.batch)]
        if not events:
            return False
        frames = encode_message(MsgType.EVENTS, None, encode_batch(events))
        if not send_when_ready(self, self._out, frames):
            return False
        self.messages += 1
        self.sent += len(events)
        return True

    def post_run(self) -> None:
        # the producer answers END behind every batch queued before it (the sockets
        # hold the whole stream): under load long after the END left, and no failure.
        # end_and_wait waits while the producer stays connected; ack_timeout_s counts
        # from its disconnection
        _, acked = end_and_wait(self, self.channel_name, [self.messages], self.ack_timeout_s)
        self.acked = acked > 0
        log.info("%s: sent %d toy events", self.id, self.sent)


class ToyQc(QcTask):
    """Histograms of 1 to 4 dimensions, a counter, an array and a record batch."""

    hists_only = Param(bool, False, "only the histograms (the merger's stacked fast path)")

    def book(self) -> None:
        self.objects["h1"] = hist.Hist.new.Reg(25, 0, 1, name="x").Double()
        self.objects["h2"] = hist.Hist.new.Reg(8, 0, 1).Var([0, 0.2, 0.5, 1]).Weight()
        self.objects["h3"] = hist.Hist.new.Reg(4, 0, 1).Reg(4, 0, 1).Reg(3, 0, 1).Int64()
        self.objects["hn"] = bh.Histogram(*(bh.axis.Regular(3, 0, 1) for _ in range(4)))
        if self.hists_only:
            return
        self.objects["count"] = 0
        self.objects["sums"] = np.zeros(4)
        self.objects["rows"] = RecordBatch({"i": "i8", "x": "f8"}, max_rows=1_000_000)

    def fill(self, store: DataStore) -> None:
        x, y, z, w = store["x"], store["y"], store["z"], store["w"]
        self.objects["h1"].fill(x)
        self.objects["h2"].fill(x, y, weight=w)
        self.objects["h3"].fill(x, y, z)
        self.objects["hn"].fill(x, y, z, w)
        if self.hists_only:
            return
        self.objects["count"] += 1
        self.objects["sums"] += (x, y, z, w)
        self.objects["rows"].fill(i=store["i"], x=x)

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

import contextlib
import itertools
import logging
import re
import time
from typing import Any

import boost_histogram as bh
import hist
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from evflow.params import Param
from evflow.processing.datastore import DataStore, EventMeta
from evflow.qc.producer import QcTask
from evflow.qc.recordbatch import RecordBatch
from evflow.runtime._loops import send_when_ready
from evflow.runtime.device import Device
from evflow.runtime.devices._stream import END_RESEND_S, ack_sources, send_end
from evflow.wire.codec import encode_batch
from evflow.wire.messages import MsgType, encode_message

__all__ = ["ToyEvents", "ToyQc", "toy_event"]

log = logging.getLogger("evflow.qc")
_INDEX = re.compile(r"_(\d+)$")
#: the longest a source waits for its END's acknowledgement from a connected producer
MAX_ACK_WAIT_S = 600.0


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
        # connects and disconnects of the producer, from now on (see _wait_ack)
        self._monitor: zmq.Socket[Any] | None = self._out.socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        )
        self._connected = True  # (CONNECT is done: the producer bound before)

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
        if send_end(self, self.channel_name, 0, self.messages, self.ack_timeout_s):
            self.acked = self._wait_ack()
        log.info("%s: sent %d toy events", self.id, self.sent)

    def reset_task(self) -> None:
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:
            self._out.socket.disable_monitor()
            monitor.close(0)
            self._monitor = None

    def _wait_ack(self) -> bool:
        """Wait for the ACK of our END while the producer is connected.

        The producer answers END when it reads it, after every batch queued before it:
        the sockets hold the whole stream (2 x 1000 messages of high-water mark), so
        under load the ACK comes as late as the producer's work on all of it (on 2
        cores shared by 19 processes, more than 30 s), long after the END left. That is
        no failure: ``ack_timeout_s`` counts from the producer's disconnection (it
        died) instead. A stop request, or MAX_ACK_WAIT_S, ends the wait too. The END
        goes again every END_RESEND_S: a producer restarted meanwhile gets it too (it
        counts one END per sender)."""
        sources = ack_sources(self, self.channel_name)
        poller = zmq.Poller()
        for ch in sources:
            poller.register(ch.socket, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        by_socket = {ch.socket: ch for ch in sources}
        gone_at: float | None = None
        started = time.monotonic()
        stopped_at: float | None = None
        resend_at = started + END_RESEND_S
        while True:
            now = time.monotonic()
            if now >= resend_at:
                resend_at = now + END_RESEND_S
                end = encode_message(MsgType.END, {"count": self.messages, "from": self.id})
                with contextlib.suppress(zmq.Again):
                    self._out.send(end, zmq.NOBLOCK)
            if self._connected:
                gone_at = None
            elif gone_at is None:
                gone_at = now
            if self.shutdown_requested and stopped_at is None:
                stopped_at = now  # (a stop still gives the ACK ack_timeout_s to come)
            if gone_at is not None and now - gone_at >= self.ack_timeout_s:
                log.error("%s: END on %r not acknowledged: the producer left %.1f s ago",
                          self.id, self.channel_name, now - gone_at)  # fmt: skip
                return False
            if now - started >= MAX_ACK_WAIT_S:  # connected, silent: a hung producer
                log.error("%s: END on %r not acknowledged within %.0f s by a connected "
                          "producer", self.id, self.channel_name, MAX_ACK_WAIT_S)  # fmt: skip
                return False
            if stopped_at is not None and now - stopped_at >= self.ack_timeout_s:
                log.warning("%s: END on %r not acknowledged %.1f s after the stop request",
                            self.id, self.channel_name, now - stopped_at)  # fmt: skip
                return False
            self._tick()
            for sock, _ in poller.poll(100):
                if sock is self._monitor:
                    event = recv_monitor_message(self._monitor)
                    self._connected = event["event"] == zmq.EVENT_CONNECTED
                    continue
                ch = by_socket[sock]
                frames = ch.recv()
                if ch.type == "router":
                    frames = frames[1:]
                msg = self.bad_messages[ch.label].decode(frames)
                ours = msg is not None and msg.header.get("to", self.id) == self.id
                if ours and msg is not None and msg.type is MsgType.ACK:
                    return True


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

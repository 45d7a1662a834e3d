"""``evflow device replay``: the readout emulator as a device.

Plays the events of a record or ROOT file at ``event_rate`` Hz on the monotonic timeline of
:class:`~evflow.hlt.replay.Timeline` and sends the events that are due together:

- ``streams = 0``: as codec events (EVENTS messages, ``encode_batch``) on the channel
  ``data`` (END with the count at the end, acknowledged as the built-in devices do);
- ``streams = N``: each event cut into N pieces (:func:`~evflow.hlt.replay.split_event`),
  sent as N fragment streams (sources ``0 .. N-1``) to the event builder at
  ``builder`` (one DEALER per stream, credits respected, END per stream).

``summary()`` (``--stats-file``) has ``replay``: sent, passes, elapsed, achieved rate
and the worst lag behind the timeline.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from evflow.errors import IncompleteStreamError, ParameterError
from evflow.hlt.links import FragmentSender, wait_acked
from evflow.hlt.replay import ReplayReport, Timeline, encoded, load_events, split_event
from evflow.params import Param
from evflow.runtime.device import Device
from evflow.runtime.devices.stream import send_end, wait_for_acks
from evflow.wire.codec import encode_batch
from evflow.wire.messages import MsgType

__all__ = ["ReplayDevice"]

log = logging.getLogger("evflow.hlt")

#: ``tick_ms = -1``: a tick of about this many events at the asked rate (1 to 50 ms)
AUTO_TICK_EVENTS = 32


class ReplayDevice(Device):
    description = "replays a record/ROOT file at a set rate, whole or as N fragment streams"

    file = Param(str, doc="record file or ROOT file (.root) to replay")
    event_rate = Param(float, 0.0, "events per second (0: as fast as possible)")
    passes = Param(int, 1, "passes over the file (0: for ever)")
    events = Param(int, 0, "stop after this many events (0: passes decide)")
    tree = Param(str, "events", "TTree of a ROOT file")
    branches = Param(str, "", "comma-separated branches of a ROOT file (empty: all)")
    streams = Param(int, 0, "fragment streams for an event builder (0: whole events)")
    builder = Param(str, "", "event builder address (with streams > 0)")
    max_batch = Param(int, 256, "events sent together at most")
    tick_ms = Param(
        float,
        -1.0,
        "send what is due at most every this many ms (several events per message, each "
        "keeps its due time; 0: every event when due; -1: auto, about 32 events per "
        "message, every 1 to 50 ms)",
    )
    channel_name = Param(str, "data", "output channel for whole events")
    ack_timeout_s = Param(float, 10.0, "how long to wait for END acknowledgements (s)")

    def init_task(self) -> None:
        if self.event_rate < 0 or self.passes < 0 or self.events < 0 or self.max_batch < 1:
            raise ParameterError(
                f"device {self.id!r}: rate, passes, events must be >= 0 and max_batch >= 1"
            )
        if self.streams and not self.builder:
            raise ParameterError(f"device {self.id!r}: streams > 0 needs --builder ADDRESS")
        branches = [b for b in self.branches.split(",") if b] or None
        stores = load_events(self.file, self.tree, branches)
        self._stores = stores
        self._n = len(stores)
        self._limit = self.events or (self._n * self.passes if self.passes else 0)
        self._senders: list[FragmentSender] = []
        if self.streams:
            self._pieces = [split_event(b, self.streams) for b in encoded(stores)]
            # per stream, every event's piece back to back: a run of consecutive events
            # goes out as one slice, with no step per event
            self._stream_data = [b"".join(p[s] for p in self._pieces) for s in range(self.streams)]
            lens = np.array([[len(x) for x in p] for p in self._pieces], np.int64)
            # lengths as their wire bytes and offsets as ints: a tick slices them, no numpy
            self._stream_lens = [lens[:, s].astype("<u4").tobytes() for s in range(self.streams)]
            self._stream_offs = [[0, *np.cumsum(lens[:, s]).tolist()] for s in range(self.streams)]
            self._senders = [
                FragmentSender(self.context, self.builder, s, session=self.session, name=self.id)
                for s in range(self.streams)
            ]
        self.sent = 0
        self.report = ReplayReport(rate_hz=self.event_rate)
        self._tick_s = self.tick_ms / 1e3
        if self.tick_ms < 0 and self.event_rate:  # auto: each message costs every process
            self._tick_s = min(max(AUTO_TICK_EVENTS / self.event_rate, 0.001), 0.05)
        elif self.tick_ms < 0:
            self._tick_s = 0.0

    def pre_run(self) -> None:
        # the timeline starts when the builder is ready (it sends the first credits once
        # every stream is connected), not while the processes are still starting
        for sender in self._senders:
            if not self._wait_credit(sender):
                break
        self._timeline = Timeline(self.event_rate)
        self._t_last = self._timeline.t0
        self._next_send = self._timeline.t0  # the first batch at once

    def conditional_run(self) -> bool:
        k = self.sent
        if self._limit and k >= self._limit:
            return False
        now = time.monotonic()
        n = self._sendable(k, now)
        if not n:  # sleep until it is time, then send in the same pass
            self._sleep_until_due(k, now)
            now = time.monotonic()
            n = self._sendable(k, now)
            if not n:
                return True
        ids = np.arange(k, k + n, dtype=np.int64)
        if self._senders:
            self._send_fragments(ids)
        else:
            stores = [self._stores[i % self._n] for i in range(k, k + n)]
            self.send(self.channel_name, MsgType.EVENTS, None, encode_batch(stores))
        self._t_last = time.monotonic()
        self._next_send = now + self._tick_s
        self.sent += n
        return True

    def _sendable(self, k: int, now: float) -> int:
        """How many events from ``k`` on go now; 0: not yet.

        What is due goes at most every tick (a send takes time: without this the
        event that fell due meanwhile would go alone right after): several events to
        a message, each keeping its due time, so the rate over the run is the same.
        The last event goes when due, not at the next tick after it."""
        tl = self._timeline
        n = min(tl.ready(k, now), self.max_batch)
        if self._limit:
            n = min(n, self._limit - k)
        if n <= 0:
            return 0
        if now < self._next_send and not (self._limit and tl.due(self._limit - 1) <= now):
            return 0
        return n

    def _sleep_until_due(self, k: int, now: float) -> None:
        """Sleep until event ``k`` is due and the tick is over (the last event: until
        it is due), at most a tick and 5 ms (the device's timers)."""
        tl = self._timeline
        wake = max(tl.due(k), self._next_send)
        if self._limit:
            wake = min(wake, max(tl.due(self._limit - 1), tl.due(k)))
        if wake > now:
            time.sleep(min(wake - now, 0.005 + self._tick_s))

    def _send_fragments(self, ids: np.ndarray) -> None:
        first = int(ids[0]) % self._n
        id_bytes = ids.astype("<u8").tobytes()  # the same ids on every stream
        if first + len(ids) <= self._n:  # one run of the file: one slice per stream
            stop = first + len(ids)
            batches: list[Any] = [
                (lens[4 * first : 4 * stop], memoryview(data)[offs[first] : offs[stop]])
                for data, lens, offs in zip(
                    self._stream_data, self._stream_lens, self._stream_offs, strict=True
                )
            ]
        else:  # across the end of a pass
            pieces = [self._pieces[i % self._n] for i in ids.tolist()]
            batches = [[p[s] for p in pieces] for s in range(len(self._senders))]
        for sender, frags in zip(self._senders, batches, strict=True):
            if not self._wait_credit(sender):
                return
            sender.send_batch(id_bytes, frags)

    def _wait_credit(self, sender: FragmentSender) -> bool:
        """Wait for ``sender``'s credit, serving the device and every other stream
        meanwhile (a restarted builder starts once every stream said HELLO again);
        False if the device was told to stop."""
        while not sender.wait_credit(time.monotonic() + 0.1, lambda: self._loop_stop):
            self._tick()
            for other in self._senders:
                other.service()
            if self._loop_stop:
                return False
        return True

    def post_run(self) -> None:
        r = self.report
        r.events = self.sent
        r.passes = -(-self.sent // self._n) if self._n else 0
        r.elapsed_s = self._t_last - self._timeline.t0
        if self.sent > 1 and self._t_last > self._timeline.t0:
            # from the start of the timeline: a late first batch does not flatter the rate
            r.achieved_hz = (self.sent - 1) / (self._t_last - self._timeline.t0)
        r.max_lag_ms = self._timeline.max_lag_s * 1e3
        log.info("%s: %s", self.id, r.line())
        if self._senders:
            for sender in self._senders:  # every END first: the builder sees them together
                sender.send_end()
            # acknowledged once every event of the stream is built: until then what is
            # not goes again to a builder restarted meanwhile
            left = wait_acked(self._senders, self.ack_timeout_s, self._tick)
            self.resent = sum(s.resent for s in self._senders)
            self.builder_restarts = max(s.builder_restarts for s in self._senders)
            if left:
                # batches the builder never said it built (kept, or let go unconfirmed)
                unsure = sum(s.kept + s.let_go for s in left)
                what = (
                    f"{self.id!r}: the event builder acknowledged no END of stream(s) "
                    f"{', '.join(str(s.source) for s in left)} within "
                    f"{self.ack_timeout_s:g} s"
                )
                if not unsure:  # it said it built all of them: nothing is missing
                    log.warning("replay %s (it had built everything they sent)", what)
                elif self.shutdown_requested:
                    log.error("replay %s; %d batches sent may not be built", what, unsure)
                else:
                    raise IncompleteStreamError(
                        f"replay {what}; {unsure} batches sent may not be built"
                    )
        else:
            send_end(self, self.channel_name, 0, self.channel(self.channel_name).messages_out)
            wait_for_acks(self, self.channel_name, 1, self.ack_timeout_s)

    def reset_task(self) -> None:
        for sender in self._senders:
            sender.close()
        self._senders = []

    def summary(self) -> dict[str, Any]:
        out = self.metrics()
        r = getattr(self, "report", ReplayReport())
        out["replay"] = {
            "sent": getattr(self, "sent", 0),
            "passes": r.passes,
            "elapsed_s": r.elapsed_s,
            "rate_hz": r.rate_hz,
            "achieved_hz": r.achieved_hz,
            "max_lag_ms": r.max_lag_ms,
            "resent": getattr(self, "resent", 0),
            "builder_restarts": getattr(self, "builder_restarts", 0),
        }
        return out

"""QC producers: ``QcTask`` fills objects per event and publishes them every cycle.

A ``QcTask`` is a path module (``parallel = True``: in a parallel run every worker
has its own instance and is its own source). Subclass it, create the objects in
``book()`` (``self.objects[name] = hist.Hist(...)``), fill them in ``fill(store)``.
Every ``cycle_s`` seconds (checked per event; ``set_cycle_s`` changes it during a run)
it publishes to the merger at ``merger``:

- **delta** mode (default): what was filled since the last publication, and the objects
  are reset (histograms, arrays and numbers through the parallel engine's
  ``DeltaEncoder``: raw bin arrays; record batches as their new rows);
- **full** mode: the whole objects, not reset (the merger keeps the latest per source).

Each publication is one EVENTS message on a DEALER socket, header ``{"qc": 1, "src",
"task", "run", "cycle", "seq", "events", "mode", "ts"}``, payload ``[objects, *delta]``
where ``objects`` is msgpack ``[[name, encode_object(obj)], ...]`` for what the delta
codec does not carry. The producer keeps every message until the merger acknowledges
it (``ACK {"upto", "seqs"}``, sent once the merger has published and checkpointed the
cycle that holds it) and re-sends it after ``resend_after_s``: a merger that was killed
and restarted gets again what it had not made durable, and drops what it had (dedup by
``(src, seq)``). At most ``max_unacked`` messages are kept: with no credit left the
objects keep filling and the next publication carries several cycles (back-pressure
with bounded memory, nothing lost), counted in ``held_cycles``.

Without ``merger`` the task publishes nothing and ``objects`` hold everything filled
(the sequential reference).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from evflow.event import DataStore, RunMeta
from evflow.params import Param
from evflow.processing.module import Module
from evflow.processing.parallel.deltas import DeltaEncoder
from evflow.qc.objects import encode_object, is_mergeable
from evflow.qc.recordbatch import RecordBatch
from evflow.transport.channel import Channel, ChannelConfig
from evflow.transport.opening import open_channel
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message

log = logging.getLogger("evflow.qc")

QC_PROTOCOL = 1
#: payloads of more bin arrays than this travel as one joined frame
JOIN_MIN_FRAMES = 8
#: send time of a publication the socket did not take yet (high-water mark)
_UNSENT = float("-inf")


def take_payload(
    objects: dict[str, Any], encoder: DeltaEncoder, mode: str, skipped: set[str]
) -> list[bytes]:
    """The payload frames of one publication (delta mode resets what it takes).

    Objects that cannot be merged are reported once (added to ``skipped``) and left out.
    """
    items: list[list[Any]] = []
    frames: list[bytes] = []
    for name, obj in objects.items():
        if name in skipped:
            continue
        if not is_mergeable(obj):
            skipped.add(name)
            log.warning(
                "QC object %r is a %s, which cannot be merged: it is not published",
                name,
                type(obj).__name__,
            )
            continue
        if mode == "full":
            items.append([name, encode_object(obj)])
        elif isinstance(obj, RecordBatch) and (len(obj) or obj.dropped):
            items.append([name, encode_object(obj)])
            obj.reset()
    if mode == "delta":
        frames = encoder.take(objects) or []
    return [msgpack.packb(items), *frames]


def join_payload(payload: list[bytes]) -> tuple[list[bytes], list[int] | None]:
    """Many bin arrays as one frame (and their sizes, for the header's ``sizes``).

    A zmq frame costs ~1 us on each side; 1000 histograms of 1 kB cost 1 ms as frames
    and 0.05 ms as one joined buffer. Payloads of few frames are left alone.
    """
    if len(payload) <= JOIN_MIN_FRAMES + 2:
        return payload, None
    arrays = payload[2:]
    return [payload[0], payload[1], b"".join(arrays)], [len(a) for a in arrays]


class QcPublisher:
    """One source's connection to a merger: sequence numbers, credits, re-sends."""

    def __init__(
        self,
        context: zmq.Context[Any],
        address: str,
        *,
        source: str,
        task: str,
        run: int = 0,
        session: str = "default",
        max_unacked: int = 16,
        resend_after_s: float = 5.0,
        hwm: int = 1000,
        clock: Callable[[], float] = time.monotonic,
        channel: Channel | None = None,
    ) -> None:
        """``channel``: an open DEALER to the merger (a device's ``qc-out``) instead of
        ``address``; it is closed with the publisher."""
        if channel is None:
            config = ChannelConfig(
                name="qc-delta",
                type="dealer",
                method="connect",
                address=address,
                sndBufSize=hwm,
                rcvBufSize=hwm,
                linger=0,
                rateLogging=0,
            )
            channel = open_channel(context, config, session)
        self.channel = channel
        self.source, self.task, self.run = source, task, run
        self.max_unacked = max(1, max_unacked)
        self.resend_after_s = resend_after_s
        self.clock = clock
        self.seq = 0
        # seq -> [frames, last send time]
        self.unacked: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()
        self.stats = {"sent": 0, "resent": 0, "acked": 0, "would_block": 0, "refused": 0}
        self.end_acked = False
        self._unsent: collections.deque[int] = collections.deque()
        self._next_scan_s = 0.0
        self._bad = BadMessageCounter(f"qc producer {source}")

    def __repr__(self) -> str:
        return f"<QcPublisher {self.source!r} seq={self.seq} unacked={len(self.unacked)}>"

    def has_credit(self) -> bool:
        return len(self.unacked) < self.max_unacked

    def publish(self, cycle: int, events: int, payload: list[bytes], mode: str = "delta") -> int:
        """Send one publication; it is kept until acknowledged. Returns its sequence number."""
        self.seq += 1
        header: dict[str, Any] = {
            "qc": QC_PROTOCOL,
            "src": self.source,
            "task": self.task,
            "run": self.run,
            "cycle": cycle,
            "seq": self.seq,
            "events": events,
            "mode": mode,
            "ts": time.time(),
        }
        payload, sizes = join_payload(payload)
        if sizes is not None:
            header["sizes"] = sizes
        frames = encode_message(MsgType.EVENTS, header, payload)
        entry = self.unacked[self.seq] = [frames, self.clock()]
        # behind what the socket refused before, or refused now: service() sends it
        if self._unsent or not self._send(frames):
            entry[1] = _UNSENT
            self._unsent.append(self.seq)
        self.stats["sent"] += 1
        return self.seq

    def _send(self, frames: list[Any]) -> bool:
        try:
            self.channel.send(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:  # high-water mark: it stays unacknowledged and is re-sent
            self.stats["would_block"] += 1
            return False

    def service(self) -> None:
        """Read acknowledgements and re-send what is overdue (call it often; non-blocking)."""
        while self.channel.poll(0):
            msg = self._bad.decode(self.channel.recv())
            if msg is None or msg.type is not MsgType.ACK:
                continue
            h = msg.header
            if h.get("refused"):
                self.stats["refused"] += 1
                log.error("QC source %s: the merger refuses it: %s", self.source, h["refused"])
            upto = h.get("upto")
            if type(upto) is int:
                seqs = set(s for s in h.get("seqs", ()) if type(s) is int)
                for s in [s for s in self.unacked if s <= upto or s in seqs]:
                    del self.unacked[s]
                    self.stats["acked"] += 1
            if h.get("end") is True:
                self.end_acked = True
        now = self.clock()
        while self._unsent:  # in order, until the socket refuses again
            entry = self.unacked.get(self._unsent[0])
            if entry is not None:
                if not self._send(entry[0]):
                    return
                entry[1] = now
            self._unsent.popleft()
        if now < self._next_scan_s:  # a scan of every kept publication, a few times a second
            return
        self._next_scan_s = now + min(0.1, self.resend_after_s / 4)
        for entry in self.unacked.values():
            if now - entry[1] >= self.resend_after_s:
                if not self._send(entry[0]):
                    break  # the queue is full: the rest waits for the next scan
                entry[1] = now
                self.stats["resent"] += 1

    def wait_acked(self, timeout_s: float) -> bool:
        """Until every publication is acknowledged (re-sending), or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.unacked and time.monotonic() < deadline:
            self.channel.poll(min(50, max(1, int((deadline - time.monotonic()) * 1000))))
            self.service()
        return not self.unacked

    def finish(self, timeout_s: float) -> bool:
        """Wait for every acknowledgement, then END (re-sent until the merger ACKs it)."""
        deadline = time.monotonic() + timeout_s
        ok = self.wait_acked(timeout_s)
        end = encode_message(
            MsgType.END,
            {"from": self.source, "count": self.seq, "qc": 1, "task": self.task, "run": self.run},
        )
        next_send = 0.0
        while not self.end_acked and time.monotonic() < deadline:
            if time.monotonic() >= next_send:
                self._send(end)
                next_send = time.monotonic() + min(self.resend_after_s, 1.0)
            self.channel.poll(50)
            self.service()
        if not (ok and self.end_acked):
            log.error(
                "QC source %s: %d publication(s) and END%s not acknowledged within %.1f s",
                self.source,
                len(self.unacked),
                "" if not self.end_acked else " (acked)",
                timeout_s,
            )
        return ok and self.end_acked

    def close(self) -> None:
        self.channel.close(0)


class QcTask(Module):
    """Base class of QC tasks; override ``book()`` and ``fill(store)`` (see module doc)."""

    parallel = True
    merger = Param(str, "", "merger address (ipc://NAME in the session or tcp://HOST:PORT)")
    cycle_s = Param(float, 10.0, "publication cycle (s)")
    mode = Param(str, "delta", "publish deltas or full objects", choices=("delta", "full"))
    task = Param(str, "", "task name in the object paths qc/<task>/<object> (default: name)")
    source = Param(str, "", "source id (default <task>@<host>:<pid>)")
    session = Param(str, "default", "session of ipc addresses")
    max_unacked = Param(int, 16, "publications kept until acknowledged (credits)")
    resend_after_s = Param(float, 5.0, "re-send an unacknowledged publication after (s)")
    finish_timeout_s = Param(float, 30.0, "how long end_run waits for acknowledgements (s)")

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(name, **params)
        self.objects: dict[str, Any] = {}
        self.run_number = 0
        self.cycle = 0
        self.events = 0  # in the objects since the last publication (delta) or in total
        self.events_total = 0
        self.held_cycles = 0
        self.publisher: QcPublisher | None = None
        self._cycle_s = self.cycle_s
        self._next_s = 0.0
        self._encoder = DeltaEncoder()
        self._skipped: set[str] = set()
        self._context: zmq.Context[Any] | None = None
        #: an open DEALER to the merger, used instead of ``merger`` (a device's qc-out)
        self.out_channel: Channel | None = None

    # --- override ------------------------------------------------------------------------
    def book(self) -> None:
        """Create the objects in ``self.objects``."""

    def fill(self, store: DataStore) -> None:
        """Fill the objects from one event."""

    # --- module hooks --------------------------------------------------------------------
    @property
    def task_name(self) -> str:
        return self.task or self.name

    def initialize(self) -> None:
        self.book()

    def begin_run(self, run: RunMeta) -> None:
        self.run_number = run.run
        if (self.merger or self.out_channel is not None) and self.publisher is None:
            self._context = zmq.Context()
            source = self.source or f"{self.task_name}@{socket.gethostname()}:{os.getpid()}"
            self.publisher = QcPublisher(
                self._context,
                self.merger,
                source=source,
                task=self.task_name,
                run=run.run,
                session=self.session,
                max_unacked=self.max_unacked,
                resend_after_s=self.resend_after_s,
                channel=self.out_channel,
            )
        self._next_s = time.monotonic() + self._cycle_s

    def event(self, store: DataStore) -> bool | None:
        self.fill(store)
        self.after_event()
        return None

    def after_event(self, filled: bool = True) -> None:
        """What follows ``fill``: count the event (unless ``filled`` is False: the fill
        raised, see ``qc-producer``) and publish when the cycle is due."""
        if filled:
            self.events += 1
            self.events_total += 1
        if self.publisher is not None:
            now = time.monotonic()
            if now >= self._next_s:
                self._next_s = now + self._cycle_s
                self.publish_cycle()
            else:
                self.publisher.service()

    def end_run(self, run: RunMeta) -> None:
        if self.publisher is None:
            return
        deadline = time.monotonic() + self.finish_timeout_s  # one budget for all of it
        self.publisher.wait_acked(self.finish_timeout_s)  # credit for the last one
        self.publish_cycle(force=True)
        self.publisher.finish(max(0.1, deadline - time.monotonic()))

    def terminate(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self._context is not None:
            self._context.term()
            self._context = None

    # --- publishing ----------------------------------------------------------------------
    def set_cycle_s(self, seconds: float) -> None:
        """Change the publication cycle during a run (from the next cycle on)."""
        if seconds <= 0:
            raise ValueError(f"QC task {self.task_name!r}: cycle must be > 0 s, got {seconds}")
        self._cycle_s = float(seconds)
        self._next_s = min(self._next_s, time.monotonic() + self._cycle_s)

    def publish_cycle(self, force: bool = False) -> int | None:
        """Publish now (if there is credit; otherwise the objects keep filling)."""
        pub = self.publisher
        if pub is None:
            return None
        pub.service()
        self.cycle += 1
        if not pub.has_credit() and not force:
            self.held_cycles += 1
            return None
        payload = take_payload(self.objects, self._encoder, self.mode, self._skipped)
        events = self.events_total if self.mode == "full" else self.events
        self.events = 0
        return pub.publish(self.cycle, events, payload, self.mode)

    def statistics(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cycle": self.cycle,
            "events": self.events_total,
            "held_cycles": self.held_cycles,
            "not_published": sorted(self._skipped),
        }
        if self.publisher is not None:
            out.update(
                self.publisher.stats, seq=self.publisher.seq, unacked=len(self.publisher.unacked)
            )
        return out

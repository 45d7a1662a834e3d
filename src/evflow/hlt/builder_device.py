"""The event builder as a device and as a source module (the first module of a path).

Both read fragment batches on a ROUTER socket (:class:`~evflow.hlt.links.FragmentReceiver`:
credits, back-pressure) into an :class:`~evflow.hlt.eventbuilder.EventBuilder`.

- ``EventBuilderDevice`` (``evflow device eventbuilder``): channel ``fragments``
  (router, bind) in, channel ``events`` (push) out; built events leave in batches
  (:func:`~evflow.hlt.built.encode_built`), the stream ends with END and its count.
  Its metrics (on the bus) carry ``eventbuilder``: built, incomplete per missing
  source, late, duplicate, in construction, bytes.
- ``EventBuilderInput``: a source; each built event is a DataStore
  (:mod:`evflow.hlt.built`).

Both end when every expected source sent END (and everything is built), or when no
fragment came for ``end_timeout_s`` after at least one source ended.

The device may be restarted (``restart = "on-failure"``, docs/hlt.md "Restarts"): it
keeps, in its session's directory (:class:`~evflow.runtime.devices.StreamRecord`
and a file mapping of built ids), the batches it sent on, the events they held, the id
below which everything had left construction, the ids it built above it, and the
streams whose END it acknowledged (only once their every event had gone on). Its next
process starts from them: the senders, who keep what is not built yet, send it again;
fragments of events already sent on are refused as late; it announces downstream what
both processes sent; and it does not wait for streams that had ended.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from evflow.errors import ConfigurationError
from evflow.event import DataStore, EventMeta
from evflow.hlt.built import (
    Merge,
    encode_built,
    encoded_from_batch,
    joined_from_batch,
    stores_from_batch,
)
from evflow.hlt.eventbuilder import BuilderConfig, BuiltBatch, EventBuilder
from evflow.hlt.links import FragmentReceiver
from evflow.hlt.replay import join_fragments
from evflow.params import Param
from evflow.processing.module import Source
from evflow.processing.parallel.worker.lazystore import LazyEvent
from evflow.runtime.device import Device
from evflow.runtime.devices import StreamRecord, end_and_wait
from evflow.wire.codec import encode_event

__all__ = ["EventBuilderDevice", "EventBuilderInput", "parse_sources"]

log = logging.getLogger("evflow.hlt")

#: the source's waits for fragments (ms): while events are in construction (their
#: time-outs are looked at this often), and when none is (ticks of a paced stream
#: wake it; this bounds how late the end of the streams is noticed)
BUSY_WAIT_MS = 10
IDLE_WAIT_MS = 100


def parse_sources(spec: str | int) -> list[int]:
    """``12`` or ``"12"`` -> 0..11; ``"0-3,8"`` -> [0, 1, 2, 3, 8]."""
    text = str(spec).strip()
    if text.isdigit():
        return list(range(int(text)))
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ConfigurationError(
            f"bad source list {spec!r}; expected a count (12) or ids like '0-3,8'"
        ) from None
    return out


class _Params:
    sources = Param(str, "12", "expected sources: a count (12) or ids ('0-5,8')")
    timeout_s = Param(float, 1.0, "an event is incomplete this long after its first fragment")
    max_events = Param(int, 4096, "events in construction at most (back-pressure beyond)")
    max_bytes = Param(int, 256 << 20, "fragment bytes in construction at most")
    credit = Param(int, 16, "batches each sender may have in flight")
    ordered = Param(bool, True, "sources deliver ascending event ids (enables inference)")
    end_timeout_s = Param(float, 5.0, "after a source ended, stop when nothing came this long")

    def builder_config(self: Any) -> BuilderConfig:
        return BuilderConfig(
            sources=parse_sources(self.sources),
            timeout_s=self.timeout_s,
            max_events=self.max_events,
            max_bytes=self.max_bytes,
            ordered=self.ordered,
        )


def _finished(recv: FragmentReceiver, quiet_s: float, end_timeout_s: float) -> bool:
    """Every source ended and everything is built, or ``quiet_s`` of silence (time spent
    downstream not counted) after at least one source ended (or, restarted, from the
    start: senders that gave up on the dead process never come)."""
    if recv.all_ended() and not recv.pending():
        # (restarted: a sender whose END the dead process took may still wait for its
        # ACK; it says HELLO again within HELLO_RESEND_S, and is answered)
        return not recv.unanswered() or quiet_s > end_timeout_s
    any_ended = recv.resumed or any(p.ended for p in recv.peers.values())
    return any_ended and quiet_s > end_timeout_s


class BuiltRing:
    """The ids of the events a device sent on (``size`` of them, the latest, in slots
    ``id % size``), in a file mapping of ``directory`` (a SIGKILL loses none; kept as
    id + 1, 0 for an empty slot). Without a directory, in memory."""

    def __init__(self, directory: Path | None, device_id: str, size: int) -> None:
        self._map: mmap.mmap | None = None
        if directory is None:
            self._ids = np.zeros(size, np.int64)
        else:
            fd = os.open(directory / f"{device_id}.built", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size != size * 8:
                    os.ftruncate(fd, 0)  # (another size: not ours to read)
                    os.ftruncate(fd, size * 8)
                self._map = mmap.mmap(fd, size * 8)
            finally:
                os.close(fd)
            self._ids = np.frombuffer(self._map, np.int64)
        self._mask = size - 1

    def mark(self, ids: np.ndarray) -> None:
        self._ids[ids & self._mask] = ids + 1

    def built(self) -> np.ndarray:
        kept = self._ids[self._ids > 0]
        return kept - 1

    def reset(self) -> None:
        self._ids[:] = 0


class EventBuilderDevice(_Params, Device):
    description = "builds events from fragment batches of N sources (router in, push out)"

    input_channel = Param(str, "fragments", "input channel (router, bind)")
    output_channel = Param(str, "events", "output channel of built events")
    ack_timeout_s = Param(float, 10.0, "how long to wait for the END acknowledgement (s)")

    _record: StreamRecord
    _ring: BuiltRing

    def init_task(self) -> None:
        self.builder = builder = EventBuilder(self.builder_config())
        # [batches sent on, events in them, the id below which all had left
        # construction, 1 once our END was acknowledged downstream]: a restarted
        # process goes on from them (module docstring)
        directory = getattr(self, "stream_dir", None)
        if hasattr(self, "_record"):  # a new task of this process, not a restart
            self._record.reset()
            self._ring.reset()
        else:
            where = Path(directory) if directory else None
            self._record = StreamRecord(where, self.id, 4)
            self._ring = BuiltRing(where, self.id, 2 * builder.capacity)
        record = self._record
        self.receiver = recv = FragmentReceiver(
            self.context,
            builder,
            "",
            credit=self.credit,
            channel=self.channel(self.input_channel),
            bad=self.bad_messages[self.channel(self.input_channel).label],
            ack_when_built=True,
            on_end=lambda source, count: record.add_end(str(source), count),
        )
        if record.restarted:  # (StreamRecord said so, with the counts)
            ended = [int(k) for k in record.ends if k.isdigit()]
            recv.resume(ended, int(record.counts[2]), self._ring.built())
        self.sent = int(record.counts[0])
        self._quiet_since = time.monotonic()

    def pre_run(self) -> None:
        self._quiet_since = time.monotonic()  # (the walk to RUNNING is not silence)

    def conditional_run(self) -> bool:
        recv = self.receiver
        if recv.pump(10):
            self._quiet_since = time.monotonic()
        t_fwd = time.monotonic()
        self._forward()
        self._quiet_since += time.monotonic() - t_fwd  # sending is not silence
        quiet_s = time.monotonic() - self._quiet_since
        if _finished(recv, quiet_s, self.end_timeout_s):
            self.builder.flush()
            self._forward()
            recv.ack_ended()  # every stream has gone on
            unended = [s for s in self.builder.sources if not _ended(recv, s)]
            if unended:
                log.warning(
                    "%s: ending without the END of stream(s) %s (silent for %.1f s)",
                    self.id,
                    ", ".join(map(str, unended)),
                    quiet_s,
                )
            return False
        return True

    def _forward(self) -> None:
        out = self.channel(self.output_channel)
        counts = self._record.counts
        sent = False
        for batch in self.builder.take_built():
            frames = encode_built(batch)
            # counted before it goes: a kill in between shows as a batch missing
            # downstream, never as an event built twice
            self._ring.mark(batch.ids)
            self.sent += 1
            counts[0] = self.sent
            counts[1] += len(batch)
            out.send(frames)
            sent = True
        if sent:
            counts[2] = self.receiver.done_below()

    def post_run(self) -> None:
        counts = self._record.counts
        if counts[3] and self.receiver.all_ended():
            # our dead predecessor ended the stream downstream (its receiver may be gone)
            log.info("%s: END of %d batches acknowledged before the restart", self.id, self.sent)
        else:
            _, acked = end_and_wait(self, self.output_channel, [self.sent], self.ack_timeout_s)
            if acked:
                counts[3] = 1
        log.info("%s: %s", self.id, self.builder.summary_line())

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        recv = getattr(self, "receiver", None)
        if recv is not None:
            out["eventbuilder"] = recv.metrics()
            counts = self._record.counts  # (this process's and a dead predecessor's)
            out["eventbuilder"].update(sent_on=int(counts[0]), events_sent_on=int(counts[1]))
        return out


def _ended(recv: FragmentReceiver, source: int) -> bool:
    peer = recv.by_source.get(source)
    return source in recv.ended_before or (peer is not None and peer.ended)


class EventBuilderInput(_Params, Source):
    """A source: events built from fragment batches that senders push to ``address``."""

    address = Param(str, "ipc://hlt-fragments", "where the senders connect (bound here)")
    session = Param(str, "default", "ipc session directory for relative ipc addresses")
    experiment = Param(int, 0, "experiment number in every event's meta")
    run = Param(int, 0, "run number in every event's meta")
    stats_file = Param(str, "", "write the builder's figures here (JSON) at the end")
    batch_ms = Param(
        float,
        50.0,
        "parallel runs: built events go to the workers in batches of what arrived in "
        "this many ms (fewer messages, less framework CPU; 0: as they are built)",
    )

    def __init__(self, name: str | None = None, merge: Merge | None = None, **params: Any):
        super().__init__(name, **params)
        self.builder_config().check()
        self.merge = merge
        self.builder: EventBuilder | None = None
        self.receiver: FragmentReceiver | None = None
        self.summary: dict[str, Any] = {}
        self._due: float | None = None  # when the batch being gathered must go

    #: for the path engine: events arrive over time; each chunk of ``encoded_batches``
    #: (``batch_ms`` of arrivals) is one batch, without waiting for the next
    streaming = True

    def events(self, start: int = 0) -> Iterator[DataStore]:
        exp, run = self.experiment, self.run
        for batch in self._built():
            if batch is None:
                continue
            if self.merge is not join_fragments:
                yield from stores_from_batch(batch, self.merge, exp, run)
                continue
            # replayed events: re-headed as bytes, decoded only if a module opens one,
            # and written as they are by a writer if none changed it
            uids, frames = joined_from_batch(batch, exp, run)
            # made for the whole batch in one warm loop, not one by one between the
            # events' modules
            yield from [
                LazyEvent(fr, EventMeta(uid, exp, run, uid))
                for uid, fr in zip(uids, frames, strict=True)
            ]

    def encoded_batches(self, start: int = 0) -> Iterator[tuple[list[int], int, int, list[Any]]]:
        """The path engine's fast path: each built batch as ``(uids, experiment, run,
        frames)``, the codec bytes of the stores :meth:`events` yields, made without the
        stores (:func:`~evflow.hlt.built.encoded_from_batch`); with ``merge``, the merged
        stores encoded."""
        exp, run = self.experiment, self.run
        wait_s = max(self.batch_ms, 0.0) / 1e3
        cap = min(self.max_events, 1024)
        uids: list[int] = []
        frames: list[Any] = []
        t_first = 0.0
        for batch in self._built():
            if batch is not None:
                if not uids:
                    t_first = time.monotonic()
                    self._due = t_first + wait_s  # _built waits no longer than this
                if self.merge is None:
                    u, f = encoded_from_batch(batch, exp, run)
                elif self.merge is join_fragments:  # replayed events: joined as bytes
                    u, f = joined_from_batch(batch, exp, run)
                else:
                    stores = list(stores_from_batch(batch, self.merge, exp, run))
                    u, f = [s.meta.uid for s in stores], [encode_event(s) for s in stores]
                uids += u
                frames += f
            # held for up to batch_ms from the first (the events of a paced stream
            # arrive a few at a time): one chunk, one batch, one message per hop
            if uids and (len(uids) >= cap or time.monotonic() - t_first >= wait_s):
                self._due = None
                yield uids, exp, run, frames
                uids, frames = [], []
        if uids:
            yield uids, exp, run, frames

    def _wait_ms(self, builder: EventBuilder) -> int:
        """How long to wait for fragments: 10 ms while events are in construction
        (their time-outs), else until the batch held by :meth:`encoded_batches` is
        due, at most ``IDLE_WAIT_MS`` (a paced stream's ticks wake it: no polling
        between them)."""
        wait = BUSY_WAIT_MS if builder.n_open else IDLE_WAIT_MS
        if self._due is not None:
            wait = min(wait, max(0, math.ceil((self._due - time.monotonic()) * 1000)))
        return wait

    def _built(self) -> Iterator[BuiltBatch | None]:
        """Built batches as they come, and None after a wait that built nothing."""
        ctx: zmq.Context[Any] = zmq.Context()
        away = [0.0]  # time spent downstream, when nobody listens to the sources

        def listening_clock() -> float:
            return time.monotonic() - away[0]

        # time-outs count only the time we listen: a slow path is back-pressure (the
        # fragments wait in the socket), not a reason to call events incomplete
        self.builder = builder = EventBuilder(self.builder_config(), clock=listening_clock)
        recv = FragmentReceiver(
            ctx, builder, self.address, session=self.session, credit=self.credit
        )
        self.receiver = recv
        quiet_since = time.monotonic()
        backlog: deque[BuiltBatch] = deque()  # built, not yet handed to the path
        waiting = 0  # events in it
        try:
            while True:
                # keep the sockets served (credits, END, HELLO) between batches, but
                # take no more while a backlog of 512 events waits for the path
                if waiting < min(self.max_events, 512):
                    if recv.pump(0 if backlog else self._wait_ms(builder)):
                        quiet_since = time.monotonic()
                    for batch in builder.take_built():
                        backlog.append(batch)
                        waiting += len(batch)
                out = None
                if backlog:
                    out = backlog.popleft()
                    waiting -= len(out)
                t_out = time.monotonic()
                yield out
                # time the path spent on our events is not silence of the sources
                spent = time.monotonic() - t_out
                quiet_since += spent
                away[0] += spent
                if out is not None:
                    continue
                if _finished(recv, time.monotonic() - quiet_since, self.end_timeout_s):
                    builder.flush()
                    yield from builder.take_built()
                    return
        finally:
            self.summary = recv.metrics()
            if self.stats_file:
                with open(self.stats_file, "w") as f:
                    json.dump(self.summary, f)
            log.info("%s", builder.summary_line())
            recv.close()
            ctx.term()

"""Replay recorded events at a set rate, in a loop: the readout emulator (C-RORC replay).

The events of a record file or a ROOT file are read once into memory (as the C-RORC
held its replay data in its buffer) and played ``passes`` times (0: for ever). Event
``k`` of the whole replay is due at ``t0 + k / rate_hz`` on the monotonic clock
(:class:`Timeline`): lateness never accumulates into drift, a late event is followed
by the next ones at once until the timeline is met again, and the achieved rate and
the worst lag are reported. ``rate_hz = 0`` plays as fast as possible.

``ReplayInput`` is a source module; ``evflow.hlt.replay_device.ReplayDevice`` sends
the same events to a device channel or, split into N fragment streams
(:func:`split_event`), to an event builder, which joins them again
(:func:`join_fragments` as its merge function).

A record file cut short (a torn tail) replays every complete record, as the record
reader recovers them (the warning names the file and the offset); damage in the
middle, a truncated or foreign ROOT file and a missing file are one ``InputError``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from evflow.errors import CodecError, InputError, ParameterError
from evflow.event import DataStore, EventMeta
from evflow.params import Param
from evflow.processing.filetypes import file_source
from evflow.processing.module import Module, Source
from evflow.wire.codec import decode_event, encode_event
from evflow.wire.raw import pack_frames, unpack_frames

__all__ = [
    "JoinFragments",
    "ReplayInput",
    "ReplayReport",
    "Timeline",
    "join_fragments",
    "load_events",
    "split_event",
]

log = logging.getLogger("evflow.hlt")


def load_events(
    file: str, tree: str = "events", branches: list[str] | None = None
) -> list[DataStore]:
    """Every event of a ROOT file (``.root``) or a record file, in file order."""
    events = list(file_source(file, tree, branches).events(0))
    if not events:
        raise InputError(f"replay file {file!r} holds no events")
    return events


def encoded(events: list[DataStore]) -> list[bytes]:
    """Each event as one buffer (``pack_frames(encode_event(...))``), made once."""
    return [pack_frames(encode_event(store)) for store in events]


def split_event(data: bytes, n: int) -> list[memoryview]:
    """``data`` cut into ``n`` contiguous pieces of nearly equal size (some may be empty)."""
    view = memoryview(data)
    size = len(view)
    cuts = [size * k // n for k in range(n + 1)]
    return [view[cuts[k] : cuts[k + 1]] for k in range(n)]


def join_fragments(event_id: int, fragments: dict[int, Any]) -> dict[str, Any]:
    """Merge function for the builder: the replayed event's objects from its pieces
    (in source id order). An incomplete event has no objects (only ``hlt_state``)."""
    data = b"".join(fragments[s] for s in sorted(fragments))
    try:
        return dict(decode_event(unpack_frames(data)).objects)
    except CodecError:
        return {}  # pieces missing: the event says so in hlt_state/hlt_missing


class JoinFragments(Module):
    """In the workers: a built event's ``frag_*`` pieces joined back into the replayed
    event (the same as :func:`join_fragments` in the builder, but in parallel).

    A complete event's store then holds the replayed objects plus ``hlt_state`` and
    ``hlt_missing``; an incomplete one keeps its pieces, or is dropped with
    ``drop_incomplete``.
    """

    parallel = True
    drop_incomplete = Param(bool, True, "drop events the builder flagged incomplete")

    def event(self, store: DataStore) -> bool | None:
        if store["hlt_state"] != 0:
            return False if self.drop_incomplete else None
        objects = store.objects  # one dict, edited in place (the store's own)
        keys = sorted((k for k in objects if k.startswith("frag_")), key=_source_id)
        data = b"".join([objects.pop(k) for k in keys])
        # bytes that are not a replayed event: the pieces are gone, as in join_fragments
        with contextlib.suppress(CodecError):
            objects.update(decode_event(unpack_frames(data)).objects)
        return None


def _source_id(key: str) -> int:
    return int(key[5:])


class Timeline:
    """When each event is due: ``t0 + k / rate_hz`` (``rate_hz = 0``: always now)."""

    def __init__(self, rate_hz: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_hz < 0:
            raise ParameterError(f"replay rate must be >= 0 Hz, got {rate_hz}")
        self.rate_hz = rate_hz
        self.clock = clock
        self.t0 = clock()
        self.max_lag_s = 0.0

    def due(self, k: int) -> float:
        return self.t0 + k / self.rate_hz if self.rate_hz else self.t0

    def ready(self, k: int, now: float | None = None) -> int:
        """How many events from ``k`` on are due by now (0: wait)."""
        now = self.clock() if now is None else now
        if not self.rate_hz:
            return 1 << 30
        n = int((now - self.t0) * self.rate_hz) + 1 - k
        if n > 0:
            self.max_lag_s = max(self.max_lag_s, now - self.due(k))
        return max(n, 0)

    def wait(self, k: int, sleep: Callable[[float], None] = time.sleep) -> None:
        """Sleep until event ``k`` is due (one sleep, to the absolute time)."""
        if not self.rate_hz:
            return
        left = self.due(k) - self.clock()
        if left > 0:
            sleep(left)
        else:
            self.max_lag_s = max(self.max_lag_s, -left)


@dataclass
class ReplayReport:
    events: int = 0
    passes: int = 0
    elapsed_s: float = 0.0
    rate_hz: float = 0.0  # asked for
    achieved_hz: float = 0.0  # (events - 1) / (last sent - start of the timeline)
    max_lag_ms: float = 0.0

    def line(self) -> str:
        asked = f"{self.rate_hz:,.0f} Hz asked" if self.rate_hz else "as fast as possible"
        return (
            f"replay: {self.events} events in {self.passes} pass(es), achieved "
            f"{self.achieved_hz:,.1f} Hz ({asked}), worst lag {self.max_lag_ms:.2f} ms"
        )


class ReplayInput(Source):
    """Replays a record or ROOT file at ``rate_hz`` for ``passes`` passes (0: for ever).

    ``meta.uid`` counts through the whole replay (pass * events + index), so every
    replayed event is unique; ``meta.event`` is its index in the file.
    """

    file = Param(str, doc="record file or ROOT file (.root) to replay")
    rate_hz = Param(float, 0.0, "events per second (0: as fast as possible)")
    passes = Param(int, 1, "passes over the file (0: for ever)")
    tree = Param(str, "events", "TTree of a ROOT file")
    branches = Param((list, tuple, type(None)), None, "branches of a ROOT file (None: all)")

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(name, **params)
        if self.rate_hz < 0 or self.passes < 0:
            raise ParameterError(
                f"module {self.name!r}: rate_hz and passes must be >= 0 "
                f"(got {self.rate_hz}, {self.passes})"
            )
        branches = list(self.branches) if self.branches is not None else None
        self._events = load_events(self.file, self.tree, branches)
        self.report = ReplayReport(rate_hz=self.rate_hz)

    def total(self) -> int | None:
        return len(self._events) * self.passes if self.passes else None

    def events(self, start: int = 0) -> Iterator[DataStore]:
        n = len(self._events)
        timeline = Timeline(self.rate_hz)
        report = self.report = ReplayReport(rate_hz=self.rate_hz)
        k = start
        t_last = timeline.t0
        try:
            while not self.passes or k < n * self.passes:
                timeline.wait(k - start)
                src = self._events[k % n]
                meta = EventMeta(k, src.meta.experiment, src.meta.run, k % n, src.meta.flags)
                t_last = time.monotonic()
                k += 1
                report.events += 1
                yield DataStore(meta, dict(src.objects))
        finally:
            report.passes = -(-k // n)
            report.elapsed_s = t_last - timeline.t0
            if report.events > 1 and t_last > timeline.t0:
                report.achieved_hz = (report.events - 1) / (t_last - timeline.t0)
            report.max_lag_ms = timeline.max_lag_s * 1e3
            log.info("%s", report.line())

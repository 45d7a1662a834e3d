"""Toy events for tests and benchmarks: deterministic payloads and real CPU work.

``ToyGenerator`` is a source; ``BusyWork`` is the parallel module that burns CPU per
event (sources run serially, so the work a benchmark wants to spread over workers
belongs in a parallel module, not in the source).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from evflow.errors import ParameterError
from evflow.event import DataStore, EventMeta
from evflow.io.cpuwork import burn_cpu
from evflow.processing.module import Module, Param, Source

# Payload views start at a position-dependent offset inside a block this much larger
# than the payload, so consecutive events carry different bytes without a copy.
_WINDOW = 4096
_GOLDEN = 0x9E3779B97F4A7C15  # 64-bit golden-ratio constant for a cheap integer hash
_MASK64 = (1 << 64) - 1


class ToyGenerator(Source):
    """A deterministic source of toy events.

    The event at position ``k`` depends only on ``seed`` and ``k``: ``events(start=k)``
    yields exactly the tail of ``events(0)``, so resumed and parallel runs see the same
    events. Each event holds ``payload`` (a read-only ``uint8`` array of
    ``payload_bytes`` bytes, a view into one random block made once), ``position``
    (int), ``value`` (float in [0, 1)) and ``tag`` (int in [0, 16)). ``meta.uid`` and
    ``meta.event`` are the position. ``work_ms`` burns CPU in the source itself (serial);
    use ``BusyWork`` for work that should run in parallel workers.
    """

    preload = ("evflow.io._encoded_toy",)  # the input's fast path (encoded_batches)
    n_events = Param(int, 1000, "number of events")
    seed = Param(int, 0, "seed of the random payload and values")
    payload_bytes = Param(int, 1024, "payload size per event in bytes")
    work_ms = Param(float, 0.0, "CPU time burnt per event in the source, ms (serial)")
    experiment = Param(int, 0, "experiment number in every event's meta")
    run = Param(int, 0, "run number in every event's meta")

    def __init__(self, name: str | None = None, **params: object) -> None:
        super().__init__(name, **params)
        for pname in ("n_events", "payload_bytes"):
            if self._params[pname] < 0:
                raise ParameterError(
                    f"module {self.name!r}: parameter {pname!r} must be >= 0, "
                    f"got {self._params[pname]}"
                )
        if self.work_ms < 0:
            raise ParameterError(f"module {self.name!r}: parameter 'work_ms' must be >= 0")
        rng = np.random.default_rng(self.seed)
        block = rng.integers(0, 256, size=self.payload_bytes + _WINDOW, dtype=np.uint8)
        block.flags.writeable = False  # views are shared; nobody may change them
        self._block = block
        self._salt = (self.seed * _GOLDEN) & _MASK64

    def total(self) -> int:
        return int(self.n_events)

    def make_event(self, position: int) -> DataStore:
        """The event at ``position`` (a few µs for 1 kB; no copy of the payload)."""
        h = ((position + 1) * _GOLDEN ^ self._salt) & _MASK64
        offset = h % _WINDOW
        meta = EventMeta(position, self.experiment, self.run, position)
        return DataStore(
            meta,
            {
                "payload": self._block[offset : offset + self.payload_bytes],
                "position": position,
                "value": (h >> 11) / 9007199254740992.0,  # 53 bits -> [0, 1)
                "tag": h & 15,
            },
        )

    def events(self, start: int = 0) -> Iterator[DataStore]:
        if start < 0:
            raise ParameterError(f"source {self.name!r}: start must be >= 0, got {start}")
        work_ms = self.work_ms
        make = self.make_event
        for position in range(start, self.n_events):
            if work_ms > 0:
                burn_cpu(work_ms)
            yield make(position)

    def encoded_events(self, start: int = 0) -> Iterator[tuple[int, int, int, list[Any]]]:
        """``(uid, experiment, run, frames)``: ``events(start)`` already encoded.

        The frames equal ``encode_event`` of the events ``events(start)`` yields, byte
        for byte, at ~1 µs per 1 kB event (the parallel input's fast path).
        """
        if start < 0:
            raise ParameterError(f"source {self.name!r}: start must be >= 0, got {start}")
        from evflow.io._encoded_toy import encoded_toy_events

        return encoded_toy_events(self, start, _WINDOW)

    def encoded_batches(
        self, start: int = 0
    ) -> Iterator[tuple[list[int], int, int, Sequence[list[Any]]]]:
        """``encoded_events`` in chunks: ``(uids, experiment, run, [frames, ...])``."""
        if start < 0:
            raise ParameterError(f"source {self.name!r}: start must be >= 0, got {start}")
        from evflow.io._encoded_toy import encoded_toy_batches

        return encoded_toy_batches(self, start, _WINDOW)


class BusyWork(Module):
    """Burns ``work_ms`` ms of CPU time per event (a busy loop, never sleep)."""

    parallel = True
    work_ms = Param(float, 1.0, "CPU time burnt per event, ms")

    def __init__(self, name: str | None = None, **params: object) -> None:
        super().__init__(name, **params)
        if self.work_ms < 0:
            raise ParameterError(f"module {self.name!r}: parameter 'work_ms' must be >= 0")

    def event(self, store: DataStore) -> bool | None:
        burn_cpu(self.work_ms)
        return None

"""The event builder's data types: states, configuration, built batches, counters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from evflow.errors import ConfigurationError

__all__ = ["MAX_SOURCES", "BuildState", "BuilderConfig", "BuilderCounters", "BuiltBatch"]

MAX_SOURCES = 64  # one bit per source in a u64


class BuildState(IntEnum):
    COMPLETE = 0
    INCOMPLETE_TIMEOUT = 1
    INCOMPLETE_INFERRED = 2


@dataclass
class BuilderConfig:
    sources: Sequence[int]
    timeout_s: float = 1.0
    max_events: int = 4096
    max_bytes: int = 256 << 20
    ordered: bool = True  # each source delivers its event ids in ascending order
    past_window: int = 1 << 20
    future_window: int = 1 << 24

    def check(self) -> None:
        srcs = list(self.sources)
        if not 1 <= len(srcs) <= MAX_SOURCES:
            raise ConfigurationError(
                f"event builder: {len(srcs)} sources; expected 1 to {MAX_SOURCES}"
            )
        if len(set(srcs)) != len(srcs) or any(not 0 <= s < 2**32 for s in srcs):
            raise ConfigurationError(
                f"event builder: source ids must be distinct integers in [0, 2**32): {srcs}"
            )
        if self.timeout_s <= 0 or self.max_events < 1 or self.max_bytes < 1:
            raise ConfigurationError(
                "event builder: timeout_s, max_events and max_bytes must be > 0 "
                f"(got {self.timeout_s}, {self.max_events}, {self.max_bytes})"
            )


@dataclass
class BuiltBatch:
    """Events that left construction together, in ascending event id order.

    ``lengths[i, k]`` is the length of source ``sources[k]``'s fragment of event ``i``
    (0 when missing: see ``missing``, a bit mask over the source index).
    """

    sources: list[int]
    ids: np.ndarray  # int64
    states: np.ndarray  # uint8 BuildState
    missing: np.ndarray  # uint64 bit mask (bit k: sources[k] missing)
    lengths: np.ndarray  # (n, nsrc) int64
    _msg: np.ndarray  # (n, nsrc) message serial
    _off: np.ndarray  # (n, nsrc)
    _bufs: dict[int, Any] = field(repr=False)

    def __len__(self) -> int:
        return len(self.ids)

    def fragments(self, i: int) -> dict[int, memoryview]:
        """Event ``i``'s fragments: source id -> bytes (missing sources left out)."""
        out = {}
        miss = int(self.missing[i])
        for k, src in enumerate(self.sources):
            if not miss >> k & 1:
                start = int(self._off[i, k])
                view = memoryview(self._bufs[int(self._msg[i, k])]).cast("B")
                out[src] = view[start : start + int(self.lengths[i, k])]
        return out

    def missing_sources(self, i: int) -> list[int]:
        miss = int(self.missing[i])
        return [src for k, src in enumerate(self.sources) if miss >> k & 1]

    def packed(self) -> bytes:
        """Every fragment, event by event in source order, back to back."""
        views = []
        bufs = {k: memoryview(b).cast("B") for k, b in self._bufs.items()}
        msg, off, lens = self._msg.tolist(), self._off.tolist(), self.lengths.tolist()
        for mrow, orow, lrow in zip(msg, off, lens, strict=True):
            for m, o, n in zip(mrow, orow, lrow, strict=True):
                if n:
                    views.append(bufs[m][o : o + n])
        return b"".join(views)


@dataclass
class BuilderCounters:
    built: int = 0
    complete: int = 0
    incomplete_timeout: int = 0
    incomplete_inferred: int = 0
    fragments: int = 0
    bytes: int = 0
    late: int = 0
    duplicate: int = 0
    unknown_source: int = 0
    far: int = 0
    stale: int = 0
    deferred: int = 0  # add() calls that left fragments for later (back-pressure)
    max_in_construction: int = 0
    max_bytes_in_construction: int = 0

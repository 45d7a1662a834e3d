"""The input's encoded-event fast path: read events that the source already encoded.

When the input path is the source alone (no serial module before the first parallel
one) and the source offers ``encoded_events(start)`` (yielding ``(uid, experiment,
run, frames)`` with the frames ``encode_event`` would give for ``events(start)``) or
``encoded_batches(start)`` (yielding ``(uids, experiment, run, [frames, ...])``, one
run per chunk), the input never builds a ``DataStore``: it cuts its batches out of
the source's chunks with list slices. Everything else (ledger, credits, confirms,
resends) is the same as on the normal path.

Set ``EVFLOW_NO_FASTPATH=1`` to turn it off, together with the workers' lazy decoding
(``lazystore.py``): benchmarks compare both in one run.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from evflow.errors import EvflowError, ModuleError
from evflow.processing.chain import ModuleChain, user_traceback
from evflow.processing.parallel.batching import PackedEvents, frames_nbytes

#: environment variable that disables the fast path when set to a non-empty value
ENV_DISABLE = "EVFLOW_NO_FASTPATH"


def fastpath_enabled() -> bool:
    """False when ``EVFLOW_NO_FASTPATH`` is set: the input reads stores, workers decode all."""
    return not os.environ.get(ENV_DISABLE)


def fastpath_allowed(chain: ModuleChain) -> bool:
    """Whether the input may read encoded events from its source."""
    if not fastpath_enabled():
        return False
    if len(chain.modules) != 1:
        return False  # serial modules run on a DataStore: they need the slow path
    source = chain.modules[0]
    return any(callable(getattr(source, m, None)) for m in ("encoded_batches", "encoded_events"))


def encoded_source(chain: ModuleChain, start: int) -> EncodedReader | None:
    """A reader of the source's encoded events from ``start``, or None if not allowed."""
    if not fastpath_allowed(chain):
        return None
    source = chain.modules[0]
    try:
        batches = getattr(source, "encoded_batches", None)
        if callable(batches):
            return EncodedReader(iter(batches(start)))
        return EncodedReader(_chunks(iter(source.encoded_events(start))))  # type: ignore[attr-defined]
    except EvflowError:
        raise
    except Exception as exc:
        raise ModuleError(source.name, "events", None, exc, user_traceback(exc)) from exc


def _chunks(events: Iterator[Any], size: int = 256) -> Iterator[Any]:
    """Per-event ``(uid, experiment, run, frames)`` grouped into one-run chunks."""
    try:
        while True:
            items = list(itertools.islice(events, size))
            if not items:
                return
            first = 0
            for i in range(1, len(items) + 1):
                if i == len(items) or items[i][1:3] != items[first][1:3]:
                    part = items[first:i]
                    yield ([e[0] for e in part], part[0][1], part[0][2], [e[3] for e in part])
                    first = i
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


class EncodedReader:
    """The source's encoded chunks, cut into the input's batches."""

    __slots__ = ("_chunks", "_pending")

    def __init__(self, chunks: Iterator[Any]) -> None:
        self._chunks = chunks
        self._pending: list[Any] | None = None  # [uids, experiment, run, frames, offset]

    def _next_chunk(self) -> list[Any] | None:
        pending = self._pending
        if pending is not None and pending[4] < len(pending[0]):
            return pending
        chunk = next(self._chunks, None)
        while chunk is not None and not chunk[0]:
            chunk = next(self._chunks, None)
        self._pending = None if chunk is None else [*chunk, 0]
        return self._pending

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()  # a generator source closes its files now


def read_encoded(
    role: Any, reader: EncodedReader, n: int
) -> tuple[Sequence[Any], list[int], list[int]]:
    """Up to ``n`` events from ``reader`` as (frames, uids, positions) lists.

    ``role`` is the input (``chain``, ``sizer``, ``read``, ``max_events``,
    ``start_position``, ``exhausted``, ``source``); its counters are updated as
    ``_read_batch`` does for stores: ``read``, the source's statistics, run switches.

    A source with ``streaming = True`` (events that arrive over time) ends a batch at
    the end of a chunk instead of waiting for the next one.

    When every chunk it reads from says its events lie back to back in one buffer
    (``contiguous``: ``(buffer, width)``, as the toy source's ``RowEvents``) and the
    batch travels packed, the frames come as one :class:`PackedEvents` (the bytes
    joined once): the input then packs the batch without a step per event.
    """
    limit = n
    if role.max_events:
        limit = min(limit, role.max_events - role.read)
        if limit <= 0:
            role.exhausted = True
            return [], [], []
    chain = role.chain
    # a stream (the source's ``streaming``): a chunk is what arrived by now, so a
    # batch never waits for the next one (it would wait for events not sent yet)
    stream = role.sizer.stream
    parts: list[tuple[Sequence[Any], int, int]] = []  # (chunk frames, first, stop)
    uids: list[int] = []
    t0 = time.perf_counter()
    got = 0
    try:
        while got < limit:
            pending = reader._next_chunk()
            if pending is None:
                role.exhausted = True
                break
            chunk_uids, experiment, run, frames, offset = pending
            if not got:  # the batch's first event updates the batch size, as for stores
                role.sizer.observe_size(frames_nbytes(frames[offset]))
                limit = min(limit, role.sizer.size())
            current = chain.run
            if current is None or current.run != run or current.experiment != experiment:
                chain.switch_run(experiment, run)
            end = min(len(chunk_uids), offset + limit - got)
            uids += chunk_uids[offset:end]
            parts.append((frames, offset, end))
            got += end - offset
            pending[4] = end
            if stream and end == len(chunk_uids):
                break
    except EvflowError:
        raise
    except Exception as exc:
        source = role.source
        raise ModuleError(source.name, "events", None, exc, user_traceback(exc)) from exc
    packed = _packed(parts, got) if role.sizer.packed else None
    if packed is not None:
        enc: Sequence[Any] = packed
    else:
        flat: list[Any] = []
        for frames, offset, end in parts:
            flat += frames[offset:end]
        enc = flat
    stats = chain.stats
    stats.calls[0] += got
    stats.time_s[0] += time.perf_counter() - t0
    first = role.start_position + role.read
    role.read += got
    if role.max_events and role.read >= role.max_events:
        role.exhausted = True
    return enc, uids, list(range(first, first + got))


def _packed(parts: list[tuple[Sequence[Any], int, int]], n: int) -> PackedEvents | None:
    """``parts`` as one packed buffer, when each is a contiguous run (else None)."""
    if not n:
        return None
    pieces = []
    widths = []
    for frames, offset, end in parts:
        contiguous = getattr(frames, "contiguous", None)
        if contiguous is None:
            return None
        buffer, width = contiguous
        pieces.append(buffer[offset * width : end * width])
        widths.append(np.full(end - offset, width, dtype=np.uint32))
    counts = np.ones(n, dtype=np.uint16).tobytes()
    if len(pieces) == 1:  # a slice of one chunk: sent (and kept by the ledger) as is
        return PackedEvents(pieces[0], counts, widths[0].tobytes())
    return PackedEvents(b"".join(pieces), counts, np.concatenate(widths).tobytes())

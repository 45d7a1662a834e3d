"""The input's encoded-event fast path: read events that the source already encoded.

When the input path is the source alone (no serial module before the first parallel
one) and the source offers ``encoded_events(start)`` (yielding ``(uid, experiment,
run, frames)`` with the frames ``encode_event`` would give for ``events(start)``),
the input never builds a ``DataStore``: it takes the frames as they come, in batches
built with list operations. Everything else (ledger, credits, confirms, resends) is
the same as on the normal path.

Set ``EVFLOW_NO_FASTPATH=1`` to turn it off, together with the workers' lazy decoding
(``lazystore.py``): benchmarks compare both in one run.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

from evflow.errors import EvflowError, ModuleError
from evflow.processing.chain import ModuleChain, user_traceback
from evflow.processing.parallel.batching import frames_nbytes

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
    return callable(getattr(chain.modules[0], "encoded_events", None))


def encoded_source(chain: ModuleChain, start: int) -> Iterator[Any] | None:
    """The source's encoded-event iterator from ``start``, or None if not allowed."""
    if not fastpath_allowed(chain):
        return None
    source = chain.modules[0]
    try:
        return iter(source.encoded_events(start))  # type: ignore[attr-defined]
    except EvflowError:
        raise
    except Exception as exc:
        raise ModuleError(source.name, "events", None, exc, user_traceback(exc)) from exc


def read_encoded(role: Any, it: Iterator[Any], n: int) -> tuple[list[Any], list[int], list[int]]:
    """Up to ``n`` events from ``it`` as (frames, uids, positions) lists.

    ``role`` is the input (``chain``, ``sizer``, ``read``, ``max_events``,
    ``start_position``, ``exhausted``, ``source``); its counters are updated as
    ``_read_batch`` does for stores: ``read``, the source's statistics, run switches.
    """
    limit = n
    if role.max_events:
        limit = min(limit, role.max_events - role.read)
        if limit <= 0:
            role.exhausted = True
            return [], [], []
    chain = role.chain
    t0 = time.perf_counter()
    try:
        items = list(itertools.islice(it, 1))
        if items:  # the batch's first event updates the batch size, as on the normal path
            role.sizer.observe_size(frames_nbytes(items[0][3]))
            limit = min(limit, role.sizer.size())
        if items and limit > 1:
            items += itertools.islice(it, limit - 1)
    except EvflowError:
        raise
    except Exception as exc:
        source = role.source
        raise ModuleError(source.name, "events", None, exc, user_traceback(exc)) from exc
    got = len(items)
    stats = chain.stats
    stats.calls[0] += got
    stats.time_s[0] += time.perf_counter() - t0
    if got < limit:
        role.exhausted = True
    if not got:
        return [], [], []
    first = role.start_position + role.read
    role.read += got
    if role.max_events and role.read >= role.max_events:
        role.exhausted = True
    _switch_runs(chain, items)
    uids = [item[0] for item in items]
    enc = [item[3] for item in items]
    return enc, uids, list(range(first, first + got))


def _switch_runs(chain: ModuleChain, items: list[Any]) -> None:
    """Run the begin/end-run hooks where the events' (experiment, run) changes."""
    current = chain.run
    if current is not None and all(
        item[1] == current.experiment and item[2] == current.run for item in items
    ):
        return
    for item in items:  # rare: a run boundary in this batch (or the first batch)
        current = chain.run
        if current is None or current.run != item[2] or current.experiment != item[1]:
            chain.switch_run(item[1], item[2])

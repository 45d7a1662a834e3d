"""Built events leaving the builder: as DataStores for a path, or as messages to a device.

A store holds one object per delivered source, ``frag_<source id>`` (a read-only
``uint8`` array, a view of the received bytes), plus ``hlt_state`` (0 complete, 1
incomplete by time-out, 2 incomplete inferred) and ``hlt_missing`` (the missing source
ids). A user ``merge(event_id, fragments) -> dict`` replaces the ``frag_*`` objects.

On a device channel a batch of built events is one EVENTS message: header ``hlt``
(format 1), ``src`` (the source ids), ``e`` (event ids, u64), ``st`` (states, u8),
``m`` (missing bit masks, u64), ``l`` (fragment lengths, u32, event-major), and one
payload frame with every fragment back to back (:meth:`BuiltBatch.packed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from evflow.errors import ProtocolError
from evflow.hlt.eventbuilder import BuildState, BuiltBatch
from evflow.processing.datastore import DataStore, EventMeta
from evflow.wire.messages import Message, MsgType, encode_message

__all__ = ["Merge", "decode_built", "encode_built", "stores_from_batch"]

Merge = Callable[[int, dict[int, memoryview]], dict[str, Any]]
FORMAT = 1


def _store(
    event_id: int,
    frags: dict[int, Any],
    state: int,
    missing: list[int],
    merge: Merge | None,
    experiment: int,
    run: int,
) -> DataStore:
    if merge is not None:
        objects = dict(merge(event_id, frags))
    else:
        objects = {f"frag_{src}": np.frombuffer(view, np.uint8) for src, view in frags.items()}
    objects["hlt_state"] = int(state)
    objects["hlt_missing"] = np.array(missing, np.uint32)
    return DataStore(EventMeta(event_id, experiment, run, event_id), objects)


def stores_from_batch(
    batch: BuiltBatch, merge: Merge | None = None, experiment: int = 0, run: int = 0
) -> Iterator[DataStore]:
    for i in range(len(batch)):
        yield _store(
            int(batch.ids[i]),
            batch.fragments(i),
            int(batch.states[i]),
            batch.missing_sources(i) if batch.missing[i] else [],
            merge,
            experiment,
            run,
        )


def encode_built(batch: BuiltBatch) -> list[Any]:
    header = {
        "hlt": FORMAT,
        "src": list(batch.sources),
        "e": batch.ids.astype("<u8").tobytes(),
        "st": batch.states.astype(np.uint8).tobytes(),
        "m": batch.missing.astype("<u8").tobytes(),
        "l": batch.lengths.astype("<u4").tobytes(),
    }
    return encode_message(MsgType.EVENTS, header, (batch.packed(),))


def decode_built(
    msg: Message, merge: Merge | None = None, experiment: int = 0, run: int = 0
) -> list[DataStore]:
    """The events of one built-batch message; ProtocolError naming what is wrong."""
    h = msg.header
    if h.get("hlt") != FORMAT:
        raise ProtocolError(f"not a built-event batch (format {h.get('hlt')!r}, expected 1)")
    try:
        srcs = [int(s) for s in h["src"]]
        ids = np.frombuffer(h["e"], "<u8").astype(np.int64)
        states = np.frombuffer(h["st"], np.uint8)
        missing = np.frombuffer(h["m"], "<u8")
        lens = np.frombuffer(h["l"], "<u4").astype(np.int64)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"built-event batch: bad header: {exc}") from None
    n = len(ids)
    if len(states) != n or len(missing) != n or len(lens) != n * len(srcs) or len(msg.payload) != 1:
        raise ProtocolError("built-event batch: header arrays do not agree")
    data = memoryview(msg.payload[0]).cast("B")
    if int(lens.sum()) != data.nbytes:
        raise ProtocolError("built-event batch: lengths do not match the payload")
    out = []
    at = 0
    lens2 = lens.reshape(n, len(srcs)).tolist()
    for i in range(n):
        frags = {}
        miss = int(missing[i])
        for k, (src, ln) in enumerate(zip(srcs, lens2[i], strict=True)):
            if not miss >> k & 1:
                frags[src] = data[at : at + ln]
                at += ln
        gone = [s for k, s in enumerate(srcs) if miss >> k & 1]
        out.append(_store(int(ids[i]), frags, int(states[i]), gone, merge, experiment, run))
    return out


STATE_NAMES = {int(s): s.name.lower() for s in BuildState}

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
from evflow.event import DataStore, EventMeta
from evflow.hlt.eventbuilder import BuildState, BuiltBatch
from evflow.hlt.joined import rehead
from evflow.hlt.replay import join_fragments
from evflow.wire.arrays import dtype_str
from evflow.wire.codec import encode_event
from evflow.wire.header import (
    CODEC_VERSION,
    INLINE_MAX_BYTES,
    KIND_EVENT,
    META,
    T_ARRAY,
    T_VALUE,
    packb,
)
from evflow.wire.messages import Message, MsgType, encode_message

__all__ = [
    "Merge",
    "decode_built",
    "encode_built",
    "encoded_from_batch",
    "joined_from_batch",
    "stores_from_batch",
]

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


_M0 = EventMeta(0)  # the flags and attempt a built event's meta has
_U1 = dtype_str(np.dtype(np.uint8))
_U4 = dtype_str(np.dtype(np.uint32))


def encoded_from_batch(
    batch: BuiltBatch, experiment: int = 0, run: int = 0
) -> tuple[list[int], list[list[Any]]]:
    """``(uids, frames)``: each event of ``batch`` encoded, byte for byte what
    ``encode_event`` gives for the store :func:`stores_from_batch` yields, without
    making the store (the path engine's fast path: the input sends these bytes as they
    are). The fragments are copied once, into the event's header (inline, as the codec
    does up to ``INLINE_MAX_BYTES``); an event with a larger fragment goes through the
    codec."""
    uids = batch.ids.tolist()
    states = batch.states.tolist()
    misses = batch.missing.tolist()
    lens = batch.lengths.tolist()
    msgs = batch._msg.tolist()
    offs = batch._off.tolist()
    bufs = {k: memoryview(b).cast("B") for k, b in batch._bufs.items()}
    names = [f"frag_{s}" for s in batch.sources]
    pack_meta = META.pack
    out: list[list[Any]] = []
    for i, uid in enumerate(uids):
        miss = misses[i]
        entries: list[Any] = []
        for k, name in enumerate(names):
            if not miss >> k & 1:
                n = lens[i][k]
                if n > INLINE_MAX_BYTES:
                    entries = []
                    break
                o = offs[i][k]
                entries.append((name, T_ARRAY, _U1, (n,), bufs[msgs[i][k]][o : o + n]))
        else:
            gone = batch.missing_sources(i) if miss else []
            entries.append(("hlt_state", T_VALUE, states[i]))
            entries.append(("hlt_missing", T_ARRAY, _U4, (len(gone),), _u4_bytes(gone)))
            meta = pack_meta(uid, experiment, run, uid, _M0.flags, _M0.attempt)
            out.append([packb((CODEC_VERSION, KIND_EVENT, meta, entries))])
            continue
        frags = batch.fragments(i)
        gone = batch.missing_sources(i) if miss else []
        out.append(encode_event(_store(uid, frags, states[i], gone, None, experiment, run)))
    return uids, out


def joined_from_batch(
    batch: BuiltBatch, experiment: int = 0, run: int = 0
) -> tuple[list[int], list[list[Any]]]:
    """:func:`encoded_from_batch` for ``merge=join_fragments`` (replayed events): a
    complete event's pieces joined are the replayed event's own bytes, so its header
    is re-headed as bytes (:func:`~evflow.hlt.joined.rehead`: the builder's meta, plus
    ``hlt_state`` and ``hlt_missing``), never rebuilt from objects. A worker that does
    not open the event never decodes it. The header is still parsed and checked once
    here; bytes that are not an event are treated as ``join_fragments`` treats them."""
    uids = batch.ids.tolist()
    states = batch.states.tolist()
    misses = batch.missing.tolist()
    msgs = batch._msg.tolist()
    offs = batch._off.tolist()
    lens = batch.lengths.tolist()
    bufs = {k: memoryview(b).cast("B") for k, b in batch._bufs.items()}
    # the pieces in source id order (join_fragments joins them so)
    order = sorted(range(len(batch.sources)), key=batch.sources.__getitem__)
    pack_meta = META.pack
    flags, attempt = _M0.flags, _M0.attempt
    out: list[list[Any]] = []
    for i, uid in enumerate(uids):
        if not misses[i]:
            m, o, n = msgs[i], offs[i], lens[i]
            data = b"".join([bufs[m[k]][o[k] : o[k] + n[k]] for k in order])
            meta = pack_meta(uid, experiment, run, uid, flags, attempt)
            head = rehead(data, meta, states[i])
            if head is not None:
                out.append([head])
                continue
        frags = batch.fragments(i)
        gone = batch.missing_sources(i) if misses[i] else []
        store = _store(uid, frags, states[i], gone, join_fragments, experiment, run)
        out.append(encode_event(store))
    return uids, out


def _u4_bytes(values: list[int]) -> bytes:
    return np.array(values, np.uint32).tobytes() if values else b""


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

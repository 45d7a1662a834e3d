"""Replayed events joined in the builder (merge=join_fragments) on the input's fast path:
re-headed as bytes, they must decode to what the long way (decode, merge, encode) gives,
whatever bytes the pieces hold."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from evflow.event import DataStore, EventMeta
from evflow.hlt.built import joined_from_batch, stores_from_batch
from evflow.hlt.eventbuilder import BuilderConfig, EventBuilder
from evflow.hlt.fragments import FragmentBatch
from evflow.hlt.replay import encoded, join_fragments, split_event
from evflow.io import ToyGenerator
from evflow.wire.codec import decode_event, encode_event
from evflow.wire.header import packb
from evflow.wire.raw import pack_frames


def _built(blobs: list[bytes], n_src: int = 3) -> list[Any]:
    """Every blob cut into ``n_src`` pieces, sent as one batch per source, built."""
    b = EventBuilder(BuilderConfig(sources=range(n_src), timeout_s=100, max_events=4096))
    pieces = [split_event(x, n_src) for x in blobs]
    ids = np.arange(len(blobs), dtype=np.int64)
    for src in range(n_src):
        frs = [p[src] for p in pieces]
        lens = np.array([len(f) for f in frs], np.int64)
        b.add(FragmentBatch(src, ids, lens, np.cumsum(lens) - lens, b"".join(frs)))
    b.flush()
    return b.take_built()


def _same(a: DataStore, b: DataStore) -> None:
    assert a.meta == b.meta
    assert list(a.objects) == list(b.objects)
    for k, x in a.objects.items():
        y = b.objects[k]
        if isinstance(x, np.ndarray):
            assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), k
        else:
            assert packb(x) == packb(y), k  # (bit for bit: NaN is NaN)


def _check(blobs: list[bytes]) -> int:
    """The fast path's events decode to the long way's; returns how many had objects."""
    with_objects = 0
    for bb in _built(blobs):
        want = list(stores_from_batch(bb, join_fragments, 4, 5))
        uids, frames = joined_from_batch(bb, 4, 5)
        assert uids == [s.meta.uid for s in want]
        for fr, store in zip(frames, want, strict=True):
            _same(decode_event(fr), store)  # never bytes that do not decode
            with_objects += len(store.objects) > 2
    return with_objects


def _events() -> list[DataStore]:
    """Toy events and events with every kind of object the codec carries."""
    out = list(ToyGenerator(n_events=6, payload_bytes=300).events())
    odd = {
        "s": "text",
        "d": {"a": [1, 2.5, None], 3: b"xy"},
        "np_scalar": np.float32(1.5),
        "nested_array": {"a": np.arange(3)},
        "grid": np.arange(12, dtype=np.int16).reshape(3, 4),
        "big": np.arange(5000, dtype=np.float64),  # a buffer frame: the long way
        "empty": np.zeros(0, np.uint8),
        "rec": np.zeros(2, dtype=[("x", "<f4"), ("y", "<i8")]),
        "strs": np.array(["ab", "c"]),
        "flag": True,
    }
    for i, (k, v) in enumerate(odd.items()):
        out.append(DataStore(EventMeta(100 + i, 1, 2, i), {k: v, "n": i}))
    out.append(DataStore(EventMeta(200), {f"o{i}": i for i in range(40)}))  # array16 header
    out.append(DataStore(EventMeta(201), {"hlt_state": 7}))  # ours win, as in the long way
    return out


def test_events_of_every_kind_decode_to_what_the_long_way_gives() -> None:
    events = _events()
    assert _check(encoded(events)) == len(events) - 1  # (the last: only hlt_state, ours)


def test_garbage_pieces_decode_to_what_the_long_way_gives() -> None:
    """Random byte flips, cuts and insertions in the joined bytes of replayed events
    (and pieces that are not events at all): never an undecodable event, never other
    objects than the long way's."""
    rng = random.Random(15)
    good = encoded(_events())
    blobs: list[bytes] = [b"", b"garbage", bytes(64), pack_frames([b"\x94\x01\x00"])]
    for _ in range(3000):
        x = bytearray(rng.choice(good))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(x))
            what = rng.random()
            if what < 0.6:
                x[at] = rng.randrange(256)
            elif what < 0.8:
                del x[at : at + rng.randint(1, 8)]
            else:
                x[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        blobs.append(bytes(x))
    assert _check(blobs) > 100  # (the mutations do not only make garbage)


def test_a_complete_event_is_re_headed_not_re_encoded() -> None:
    (store,) = ToyGenerator(n_events=1, payload_bytes=500).events()
    ((bb,),) = [_built(encoded([store]))]
    (frames,) = joined_from_batch(bb, 1, 2)[1]
    want = DataStore(EventMeta(0, 1, 2, 0), {**store.objects, "hlt_state": 0})
    want.objects["hlt_missing"] = np.zeros(0, np.uint32)
    assert [bytes(f) for f in frames] == [bytes(f) for f in encode_event(want)]

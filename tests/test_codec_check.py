"""``quick_meta``: the output's check that an event decodes, without decoding it. It may
leave an event to the decoder, but never accept one the decoder refuses."""

from __future__ import annotations

import random

import numpy as np
import pytest

from evflow.errors import CodecError
from evflow.event import DataStore, EventMeta
from evflow.processing.parallel.worker.lazystore import LazyEvent
from evflow.wire.check import quick_meta
from evflow.wire.codec import decode_event, encode_event


def _events() -> list[list[bytes]]:
    objs = [
        {"a": np.arange(5, dtype=np.int32), "v": 1.5, "s": "x", "d": {"k": [1, None]}},
        {"grid": np.zeros((2, 3)), "n": 1},  # 2-d: left to the decoder
        {"big": np.arange(5000, dtype=np.float64)},  # a buffer frame: left to the decoder
        {"e": np.zeros(0, np.uint8), "b": b"\x00\x01", "t": True},
        {"rec": np.zeros(2, dtype=[("x", "<f4")]), "scalar": np.int64(3)},
    ]
    return [
        [bytes(f) for f in encode_event(DataStore(EventMeta(i, 1, 2, 3, 4, 5), o))]
        for i, o in enumerate(objs)
    ]


def _decodes(frames: list[bytes]) -> DataStore | None:
    try:
        return decode_event(frames)
    except CodecError:
        return None


def test_plain_events_are_checked_without_decoding_others_left_to_the_decoder() -> None:
    simple = [quick_meta(f) is not None for f in _events()]
    assert simple == [True, False, False, True, True]
    for frames in _events():
        meta = quick_meta(frames)
        assert meta is None or meta == decode_event(frames).meta


def test_mutated_events_are_never_accepted_when_the_decoder_refuses_them() -> None:
    rng = random.Random(15)
    events = _events()
    accepted = refused = 0
    for _ in range(20_000):
        frames = list(rng.choice(events))
        head = bytearray(frames[0])
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(head))
            if rng.random() < 0.7:
                head[at] = rng.randrange(256)
            else:
                del head[at : at + rng.randint(1, 6)]
        frames[0] = bytes(head)
        meta = quick_meta(frames)
        store = _decodes(frames)
        if meta is not None:
            assert store is not None and store.meta == meta
            accepted += 1
        refused += store is None
    assert accepted > 1000 and refused > 1000  # (both kinds were tried)


def test_a_checked_event_decodes_when_opened_and_garbage_raises() -> None:
    frames = _events()[0]
    store = LazyEvent.checked(frames)
    assert not store.loaded and store.as_received() is frames
    assert store["s"] == "x" and store.meta == EventMeta(0, 1, 2, 3, 4, 5)
    for bad in ([b"garbage"], [frames[0][:-3]]):
        with pytest.raises(CodecError):
            LazyEvent.checked(bad)

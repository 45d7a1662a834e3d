"""The packed-batch layout: what the ledger keeps of a sent batch reads back exactly."""

from __future__ import annotations

import numpy as np
import pytest

from evflow.processing.datastore import DataStore, EventMeta
from evflow.processing.parallel.batching import PackedEvents, pack_batch, unpack_batch
from evflow.wire.codec import decode_event, encode_event


def _events() -> list[list[object]]:
    # one-frame events and events with a buffer frame (arrays above the inline limit)
    stores = [
        DataStore(EventMeta(uid=1), {"x": 1}),
        DataStore(EventMeta(uid=2), {"big": np.arange(5000.0)}),
        DataStore(EventMeta(uid=3), {"y": "three", "big": np.ones(3000)}),
    ]
    return [encode_event(s) for s in stores]


def test_packed_events_give_each_event_its_frames_back() -> None:
    events = _events()
    header: dict[str, object] = {}
    (blob,) = pack_batch(events, header, packed=True)
    kept = PackedEvents(blob, header["n"], header["l"])  # type: ignore[arg-type]
    assert len(kept) == 3
    expected = unpack_batch(header, [blob])
    for i in (0, 1, 2, -1):
        assert [bytes(f) for f in kept[i]] == [bytes(f) for f in expected[i]]
    assert decode_event(kept[1]).meta.uid == 2
    np.testing.assert_array_equal(decode_event(kept[2])["big"], np.ones(3000))


def test_packed_events_refuse_an_index_outside_the_batch() -> None:
    header: dict[str, object] = {}
    (blob,) = pack_batch(_events(), header, packed=True)
    kept = PackedEvents(blob, header["n"], header["l"])  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="event 3 of a batch of 3"):
        kept[3]

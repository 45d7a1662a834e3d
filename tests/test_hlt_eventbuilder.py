"""The event builder core (pure logic, fake clock) and its wire formats."""

from __future__ import annotations

import numpy as np
import pytest

from evflow.errors import ConfigurationError, ProtocolError
from evflow.hlt import eventbuilder
from evflow.hlt.built import decode_built, encode_built, encoded_from_batch, stores_from_batch
from evflow.hlt.eventbuilder import BuilderConfig, BuildState, EventBuilder
from evflow.hlt.fragments import FragmentBatch, decode_fragments, encode_fragments
from evflow.wire.codec import INLINE_MAX_BYTES, encode_event
from evflow.wire.messages import decode_message


@pytest.fixture(autouse=True, params=["numpy", "scalar"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both paths: numpy (large batches) and scalar (a few fragments)."""
    monkeypatch.setattr(eventbuilder, "SMALL_BATCH", 0 if request.param == "numpy" else 10**6)
    return str(request.param)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def batch(src: int, ids: list[int] | range, size: int = 4) -> FragmentBatch:
    arr = np.array(list(ids), np.int64)
    lens = np.full(len(arr), size, np.int64)
    data = b"".join(bytes([src % 256, i % 256]) * (size // 2) for i in arr.tolist())
    return FragmentBatch(src, arr, lens, np.cumsum(lens) - lens, data)


def builder(n: int = 3, **kw: object) -> tuple[EventBuilder, Clock]:
    clock = Clock()
    cfg = BuilderConfig(sources=list(range(n)), **kw)  # type: ignore[arg-type]
    return EventBuilder(cfg, clock=clock), clock


def built(b: EventBuilder) -> dict[int, tuple[int, list[int]]]:
    out = {}
    for bb in b.take_built():
        for i in range(len(bb)):
            out[int(bb.ids[i])] = (int(bb.states[i]), bb.missing_sources(i))
    return out


def test_complete_events_carry_every_fragment() -> None:
    b, _ = builder(3)
    for s in range(3):
        assert b.add(batch(s, range(10))) == 10
    (bb,) = b.take_built()
    assert bb.ids.tolist() == list(range(10))
    assert set(bb.states.tolist()) == {BuildState.COMPLETE}
    frags = bb.fragments(7)
    assert {s: bytes(v) for s, v in frags.items()} == {s: bytes([s, 7]) * 2 for s in range(3)}
    assert b.n_open == 0 and b.open_bytes == 0
    assert b.summary_line() == "event builder: built 10, incomplete 0, late 0, duplicate 0"


def test_late_duplicate_unknown_far_are_counted_and_dropped() -> None:
    b, _ = builder(2)
    b.add(batch(0, range(5)))
    b.add(batch(0, [3]))  # duplicate of an event in construction
    b.add(batch(1, range(5)))  # all complete
    b.add(batch(1, [2]))  # late: already built
    b.add(batch(7, [6]))  # unknown source
    b.add(batch(0, [5, 5]))  # repeated inside one batch
    b.add(batch(0, [2**40]))  # far in the future
    c = b.counters
    assert (c.built, c.duplicate, c.late, c.unknown_source, c.far) == (5, 2, 1, 1, 1)
    assert b.n_open == 1  # event 5, one fragment
    assert len(built(b)) == 5


def test_timeout_names_the_missing_source() -> None:
    b, clock = builder(3, timeout_s=0.5, ordered=False)
    b.add(batch(0, [1, 2]))
    b.add(batch(1, [1, 2]))
    clock.t += 0.4
    b.poll()
    assert built(b) == {}
    clock.t += 0.2
    b.poll()
    assert built(b) == {1: (1, [2]), 2: (1, [2])}
    assert b.incomplete_by_source == {0: 0, 1: 0, 2: 2}


def test_inferred_when_the_missing_source_moved_past() -> None:
    b, _ = builder(2, timeout_s=100)
    b.add(batch(0, [1, 2, 3]))
    b.add(batch(1, [1, 3]))  # source 1 skipped event 2 and went on
    b.poll()
    assert built(b) == {1: (0, []), 3: (0, []), 2: (2, [1])}


def test_end_of_a_source_infers_its_missing_events() -> None:
    b, _ = builder(2, timeout_s=100, ordered=False)
    b.add(batch(0, [1, 2]))
    b.add(batch(1, [1]))
    b.poll()
    assert 2 not in built(b)
    b.end_source(1)
    b.poll()
    assert built(b) == {2: (2, [1])}


def test_a_silent_source_does_not_stall_the_builder() -> None:
    """Once a source is silent for the timeout, new events missing only it leave at once."""
    b, clock = builder(2, timeout_s=1.0)
    b.add(batch(0, [0]))
    b.add(batch(1, [0]))
    clock.t += 2.0  # source 1 stopped sending
    b.add(batch(0, [1, 2, 3]))
    b.poll()
    assert built(b) == {0: (0, []), 1: (1, [1]), 2: (1, [1]), 3: (1, [1])}


def test_memory_is_bounded_and_the_rest_waits() -> None:
    b, _ = builder(2, max_events=4, max_bytes=10_000)
    assert b.add(batch(0, range(10))) == 4  # room for 4 events in construction
    assert b.n_open == 4 and b.counters.deferred == 1
    one = batch(1, range(10))
    assert b.add(one) == 4  # completes 0..3; room is counted per batch
    assert b.n_open == 0
    assert b.add(one.tail(4)) == 4  # the caller retries the rest: opens 4..7
    zero = batch(0, range(4, 10))
    assert b.add(zero) == 4  # completes 4..7
    assert b.add(zero.tail(4)) == 2  # opens 8, 9
    assert b.add(one.tail(8)) == 2
    assert b.counters.complete == 10 and b.counters.max_in_construction == 4


def test_byte_limit() -> None:
    b, _ = builder(2, max_bytes=20)
    assert b.add(batch(0, range(10), size=4)) == 5
    assert b.open_bytes == 20


def test_ring_window_defers_ids_too_far_ahead() -> None:
    b, _ = builder(2, max_events=8)
    b.add(batch(0, [0]))
    assert b.add(batch(0, [b.capacity + 5])) == 0  # beyond the ring: wait
    assert b.add(batch(1, [0])) == 1
    assert b.add(batch(0, [b.capacity + 5])) == 1  # base moved on


def test_config_errors() -> None:
    with pytest.raises(ConfigurationError, match="distinct"):
        BuilderConfig(sources=[1, 1]).check()
    with pytest.raises(ConfigurationError, match="1 to 64"):
        BuilderConfig(sources=list(range(65))).check()


def test_fragment_wire_roundtrip_and_garbage() -> None:
    frames = encode_fragments(3, [10, 11], [b"abc", b"de"])
    fb = decode_fragments(decode_message(frames))
    assert fb.source == 3 and fb.ids.tolist() == [10, 11] and fb.lengths.tolist() == [3, 2]
    frames[1] = frames[1].replace(b"\x02\x00\x00\x00", b"\x09\x00\x00\x00")  # lie on a length
    with pytest.raises(ProtocolError, match="add up"):
        decode_fragments(decode_message(frames))
    bad = decode_message(encode_fragments(3, [1], [b"x"]))
    bad.header["e"] = b"1234567"
    with pytest.raises(ProtocolError, match="do not match"):
        decode_fragments(bad)


def test_fragment_batch_from_wire_bytes_is_the_same_message() -> None:
    """A sender may hand the ids and lengths as their wire bytes (the replay slices
    them): the message is the one the arrays give, and counts that differ are refused."""
    ids, lens = np.array([7, 8, 9]), np.array([1, 2, 3])
    data = b"abbccc"
    want = encode_fragments(5, ids, (lens, data))
    got = encode_fragments(5, ids.astype("<u8").tobytes(), (lens.astype("<u4").tobytes(), data))
    assert [bytes(f) for f in got] == [bytes(f) for f in want]
    with pytest.raises(ProtocolError, match="3 event ids for 2 fragments"):
        encode_fragments(5, ids.astype("<u8").tobytes(), (lens[:2].astype("<u4").tobytes(), data))


def test_a_run_built_whole_equals_the_same_events_built_one_by_one() -> None:
    """The slice fast path (a batch that completes a run of consecutive events) gives
    the events, fragments and counters the event-by-event path gives."""
    runs, singles = builder(3, timeout_s=100)[0], builder(3, timeout_s=100)[0]
    for src in range(3):
        runs.add(batch(src, list(range(100, 140))))
        for e in range(100, 140):
            singles.add(batch(src, [e]))
    a = [x for bb in runs.take_built() for x in stores_from_batch(bb)]
    b = [x for bb in singles.take_built() for x in stores_from_batch(bb)]
    assert [s.meta.uid for s in a] == [s.meta.uid for s in b] == list(range(100, 140))
    assert [sorted(s.keys()) for s in a] == [sorted(s.keys()) for s in b]
    for x, y in zip(a, b, strict=True):
        frags = [k for k in sorted(x.keys()) if k.startswith("frag_")]
        assert len(frags) == 3 and all(bytes(x[k]) == bytes(y[k]) for k in frags)
    peak = ("max_in_construction", "max_bytes_in_construction")  # (40 at once vs 1)
    ma, mb = runs.metrics(), singles.metrics()
    assert {k: v for k, v in ma.items() if k not in peak} == {
        k: v for k, v in mb.items() if k not in peak
    }
    assert ma["built"] == ma["complete"] == 40 and ma["in_construction"] == 0
    assert not runs._bufs and not singles._bufs  # every buffer let go


def test_built_batch_to_stores_and_over_the_wire() -> None:
    b, _ = builder(3, timeout_s=100)
    b.add(batch(0, [4, 5]))
    b.add(batch(2, [4, 5]))
    b.add(batch(1, [4]))
    b.end_source(1)
    b.poll()
    batches = b.take_built()
    stores = [s for bb in batches for s in stores_from_batch(bb)]
    wired = [s for bb in batches for s in decode_built(decode_message(encode_built(bb)))]
    for got in (stores, wired):
        assert [s.meta.uid for s in got] == [4, 5]
        assert got[0]["hlt_state"] == 0 and got[1]["hlt_state"] == 2
        assert got[1]["hlt_missing"].tolist() == [1]
        assert "frag_1" not in got[1]
        assert bytes(got[0]["frag_2"]) == bytes([2, 4]) * 2


@pytest.mark.parametrize("size", [4, 300, INLINE_MAX_BYTES + 2])
def test_encoded_events_are_the_codec_bytes_of_the_stores(size: int) -> None:
    """The source's fast path sends these bytes instead of encoding each store."""
    b, _ = builder(3, timeout_s=100)
    b.add(batch(0, range(10, 20), size))
    b.add(batch(2, range(10, 20), size))
    b.add(batch(1, range(10, 15), size))
    b.end_source(1)
    b.poll()
    batches = b.take_built()
    assert sum(len(bb) for bb in batches) == 10
    for bb in batches:
        uids, frames = encoded_from_batch(bb, experiment=3, run=7)
        stores = list(stores_from_batch(bb, experiment=3, run=7))
        assert uids == [s.meta.uid for s in stores]
        want = [[bytes(f) for f in encode_event(s)] for s in stores]
        assert [[bytes(f) for f in fr] for fr in frames] == want


def test_joined_events_are_the_codec_bytes_of_the_merged_stores() -> None:
    """merge=join_fragments on the fast path: the replayed event's header reused."""
    from evflow.hlt.built import joined_from_batch
    from evflow.hlt.replay import encoded, join_fragments, split_event
    from evflow.io import ToyGenerator

    events = list(ToyGenerator(n_events=12, payload_bytes=700).events())
    pieces = [split_event(blob, 3) for blob in encoded(events)]
    pieces[5][1] = memoryview(b"garbage")  # complete, but not an event: no objects
    b, _ = builder(3, timeout_s=100)
    for src in (0, 2, 1):
        ids = range(12) if src != 1 else range(10)  # 10 and 11 miss source 1
        frs = [pieces[i][src] for i in ids]
        lens = np.array([len(f) for f in frs], np.int64)
        b.add(
            FragmentBatch(src, np.array(ids, np.int64), lens, np.cumsum(lens) - lens, b"".join(frs))
        )
    b.end_source(1)
    b.poll()
    batches = b.take_built()
    stores = [s for bb in batches for s in stores_from_batch(bb, join_fragments, 1, 2)]
    joined = [f for bb in batches for f in joined_from_batch(bb, 1, 2)[1]]
    assert [[bytes(f) for f in fr] for fr in joined] == [
        [bytes(f) for f in encode_event(s)] for s in stores
    ]
    assert stores[3]["payload"].tobytes() == events[3]["payload"].tobytes()
    assert "payload" not in stores[5] and stores[11]["hlt_missing"].tolist() == [1]


def test_merge_function() -> None:
    b, _ = builder(2)
    b.add(batch(0, [1]))
    b.add(batch(1, [1]))
    (bb,) = b.take_built()
    (store,) = stores_from_batch(bb, merge=lambda e, f: {"all": b"".join(f[s] for s in sorted(f))})
    assert store["all"] == bytes([0, 1, 0, 1, 1, 1, 1, 1])


def test_runs_of_consecutive_ids_build_as_the_general_path_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ring-slice path for consecutive ids (``_add_run``) against the general one:
    random runs per source, repeated, late, overlapping, past the event and byte
    limits; the same takes, counters and built events, step by step."""
    rng = np.random.default_rng(15)
    for trial in range(40):
        cfg = dict(sources=range(3), timeout_s=5.0, max_events=int(rng.integers(8, 80)))
        if trial % 3 == 0:
            cfg["max_bytes"] = int(rng.integers(50, 400))
        clock = Clock()
        fast, slow = (
            EventBuilder(BuilderConfig(**cfg), clock),
            EventBuilder(BuilderConfig(**cfg), clock),
        )
        monkeypatch.setattr(slow, "_add_run", lambda *a: False)
        nxt = [0, 0, 0]
        for _ in range(60):
            src = int(rng.integers(0, 3))
            start = nxt[src]  # on, or back (late, duplicate) or ahead
            if rng.random() < 0.4:
                start += int(rng.integers(-12, 6))
            n = int(rng.integers(1, 40))
            ids = list(range(max(start, 0), max(start, 0) + n))
            if rng.random() < 0.1:
                ids[n // 2] = ids[0]  # repeated inside the batch
            b = batch(src, ids)
            assert fast.add(b) == slow.add(b)
            nxt[src] = max(nxt[src], ids[-1] + 1)
            clock.t += float(rng.random())
            fast.poll(), slow.poll()
            got, want = fast.take_built(), slow.take_built()
            assert [x.ids.tolist() for x in got] == [x.ids.tolist() for x in want]
            assert [x.states.tolist() for x in got] == [x.states.tolist() for x in want]
            assert [x.packed() for x in got] == [x.packed() for x in want]
            assert fast.metrics() == slow.metrics()

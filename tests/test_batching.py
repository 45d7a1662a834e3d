"""The packed-batch layout (what the ledger keeps of a sent batch reads back exactly)
and the batch sizes the input chooses."""

from __future__ import annotations

import numpy as np
import pytest

from evflow.event import DataStore, EventMeta
from evflow.processing.parallel.batching import (
    LOSS_MEMORY,
    LOSS_SHARE,
    MAX_BATCH_EVENTS,
    MAX_BATCH_WORK_S,
    TARGET_BATCH_B,
    TARGET_BATCH_WORK_S,
    TIMEOUT_SHARE,
    BatchSizer,
    PackedEvents,
    pack_batch,
    unpack_batch,
)
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


# --- batch sizes -------------------------------------------------------------------------
def _sizer(work_s: float, remaining: int | None, workers: int = 2, **kw: float) -> BatchSizer:
    sizer = BatchSizer(**kw)  # type: ignore[arg-type]
    sizer.observe_size(1024)
    sizer.observe_work(work_s)
    sizer.remaining, sizer.workers = remaining, workers
    return sizer


def test_expensive_events_share_the_work_left_and_batches_shrink_to_the_end() -> None:
    sizes = [_sizer(0.01, left).size() for left in (4000, 400, 100, 40, 8, 2)]
    # 0.5 s of work at most; then 1/(2 x 2 workers) of what is left; at least one event
    assert sizes == [50, 50, 25, 10, 2, 1]
    # more workers share the same work: smaller batches
    assert _sizer(0.01, 100, workers=4).size() == 12


def test_without_a_known_length_batches_hold_the_minimum_work() -> None:
    assert _sizer(0.001, None).size() == int(TARGET_BATCH_WORK_S / 0.001)
    # until a worker reported its speed: a few events
    fresh = BatchSizer()
    fresh.observe_size(1024)
    fresh.remaining = 10_000
    assert fresh.size() == 4


def test_a_stream_is_bounded_by_the_most_work_per_batch_not_the_minimum() -> None:
    """A stream's source cuts its chunks by time; the sizer only caps their work."""
    stream = _sizer(0.001, None)
    stream.stream = True
    assert stream.size() == int(stream.max_work_s / 0.001) == 500
    timed = _sizer(0.001, None, event_timeout_s=0.4)
    timed.stream = True
    assert timed.size() == 100  # a quarter of the event time-out


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_while_workers_are_lost_a_batch_holds_a_bounded_time_of_work() -> None:
    """A worker SIGKILLed every second: a batch holds LOSS_SHARE of that (20 ms of
    work), not up to half a second, so each kill re-sends and re-does little."""
    clock = FakeClock()
    sizer = BatchSizer(clock=clock)
    sizer.observe_size(1024)
    sizer.observe_work(0.001)  # 1 ms per event
    sizer.remaining, sizer.workers = 20_000, 2
    assert sizer.size() == int(MAX_BATCH_WORK_S / 0.001) == 500  # 0.5 s of work
    sizer.observe_loss()  # one loss says nothing about a rate yet
    assert sizer.size() == 500
    for _ in range(5):
        clock.now += 1.0
        sizer.observe_loss()
    assert sizer.loss_cap_s == pytest.approx(LOSS_SHARE * 1.0)
    assert sizer.size() == round(LOSS_SHARE * 1.0 / 0.001)  # 20 ms: 20 events
    assert sizer.window(10_000) == 2 * 20  # what a worker holds: two such batches
    # never below the minimum work of a batch, however fast workers die
    for _ in range(20):
        clock.now += 0.001
        sizer.observe_loss()
    assert sizer.size() == int(TARGET_BATCH_WORK_S / 0.001)
    # the losses stop: after LOSS_MEMORY mean intervals, full batches again
    clock.now += LOSS_MEMORY * sizer.loss_gap_s + 0.01
    assert sizer.size() == 500 and sizer.loss_cap_s == 0.0


def test_a_run_without_losses_never_has_its_batches_capped() -> None:
    clock = FakeClock()
    sizer = _sizer(0.001, 20_000, clock=clock)  # type: ignore[arg-type]
    clock.now += 1000
    assert sizer.loss_cap_s == 0.0 and sizer.size() == 500


def test_cheap_events_are_batched_by_bytes_and_the_event_limit() -> None:
    assert _sizer(1e-6, 1_000_000).size() == MAX_BATCH_EVENTS
    big = _sizer(1e-6, 1_000_000)
    big.observe_size(100_000)
    for _ in range(30):
        big.observe_size(100_000)
    assert big.size() == TARGET_BATCH_B // 100_000


def test_an_event_timeout_caps_the_work_of_a_batch() -> None:
    # the timeout watches progress message by message: a batch must end well within it
    capped = _sizer(0.01, 100_000, event_timeout_s=0.4)
    assert capped.size() == int(TIMEOUT_SHARE * 0.4 / 0.01)
    assert capped.size() * 0.01 <= 0.4 / 2
    assert _sizer(0.01, 100_000).size() * 0.01 == pytest.approx(MAX_BATCH_WORK_S)


def test_expensive_events_keep_little_queued_in_a_worker() -> None:
    # what waits in a worker when the source ends is what the others may idle for
    ending = _sizer(0.01, 2)
    assert ending.window(event_buffer=4) == 2  # one running, one queued: not the credit
    cheap = _sizer(1e-5, 8)
    assert cheap.window(event_buffer=4) >= 4  # cheap events use the credit

"""QcTask against a real merger (in a thread): credits, held cycles, full mode, cycle changes."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from evflow.event import RunMeta
from evflow.qc.merger import QcMerger
from evflow.qc.publication import PublishedObject
from evflow.qc.toy import ToyQc
from evflow.transport.channel import parse_channel_config
from evflow.transport.paths import remove_session_files

sys.path.insert(0, str(Path(__file__).parent))
from test_qc_layers import RUN, assert_equal_objects, event, reference

SESSION = "qctask"


@pytest.fixture
def merger() -> Iterator[tuple[QcMerger, list[PublishedObject]]]:
    pubs: list[PublishedObject] = []
    dev = QcMerger(
        "qc-merger",
        parse_channel_config("name=qc-in,type=router,method=bind,address=ipc://qct"),
        session=SESSION, cycle_s=0.5, inputs=1, run_number=RUN, on_publish=[pubs.append],
    )  # fmt: skip
    thread = threading.Thread(target=dev.run)
    thread.start()
    try:
        yield dev, pubs
    finally:
        dev.request_shutdown()
        thread.join(20)
        assert not thread.is_alive()


def final_of(pubs: list[PublishedObject]) -> dict[str, PublishedObject]:
    return {p.name: p for p in pubs if p.metadata["final"]}


def test_no_credit_holds_cycles_in_the_objects_and_loses_nothing(
    merger: tuple[QcMerger, list[PublishedObject]],
) -> None:
    _, pubs = merger
    task = ToyQc(name="det", merger="ipc://qct", session=SESSION, cycle_s=0.005,
                 source="slowpoke", max_unacked=2, resend_after_s=5.0)  # fmt: skip
    task.initialize()
    task.begin_run(RunMeta(0, RUN))
    most_unacked = 0
    n = 0
    deadline = time.monotonic() + 1.5  # three merger cycles: acknowledgements every 0.5 s
    while time.monotonic() < deadline:
        task.event(event(n))
        n += 1
        assert task.publisher is not None
        most_unacked = max(most_unacked, len(task.publisher.unacked))
        time.sleep(0.0005)
    task.end_run(RunMeta(0, RUN))
    stats = task.statistics()
    task.terminate()
    assert most_unacked <= 2
    assert stats["held_cycles"] > 0  # credits ran out: cycles were held, not queued
    assert stats["unacked"] == 0
    final = final_of(pubs)
    assert_equal_objects(final, reference(list(range(n))))
    assert final["h1"].event_count == n


def test_full_mode_publishes_whole_objects_that_replace_each_other(
    merger: tuple[QcMerger, list[PublishedObject]],
) -> None:
    _, pubs = merger
    task = ToyQc(name="det", merger="ipc://qct", session=SESSION, cycle_s=0.02,
                 mode="full", source="whole")  # fmt: skip
    task.initialize()
    task.begin_run(RunMeta(0, RUN))
    for i in range(600):
        task.event(event(i))
        if i % 100 == 99:
            time.sleep(0.03)
    task.end_run(RunMeta(0, RUN))
    assert task.publisher is not None and task.publisher.seq > 3
    task.terminate()
    final = final_of(pubs)
    assert_equal_objects(final, reference(list(range(600))))
    assert final["h1"].event_count == 600


def test_set_cycle_s_changes_the_cycle_during_the_run() -> None:
    task = ToyQc(name="det", cycle_s=100.0)
    task.initialize()
    with pytest.raises(ValueError, match="must be > 0"):
        task.set_cycle_s(0)
    task.set_cycle_s(0.5)
    assert task._cycle_s == 0.5


def test_a_merger_that_cannot_keep_up_reports_it_and_producers_hold_back() -> None:
    import zmq

    from evflow.qc.producer import QcPublisher

    dev = QcMerger(
        "slow-merger",
        parse_channel_config("name=qc-in,type=router,method=bind,address=ipc://qcslow"),
        session=SESSION, cycle_s=0.3, run_number=RUN, drain_max=1,
    )  # fmt: skip
    thread = threading.Thread(target=dev.run)
    thread.start()
    context: zmq.Context[object] = zmq.Context()
    pubs = [QcPublisher(context, "ipc://qcslow", source=f"flood-{i}", task="t", run=RUN,
                        session=SESSION, max_unacked=50) for i in range(4)]  # fmt: skip
    try:
        overloaded = False
        deadline = time.monotonic() + 30  # (ends as soon as it is overloaded)
        while time.monotonic() < deadline and not overloaded:
            for pub in pubs:
                pub.service()
                if pub.has_credit():
                    pub.publish(1, 1, [b"\x90"])  # an empty delta: only the bookkeeping
            overloaded = dev.metrics()["receive_buffer_overloaded"]
        assert overloaded  # it read its drain limit and the socket still had more
        assert all(len(p.unacked) <= 50 for p in pubs)  # credits bound what waits
    finally:
        for pub in pubs:
            pub.close()
        context.term()
        dev.request_shutdown()
        thread.join(20)
    assert dev.qc.counters["deltas"] > 0


def test_an_unreachable_merger_delays_the_end_of_the_run_by_finish_timeout_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    task = ToyQc(name="det", merger="ipc://nobody-listens", session=SESSION, cycle_s=0.01,
                 finish_timeout_s=0.5)  # fmt: skip
    task.initialize()
    task.begin_run(RunMeta(0, RUN))
    for i in range(50):
        task.event(event(i))
    t0 = time.monotonic()
    task.end_run(RunMeta(0, RUN))
    took_s = time.monotonic() - t0
    stats = task.statistics()
    task.terminate()
    remove_session_files(SESSION)  # the connecting socket made the session directory
    # it waited out its budget (0.5 s), and not the default one: no bound on how long
    # a loaded machine takes for that, only that it is not the default's 30 s
    assert 0.5 <= took_s < ToyQc.declared_params()["finish_timeout_s"].default
    assert stats["unacked"] >= 1 and stats["acked"] == 0
    assert "not acknowledged within" in caplog.text

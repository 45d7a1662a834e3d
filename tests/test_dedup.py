"""The output's set of written uids: late results and re-sends are dropped and counted."""

from __future__ import annotations

from evflow.processing.parallel.output.dedup import DedupStatistics, WrittenUids


class _ReopenedWriter:
    def written_uids(self) -> set[int]:
        return {3, 5, 2**64 - 1}


def test_second_arrival_of_a_uid_is_dropped_and_counted() -> None:
    seen = WrittenUids()
    assert seen.check_and_add(7)
    assert seen.check_and_add(8)
    assert not seen.check_and_add(7)
    assert seen.seen(8) and not seen.seen(9)
    assert seen.duplicates_dropped == 1 and len(seen) == 2


def test_rebuilt_from_a_reopened_writer_drops_what_the_file_already_has() -> None:
    seen = WrittenUids.from_writer(_ReopenedWriter())
    assert not seen.check_and_add(5)
    assert not seen.check_and_add(2**64 - 1)
    assert seen.check_and_add(6)
    assert seen.statistics() == DedupStatistics(
        written=4, rebuilt=3, duplicates_dropped=2, already_written=2
    )
    assert not seen.check_and_add(6)  # a duplicate of this run's own write
    assert (seen.duplicates_dropped, seen.already_written) == (3, 2)


def test_seen_then_add_and_explicit_drop_count() -> None:
    seen = WrittenUids()
    assert not seen.seen(1)
    seen.add(1)
    assert 1 in seen
    seen.drop_duplicate()
    assert seen.duplicates_dropped == 1
    assert "duplicates_dropped=1" in repr(seen)


def test_a_result_finishing_just_after_its_timeout_is_written_once() -> None:
    """The basf2 failure ("no matching event backup found", events written twice),
    step by step with a fake clock: the timeout fires, the event is retried on another
    worker, then BOTH results reach the output, in either order."""
    from evflow.processing.parallel.input.ledger import Failure, Ledger

    for late_first in (True, False):
        now = [0.0]
        ledger = Ledger(event_timeout_s=1.0, clock=lambda now=now: now[0])
        seen = WrittenUids()
        written: list[int] = []
        ledger.add(42, 0, "w1", [b"frames"])
        now[0] = 1.01  # w1 is late: the timeout fires
        (late,) = ledger.expired()
        assert late.uid == 42
        (retry,) = ledger.requeue_worker("w1", Failure.timeout(1.0))
        ledger.resend(retry.uid, "w2")
        results = ["w1 (late)", "w2 (retry)"] if late_first else ["w2 (retry)", "w1 (late)"]
        for _who in results:  # the output receives both, writes the first, confirms
            if seen.check_and_add(42):
                written.append(42)
            ledger.confirm([42])
        assert written == [42]
        assert seen.duplicates_dropped == 1
        assert len(ledger) == 0 and ledger.statistics().duplicate_confirms == 1


def test_add_if_all_new_takes_a_batch_only_when_nothing_in_it_was_seen() -> None:
    seen = WrittenUids([1, 2])
    assert seen.add_if_all_new([3, 4, 5])
    assert {3, 4, 5} <= set(range(6)) and 4 in seen and len(seen) == 5
    assert not seen.add_if_all_new([6, 2, 7])  # 2 was written: nothing is taken
    assert 6 not in seen and 7 not in seen and seen.duplicates_dropped == 0

"""The output's set of written uids: late results and re-sends are dropped and counted."""

from __future__ import annotations

from evflow.processing.parallel.dedup import DedupStatistics, WrittenUids


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

"""The input's roster: replacements it waits for, recycled workers whose results are due."""

from __future__ import annotations

from evflow.processing.parallel.input.roster import RESULTS_GRACE_S, Roster


def test_a_replacement_is_waited_for_until_its_hello() -> None:
    roster = Roster()
    roster.lost("worker-1", "worker-1.1")
    assert roster.coming == {"worker-1.1"}
    roster.hello("worker-1.1")
    assert not roster.coming


def test_a_hello_that_comes_before_the_worker_lost_naming_it_is_not_waited_for() -> None:
    # two connections, no order between them: the replacement may greet first
    roster = Roster()
    roster.hello("worker-1.1")
    roster.lost("worker-1", "worker-1.1")
    assert not roster.coming


def test_a_replacement_that_dies_before_its_hello_hands_over_to_the_next() -> None:
    roster = Roster()
    roster.lost("worker-2", "worker-2.1")
    roster.lost("worker-2.1", "worker-2.2")
    assert roster.coming == {"worker-2.2"}
    roster.lost("worker-2.2", None)  # delayed by the backoff: nothing to wait for
    assert not roster.coming


def test_a_recycled_worker_brings_its_successor_and_its_results_have_a_deadline() -> None:
    roster = Roster()
    roster.recycled("worker-0.3", now_s=10.0)
    assert roster.coming == {"worker-0.4"}
    held = {"worker-0.3": 2}
    assert roster.overdue(10.0 + RESULTS_GRACE_S - 0.1, held.__getitem__) == []
    assert roster.overdue(10.0 + RESULTS_GRACE_S, held.__getitem__) == ["worker-0.3"]
    assert not roster.leavers  # handed back once


def test_a_recycled_worker_whose_results_all_came_is_forgotten() -> None:
    roster = Roster()
    roster.recycled("worker-0", now_s=0.0)
    assert roster.overdue(1.0, lambda name: 0) == []
    assert not roster.leavers

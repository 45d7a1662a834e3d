"""Re-sends after worker deaths: grouped into messages when that is safe, never one
event per message for ever; the ledger's confirm stays linear with foreign uids."""

from __future__ import annotations

from evflow.processing.parallel.input.ledger import Failure, Ledger, LedgerEntry
from evflow.processing.parallel.input.resend import HOLD_S, ResendQueue

KILLED = Failure.from_returncode(-9)


def send_round(ledger: Ledger, queue: ResendQueue, worker: str, room: int = 100) -> list[list[int]]:
    """Hand every group ``queue`` gives a busy worker to ``worker``: the messages' uids."""
    messages = []
    while (group := queue.pick(False, room, 100)) is not None:
        ledger.resend_many([e.uid for e in group], worker)
        messages.append([e.uid for e in group])
    return messages


def test_a_finished_message_goes_again_whole_and_stays_whole_when_killed_again() -> None:
    ledger = Ledger()
    ledger.add_batch([(u, u, ()) for u in range(0, 8)], "w")  # finished: READY came
    ledger.add_batch([(u, u, ()) for u in range(8, 16)], "w")  # finished
    ledger.add_batch([(u, u, ()) for u in range(16, 24)], "w")  # died in it, on 18
    ledger.add_batch([(u, u, ()) for u in range(24, 28)], "w")  # never begun
    ledger.progress("w", n_events=16)
    queue = ResendQueue(ledger.requeue_worker("w", KILLED, culprit_uid=18))
    messages = send_round(ledger, queue, "v")
    # each finished message whole (its late result holds exactly these events), the
    # never-begun events together; the culprit apart, for an idle worker
    assert messages == [list(range(0, 8)), list(range(8, 16)), [16, 17, *range(19, 28)]]
    assert queue.isolated == 1 and queue.only_isolated()
    assert queue.pick(False, 100, 100) is None  # not to a busy worker
    assert [e.uid for e in queue.pick(True, 100, 100) or []] == [18]
    # the worker that took them finished all and died idle, several times over: the
    # groups come back as they went, never one event per message
    for victim, heir in (("v", "x"), ("x", "y"), ("y", "z")):
        ledger.progress(victim, n_events=27)
        queue.extend(ledger.requeue_worker(victim, KILLED, culprit_uid=-1))
        messages = send_round(ledger, queue, heir)
        assert sorted(len(m) for m in messages) == [8, 8, 11], messages


def test_a_partly_confirmed_finished_message_goes_again_without_its_confirmed_events() -> None:
    ledger = Ledger()
    ledger.add_batch([(u, u, ()) for u in range(6)], "w")
    ledger.add_batch([(u, u, ()) for u in range(6, 9)], "w")
    ledger.progress("w", n_events=9)
    ledger.confirm([0, 1, 2])  # a retry of them elsewhere was confirmed meanwhile
    queue = ResendQueue(ledger.requeue_worker("w", KILLED, culprit_uid=-1))
    assert send_round(ledger, queue, "v") == [[3, 4, 5], [6, 7, 8]]


def test_never_begun_events_fill_at_most_a_batch_and_the_room_left() -> None:
    ledger = Ledger()
    ledger.add_batch([(100, 0, ())], "w")  # it may have finished this one (READY lags)
    ledger.add_batch([(u, u + 1, ()) for u in range(10)], "w")  # not this one
    ledger.progress("w", n_events=0)
    queue = ResendQueue(ledger.requeue_worker("w", KILLED, culprit_uid=-1))
    assert [len(g) for g in iter(lambda: queue.pick(False, 4, 3), None)] == [1, 3, 3, 3, 1]


def test_isolated_events_wait_aside_and_do_not_hold_up_the_others() -> None:
    ledger = Ledger()
    ledger.add_batch([(1, 0, ()), (2, 1, ()), (3, 2, ())], "w")
    ledger.add_batch([(4, 3, ())], "w")
    ledger.progress("w", n_events=0)
    # no scoreboard verdict: the message it was in comes back isolated (suspects)
    entries = ledger.requeue_worker("w", KILLED)
    assert [e.uid for e in entries if e.isolate] == [1, 2, 3]
    queue = ResendQueue(entries)
    assert [e.uid for e in queue.pick(False, 10, 10) or []] == [4]  # not stuck behind them
    assert queue.pick(False, 10, 10) is None and len(queue) == 3
    assert [queue.pick(True, 10, 10)[0].uid for _ in range(3)] == [1, 2, 3]  # type: ignore[index]
    assert not queue


def test_one_message_carries_one_attempt_number() -> None:
    ledger = Ledger()
    ledger.add_batch([(1, 0, ()), (2, 1, ())], "w")
    ledger.progress("w", n_events=2)
    entries = ledger.requeue_worker("w", KILLED, culprit_uid=-1)
    entries[1].attempt += 1  # (as if it had come back once more)
    queue = ResendQueue(entries)
    assert [[e.uid for e in g] for g in iter(lambda: queue.pick(False, 9, 9), None)] == [[1], [2]]


def test_replace_drops_what_waited_aside() -> None:
    ledger = Ledger()
    ledger.add_batch([(1, 0, ()), (2, 1, ())], "w")
    queue = ResendQueue(ledger.requeue_worker("w", KILLED))
    assert queue.only_isolated() and queue.isolated == 2
    queue.replace(ledger.requeue_all())  # the same two again, not four
    assert len(queue) == 2 and queue.isolated == 0


class CountedUid(int):
    """An int that counts its equality comparisons (a list scan compares every item)."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountedUid.compared += 1
        return int(self) == other

    __hash__ = int.__hash__


def test_a_confirm_full_of_repeated_and_unknown_uids_costs_linear_work() -> None:
    # after worker churn or an input restart a CONFIRM may hold thousands of uids the
    # ledger does not have (late duplicates): each used to scan the whole list again
    ledger = Ledger()
    ledger.add_batch([(u, u, ()) for u in range(100)], "w")
    n = 3000
    uids: list[int] = [CountedUid(10_000 + u) for u in range(n)]  # unknown, distinct
    uids += [CountedUid(20_000)] * 2  # one listed twice: a duplicate
    uids += list(range(100))  # ours
    CountedUid.compared = 0
    assert ledger.confirm(uids) == 100
    assert CountedUid.compared <= 4 * len(uids), CountedUid.compared  # was ~n*n = 9e6
    st = ledger.statistics()
    assert (st.confirmed, st.unknown_confirms, st.duplicate_confirms) == (100, n, 2)
    assert ledger.confirm(uids[:10]) == 0  # confirmed again: duplicates, not unknown
    assert ledger.statistics().duplicate_confirms == 12


def test_requeued_entries_keep_the_number_of_the_message_they_were_in() -> None:
    # resend.py groups a finished message's events by it: a retry renumbers them
    ledger = Ledger()
    ledger.add_batch([(1, 0, ()), (2, 1, ())], "w")
    ledger.progress("w", n_events=2)
    first: list[LedgerEntry] = ledger.requeue_worker("w", KILLED, culprit_uid=-1)
    assert first[0].send == first[1].send
    ledger.resend_many([1], "v")
    ledger.resend_many([2], "v")
    assert ledger.get(1).send != ledger.get(2).send  # type: ignore[union-attr]


def test_after_a_death_finished_messages_wait_for_their_confirm_the_rest_goes_at_once() -> None:
    ledger = Ledger()
    ledger.add_batch([(u, u, ()) for u in range(4)], "w")  # finished: results on their way
    ledger.add_batch([(u, u, ()) for u in range(4, 8)], "w")  # died in it, on 5
    ledger.progress("w", n_events=4)
    queue = ResendQueue()
    queue.add_after_death(ledger.requeue_worker("w", KILLED, culprit_uid=5), now_s=10.0)
    assert len(queue) == 8 and queue.next_due_s() == 10.0 + HOLD_S
    assert send_round(ledger, queue, "v") == [[4, 6, 7]]  # never begun: at once
    assert [e.uid for e in queue.pick(True, 9, 9) or []] == [5]  # the culprit, alone
    ledger.confirm([0, 1, 2])  # the finished message's results arrived meanwhile
    queue.release(10.0 + HOLD_S / 2)
    assert queue.pick(False, 9, 9) is None  # not due yet
    queue.release(10.0 + HOLD_S)
    assert send_round(ledger, queue, "v") == [[3]]  # only what is still unconfirmed
    assert not queue and queue.next_due_s() is None
    st = ledger.statistics()  # 8 came back; 4 went again (5, picked above, not sent here)
    assert (st.requeued, st.resent) == (8, 4)


def test_an_output_restart_drops_what_was_held() -> None:
    ledger = Ledger()
    ledger.add_batch([(1, 0, ()), (2, 1, ())], "w")
    ledger.progress("w", n_events=2)
    queue = ResendQueue()
    queue.add_after_death(ledger.requeue_worker("w", KILLED, culprit_uid=-1), now_s=0.0)
    assert queue.only_isolated() and len(queue) == 2  # held: nothing can go now
    queue.replace(ledger.requeue_all())
    assert len(queue) == 2 and queue.next_due_s() is None

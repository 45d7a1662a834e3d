"""The input's ledger: confirms, requeues, timeouts, poison and the checkpoint position."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from evflow.errors import ConfigurationError, InternalError
from evflow.processing.parallel.input.ledger import EntryState, Failure, Ledger


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make(**kw: object) -> tuple[Ledger, FakeClock]:
    clock = FakeClock()
    return Ledger(clock=clock, **kw), clock  # type: ignore[arg-type]


def test_confirm_removes_entries_and_counts_unknown_and_duplicate() -> None:
    ledger, _ = make()
    frames = [b"header", b"x" * 10]
    for uid in range(5):
        ledger.add(uid + 1000, uid, "w1", frames)
    assert len(ledger) == 5
    assert ledger.get(1000).frames is frames  # by reference, not copied
    assert ledger.confirm([1000, 1002]) == 2
    assert ledger.confirm([1002, 999999]) == 0
    st_ = ledger.statistics()
    assert (st_.confirmed, st_.duplicate_confirms, st_.unknown_confirms) == (2, 1, 1)
    assert len(ledger) == 3 and 1000 not in ledger and 1001 in ledger
    assert ledger.in_flight("w1") == 3


def test_checkpoint_position_under_out_of_order_confirms() -> None:
    ledger, _ = make(start_position=10)
    assert ledger.checkpoint_position() == 10
    for pos in range(10, 20):
        ledger.add(pos * 7, pos, f"w{pos % 3}", ())
    ledger.confirm([11 * 7, 13 * 7, 12 * 7])
    assert ledger.checkpoint_position() == 10  # 10 still unconfirmed
    ledger.confirm([10 * 7])
    assert ledger.checkpoint_position() == 14
    ledger.confirm([p * 7 for p in range(14, 20)])
    assert ledger.checkpoint_position() == 20  # nothing left: the next position
    assert len(ledger) == 0


def test_positions_must_increase_and_uids_are_unique() -> None:
    ledger, _ = make()
    ledger.add(1, 5, "w", ())
    with pytest.raises(InternalError, match="position 4 of uid 2"):
        ledger.add(2, 4, "w", ())
    with pytest.raises(InternalError, match="uid 1 added twice"):
        ledger.add(1, 6, "w", ())


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="max_attempts"):
        Ledger(max_attempts=0)
    with pytest.raises(ConfigurationError, match="event_timeout_s"):
        Ledger(event_timeout_s=0)


def test_dead_worker_with_one_event_is_charged_and_requeued_with_next_attempt() -> None:
    ledger, _ = make()
    ledger.add(7, 0, "w1", ())
    ledger.add(8, 1, "w2", ())
    (entry,) = ledger.requeue_worker("w1", Failure.from_returncode(-9))
    assert entry.uid == 7 and entry.attempt == 2 and entry.state is EntryState.PENDING
    assert entry.failures == 1 and "signal 9 (SIGKILL)" in entry.reason
    assert ledger.in_flight("w1") == 0 and len(ledger) == 2
    assert ledger.checkpoint_position() == 0  # requeued entries keep their position
    ledger.resend(7, "w3")
    assert ledger.in_flight("w3") == 1 and ledger.get(7).worker == "w3"
    with pytest.raises(InternalError, match="not pending"):
        ledger.resend(7, "w4")
    ledger.confirm([7, 8])
    assert ledger.checkpoint_position() == 2


def test_dead_worker_with_several_events_isolates_them_without_charging() -> None:
    ledger, _ = make()
    for uid in (1, 2, 3):
        ledger.add(uid, uid, "w1", ())
    entries = ledger.requeue_worker("w1", Failure.from_returncode(-11))
    assert [e.uid for e in entries] == [1, 2, 3]
    assert all(e.isolate and e.failures == 0 and e.attempt == 2 for e in entries)
    # sent alone, the culprit dies again: now it is charged
    ledger.resend(2, "w2")
    (e2,) = ledger.requeue_worker("w2", Failure.from_returncode(-11))
    assert e2.failures == 1 and e2.attempt == 3


def test_with_progress_reports_only_the_current_message_is_blamed() -> None:
    ledger, _ = make()
    ledger.add_batch([(1, 0, ()), (2, 1, ())], "w")  # message 1: finished
    ledger.add_batch([(3, 2, ())], "w")  # message 2: the one it dies on
    ledger.add_batch([(4, 3, ()), (5, 4, ())], "w")  # message 3: not started
    ledger.progress("w", n_events=2)
    entries = {e.uid: e for e in ledger.requeue_worker("w", Failure.from_returncode(-11))}
    assert entries[3].failures == 1 and entries[3].isolate
    assert all(entries[u].failures == 0 and not entries[u].isolate for u in (1, 2, 4, 5))
    assert all(e.attempt == 2 for e in entries.values())


def test_with_progress_a_batch_that_kills_is_isolated_and_others_spared() -> None:
    ledger, _ = make()
    ledger.add_batch([(1, 0, ())], "w")
    ledger.add_batch([(2, 1, ()), (3, 2, ())], "w")
    ledger.add_batch([(4, 3, ())], "w")
    ledger.progress("w", n_events=1)
    entries = {e.uid: e for e in ledger.requeue_worker("w", Failure.from_returncode(-9))}
    assert [u for u, e in sorted(entries.items()) if e.isolate] == [2, 3]
    assert all(e.failures == 0 for e in entries.values())
    # the worker that finished everything it held is not blamed at all
    ledger.resend(2, "v")
    ledger.progress("v", n_events=1)
    (e2,) = ledger.requeue_worker("v", Failure.from_returncode(-9))
    assert e2.failures == 0


def test_a_worker_leaving_in_order_gives_back_only_what_it_did_not_finish() -> None:
    ledger, _ = make()
    ledger.add_batch([(1, 0, ()), (2, 1, ())], "w")  # finished: results on their way
    ledger.add_batch([(3, 2, ()), (4, 3, ())], "w")  # never started
    ledger.progress("w", n_events=2)
    recycled = Failure("recycled", "memory")
    back = ledger.requeue_unfinished("w", recycled)
    assert sorted(e.uid for e in back) == [3, 4]
    assert all(e.attempt == 2 and e.failures == 0 and not e.isolate for e in back)
    assert all(e.unstarted for e in back)
    assert ledger.in_flight("w") == 2  # 1 and 2 wait for their CONFIRM
    # the two come back together, in one message to another worker
    ledger.resend_many([3, 4], "v")
    assert ledger.in_flight("v") == 2
    ledger.progress("v", n_events=2)
    assert ledger.requeue_worker("v", Failure.from_returncode(-9)) != []  # not yet confirmed
    # the left worker's results never came: later, they go again, uncharged
    late = ledger.requeue_worker("w", recycled, culprit_uid=-1)
    assert sorted(e.uid for e in late) == [1, 2] and all(e.failures == 0 for e in late)


def test_only_events_no_result_of_which_can_exist_may_go_again_together() -> None:
    # results leave a worker one whole message at a time: the message it died in and
    # the later ones have none; a finished message's results may still be on the way
    ledger, _ = make()
    ledger.add_batch([(1, 0, ()), (2, 1, ())], "w")  # finished (its READY came)
    ledger.add_batch([(3, 2, ())], "w")  # finished, READY not yet
    ledger.add_batch([(4, 3, ()), (5, 4, ())], "w")  # the culprit 4 killed it
    ledger.add_batch([(6, 5, ())], "w")  # never started
    ledger.progress("w", n_events=2)
    entries = {e.uid: e for e in ledger.requeue_worker("w", Failure.from_returncode(-9), 4)}
    assert [u for u in sorted(entries) if entries[u].unstarted] == [5, 6]
    assert entries[4].failures == 1
    # died between messages (scoreboard idle): only messages after the current one
    ledger.add_batch([(7, 6, ())], "v")  # finished (READY may lag)
    ledger.add_batch([(8, 7, ()), (9, 8, ())], "v")
    entries = {e.uid: e for e in ledger.requeue_worker("v", Failure.from_returncode(-9), -1)}
    assert [u for u in sorted(entries) if entries[u].unstarted] == [8, 9]
    # an output restart may have lost any result: none counts as unstarted
    ledger.resend_many([8, 9], "u")
    again = {e.uid: e for e in ledger.requeue_all()}
    assert not again[8].unstarted and not again[9].unstarted
    assert again[6].unstarted  # still waiting to go again: nothing changed for it


def test_a_worker_leaving_after_its_results_were_confirmed_gives_back_nothing_more() -> None:
    ledger, _ = make()
    ledger.add_batch([(1, 0, ()), (2, 1, ())], "w")
    ledger.progress("w", n_events=2)
    assert ledger.requeue_unfinished("w", Failure("recycled", "memory")) == []
    ledger.confirm([1, 2])
    assert ledger.in_flight("w") == 0 and len(ledger) == 0


def test_resend_many_refuses_an_event_that_is_not_pending() -> None:
    ledger, _ = make()
    ledger.add(1, 0, "w", ())
    with pytest.raises(InternalError, match="uid 1, which is in-flight, not pending"):
        ledger.resend_many([1], "v")


def test_a_culprit_from_the_scoreboard_overrides_a_lost_ready() -> None:
    # the worker finished message 1 but its READY died with it: the READY guess would
    # blame uid 1; the scoreboard says it died on uid 4 (in a batch): only 4 is charged
    ledger, _ = make()
    ledger.add_batch([(1, 0, ())], "w")
    ledger.add_batch([(2, 1, ())], "w")
    ledger.add_batch([(3, 2, ()), (4, 3, ()), (5, 4, ())], "w")
    ledger.progress("w", n_events=0)
    died = Failure.from_returncode(-11)
    entries = {e.uid: e for e in ledger.requeue_worker("w", died, culprit_uid=4)}
    assert [u for u, e in sorted(entries.items()) if e.failures] == [4]
    assert "signal 11" in entries[4].reasons[0]
    assert all(not entries[u].isolate and not entries[u].reasons for u in (1, 2, 3, 5))
    assert all(e.state is EntryState.PENDING and e.attempt == 2 for e in entries.values())


def test_a_worker_that_died_between_events_charges_nobody() -> None:
    ledger, _ = make()
    ledger.add_batch([(1, 0, ())], "w")
    ledger.add_batch([(2, 1, ()), (3, 2, ())], "w")
    ledger.progress("w", n_events=0)
    entries = ledger.requeue_worker("w", Failure.from_returncode(-9), culprit_uid=-1)
    assert len(entries) == 3 and all(e.failures == 0 and not e.isolate for e in entries)
    assert ledger.statistics().failures == 0


def test_poisoned_after_max_attempts_with_every_reason() -> None:
    ledger, _ = make(max_attempts=3)
    ledger.add(42, 0, "a", ())
    ledger.requeue_worker("a", Failure.from_returncode(-11))
    ledger.resend(42, "b")
    ledger.fail(42, Failure.exception("ValueError: bad track"))
    ledger.resend(42, "c")
    (entry,) = ledger.requeue_worker("c", Failure.timeout(2.5))
    assert entry.poisoned and entry.failures == 3 and entry.attempt == 3
    assert entry.reasons == (
        "attempt 1: signal: worker killed by signal 11 (SIGSEGV)",
        "attempt 2: exception: ValueError: bad track",
        "attempt 3: timeout: no result within event_timeout_s=2.5 s",
    )
    st_ = ledger.statistics()
    assert (st_.poisoned, st_.poisoned_pending, st_.timeouts, st_.failures) == (1, 1, 1, 3)
    with pytest.raises(InternalError):
        ledger.resend(42, "d")  # poisoned events are not retried
    ledger.confirm([42])  # the output wrote it quarantined
    assert len(ledger) == 0 and ledger.statistics().poisoned_pending == 0


def test_exception_in_module_charges_the_event_not_the_worker() -> None:
    ledger, _ = make(max_attempts=2)
    ledger.add(1, 0, "w", ())
    ledger.add(2, 1, "w", ())
    entry = ledger.fail(2, Failure.exception("KeyError: 'tracks'"))
    assert entry is not None and entry.state is EntryState.PENDING and entry.attempt == 2
    assert ledger.in_flight("w") == 1  # the worker keeps its other event
    assert ledger.fail(999, Failure.exception("x")) is None


def test_suspect_in_many_deaths_is_charged_so_runs_terminate() -> None:
    ledger, _ = make(max_attempts=2)
    ledger.add(1, 0, "w0", ())
    for i in range(6):  # an engine that never isolates: 1 always travels with 1000+i
        ledger.add(1000 + i, 1 + i, f"w{i}", ())
        entries = ledger.requeue_worker(f"w{i}", Failure.from_returncode(-9))
        if ledger.get(1).poisoned:
            break
        for e in entries:
            if e.uid != 1:
                ledger.confirm([e.uid])
        ledger.get(1).isolate = False  # pretend the engine ignores isolation
        ledger.resend(1, f"w{i + 1}")
    entry = ledger.get(1)
    assert entry.poisoned and entry.failures == 2 and entry.suspicions == 4
    assert i == 3  # 2 * max_attempts deaths


def test_timeout_fires_only_after_no_progress_with_fake_clock() -> None:
    ledger, clock = make(event_timeout_s=5.0)
    ledger.add(1, 0, "w1", ())
    ledger.add(2, 1, "w1", ())
    ledger.add(3, 2, "w2", ())
    clock.now_s += 4.0
    assert ledger.expired() == []
    ledger.confirm([1])  # w1 made progress at t+4
    clock.now_s += 1.5
    (late,) = ledger.expired()
    assert late.uid == 3  # w2: 5.5 s without progress
    clock.now_s += 4.0
    assert sorted(e.uid for e in ledger.expired()) == [2, 3]
    ledger.progress("w1")
    assert [e.uid for e in ledger.expired()] == [3]
    (entry,) = ledger.requeue_worker("w2", Failure.timeout(5.0))
    assert entry.failures == 1 and ledger.statistics().timeouts == 1
    assert [e.uid for e in ledger.expired(clock.now_s + 100)] == [2]


def test_no_timeouts_when_disabled() -> None:
    ledger, clock = make()
    ledger.add(1, 0, "w", ())
    clock.now_s += 1e9
    assert ledger.expired() == []


def test_requeue_all_after_output_restart_keeps_poisoned_and_charges_nobody() -> None:
    ledger, _ = make(max_attempts=1)
    ledger.add(1, 0, "a", ())
    ledger.add(2, 1, "b", ())
    ledger.add(3, 2, "b", ())
    ledger.requeue_worker("a", Failure.from_returncode(1))  # 1 poisoned at once
    ledger.requeue_worker("b", Failure.from_returncode(-9))  # 2, 3 suspects
    ledger.resend(2, "c")
    entries = ledger.requeue_all()
    assert [(e.uid, e.state) for e in entries] == [
        (1, EntryState.POISONED),
        (2, EntryState.PENDING),
        (3, EntryState.PENDING),
    ]
    assert ledger.get(2).failures == 0 and ledger.get(2).attempt == 3
    assert ledger.in_flight("c") == 0


# --- a model-based test: the ledger against a plain dict of positions ------------------
class LedgerMachine(RuleBasedStateMachine):
    """Random sends, confirms, deaths, failures and resends against a simple model."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.ledger = Ledger(max_attempts=3, event_timeout_s=10.0, clock=self.clock)
        self.next_pos = 0
        self.model: dict[int, int] = {}  # uid -> position, unconfirmed
        self.confirmed: set[int] = set()

    @rule(worker=st.integers(0, 3))
    def send(self, worker: int) -> None:
        uid = 10_000 + self.next_pos * 3
        self.ledger.add(uid, self.next_pos, worker, (b"f",))
        self.model[uid] = self.next_pos
        self.next_pos += 1

    @rule(worker=st.integers(0, 3), n=st.integers(1, 4))
    def send_batch(self, worker: int, n: int) -> None:
        events = []
        for _ in range(n):
            uid = 10_000 + self.next_pos * 3
            events.append((uid, self.next_pos, (b"f",)))
            # the checkpoint is conservative inside a batch: its first position
            self.model[uid] = self.next_pos - len(events) + 1
            self.next_pos += 1
        self.ledger.add_batch(events, worker)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def confirm_some(self, data: st.DataObject) -> None:
        uids = data.draw(st.lists(st.sampled_from(sorted(self.model)), max_size=4))
        extra = data.draw(st.lists(st.integers(0, 50), max_size=2))
        ours = set(uids)
        assert self.ledger.confirm(uids + extra) == len(ours)
        for uid in ours:
            del self.model[uid]
        self.confirmed |= ours

    @rule(worker=st.integers(0, 3), n=st.integers(1, 3))
    def worker_reports_done(self, worker: int, n: int) -> None:
        self.ledger.progress(worker, n_events=n)

    @rule(worker=st.integers(0, 3), signum=st.sampled_from([9, 11, 6]))
    def worker_dies(self, worker: int, signum: int) -> None:
        for e in self.ledger.requeue_worker(worker, Failure.from_returncode(-signum)):
            assert e.uid in self.model and e.state in (EntryState.PENDING, EntryState.POISONED)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def event_raises(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(sorted(self.model)))
        self.ledger.fail(uid, Failure.exception("boom"))

    @rule(worker=st.integers(0, 3))
    def resend_pending(self, worker: int) -> None:
        for e in self.ledger.entries():
            if e.state is EntryState.PENDING:
                self.ledger.resend(e.uid, worker)
                break

    @rule(dt=st.floats(0, 20))
    def time_passes(self, dt: float) -> None:
        self.clock.now_s += dt
        for e in self.ledger.expired():
            # the late worker's oldest unconfirmed event, or a placeholder (uid -1)
            assert e.state is EntryState.IN_FLIGHT and e.worker in range(4)
            assert e.uid == -1 or e.uid in self.model

    @invariant()
    def matches_model(self) -> None:
        ledger = self.ledger
        assert len(ledger) == len(self.model)
        assert {e.uid for e in ledger.entries()} == set(self.model)
        expected = min(self.model.values(), default=self.next_pos)
        assert ledger.checkpoint_position() == expected
        s = ledger.statistics()
        assert s.in_flight + s.pending + s.poisoned_pending == s.unconfirmed
        assert s.confirmed == len(self.confirmed)
        assert sum(ledger.in_flight(w) for w in range(4)) == s.in_flight
        for e in ledger.entries():
            assert e.failures <= e.attempt  # innocent retries raise attempt, not failures
            assert e.poisoned == (e.failures >= 3)


LedgerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_ledger_matches_model = LedgerMachine.TestCase


def test_with_progress_a_worker_hung_on_an_already_confirmed_retry_still_times_out() -> None:
    ledger, clock = make(event_timeout_s=5.0)
    ledger.add_batch([(1, 0, ())], "w")
    ledger.progress("w", n_events=0)  # progress reports are on
    clock.now_s += 1.0
    ledger.confirm([1])  # another copy of uid 1 was written: the ledger holds nothing
    assert len(ledger) == 0 and ledger.expired() == []
    clock.now_s += 6.0  # ... but w never finished the message: it hangs
    (late,) = ledger.expired()
    assert late.worker == "w" and late.uid == -1
    assert ledger.requeue_worker("w", Failure.timeout(5.0)) == []
    assert ledger.expired() == []

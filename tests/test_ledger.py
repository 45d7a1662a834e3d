"""The input's ledger: confirms, blame, requeues, timeouts, poison, checkpoint position."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from evflow.errors import ConfigurationError, InternalError
from evflow.processing.parallel.ledger import EntryState, Failure, Ledger

SIGKILL = Failure.from_returncode(-9)
SIGSEGV = Failure.from_returncode(-11)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make(**kw: object) -> tuple[Ledger, FakeClock]:
    clock = FakeClock()
    return Ledger(clock=clock, **kw), clock  # type: ignore[arg-type]


def batch(ledger: Ledger, key: int, worker: str, uids: list[int], position: int) -> None:
    frames = [[f"ev{u}".encode()] for u in uids]
    ledger.add_batch(key, worker, np.array(uids, "<u8").tobytes(), frames, position,
                     end_position=position + len(uids))  # fmt: skip


def test_confirm_forgets_sends_and_counts_unknown_and_duplicate_keys() -> None:
    ledger, _ = make()
    frames = [b"header", b"x" * 10]
    for uid in range(5):
        ledger.add(uid + 1000, uid, "w1", frames)
    assert len(ledger) == 5 and ledger.get(1000).frames[0] is frames  # by reference
    assert ledger.confirm([1000, 1002]) == 2
    assert ledger.confirm([1002, 999999]) == 0
    s = ledger.statistics()
    assert (s.confirmed, s.duplicate_confirms, s.unknown_confirms) == (2, 1, 1)
    assert len(ledger) == 3 and 1000 not in ledger and 1001 in ledger
    assert ledger.in_flight("w1") == 3


def test_batches_count_events_and_the_checkpoint_follows_out_of_order_confirms() -> None:
    ledger, _ = make(start_position=10)
    assert ledger.checkpoint_position() == 10
    batch(ledger, 1, "a", [10, 11, 12], 10)
    batch(ledger, 2, "b", [13, 14], 13)
    batch(ledger, 3, "a", [15], 15)
    assert len(ledger) == 6 and ledger.in_flight("a") == 4
    ledger.confirm([3, 2])
    assert ledger.checkpoint_position() == 10
    ledger.confirm([1])
    assert ledger.checkpoint_position() == 16 and len(ledger) == 0


def test_positions_must_not_decrease_and_keys_are_unique() -> None:
    ledger, _ = make()
    ledger.add(1, 5, "w", ())
    with pytest.raises(InternalError, match="position 4"):
        ledger.add(2, 4, "w", ())
    with pytest.raises(InternalError, match="key 1 used twice"):
        ledger.add(1, 6, "w", ())


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="max_attempts"):
        Ledger(max_attempts=0)
    with pytest.raises(ConfigurationError, match="event_timeout_s"):
        Ledger(event_timeout_s=0)


def test_dead_worker_charges_its_current_single_event_and_spares_the_others() -> None:
    ledger, _ = make()
    ledger.add(7, 0, "w1", [b"seven"])
    ledger.add(8, 1, "w1", [b"eight"])
    ledger.add(9, 2, "w2", [b"nine"])
    entries = ledger.requeue_worker("w1", SIGKILL)
    by_uid = {e.uid: e for e in entries}
    assert by_uid[7].failures == 1 and "signal 9 (SIGKILL)" in by_uid[7].reason
    assert by_uid[8].failures == 0 and not by_uid[8].isolate
    assert all(e.attempt == 2 and e.state is EntryState.PENDING for e in entries)
    assert len(ledger) == 3 and ledger.in_flight("w1") == 0
    assert ledger.checkpoint_position() == 0  # taken back events keep their position
    first = ledger.take_pending(10)
    assert [e.uid for e in first] == [7]  # charged events travel alone
    assert [e.uid for e in ledger.take_pending(10)] == [8]
    ledger.resend(100, "w3", first)
    assert ledger.in_flight("w3") == 1 and ledger.get(100).frames == [[b"seven"]]
    with pytest.raises(InternalError, match="not pending"):
        ledger.resend(101, "w4", first)


def test_finished_sends_tell_which_send_was_current() -> None:
    ledger, _ = make()
    ledger.add(1, 0, "w", [b"1"])
    ledger.add(2, 1, "w", [b"2"])
    ledger.worker_done("w", 1)  # finished uid 1 (not confirmed yet): 2 is current
    entries = {e.uid: e for e in ledger.requeue_worker("w", SIGSEGV)}
    assert entries[1].failures == 0 and entries[2].failures == 1


def test_a_batch_that_kills_its_worker_is_isolated_then_the_culprit_is_charged() -> None:
    ledger, _ = make()
    batch(ledger, 1, "w", [5, 6, 7, 8], 0)
    entries = ledger.requeue_worker("w", SIGSEGV)
    assert [e.uid for e in entries] == [5, 6, 7, 8]
    assert all(e.isolate and e.failures == 0 and e.attempt == 2 for e in entries)
    assert entries[2].frames == [b"ev7"]
    singles = [ledger.take_pending(64) for _ in range(4)]
    assert [[e.uid for e in s] for s in singles] == [[5], [6], [7], [8]]
    for key, single in enumerate(singles, start=10):
        ledger.resend(key, f"v{key}", single)
    ledger.confirm([10, 11, 13])
    (e7,) = ledger.requeue_worker("v12", SIGSEGV)
    assert e7.uid == 7 and e7.failures == 1 and e7.attempt == 3
    assert ledger.checkpoint_position() == 0


def test_poisoned_after_max_attempts_with_every_reason() -> None:
    ledger, _ = make(max_attempts=3, event_timeout_s=2.5)
    ledger.add(42, 0, "a", [b"x"])
    ledger.requeue_worker("a", SIGSEGV)
    ledger.resend(1, "b", ledger.take_pending(1))
    ledger.fail(1, 42, Failure.exception("ValueError: bad track"))
    ledger.resend(2, "c", ledger.take_pending(1))
    ledger.note_timeout("c")
    (entry,) = ledger.requeue_worker("c", SIGKILL)  # the kill was our timeout
    assert entry.poisoned and entry.failures == 3 and entry.attempt == 3
    assert entry.reasons == (
        "attempt 1: signal: worker killed by signal 11 (SIGSEGV)",
        "attempt 2: exception: ValueError: bad track",
        "attempt 3: timeout: no result within event_timeout_s=2.5 s",
    )
    s = ledger.statistics()
    assert (s.poisoned, s.poisoned_waiting, s.timeouts, s.failures) == (1, 1, 1, 3)
    assert ledger.take_pending(10) == []  # poisoned events are not retried
    (q,) = ledger.take_poisoned()
    assert q is entry and ledger.take_poisoned() == []
    ledger.quarantine(3, [q])
    assert len(ledger) == 1
    ledger.confirm([3])  # the output wrote it quarantined
    assert len(ledger) == 0 and ledger.checkpoint_position() == 1


def test_exception_in_module_charges_the_event_not_the_worker_nor_its_batch() -> None:
    ledger, _ = make(max_attempts=2)
    batch(ledger, 1, "w", [1, 2, 3], 0)
    entry = ledger.fail(1, 2, Failure.exception("KeyError: 'tracks'"))
    assert entry is not None and entry.state is EntryState.PENDING and entry.attempt == 2
    assert ledger.fail(1, 2, Failure.exception("again")) is None  # already taken out
    assert ledger.fail(999, 1, Failure.exception("x")) is None
    assert ledger.confirm([1]) == 2  # the other two were written
    assert len(ledger) == 1 and ledger.checkpoint_position() == 0
    ledger.resend(2, "w", ledger.take_pending(8))
    ledger.confirm([2])
    assert len(ledger) == 0 and ledger.checkpoint_position() == 3


def test_timeout_counts_from_the_start_of_the_current_send_with_a_fake_clock() -> None:
    ledger, clock = make(event_timeout_s=5.0)
    ledger.add(1, 0, "w1", [b"1"])
    ledger.add(2, 1, "w1", [b"2"])
    ledger.add(3, 2, "w2", [b"3"])
    clock.now_s += 4.0
    assert ledger.expired() == []
    ledger.worker_done("w1", 1)  # w1 starts uid 2 at t+4
    clock.now_s += 1.5
    assert [s.key for s in ledger.expired()] == [3]
    clock.now_s += 4.0
    assert sorted(s.key for s in ledger.expired()) == [2, 3]
    ledger.note_timeout("w2")
    assert [s.key for s in ledger.expired()] == [2]  # w2 is being killed already
    (entry,) = ledger.requeue_worker("w2", SIGKILL)
    assert entry.failures == 1 and ledger.statistics().timeouts == 1


def test_no_timeouts_when_disabled() -> None:
    ledger, clock = make()
    ledger.add(1, 0, "w", ())
    clock.now_s += 1e9
    assert ledger.expired() == []


def test_requeue_all_after_output_restart_keeps_poisoned_and_charges_nobody() -> None:
    ledger, _ = make(max_attempts=1)
    ledger.add(1, 0, "a", [b"1"])
    batch(ledger, 2, "b", [2, 3], 1)
    ledger.requeue_worker("a", Failure.from_returncode(1))  # 1 poisoned at once
    ledger.quarantine(5, ledger.take_poisoned())
    entries = ledger.requeue_all()
    assert sorted((e.uid, e.state, e.failures) for e in entries) == [
        (1, EntryState.POISONED, 1),
        (2, EntryState.PENDING, 0),
        (3, EntryState.PENDING, 0),
    ]
    assert [e.uid for e in ledger.take_poisoned()] == [1]
    assert [e.uid for e in ledger.take_pending(8)] == [2, 3]
    assert ledger.in_flight("b") == 0 and len(ledger) == 3


def test_late_result_of_a_taken_back_send_is_a_duplicate_confirm() -> None:
    ledger, _ = make()
    ledger.add(1, 0, "w", [b"1"])
    ledger.requeue_worker("w", SIGKILL)
    ledger.resend(2, "v", ledger.take_pending(4))
    ledger.confirm([2])
    ledger.confirm([1])  # the first worker's result arrived after all: not ours any more
    s = ledger.statistics()
    assert s.unknown_confirms == 1 and s.confirmed == 1 and len(ledger) == 0


# --- a model-based test: the ledger against a plain dict of positions ------------------
class LedgerMachine(RuleBasedStateMachine):
    """Random sends, confirms, deaths, failures and resends against a simple model."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.ledger = Ledger(max_attempts=3, event_timeout_s=10.0, clock=self.clock)
        self.next_pos = 0
        self.next_key = 0
        self.model: dict[int, int] = {}  # uid -> its first send's position, unconfirmed
        self.keys: dict[int, list[int]] = {}  # live send key -> its uids
        self.poisoned: set[int] = set()

    def _key(self) -> int:
        self.next_key += 1
        return self.next_key

    @rule(worker=st.integers(0, 3), n=st.integers(1, 4))
    def send(self, worker: int, n: int) -> None:
        uids = [10_000 + (self.next_pos + i) * 3 for i in range(n)]
        key = self._key()
        batch(self.ledger, key, worker, uids, self.next_pos)
        for uid in uids:
            # the checkpoint is conservative: an event taken out of its batch keeps the
            # batch's first position (a resumed run re-reads a few, the output drops them)
            self.model[uid] = self.next_pos
        self.keys[key] = uids
        self.next_pos += n

    @precondition(lambda self: self.keys)
    @rule(data=st.data())
    def confirm_some(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.keys)), max_size=3, unique=True))
        self.ledger.confirm([*keys, 999_999])
        for key in keys:
            for uid in self.keys.pop(key):
                self.model.pop(uid, None)

    @rule(worker=st.integers(0, 3), n=st.integers(1, 8))
    def worker_reports_done(self, worker: int, n: int) -> None:
        self.ledger.worker_done(worker, n)

    @rule(worker=st.integers(0, 3), signum=st.sampled_from([9, 11, 6]))
    def worker_dies(self, worker: int, signum: int) -> None:
        for e in self.ledger.requeue_worker(worker, Failure.from_returncode(-signum)):
            assert e.uid in self.model
        self._forget_taken_keys()

    @precondition(lambda self: any(self.keys.values()))
    @rule(data=st.data())
    def event_raises(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, u in self.keys.items() if u)))
        uid = data.draw(st.sampled_from(self.keys[key]))
        if self.ledger.fail(key, uid, Failure.exception("boom")) is not None:
            self.keys[key] = [u for u in self.keys[key] if u != uid]

    @rule(worker=st.integers(0, 3), n=st.integers(1, 4))
    def resend_pending(self, worker: int, n: int) -> None:
        entries = self.ledger.take_pending(n)
        if entries:
            key = self._key()
            self.ledger.resend(key, worker, entries)
            self.keys[key] = [e.uid for e in entries]

    @rule()
    def quarantine_poisoned(self) -> None:
        entries = self.ledger.take_poisoned()
        if entries:
            key = self._key()
            self.ledger.quarantine(key, entries)
            self.keys[key] = [e.uid for e in entries]

    @rule()
    def output_restarts(self) -> None:
        self.ledger.requeue_all()
        self.keys.clear()

    @rule(dt=st.floats(0, 20))
    def time_passes(self, dt: float) -> None:
        self.clock.now_s += dt
        for send in self.ledger.expired():
            assert send.key in self.keys

    def _forget_taken_keys(self) -> None:
        for key in [k for k in self.keys if k not in self.ledger]:
            del self.keys[key]

    @invariant()
    def matches_model(self) -> None:
        ledger = self.ledger
        assert len(ledger) == len(self.model)
        assert ledger.checkpoint_position() == min(self.model.values(), default=self.next_pos)
        s = ledger.statistics()
        assert s.confirmed + s.unconfirmed == s.added
        in_sends = sum(len(u) for u in self.keys.values())
        assert in_sends + s.pending + s.poisoned_waiting <= s.unconfirmed
        assert sum(ledger.in_flight(w) for w in range(4)) <= in_sends


LedgerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
test_ledger_matches_model = LedgerMachine.TestCase

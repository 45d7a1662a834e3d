"""Restart backoff: worker slots that keep dying are forked again later and later.

Unit tests of the policy (pure, times passed in) and real parallel runs: a path that
crashes on every event stops with the max_restarts message while the measured spacing
between forks grows; a pending fork is dropped at an interrupt and at the end of input.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import signal
import threading
import time
from pathlib import Path as FsPath

import psutil
import pytest

import evflow
from _wait import poll_until
from evflow import DataStore, Module, Param, Path
from evflow.errors import ConfigurationError
from evflow.io.generators import BusyWork, ToyGenerator
from evflow.io.records import RecordOutput, RecordReader, decode_record
from evflow.processing.faults import FaultInjector
from evflow.processing.parallel import notices
from evflow.processing.parallel.run import engine
from evflow.processing.parallel.run.restarts import RestartPolicy
from evflow.processing.parallel.scoreboard import BUSY, IDLE, UNKNOWN

# --- the policy ---------------------------------------------------------------------------


def test_delays_start_immediate_then_double_up_to_the_cap() -> None:
    policy = RestartPolicy(backoff_s=0.05, backoff_max_s=0.4)
    assert [policy.delay_s(k) for k in range(1, 8)] == [0.0, 0.05, 0.1, 0.2, 0.4, 0.4, 0.4]
    assert policy.delay_s(10_000) == 0.4  # no overflow on a long streak


def test_unproductive_deaths_in_a_row_are_delayed_more_and_more() -> None:
    policy = RestartPolicy(backoff_s=0.1, backoff_max_s=1.0)
    now, delays = 100.0, []
    for _ in range(7):
        policy.spawned(0, now)
        now += 0.01  # died 10 ms after its fork, on its first event
        policy.observe(0, BUSY, 42)
        delay = policy.replace(0, now)
        delays.append(delay)
        if delay:
            assert policy.next_due_in_s(now) == pytest.approx(delay)
            assert policy.pop_due(now + delay / 2) == []  # not due yet
            now += delay
            assert policy.pop_due(now) == [0]
        assert not policy.pending
    assert delays == pytest.approx([0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    stats = policy.stats()
    assert (stats.delayed, stats.streak) == (6, 7)
    assert stats.total_delay_s == pytest.approx(3.5) and stats.max_delay_s == 1.0


def test_a_worker_that_finished_an_event_resets_the_streak() -> None:
    policy = RestartPolicy(backoff_s=0.1, backoff_max_s=1.0)
    for _ in range(3):
        policy.spawned(1, 0.0)
        policy.replace(1, 0.01)
    assert policy.streak == 3
    policy.pop_due(100.0)
    policy.spawned(1, 100.0)
    policy.observe(1, BUSY, 7)
    policy.observe(1, IDLE)  # uid 7 finished: productive
    assert 1 not in policy.watching()
    assert policy.replace(1, 100.02) == 0.0 and policy.streak == 0
    policy.spawned(1, 100.02)  # the next one dies at once again: a new streak
    assert policy.replace(1, 100.03) == 0.0
    policy.spawned(1, 100.03)
    assert policy.replace(1, 100.04) == pytest.approx(0.1)


def test_busy_on_another_uid_is_progress_but_the_same_uid_or_unknown_is_not() -> None:
    policy = RestartPolicy()
    policy.spawned(0, 0.0)
    policy.observe(0, BUSY, 5)
    policy.observe(0, BUSY, 5)  # still in the same event
    policy.observe(0, UNKNOWN)  # a torn reading tells nothing
    assert 0 not in policy.productive
    policy.observe(0, BUSY, 6)
    assert 0 in policy.productive
    policy.spawned(0, 1.0)  # a fresh worker starts unknown again
    assert 0 not in policy.productive and policy.watching() == [0]


def test_a_worker_that_lived_long_enough_counts_as_productive() -> None:
    policy = RestartPolicy(backoff_s=0.1, healthy_after_s=1.0)
    policy.spawned(0, 0.0)
    policy.replace(0, 0.01)
    policy.spawned(0, 0.01)
    assert policy.replace(0, 0.02) > 0.0  # second quick death: delayed
    policy.pop_due(10.0)
    policy.spawned(0, 10.0)
    assert policy.replace(0, 11.5) == 0.0 and policy.streak == 0


def test_a_kill_from_outside_neither_grows_nor_ends_a_streak() -> None:
    policy = RestartPolicy(backoff_s=0.1, backoff_max_s=1.0)
    for t in (0.0, 0.1, 0.2):
        policy.spawned(0, t)
        policy.replace(0, t + 0.01)
    assert policy.streak == 3
    policy.pop_due(1.0)
    policy.spawned(0, 1.0)
    assert policy.replace(0, 1.01, crashed=False) == 0.0  # SIGKILL: fork at once
    assert policy.streak == 3
    policy.spawned(0, 1.01)
    assert policy.replace(0, 1.02) == pytest.approx(0.4)  # the streak goes on: 4th crash


def test_a_quiet_period_without_crashes_ends_a_streak() -> None:
    policy = RestartPolicy(backoff_s=0.1, backoff_max_s=1.0, healthy_after_s=1.0)
    assert policy.reset_after_s == 3.0  # longer than any gap inside a crash loop
    for t in (0.0, 0.1):
        policy.spawned(0, t)
        policy.replace(0, t + 0.01)
    policy.pop_due(10.0)
    policy.spawned(0, 10.0)
    assert policy.replace(0, 10.01) == 0.0 and policy.streak == 1  # a new streak


def test_pending_forks_are_due_earliest_first_and_cancel_drops_them() -> None:
    policy = RestartPolicy(backoff_s=1.0, backoff_max_s=10.0)
    for slot in range(4):
        policy.spawned(slot, 0.0)
    delays = [policy.replace(slot, 0.1) for slot in range(4)]
    assert delays == [0.0, 1.0, 2.0, 4.0]
    assert sorted(policy.pending) == [1, 2, 3]
    assert policy.next_due_in_s(0.1) == pytest.approx(1.0)
    assert policy.next_due_in_s(50.0) == 0.0  # overdue
    assert policy.pop_due(2.2) == [1, 2]
    assert policy.cancel(3.1) == 1 and not policy.pending  # slot 3 was due at 4.1
    assert policy.next_due_in_s(3.0) is None
    stats = policy.stats()  # forks done: 2 (after 1 + 2 s); slot 3 stood empty 3 s
    assert stats.delayed == 2 and stats.total_delay_s == pytest.approx(1.0 + 2.0 + 3.0)


def test_zero_backoff_forks_at_once() -> None:
    policy = RestartPolicy(backoff_s=0.0)
    for _ in range(5):
        policy.spawned(0, 0.0)
        assert policy.replace(0, 0.01) == 0.0
    assert policy.stats().delayed == 0


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, "1s", True])
def test_a_bad_backoff_option_is_one_clear_error(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="option 'restart_backoff_s' must be a number"):
        RestartPolicy.from_options({"restart_backoff_s": bad})
    with pytest.raises(ConfigurationError, match="restart_backoff_max_s"):
        RestartPolicy.from_options({"restart_backoff_max_s": bad})


def test_a_bad_backoff_option_stops_a_parallel_run_before_it_starts(tmp_path: FsPath) -> None:
    path = Path([ToyGenerator(n_events=10), BusyWork(work_ms=0.0)])
    with pytest.raises(ConfigurationError, match="restart_backoff_s"):
        evflow.process(path, workers=1, quiet=True, extra={"restart_backoff_s": -1})


# --- real runs ---------------------------------------------------------------------------


class StartLog(Module):
    """Appends ``<process name> <time.monotonic()>`` to ``file`` when a worker starts.

    CLOCK_MONOTONIC is one clock for every process of the machine, so the test reads
    the real spacing between forks.
    """

    parallel = True
    file = Param(str, "")

    def initialize(self) -> None:
        with open(f"/proc/{os.getpid()}/comm") as f:
            name = f.read().strip()
        with open(self.file, "a") as f:
            f.write(f"{name} {time.monotonic()}\n")


def _alive_named(name: str) -> bool:
    """Whether a live (not zombie) process below this one is named ``name``."""
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() == name and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            pass
    return False


def _starts(file: FsPath) -> list[tuple[str, float]]:
    if not file.exists():
        return []
    return [(n, float(t)) for n, t in (line.split() for line in file.read_text().splitlines())]


def test_a_crash_on_every_event_stops_with_the_limit_message_and_growing_spacing(
    tmp_path: FsPath,
) -> None:
    log = tmp_path / "starts.txt"
    path = Path(
        [
            ToyGenerator(n_events=1000),
            StartLog(file=str(log)),
            FaultInjector(mode="exit", probability=1.0, exit_code=7),
            RecordOutput(file=str(tmp_path / "x.evr"), fsync=False),
        ]
    )
    extra = {"max_restarts": 6, "restart_backoff_s": 0.1, "restart_backoff_max_s": 0.4}
    with pytest.raises(evflow.EvflowError) as info:
        evflow.process(path, workers=1, quiet=True, extra=extra)
    message = str(info.value)
    # one clear message: the worker, its exit cause, the count, the option to raise
    assert message.startswith("worker-0.6 (pid ")
    assert "died with exit code 7; 6 workers were already replaced" in message
    assert "limit max_restarts=6" in message and "'max_restarts': N" in message
    assert "The last 7 workers crashed before finishing an event" in message, message
    assert "restarts were delayed 5 times, 1.50 s in all" in message
    starts = _starts(log)
    assert [n for n, _ in starts] == ["worker-0"] + [f"worker-0.{g}" for g in range(1, 7)]
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(starts)]
    # measured between the worker processes' starts: fork k+1 cannot start before
    # fork k died plus its backoff, so each gap is at least the (growing) delay; without
    # the backoff each gap is one worker's short life (tens of ms)
    for gap, delay in zip(gaps, [0.0, 0.1, 0.2, 0.4, 0.4, 0.4], strict=True):
        assert gap >= delay, (gaps, delay)


def test_default_backoff_still_stops_a_crash_loop_quickly(tmp_path: FsPath) -> None:
    path = Path(
        [
            ToyGenerator(n_events=100),
            FaultInjector(mode="segfault", probability=1.0),
            RecordOutput(file=str(tmp_path / "x.evr"), fsync=False),
        ]
    )
    with pytest.raises(evflow.EvflowError, match=r"signal 11 \(SIGSEGV\).*max_restarts=6") as info:
        evflow.process(path, workers=2, quiet=True)
    # defaults: 0.05 s doubling, 2 workers, 6 restarts: well under 2 s of backoff (the
    # delays the run gave its forks, as it reports them: not a wall-clock measurement)
    delayed = re.search(r"restarts were delayed (\d+) times, ([\d.]+) s in all", str(info.value))
    assert delayed is not None, str(info.value)
    assert int(delayed[1]) >= 1 and float(delayed[2]) < 2.0


def test_a_second_interrupt_drops_a_pending_fork_and_nothing_is_forked_after(
    tmp_path: FsPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "starts.txt"
    path = Path(
        [
            ToyGenerator(n_events=1000),
            StartLog(file=str(log)),
            FaultInjector(mode="exit", probability=1.0),
            RecordOutput(file=str(tmp_path / "x.evr"), fsync=False),
        ]
    )
    # the second death waits an hour for its fork: a run that waited for it would be
    # failed by the test's time-out
    extra = {"max_restarts": 100, "restart_backoff_s": 3600.0, "restart_backoff_max_s": 3600.0}
    # what the run says on stderr: the first interrupt's "stopping" line shows it was
    # handled (two signals close together would be handled once)
    said: list[str] = []
    monkeypatch.setattr(engine, "_say", lambda line: said.append(line) or notices.say(line))
    interrupted: list[bool] = []

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while len(_starts(log)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        # the second worker has died (one event, then os._exit): its fork is pending
        while _alive_named("worker-0.1") and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        stopping = poll_until(lambda: any(s.startswith("evflow: stopping") for s in said), 60)
        interrupted.append(stopping)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        evflow.process(path, workers=1, quiet=True, extra=extra)
    thread.join(timeout=60)
    assert interrupted == [True], ("the run ended before the interrupts", said)
    assert [n for n, _ in _starts(log)] == ["worker-0", "worker-0.1"]
    # the conftest fixture checks: no child process or ipc file left


class CrashInSlot(Module):
    """``os._exit`` on every event in worker slot ``slot`` (all its replacements)."""

    parallel = True
    slot = Param(int, 1)

    def event(self, store: DataStore) -> bool | None:
        with open(f"/proc/{os.getpid()}/comm") as f:
            name = f.read().strip()
        if name.split("-")[1].split(".")[0] == str(self.slot):
            os._exit(5)
        return None


def test_a_fork_pending_at_the_end_of_input_is_dropped_and_every_uid_written_once(
    tmp_path: FsPath,
) -> None:
    out, log = tmp_path / "e.evr", tmp_path / "starts.txt"
    n = 400
    path = Path(
        [
            ToyGenerator(n_events=n),
            StartLog(file=str(log)),
            BusyWork(work_ms=4.0),
            CrashInSlot(slot=1),
            RecordOutput(file=str(out), fsync=False),
        ]
    )
    # slot 1 dies on every event (forks after 0, 0.5, 1, 2, 4 s, ...); slot 0 does the work
    extra = {"max_restarts": 100, "restart_backoff_s": 0.5, "restart_backoff_max_s": 30.0}
    summary = evflow.process(path, workers=2, quiet=True, max_attempts=10, extra=extra)
    uids = []
    with RecordReader(str(out)) as reader:
        for record in reader:
            uids.append(decode_record(str(out), record).meta.uid)
    assert sorted(uids) == list(range(n))
    c = summary.counters
    forks = [name for name, _ in _starts(log) if name.startswith("worker-1")]
    assert len(forks) - 1 == c["workers restarted"]  # a cancelled fork is not counted
    assert c["workers lost"] - c["workers restarted"] in (0, 1)  # 1: dropped at the end
    # the summary says how many: every loss was replaced or not needed any more
    assert c["workers restarted"] + c["restarts not needed (run ended)"] == c["workers lost"]
    assert c["restarts delayed"] >= 1 and c["restart backoff (s)"] >= 0.5
    assert c["events lost"] == 0


def test_the_limit_hint_says_crash_loop_only_after_a_streak() -> None:
    policy = RestartPolicy(backoff_s=0.1)
    assert policy.limit_hint(1) == (
        "Raise the limit with extra={'max_restarts': N} if these deaths are expected"
    )
    for t in (0.0, 0.1):
        policy.spawned(0, t)
        policy.replace(0, t + 0.01)
    hint = policy.limit_hint(3)
    assert hint.startswith("The last 3 workers crashed before finishing an event")
    assert "delayed 1 times, 0.10 s in all" in hint and "'max_restarts': N" in hint

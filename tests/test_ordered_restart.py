"""--ordered runs survive the loss of their output or input process.

Real processes: the output or the input is SIGKILLed mid-run, the engine restarts it,
and the file must still hold every uid exactly once *in input order* (events a module
dropped absent, quarantined ones in their place). The reorder buffer's handling of
duplicates, which used to stall the order, is tested on its own.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path as FsPath

import pytest

import evflow
from _kill import HoldUntil, kill_role_when
from _wait import size_of, wait_until
from evflow import DataStore, Module, Path
from evflow.errors import InternalError
from evflow.event import FLAG_QUARANTINED
from evflow.io.generators import BusyWork, ToyGenerator
from evflow.io.records import RecordOutput, RecordReader, decode_record
from evflow.processing.faults import FaultInjector
from evflow.processing.parallel.input.checkpoint import Checkpoint, CheckpointFile
from evflow.processing.parallel.output.reorder import SKIP, ReorderBuffer

N_EVENTS = 4000
POISON = [1234, 2999]  # raise on every attempt: quarantined, written raw in their place


class DropTag3(Module):
    """A trigger in the workers: drops events with tag 3 (they still hold their seq)."""

    parallel = True

    def event(self, store: DataStore) -> bool | None:
        return store["tag"] != 3


class InputTrigger(Module):
    """A serial trigger in the input: every 7th event gets no seq, so seq != position."""

    parallel = False

    def event(self, store: DataStore) -> bool | None:
        return store.meta.uid % 7 != 0


def _path(out: FsPath, input_trigger: bool = False, gate: FsPath | None = None) -> Path:
    modules: list[Module] = [ToyGenerator(n_events=N_EVENTS, payload_bytes=500, seed=3)]
    if input_trigger:
        modules.append(InputTrigger())
    if gate is not None:  # the second half waits for the kill: the run cannot end before it
        modules.append(HoldUntil(gate=str(gate), from_uid=N_EVENTS // 2))
    modules += [
        BusyWork(work_ms=0.5),
        DropTag3(),
        FaultInjector(name="poison", mode="raise", uids=POISON, poison=True),
        RecordOutput(file=str(out)),
    ]
    return Path(modules)


def _expected(input_trigger: bool) -> list[int]:
    """The uids a correct run writes, in input order."""
    source = ToyGenerator(n_events=N_EVENTS, payload_bytes=500, seed=3)
    uids = []
    for store in source.events(0):
        uid = store.meta.uid
        if input_trigger and uid % 7 == 0:
            continue
        if store["tag"] == 3 and uid not in POISON:
            continue
        uids.append(uid)
    return uids


def _file_uids(file: FsPath) -> tuple[list[int], set[int]]:
    """The uids in the file in file order, and the quarantined ones."""
    uids, poisoned = [], set()
    with RecordReader(str(file)) as reader:
        for record in reader:
            meta = decode_record(str(file), record).meta
            uids.append(meta.uid)
            if meta.flags & FLAG_QUARANTINED:
                poisoned.add(meta.uid)
    return uids, poisoned


def _assert_in_order_exactly_once(file: FsPath, input_trigger: bool = False) -> None:
    uids, poisoned = _file_uids(file)
    expected = _expected(input_trigger)
    twice = len(uids) - len(set(uids))
    assert twice == 0, f"{twice} uids written more than once"
    missing = sorted(set(expected) - set(uids))
    assert not missing, f"{len(missing)} uids lost, e.g. {missing[:5]}"
    assert set(uids) == set(expected)
    bad = next((i for i, (a, b) in enumerate(zip(uids, expected, strict=True)) if a != b), None)
    assert bad is None, f"out of order at record {bad}: {uids[bad - 2 : bad + 3]}"
    assert poisoned == set(POISON)


def test_ordered_run_restarts_a_killed_output_and_keeps_input_order(tmp_path: FsPath) -> None:
    out, gate = tmp_path / "o.evr", tmp_path / "killed"
    killer = kill_role_when("output", lambda: size_of(out) > 300_000, gate=gate)
    summary = evflow.process(_path(out, gate=gate), workers=2, quiet=True, ordered=True)
    killer.finish()
    assert summary.counters["output restarts"] == 1
    assert summary.counters["events lost"] == 0
    _assert_in_order_exactly_once(out)


def test_ordered_run_restarts_a_killed_input_from_its_checkpoint_in_order(
    tmp_path: FsPath,
) -> None:
    out, gate = tmp_path / "i.evr", tmp_path / "killed"
    ckpt = FsPath(str(out) + ".ckpt")
    # the output file may appear after the first checkpoint: size_of() is 0 until then
    killer = kill_role_when("input", lambda: ckpt.exists() and size_of(out) > 300_000, gate=gate)
    summary = evflow.process(
        _path(out, input_trigger=True, gate=gate),  # the slow path: seqs are not positions
        workers=2,
        quiet=True,
        ordered=True,
        extra={"checkpoint_interval_s": 0.1},
    )
    killer.finish()
    assert summary.counters["input restarts"] == 1
    assert summary.counters["events lost"] == 0
    assert summary.events_read < N_EVENTS  # the new input read from the checkpoint on
    _assert_in_order_exactly_once(out, input_trigger=True)


_START = Checkpoint("", 0, {})  # what "no checkpoint yet" counts as

_KILL9_ORDERED = """
import sys
import evflow
from evflow.io.generators import BusyWork, ToyGenerator
from evflow.io.records import RecordOutput
path = evflow.Path([ToyGenerator(n_events=3000, payload_bytes=500, seed=3), BusyWork(work_ms=1.0),
                    RecordOutput(file=sys.argv[1])])
evflow.process(path, workers=2, quiet=True, ordered=True, extra={"checkpoint_interval_s": 0.2})
"""


def test_ordered_resume_after_kill_9_continues_the_order(tmp_path: FsPath) -> None:
    out = tmp_path / "k.evr"
    ckpt = FsPath(str(out) + ".ckpt")
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL9_ORDERED, str(out)], start_new_session=True
    )
    try:
        # kill once a checkpoint says the run is under way (position > 0)
        wait_until(lambda: (CheckpointFile(ckpt).load() or _START).position > 0, 60,
                   "a checkpoint past position 0", proc=proc)  # fmt: skip
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    cp = CheckpointFile(ckpt).load()
    assert cp is not None and 0 < cp.position < 3000
    assert cp.counts["seq"] == cp.position  # no input path: one seq per position
    for leftover in FsPath(os.environ["EVFLOW_RUNTIME_DIR"]).iterdir():
        shutil.rmtree(leftover)  # the killed run's session directory
    path = Path(
        [
            ToyGenerator(n_events=3000, payload_bytes=500, seed=3),
            BusyWork(work_ms=1.0),
            RecordOutput(file=str(out)),
        ]
    )
    evflow.process(path, workers=2, quiet=True, ordered=True, resume=True)
    uids, _ = _file_uids(out)
    assert uids == list(range(3000))  # every uid once, in order, across both runs


# --- the reorder buffer on its own ------------------------------------------------------
def _drain(buffer: ReorderBuffer) -> list[tuple[str, int]]:
    """What the output would do, in order: ("write"|"skip"|"drop"|"late", uid)."""
    done = [("late", uid) for uid in buffer.take_late()]
    for frames, _, uid in buffer.release():
        kind = "skip" if frames is SKIP else "drop" if frames is None else "write"
        done.append((kind, uid))
    return done


def test_duplicates_hold_their_seq_so_the_order_moves_on() -> None:
    buffer = ReorderBuffer(start=0)
    buffer.put(1, 101, b"f1")
    buffer.skip(0, 100)  # already in the file (written before a restart): a skip
    buffer.put(3, 103, None)  # dropped by a module
    assert _drain(buffer) == [("skip", 100), ("write", 101)]
    buffer.skip(2, 102)
    assert _drain(buffer) == [("skip", 102), ("drop", 103)]
    assert buffer.next_seq == 4 and len(buffer) == 0


def test_a_duplicate_of_a_held_or_released_event_writes_nothing_more() -> None:
    buffer = ReorderBuffer(start=0)
    buffer.put(1, 101, b"f1")
    buffer.skip(1, 101)  # the re-sent copy of an event still waiting: no change
    buffer.put(0, 100, b"f0")
    assert _drain(buffer) == [("write", 100), ("write", 101)]
    buffer.skip(0, 100)  # a late copy of a released event: confirmed again, not held
    assert _drain(buffer) == [("late", 100)]
    assert len(buffer) == 0


def test_a_restarted_output_waits_for_the_input_to_say_where_the_order_goes_on() -> None:
    buffer = ReorderBuffer(start=None)
    buffer.skip(5, 105)  # re-sent, in the reopened file
    buffer.put(6, 106, b"f6")
    buffer.put(2, 102, None)  # a worker's late result of an event confirmed before
    assert _drain(buffer) == []  # nothing released before the start is known
    # the input: everything below 5 is confirmed, and so is 7 (a restarted input's
    # catch-up confirmed it out of order)
    buffer.start_at(5, done=[7])
    buffer.put(8, 108, b"f8")
    assert _drain(buffer) == [("late", 102), ("skip", 105), ("write", 106), ("write", 108)]
    buffer.start_at(3)  # a restarted input knows less than the output released: no way back
    assert buffer.next_seq == 9


def test_an_inconsistent_numbering_is_a_clear_error() -> None:
    buffer = ReorderBuffer(start=0)
    buffer.put(4, 104, b"f4")
    with pytest.raises(InternalError, match=r"seq 4 arrived with uid 999 but holds uid 104"):
        buffer.put(4, 999, b"x")


def test_ledger_first_unconfirmed_is_exact_in_a_partly_confirmed_batch() -> None:
    from evflow.processing.parallel.input.ledger import Ledger

    ledger = Ledger()
    ledger.add_lists([10, 11, 12], [100, 101, 103], [(), (), ()], "w0")
    ledger.add_lists([13], [104], [()], "w1")
    assert ledger.first_unconfirmed() == (10, 100)
    ledger.confirm([10, 11])
    assert ledger.checkpoint_position() == 100  # the batch's start: too low for --ordered
    assert ledger.first_unconfirmed() == (12, 103)
    ledger.confirm([12, 13])
    assert ledger.first_unconfirmed() is None


def test_resume_of_an_ordered_checkpoint_continues_its_numbering(tmp_path: FsPath) -> None:
    from evflow.processing.parallel.input.checkpoint import Checkpoint, checkpoint_path_for, plan

    out = str(tmp_path / "r.evr")
    CheckpointFile(checkpoint_path_for(out)).write(Checkpoint("r", 700, {"seq": 600}))
    options = plan([out], resume=True)
    assert (options["start_position"], options["start_seq"]) == (700, 600)
    assert plan([out], resume=False)["start_seq"] == 0

"""Issue 10, item 13: 'events lost' never says 0 when the output did not get every event.

The ledger's figure trusts CONFIRMs: forged ones made it say 0 while 2/3 of the events
were missing. The parent now checks it against what the output itself reports.
"""

from __future__ import annotations

from typing import Any

import pytest

import evflow
from evflow.errors import PeerLostError
from evflow.io.generators import BusyWork, ToyGenerator
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel.run.engine import Parent
from evflow.processing.parallel.split import split_path


def _parent(results: dict[str, dict[str, Any]]) -> Parent:
    split = split_path(evflow.Path([ToyGenerator(n_events=10), BusyWork(work_ms=0.0)]))
    assert split is not None
    parent = Parent(split, ProcessOptions(workers=2, quiet=True))
    parent.results = {role: (header, []) for role, header in results.items()}
    return parent


def _input(read: int, confirmed: int) -> dict[str, Any]:
    ledger = {"confirmed": confirmed, "unconfirmed": 0, "retries": 0, "failures": 0}
    return {"read": read, "dropped": 0, "ledger": {**ledger, "poisoned": 0}}


def test_events_the_ledger_calls_confirmed_but_the_output_never_wrote_are_lost() -> None:
    parent = _parent({"input": _input(900, 900), "output": {"written": 300, "dropped": 10}})
    assert parent._summary(1.0).counters["events lost"] == 590


def test_a_complete_run_loses_nothing() -> None:
    out = {"written": 880, "dropped": 15, "quarantined": 5}
    parent = _parent({"input": _input(900, 900), "output": out})
    assert parent._summary(1.0).counters["events lost"] == 0


def test_an_output_that_never_reported_lost_everything() -> None:
    parent = _parent({"input": _input(900, 900)})
    assert parent._summary(1.0).counters["events lost"] == 900


def test_after_restarts_the_ledger_alone_counts() -> None:
    # a restarted output reports only its own writes: the cross-check does not apply
    parent = _parent({"input": _input(900, 900), "output": {"written": 10}})
    parent.output_restarts = 1
    assert parent._summary(1.0).counters["events lost"] == 0


def test_a_run_that_lost_events_does_not_end_as_a_success(monkeypatch: Any) -> None:
    # whatever made the output miss events (forged END or CONFIRMs before the fix),
    # the parent's verdict: the run raises, its summary attached
    monkeypatch.setattr(Parent, "_unwritten", lambda self, inp: 7)
    path = evflow.Path([ToyGenerator(n_events=50), BusyWork(work_ms=0.0)])
    with pytest.raises(PeerLostError, match="7 of the 50 events read never reached") as info:
        evflow.process(path, workers=2, quiet=True)
    assert info.value.summary.counters["events lost"] == 7  # type: ignore[attr-defined]


def test_an_interrupted_run_with_a_checkpoint_calls_its_unwritten_events_resumable() -> None:
    # Ctrl-C twice: the events in flight are not written, and `--resume` writes them;
    # the summary called them "events lost"
    parent = _parent({"input": _input(900, 700), "output": {"written": 700}})
    parent.signals = [2]
    parent.role_options = {"checkpoint": "out.evr.ckpt"}
    counters = parent._summary(1.0).counters
    assert counters["events not written (--resume completes them)"] == 200
    assert "events lost" not in counters
    parent.role_options = {"checkpoint": None}  # no output file: nothing to resume
    counters = parent._summary(1.0).counters
    assert counters["events not written (interrupted)"] == 200
    assert "events lost" not in counters


def test_a_run_stopped_at_once_counts_what_the_output_wrote_not_the_confirms_in_flight() -> None:
    # the second Ctrl-C stops the input before the CONFIRMs of the last events the output
    # wrote come back: the ledger's 280 overstated what --resume completes (200)
    parent = _parent({"input": _input(900, 620), "output": {"written": 700}})
    parent.signals = [2, 2]
    parent.role_options = {"checkpoint": "out.evr.ckpt"}
    counters = parent._summary(1.0).counters
    assert counters["events not written (--resume completes them)"] == 200
    parent.signals = []  # a run that was not stopped: the ledger's figure stands
    assert parent._summary(1.0).counters["events lost"] == 280

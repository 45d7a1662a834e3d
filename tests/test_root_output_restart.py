"""A killed output that writes ROOT cannot be restarted: the run stops with one clear error.

A restarted output continues its files in append mode; ``RootOutput`` cannot append to
a ROOT file. So when the output process of a parallel run writing ROOT is SIGKILLed,
the engine forks no new output and stops the run at once with a ``PeerLostError`` that
names the process, the signal, the writer and file, and what to do instead.
"""

from __future__ import annotations

from pathlib import Path as FsPath

import psutil
import pytest

import evflow
from evflow import Path
from evflow.errors import PeerLostError
from evflow.io.generators import BusyWork, ToyGenerator
from evflow.io.records import RecordOutput
from evflow.io.root import RootOutput
from evflow.processing.parallel.run.restarts import output_restart_refusal
from test_chaos import _kill_role_when


def test_sigkill_of_a_root_output_stops_the_run_with_one_clear_error(tmp_path: FsPath) -> None:
    out = tmp_path / "o.root"
    path = Path(
        [
            ToyGenerator(n_events=50_000, payload_bytes=100),
            BusyWork(work_ms=0.3),
            RootOutput(file=str(out), chunk_events=200),
        ]
    )
    # kill once the output has written chunks (the file exists only once the run started)
    killer = _kill_role_when("output", lambda: out.exists() and out.stat().st_size > 50_000)
    with pytest.raises(PeerLostError) as info:  # (a hang: the test's time-out fails it)
        evflow.process(path, workers=2, quiet=True)
    killer.finish()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("the output process (pid ")
    assert "died with signal 9 (SIGKILL); the run is stopped: " in message
    assert f"its writer 'RootOutput' (RootOutput) cannot reopen '{out}' after a crash" in message
    assert "a ROOT file cannot be appended to" in message
    assert "run again from the start" in message and "RecordOutput" in message
    assert psutil.Process().children(recursive=True) == []  # nothing left running


def test_only_writers_that_cannot_append_refuse_an_output_restart(tmp_path: FsPath) -> None:
    record = RecordOutput(file=str(tmp_path / "a.evr"))
    root = RootOutput(file=str(tmp_path / "b.root"))
    assert output_restart_refusal([BusyWork(), record]) is None
    assert output_restart_refusal([]) is None
    why = output_restart_refusal([record, root])
    assert why is not None and "'RootOutput' (RootOutput)" in why and "b.root" in why

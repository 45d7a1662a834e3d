"""Parallel processing with real processes: same events, same content, merged results."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path as FsPath
from typing import Any

import boost_histogram as bh
import hist
import numpy as np
import pytest
import skhep_testdata

import evflow
from evflow import DataStore, Module, Param, Path
from evflow.errors import ModuleError
from evflow.io import BusyWork, RecordOutput, RecordReader, RootInput, ToyGenerator
from evflow.io.records import decode_record
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import run_parallel

HZZ = skhep_testdata.data_path("uproot-HZZ.root")


# --- modules used by the paths below (forked into workers, never pickled) -------------
class Enrich(Module):
    """Adds objects computed from the event and drops events with tag 3 (a trigger)."""

    parallel = True

    def event(self, store: DataStore) -> bool | None:
        if store["tag"] == 3:
            return False
        payload = store["payload"]
        store["checksum"] = int(payload.astype(np.uint64).sum())
        store["doubled"] = payload[:16].astype(np.int32) * 2
        return None


class Shuffle(Module):
    """Burns an uneven amount of CPU per event so that workers finish out of order."""

    parallel = True

    def event(self, store: DataStore) -> bool | None:
        from evflow.io.generators import burn_cpu

        burn_cpu(0.05 * (store.meta.uid * 7919 % 11))
        return None


class Booker(Module):
    """Fills histograms and other mergeable objects in ``store.persistent``."""

    parallel = True

    def event(self, store: DataStore) -> bool | None:
        p = store.persistent
        if "h_value" not in p:
            p["h_value"] = hist.Hist.new.Reg(20, 0, 1, name="value").Double()
            p["h_tag"] = bh.Histogram(bh.axis.Integer(0, 16), storage=bh.storage.Int64())
            p["h_2d"] = hist.Hist.new.Reg(8, 0, 1).Reg(4, 0, 16).Weight()
            p["counts"] = np.zeros(16, dtype=np.int64)
            p["n"] = 0
        p["h_value"].fill(store["value"])
        p["h_tag"].fill(store["tag"])
        p["h_2d"].fill(store["value"], store["tag"], weight=2.0)
        p["counts"][store["tag"]] += 1
        p["n"] += 1
        return None


class MergedReport(Module):
    """Output-path module: writes what it sees in ``persistent`` at terminate to a file."""

    file = Param(str, doc="json report")

    def event(self, store: DataStore) -> bool | None:
        self.persistent = store.persistent
        return None

    def terminate(self) -> None:
        p = getattr(self, "persistent", {})
        report = {"n": p.get("n"), "h_value": float(p["h_value"].sum()) if "h_value" in p else 0}
        FsPath(self.file).write_text(json.dumps(report))


class MuonSummary(Module):
    """HZZ: momentum of the muons and a selection (at least one muon)."""

    parallel = True

    def event(self, store: DataStore) -> bool | None:
        if store["NMuon"] < 1:
            return False
        px, py = np.asarray(store["Muon_Px"]), np.asarray(store["Muon_Py"])
        store["Muon_Pt"] = np.hypot(px, py)
        store["lead_pt"] = float(store["Muon_Pt"].max())
        return None


class FailInit(Module):
    parallel = True

    def initialize(self) -> None:
        raise RuntimeError("no calibration constants")


class FailEvent(Module):
    parallel = True

    def event(self, store: DataStore) -> bool | None:
        if store.meta.uid == 77:
            raise ValueError("bad cluster")
        return None


class CrashOnce(Module):
    """Kills its worker the first time it sees uid ``at`` (attempt 1 only)."""

    parallel = True
    at = Param(int, 50, "uid")

    def event(self, store: DataStore) -> bool | None:
        if store.meta.uid == self.at and store.meta.attempt == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return None


# --- helpers ------------------------------------------------------------------------------
def read_events(file: FsPath) -> list[DataStore]:
    with RecordReader(str(file)) as reader:
        return [decode_record(str(file), r) for r in reader]


def canonical(store: DataStore) -> tuple[int, dict[str, Any]]:
    out: dict[str, Any] = {}
    for key, value in store.items():
        if isinstance(value, np.ndarray):
            out[key] = (value.dtype.str, value.shape, value.tobytes())
        else:
            out[key] = repr(value)
    return store.meta.uid, out


def toy_path(out: FsPath, n: int = 600, payload: int = 700) -> Path:
    return Path(
        [
            ToyGenerator(n_events=n, payload_bytes=payload, seed=5),
            Enrich(),
            Shuffle(),
            RecordOutput(file=str(out)),
        ]
    )


def run(path: Path, workers: int, **options: Any) -> evflow.processing.summary.RunSummary:
    return evflow.process(path, workers=workers, quiet=True, **options)


# --- tests --------------------------------------------------------------------------------
def test_toy_parallel_runs_write_the_same_events_and_content_as_sequential(tmp_path):
    seq = run(toy_path(tmp_path / "seq.evr"), 0)
    expected = dict(canonical(s) for s in read_events(tmp_path / "seq.evr"))
    assert len(expected) == seq.events_written > 0
    for p in (1, 2, 4):
        out = tmp_path / f"p{p}.evr"
        summary = run(toy_path(out), p)
        events = [canonical(s) for s in read_events(out)]
        assert len(events) == len(expected), f"p={p}: {len(events)} events"
        assert dict(events) == expected, f"p={p}: content differs"
        assert summary.events_read == seq.events_read
        assert summary.events_written == seq.events_written
        assert summary.events_dropped == seq.events_dropped > 0
        assert summary.workers == p
        assert summary.counters["duplicates dropped"] == 0


def test_ordered_run_writes_events_in_input_order(tmp_path):
    run(toy_path(tmp_path / "seq.evr"), 0)
    expected = [canonical(s) for s in read_events(tmp_path / "seq.evr")]
    for p in (2, 4):
        out = tmp_path / f"ordered{p}.evr"
        run(toy_path(out), p, ordered=True)
        assert [canonical(s) for s in read_events(out)] == expected


def test_unordered_run_may_reorder_but_keeps_every_uid_once(tmp_path):
    run(toy_path(tmp_path / "p2.evr"), 2)
    uids = [s.meta.uid for s in read_events(tmp_path / "p2.evr")]
    assert len(uids) == len(set(uids))


def test_hzz_parallel_matches_sequential(tmp_path):
    def path(out: FsPath) -> Path:
        return Path(
            [RootInput(file=HZZ, step_size=500), MuonSummary(), RecordOutput(file=str(out))]
        )

    seq = run(path(tmp_path / "seq.evr"), 0)
    expected = dict(canonical(s) for s in read_events(tmp_path / "seq.evr"))
    assert seq.events_read == 2421 and 0 < len(expected) < 2421
    for p in (1, 2, 4):
        out = tmp_path / f"hzz{p}.evr"
        summary = run(path(out), p)
        assert dict(canonical(s) for s in read_events(out)) == expected, f"p={p}"
        assert summary.events_dropped == seq.events_dropped


def test_merged_histograms_equal_sequential_exactly(tmp_path):
    def path(report: FsPath) -> Path:
        return Path(
            [
                ToyGenerator(n_events=900, seed=9),
                Booker(),
                Shuffle(),
                MergedReport(file=str(report)),
            ]
        )

    seq = run(path(tmp_path / "seq.json"), 0).persistent
    for p in (2, 4):
        par = run(path(tmp_path / f"p{p}.json"), p).persistent
        assert isinstance(par["h_value"], hist.Hist)
        assert isinstance(par["h_tag"], bh.Histogram)
        for name in ("h_value", "h_tag", "h_2d"):
            assert par[name] == seq[name], f"{name} differs at p={p}"
        np.testing.assert_array_equal(par["counts"], seq["counts"])
        assert par["n"] == seq["n"] == 900
        # the output path's terminate saw the merged objects
        report = json.loads((tmp_path / f"p{p}.json").read_text())
        assert report == {"n": 900, "h_value": 900.0}


def test_module_statistics_have_a_column_per_process(tmp_path):
    summary = run(toy_path(tmp_path / "o.evr", n=300), 2)
    processes = {row.process for row in summary.modules}
    assert {"input", "output"} <= processes
    assert {p for p in processes if p.startswith("worker")} == {"worker-0", "worker-1"}
    totals = {row.module: row for row in summary.module_totals()}
    assert totals["Enrich"].calls == 300
    assert totals["ToyGenerator"].calls == 300
    table = str(summary)
    assert "worker-0" in table and "worker-1" in table
    # the serial-cost figures: CPU seconds of the input, the output and all workers
    for role in ("input", "output", "workers"):
        assert 0 < summary.counters[f"{role} CPU (s)"] < 60, summary.counters


def test_worker_initialize_error_stops_run_with_one_message_naming_module(tmp_path):
    path = Path(
        [ToyGenerator(n_events=100), FailInit(), RecordOutput(file=str(tmp_path / "o.evr"))]
    )
    with pytest.raises(ModuleError) as info:
        run(path, 2)
    text = str(info.value)
    assert "module 'FailInit' raised in initialize()" in text
    assert "RuntimeError: no calibration constants" in text
    assert "worker" in text
    assert "\n" not in text


def test_worker_event_error_stops_run_naming_module_and_uid(tmp_path):
    path = Path(
        [ToyGenerator(n_events=300), FailEvent(), RecordOutput(file=str(tmp_path / "o.evr"))]
    )
    # on_event_error="stop": the default ("retry") retries and quarantines the event
    with pytest.raises(ModuleError, match=r"'FailEvent' raised in event\(\) on event uid=77"):
        run(path, 2, extra={"on_event_error": "stop"})
    # what was written before the stop is readable
    read_events(tmp_path / "o.evr")


def test_killed_worker_is_replaced_and_its_events_are_sent_again(tmp_path):
    out = tmp_path / "o.evr"
    path = Path([ToyGenerator(n_events=400), CrashOnce(at=50), RecordOutput(file=str(out))])
    summary = run(path, 2)
    uids = [s.meta.uid for s in read_events(out)]
    assert sorted(uids) == list(range(400))
    assert summary.counters["workers lost"] == 1
    assert summary.counters["workers restarted"] == 1


def test_max_events_limits_what_is_read(tmp_path):
    summary = run(toy_path(tmp_path / "o.evr", n=500), 2, max_events=120)
    assert summary.events_read == 120
    assert summary.events_written + summary.events_dropped == 120


def test_large_events_go_through_unchanged(tmp_path):
    out = tmp_path / "big.evr"
    path = Path([ToyGenerator(n_events=12, payload_bytes=1_200_000), BusyWork(work_ms=0.0)])
    path.add(RecordOutput(file=str(out)))
    run(path, 2)
    seq_out = tmp_path / "big_seq.evr"
    path2 = Path([ToyGenerator(n_events=12, payload_bytes=1_200_000), BusyWork(work_ms=0.0)])
    path2.add(RecordOutput(file=str(seq_out)))
    run(path2, 0)
    assert dict(map(canonical, read_events(out))) == dict(map(canonical, read_events(seq_out)))


def test_path_without_parallel_module_runs_sequentially_with_a_note(tmp_path, capsys):
    path = Path([ToyGenerator(n_events=10), RecordOutput(file=str(tmp_path / "o.evr"))])
    summary = run_parallel(path, ProcessOptions(workers=2))
    assert summary.workers == 0 and summary.events_written == 10
    assert "running sequentially" in capsys.readouterr().err


def test_parallel_run_draws_a_progress_bar_of_every_event(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # the output process draws it (it learns every uid's fate), so capture at fd level
    path = Path([ToyGenerator(n_events=300, payload_bytes=64), BusyWork(work_ms=0.0)])
    summary = evflow.process(path, workers=2, progress=True)
    assert summary.events_read == 300
    err = capfd.readouterr().err
    assert "300/300" in err, err[-500:]
    quiet = evflow.process(
        Path([ToyGenerator(n_events=50), BusyWork(work_ms=0.0)]), workers=2, quiet=True
    )
    assert quiet.events_read == 50
    assert "/50" not in capfd.readouterr().err


# --- Module.preload --------------------------------------------------------------------
class NeedsPreloaded(Module):
    """Fails in its worker unless its heavy module was imported before the fork."""

    parallel = True
    preload = ("evflow_test_heavy",)

    def initialize(self) -> None:
        import sys

        if "evflow_test_heavy" not in sys.modules:
            raise RuntimeError("evflow_test_heavy was imported after the fork")


def test_preload_imports_a_module_once_before_the_processes_fork(
    tmp_path: FsPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "evflow_test_heavy.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "evflow_test_heavy", raising=False)
    path = Path([ToyGenerator(n_events=20), NeedsPreloaded()])
    summary = run_parallel(path, ProcessOptions(workers=2, quiet=True))
    assert summary.events_written == 20


@pytest.mark.parametrize(
    ("preload", "message"),
    [
        (("evflow_no_such_module",), "cannot preload 'evflow_no_such_module'"),
        ("evflow_test_heavy", "preload must be a tuple of module names"),
    ],
)
def test_a_bad_preload_is_one_clear_error(preload: Any, message: str) -> None:
    module = NeedsPreloaded(name="needy")
    module.preload = preload  # type: ignore[misc]
    with pytest.raises(evflow.errors.ConfigurationError, match=f"module 'needy': {message}"):
        run_parallel(
            Path([ToyGenerator(n_events=5), module]), ProcessOptions(workers=1, quiet=True)
        )

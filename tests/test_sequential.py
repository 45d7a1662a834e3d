"""The sequential processor: hooks in order, drops, statistics, errors, progress, process()."""

from __future__ import annotations

import io
import sys
import time

import pytest

import evflow
from evflow import DataStore, Module, Path, ProcessOptions, RunSummary
from evflow.errors import ConfigurationError, InputError, ModuleError, OutputError
from evflow.event import FLAG_DROPPED
from evflow.io.records import RecordInput, RecordOutput
from evflow.processing import chain as chain_module
from evflow.processing.console import ConsoleProgress
from evflow.processing.sequential import run_sequential
from evflow.processing.statistics import ModuleStatistics, merge_statistics
from helpers_processing import Exploder, ListSource, Recorder


def quiet(**kw: object) -> ProcessOptions:
    return ProcessOptions(quiet=True, **kw)  # type: ignore[arg-type]


def test_hooks_run_in_order_with_run_boundaries() -> None:
    log: list = []
    runs = [(0, 1), (0, 1), (0, 2), (1, 2)]
    path = Path([ListSource(n=4, runs=runs), Recorder("a", log), Recorder("b", log)])
    run_sequential(path, quiet())
    hooks = [(name, hook, d) for name, hook, d in log]
    assert hooks == [
        ("a", "initialize", None),
        ("b", "initialize", None),
        ("a", "begin_run", (0, 1)),
        ("b", "begin_run", (0, 1)),
        ("a", "event", 0),
        ("b", "event", 0),
        ("a", "event", 1),
        ("b", "event", 1),
        ("a", "end_run", (0, 1)),
        ("b", "end_run", (0, 1)),
        ("a", "begin_run", (0, 2)),
        ("b", "begin_run", (0, 2)),
        ("a", "event", 2),
        ("b", "event", 2),
        ("a", "end_run", (0, 2)),
        ("b", "end_run", (0, 2)),
        ("a", "begin_run", (1, 2)),
        ("b", "begin_run", (1, 2)),
        ("a", "event", 3),
        ("b", "event", 3),
        ("a", "end_run", (1, 2)),
        ("b", "end_run", (1, 2)),
        ("a", "terminate", None),
        ("b", "terminate", None),
    ]


def test_dropped_event_skips_the_rest_of_the_path_and_is_counted() -> None:
    log: list = []
    path = Path(
        [
            ListSource(n=10),
            Recorder("trigger", log, drop_if=lambda s: s.meta.uid % 3 == 0),
            Recorder("after", log),
        ]
    )
    summary = run_sequential(path, quiet())
    after = [d for name, hook, d in log if name == "after" and hook == "event"]
    assert after == [1, 2, 4, 5, 7, 8]
    assert (summary.events_read, summary.events_written, summary.events_dropped) == (10, 6, 4)
    stats = {s.module: s for s in summary.modules}
    assert stats["ListSource"].calls == 10
    assert (stats["trigger"].calls, stats["trigger"].dropped) == (10, 4)
    assert (stats["after"].calls, stats["after"].dropped) == (6, 0)


def test_dropped_event_gets_the_dropped_flag() -> None:
    seen: list[DataStore] = []

    class Keep(Module):
        def event(self, store: DataStore) -> bool | None:
            seen.append(store)
            return store.meta.uid != 1

    run_sequential(Path([ListSource(n=3), Keep()]), quiet())
    assert [bool(s.meta.flags & FLAG_DROPPED) for s in seen] == [False, True, False]


def test_max_events_stops_reading_the_source() -> None:
    source = ListSource(n=100)
    summary = run_sequential(Path([source]), quiet(max_events=7))
    assert summary.events_read == 7
    assert source.produced == 7  # the 8th event was never pulled from the source


def test_statistics_time_is_measured_per_module(monkeypatch: pytest.MonkeyPatch) -> None:
    # the chain's clock is injected: each Slow call takes exactly 2 ms of it (and 2 ms
    # of real time, which the run's wall clock sees), whatever the machine's load
    now = [0.0]
    monkeypatch.setattr(chain_module, "_clock", lambda: now[0])

    class Slow(Module):
        def event(self, store: DataStore) -> bool | None:
            time.sleep(0.002)
            now[0] += 0.002
            return None

    summary = run_sequential(Path([ListSource(n=20), Slow()]), quiet())
    slow = next(s for s in summary.modules if s.module == "Slow")
    assert slow.calls == 20
    assert slow.time_s == pytest.approx(0.04)
    assert slow.mean_ms == pytest.approx(2.0)
    assert summary.wall_s >= slow.time_s
    assert summary.rate_hz == pytest.approx(20 / summary.wall_s)


def test_persistent_store_is_shared_by_all_events_and_returned() -> None:
    class Count(Module):
        def event(self, store: DataStore) -> bool | None:
            store.persistent["n"] = store.persistent.get("n", 0) + store["x"]
            return None

    summary = run_sequential(Path([ListSource(n=5), Count()]), quiet())
    assert summary.persistent == {"n": 0 + 1 + 2 + 3 + 4}


def test_path_without_source_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="no source"):
        run_sequential(Path([Recorder("a", [])]), quiet())


def test_module_error_names_module_uid_and_keeps_user_traceback() -> None:
    path = Path([ListSource(n=10), Exploder(at=4)])
    with pytest.raises(ModuleError) as info:
        run_sequential(path, quiet())
    err = info.value
    assert (err.module, err.hook, err.uid) == ("Exploder", "event", 4)
    assert "module 'Exploder' raised in event() on event uid=4" in str(err)
    assert "ValueError: bad value in event 4" in str(err)
    assert isinstance(err.__cause__, ValueError)
    # the user's frames, not the processor's
    assert "fail_on_uid" in err.traceback_text
    assert "helpers_processing.py" in err.traceback_text
    assert "chain.py" not in err.traceback_text


def test_module_error_closes_writers_so_output_stays_readable(tmp_path) -> None:
    out = tmp_path / "out.evf"
    log: list = []
    path = Path(
        [ListSource(n=10), Exploder(at=6), Recorder("other", log), RecordOutput(file=str(out))]
    )
    with pytest.raises(ModuleError):
        run_sequential(path, quiet())
    # only writers are terminated after an error: the other module is left alone
    assert ("other", "terminate", None) not in log
    uids = [s.meta.uid for s in RecordInput(file=str(out)).events()]
    assert uids == [0, 1, 2, 3, 4, 5]


def test_error_in_initialize_names_the_hook_and_closes_earlier_writers() -> None:
    closed: list[str] = []

    class FakeWriter(RecordOutput):
        def terminate(self) -> None:
            closed.append(self.name)
            super().terminate()

    class Late(Exploder):
        pass

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path([ListSource(n=3), FakeWriter(file=f"{d}/x.evf"), Late(hook="initialize")])
        with pytest.raises(ModuleError, match=r"'Late' raised in initialize\(\).*calibration"):
            run_sequential(path, quiet())
    assert closed == ["FakeWriter"]


def test_error_in_begin_run_is_a_module_error() -> None:
    with pytest.raises(ModuleError, match=r"raised in begin_run\(\).*no conditions"):
        run_sequential(Path([ListSource(n=3), Exploder(hook="begin_run")]), quiet())


def test_source_raising_is_a_module_error_naming_the_source() -> None:
    class Broken(ListSource):
        def events(self, start: int = 0):  # type: ignore[no-untyped-def]
            yield from list(super().events(start))[:2]
            raise OSError("disk went away")

    with pytest.raises(ModuleError, match=r"'Broken' raised in events\(\).*disk went away"):
        run_sequential(Path([Broken(n=5)]), quiet())


def test_evflow_errors_from_modules_pass_through_unchanged(tmp_path) -> None:
    class Reader(Module):
        def event(self, store: DataStore) -> bool | None:
            raise InputError("calibration file 'calib.db' is corrupt")

    out = tmp_path / "o.evf"
    with pytest.raises(InputError, match=r"calib\.db"):
        run_sequential(Path([ListSource(n=3), Reader(), RecordOutput(file=str(out))]), quiet())
    assert out.exists()


def test_keyboard_interrupt_closes_writers_and_propagates(tmp_path) -> None:
    class Stop(Module):
        def event(self, store: DataStore) -> bool | None:
            if store.meta.uid == 5:
                raise KeyboardInterrupt
            return None

    out = tmp_path / "o.evf"
    with pytest.raises(KeyboardInterrupt):
        run_sequential(Path([ListSource(n=10), Stop(), RecordOutput(file=str(out))]), quiet())
    assert [s.meta.uid for s in RecordInput(file=str(out)).events()] == [0, 1, 2, 3, 4]


# --- statistics and summary ------------------------------------------------------------
def test_statistics_merge_like_histograms() -> None:
    a = ModuleStatistics("sel", calls=10, time_s=1.0, dropped=2, process="worker-0")
    b = ModuleStatistics("sel", calls=30, time_s=2.0, dropped=1, process="worker-1")
    total = sum([a, b])
    assert total == ModuleStatistics("sel", 40, 3.0, 3, "all")
    assert total.mean_ms == pytest.approx(75.0)
    assert ModuleStatistics("x").mean_ms == 0.0
    assert ModuleStatistics.from_dict(a.as_dict()) == a
    with pytest.raises(ConfigurationError, match=r"'sel'.*'other'"):
        a + ModuleStatistics("other")
    merged = merge_statistics([a, ModuleStatistics("out", 5), b])
    assert [m.module for m in merged] == ["sel", "out"]
    assert merged[0].calls == 40


def test_summary_renders_module_table() -> None:
    summary = run_sequential(
        Path([ListSource(n=10), Recorder("trigger[tight]", [], drop_if=lambda s: s.meta.uid < 4)]),
        quiet(),
    )
    text = str(summary)
    assert "10 read, 6 written, 4 dropped" in text
    assert "Module statistics" in text
    for word in ("ListSource", "trigger[tight]", "Calls", "Time/call (ms)"):
        assert word in text


def test_summary_shows_a_column_per_process() -> None:
    rows = (
        ModuleStatistics("in", 100, 0.1, 0, "input"),
        ModuleStatistics("sel", 60, 0.6, 5, "worker-0"),
        ModuleStatistics("sel", 40, 0.4, 3, "worker-1"),
    )
    text = str(RunSummary(events_read=100, events_written=92, workers=2, modules=rows))
    assert "worker-0" in text and "worker-1" in text and "input" in text
    assert "per-process columns: calls" in text
    row = next(line for line in text.splitlines() if line.startswith("│ sel"))
    assert [c.strip() for c in row.split("│")[1:-1]] == [
        "sel",
        "100",
        "8",
        "1.000",
        "10.0000",
        "90.9%",
        "",
        "60",
        "40",
    ]
    assert "2 worker(s)" in text


# --- progress ----------------------------------------------------------------------------
def test_progress_bar_shows_counts_rate_and_eta() -> None:
    buf = io.StringIO()
    progress = ConsoleProgress(total=100, enabled=True, file=buf).start()
    progress.update(50)
    progress.stop(100)
    text = buf.getvalue()
    assert "100/100" in text
    assert "events/s" in text
    assert "ETA" in text


def test_progress_bar_disabled_costs_nothing_and_prints_nothing() -> None:
    buf = io.StringIO()
    progress = ConsoleProgress(total=None, enabled=False, file=buf).start()
    assert not progress.due(time.monotonic())
    progress.update(5)
    progress.stop(5)
    assert buf.getvalue() == ""


def test_progress_redraws_at_most_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    updates: list[int] = []
    original = ConsoleProgress.update

    def counting(self: ConsoleProgress, done: int, now: float | None = None) -> None:
        updates.append(done)
        original(self, done, now)

    monkeypatch.setattr(ConsoleProgress, "update", counting)
    monkeypatch.setattr(sys, "stderr", io.StringIO())

    class Slowish(Module):
        def event(self, store: DataStore) -> bool | None:
            time.sleep(0.0002)
            return None

    summary = run_sequential(
        Path([ListSource(n=1500), Slowish()]),
        ProcessOptions(progress=True, progress_interval_s=0.05),
    )
    # at most one redraw per interval, plus the final one
    assert 2 <= len(updates) <= summary.wall_s / 0.05 + 2
    assert updates[-1] == 1500


def test_progress_is_off_when_not_a_terminal_or_quiet() -> None:
    assert not ProcessOptions().show_progress(is_tty=False)
    assert ProcessOptions().show_progress(is_tty=True)
    assert not ProcessOptions(quiet=True).show_progress(is_tty=True)
    assert not ProcessOptions(progress=False).show_progress(is_tty=True)
    assert ProcessOptions(progress=True).show_progress(is_tty=False)


# --- evflow.process ----------------------------------------------------------------------
def test_process_prints_summary_unless_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    summary = evflow.process(Path([ListSource(n=4)]))
    assert isinstance(summary, RunSummary)
    assert "4 read, 4 written, 0 dropped" in capsys.readouterr().out
    evflow.process(Path([ListSource(n=4, name="again")]), quiet=True)
    assert capsys.readouterr().out == ""


def test_process_refuses_unknown_options_and_bad_values() -> None:
    path = Path([ListSource(n=1)])
    with pytest.raises(ConfigurationError, match="unknown option 'max_event'"):
        evflow.process(path, max_event=3)
    with pytest.raises(ConfigurationError, match="max_events must be an integer >= 0"):
        evflow.process(path, max_events=-1)
    with pytest.raises(ConfigurationError, match="workers"):
        evflow.process(path, workers="two")
    with pytest.raises(ConfigurationError, match="takes a Path"):
        evflow.process([ListSource(n=1)])  # type: ignore[arg-type]


def test_process_without_parallel_support_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "evflow.processing.parallel", None)
    with pytest.raises(ConfigurationError, match=r"parallel processing .* not available"):
        evflow.process(Path([ListSource(n=1)]), workers=2, quiet=True)


def test_output_option_appends_a_record_writer(tmp_path) -> None:
    out = tmp_path / "sel.evf"
    path = Path([ListSource(n=6), Recorder("odd", [], drop_if=lambda s: s.meta.uid % 2 == 0)])
    summary = evflow.process(path, output=str(out), quiet=True)
    assert [s.meta.uid for s in RecordInput(file=str(out)).events()] == [1, 3, 5]
    assert summary.outputs == (str(out),)
    assert len(path) == 2  # the user's path is not changed


def test_unwritable_output_is_one_clear_error(tmp_path) -> None:
    path = Path([ListSource(n=1)])
    with pytest.raises(OutputError, match=r"directory .*nowhere.* does not exist"):
        evflow.process(path, output=str(tmp_path / "nowhere" / "x.evf"), quiet=True)
    with pytest.raises(OutputError, match="is a directory"):
        evflow.process(path, output=str(tmp_path), quiet=True)


# --- signals -----------------------------------------------------------------------------
class SignalSelf(Module):
    """Sends itself ``times`` signals while processing event uid ``at``."""

    def __init__(self, at: int, times: int, signum: int = 2) -> None:
        super().__init__()
        self.at, self.times, self.signum = at, times, signum

    def event(self, store: DataStore) -> bool | None:
        import os

        if store.meta.uid == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)
                time.sleep(0.01)  # let the handler run between the two
        return None


def test_first_sigint_finishes_the_event_and_ends_the_run_cleanly(tmp_path, capsys) -> None:
    import signal

    out = tmp_path / "o.evf"
    log: list = []
    before = signal.getsignal(signal.SIGINT)
    path = Path([ListSource(n=50), SignalSelf(at=5, times=1), Recorder("r", log)])
    with pytest.raises(KeyboardInterrupt):
        evflow.process(path, output=str(out))
    assert [s.meta.uid for s in RecordInput(file=str(out)).events()] == list(range(6))
    assert ("r", "end_run", (0, 0)) in log and ("r", "terminate", None) in log
    assert (
        "6 read, 6 written" in capsys.readouterr().out and signal.getsignal(signal.SIGINT) is before
    )


def test_second_sigint_stops_at_once_but_closes_writers(tmp_path) -> None:
    out = tmp_path / "o.evf"
    log: list = []
    path = Path([ListSource(n=50), Recorder("r", log), SignalSelf(at=5, times=2)])
    with pytest.raises(KeyboardInterrupt):
        evflow.process(path, output=str(out), quiet=True)
    assert [s.meta.uid for s in RecordInput(file=str(out)).events()] == list(range(5))
    assert ("r", "terminate", None) not in log


def test_sigterm_ends_the_run_cleanly_with_exit_143(tmp_path) -> None:
    import os
    import signal
    import subprocess
    import textwrap

    marker, out = tmp_path / "marker", tmp_path / "o.evf"
    steer = tmp_path / "s.py"
    steer.write_text(
        textwrap.dedent(
            f"""
            import time, evflow
            from evflow.io.generators import ToyGenerator
            class Slow(evflow.Module):
                def event(self, store):
                    if store.meta.uid == 10:
                        open({str(marker)!r}, "w").close()
                    time.sleep(0.005)
            evflow.process(evflow.Path([ToyGenerator(n_events=100000), Slow()]))
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "evflow", "run", str(steer), "-o", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "no marker"
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr
    assert "[interrupted]" in stdout and "Traceback" not in stderr
    uids = [s.meta.uid for s in RecordInput(file=str(out)).events()]
    assert len(uids) > 10 and uids == list(range(len(uids)))

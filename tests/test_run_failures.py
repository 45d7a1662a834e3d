"""Failures a user of ``evflow run`` hits (issue 10, items 1-5 and the smaller ones):
quarantined events and columnar outputs, exit codes, hung events and Ctrl-C, the
statistics of killed workers, the command line, a full disk, Ctrl-C while starting."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evflow import DataStore, Module
from evflow.cli import main
from evflow.event import FLAG_QUARANTINED
from evflow.processing.options import DEFAULT_EVENT_TIMEOUT_S, ProcessOptions
from evflow.processing.parallel.input.checkpoint import CheckpointFile, CheckpointWriter
from evflow.processing.statistics import ModuleStatistics
from evflow.processing.summary import RunSummary

SRC = Path(__file__).resolve().parents[1] / "src"

#: a module that fails on uid 7 every time, after a module-added object on the others
BURN = """\
import evflow
import numpy as np
from evflow.io.generators import ToyGenerator

class Burn(evflow.Module):
    parallel = True
    def event(self, store):
        if store.meta.uid == 7:
            raise ValueError("bad calibration for uid 7")
        store["burn_trace"] = np.arange(3, dtype=np.float64)

class Flaky(evflow.Module):
    parallel = True
    def event(self, store):
        if store.meta.uid == 11:
            {}["no-such-constant"]

evflow.process(evflow.Path([ToyGenerator(n_events=30, payload_bytes=16), Burn(), Flaky()]))
"""

#: uid 5 hangs (after creating the file $EVFLOW_TEST_MARK); the others take 2 ms;
#: argv[1]: the stop grace (s)
HANG = """\
import os, sys, time
import evflow
from evflow.io.generators import ToyGenerator

class Hang(evflow.Module):
    parallel = True
    def event(self, store):
        if store.meta.uid == 5:
            open(os.environ.get("EVFLOW_TEST_MARK", os.devnull), "w").close()
            time.sleep(1000)
        time.sleep(0.002)

extra = {"stop_grace_s": float(sys.argv[1])} if len(sys.argv) > 1 else {}
path = evflow.Path([ToyGenerator(n_events=400, payload_bytes=16), Hang()])
evflow.process(path, extra=extra)
"""

#: 10 ms per event: long enough to send a signal into ($EVFLOW_TEST_MARK: running)
SLOW = """\
import os, time
import evflow
from evflow.io.generators import ToyGenerator

class Slow(evflow.Module):
    parallel = True
    def event(self, store):
        if store.meta.uid == 20:
            open(os.environ.get("EVFLOW_TEST_MARK", os.devnull), "w").close()
        time.sleep(0.01)

evflow.process(evflow.Path([ToyGenerator(n_events=400, payload_bytes=16), Slow()]))
"""


def steering(tmp_path: Path, text: str, name: str = "steer.py") -> str:
    file = tmp_path / name
    file.write_text(textwrap.dedent(text))
    return str(file)


def run_cli(
    *args: str, timeout_s: float = 90, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evflow", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


def start_cli(
    *args: str, ignore_sigint: bool = False, mark: Path | None = None
) -> subprocess.Popen[str]:
    """A run in its own process group (so a stray child never outlives the test);
    ``mark``: the file its steering creates when it is where the test wants it."""
    handler = signal.SIG_IGN if ignore_sigint else signal.SIG_DFL
    env = {**os.environ, "EVFLOW_TEST_MARK": str(mark)} if mark is not None else None

    def child() -> None:
        os.setpgrp()
        signal.signal(signal.SIGINT, handler)  # pytest in the background may ignore it

    return subprocess.Popen(
        [sys.executable, "-m", "evflow", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=child,
        env=env,
    )


def wait_for(mark: Path, proc: subprocess.Popen[str], timeout_s: float = 60) -> None:
    """Until the run created ``mark`` (a loaded machine may take long to start it)."""
    deadline = time.monotonic() + timeout_s
    while not mark.exists():
        assert proc.poll() is None, "the run ended before it got there"
        assert time.monotonic() < deadline, f"the run did not get there in {timeout_s} s"
        time.sleep(0.02)


@pytest.fixture
def cli() -> Iterator[Any]:
    """``cli(*args)`` starts a run; every run still going at the end is killed and reaped
    (a failed assertion must not leave processes behind)."""
    started: list[subprocess.Popen[str]] = []

    def start(
        *args: str, ignore_sigint: bool = False, mark: Path | None = None
    ) -> subprocess.Popen[str]:
        proc = start_cli(*args, ignore_sigint=ignore_sigint, mark=mark)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:  # (an ended, reaped run's pid may belong to another now)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def finish(proc: subprocess.Popen[str], timeout_s: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the run did not end within {timeout_s} s: {err[-2000:]}")
    return proc.returncode, out, err


def calls_of(table_text: str, module: str) -> int:
    """The Calls column of ``module``'s row in a rendered statistics table."""
    for line in table_text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells and cells[0] == module:
            return int(cells[1].replace(",", ""))
    raise AssertionError(f"no row for {module!r} in:\n{table_text}")


# --- 1. a columnar (ROOT) output and a quarantined event ---------------------------------
def test_root_output_with_a_quarantined_event_completes_and_keeps_it_beside(
    tmp_path: Path,
) -> None:
    import uproot

    from evflow.io.records import RecordInput

    out = tmp_path / "out.root"
    result = run_cli("run", steering(tmp_path, BURN), "-p", "2", "-o", str(out))
    assert result.returncode == 3, result.stderr
    quarantine = Path(f"{out}.quarantine.evr")
    assert f"quarantined events written to {quarantine}" in result.stdout
    with uproot.open(out) as f:  # the run completed: a whole TTree without uid 7
        tree = f["events"]
        uids = sorted(tree["evflow_uid"].array(library="np").tolist())
        assert "burn_trace" in tree
    assert uids == [u for u in range(30) if u not in (7, 11)]
    raw = list(RecordInput(file=str(quarantine)).events())
    assert sorted(s.meta.uid for s in raw) == [7, 11]
    assert all(s.meta.flags & FLAG_QUARANTINED for s in raw)


def test_no_quarantine_file_is_left_when_nothing_was_quarantined(tmp_path: Path) -> None:
    file = steering(tmp_path, BURN.replace("== 7", "== -1").replace("== 11", "== -1"))
    out = tmp_path / "out.root"
    result = run_cli("run", file, "-p", "2", "-q", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.exists() and not Path(f"{out}.quarantine.evr").exists()


# --- 2. failures are never silent; exit codes ------------------------------------------
def test_quarantine_exits_3_and_names_every_failing_module_even_with_quiet(
    tmp_path: Path,
) -> None:
    result = run_cli("run", steering(tmp_path, BURN), "-p", "2", "-q")
    assert result.returncode == 3, result.stderr
    assert result.stdout == ""
    err = result.stderr
    # the first traceback of each distinct failure, once
    assert err.count("Traceback (most recent call last)") == 2
    assert err.count('raise ValueError("bad calibration for uid 7")') == 1
    assert err.count('{}["no-such-constant"]') == 1
    lines = [line for line in err.splitlines() if line.startswith("evflow: module")]
    assert len(lines) == 2
    burn = next(line for line in lines if "'Burn'" in line)
    assert "ValueError" in burn and "uid 7;" in burn and "3 failed attempts" in burn
    assert "1 quarantined" in burn and "bad calibration for uid 7" in burn
    flaky = next(line for line in lines if "'Flaky'" in line)
    assert "KeyError" in flaky and "uid 11;" in flaky
    assert err.strip().splitlines()[-1].startswith("evflow: error: 2 events failed")


def test_sequential_and_parallel_runs_exit_alike_for_a_failing_event(tmp_path: Path) -> None:
    file = steering(tmp_path, BURN)
    sequential = run_cli("run", file, "-q")
    parallel = run_cli("run", file, "-q", "-p", "2")
    assert sequential.returncode == parallel.returncode == 3
    assert "module 'Burn' raised in event() on event uid=7" in sequential.stderr


def test_allow_quarantine_exits_0_but_still_names_the_failures(tmp_path: Path) -> None:
    result = run_cli("run", steering(tmp_path, BURN), "-p", "2", "-q", "--allow-quarantine")
    assert result.returncode == 0, result.stderr
    assert "evflow: module 'Burn' failed: ValueError" in result.stderr
    assert "error" not in result.stderr


def test_help_documents_the_exit_codes_and_the_new_options(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "3 events failed in a module" in text
    assert "--allow-quarantine" in text and "--event-timeout S" in text
    assert "default: 300; 0: no limit" in text


# --- 3. hung events, event timeout, Ctrl-C ------------------------------------------------
def test_default_event_timeout_and_zero_for_no_limit() -> None:
    assert DEFAULT_EVENT_TIMEOUT_S == 300.0
    assert ProcessOptions().effective_event_timeout_s() == DEFAULT_EVENT_TIMEOUT_S
    assert ProcessOptions(event_timeout_s=0).effective_event_timeout_s() is None
    assert ProcessOptions(event_timeout_s=2.5).effective_event_timeout_s() == 2.5


def test_event_timeout_quarantines_a_hung_event_and_killed_workers_still_count(
    tmp_path: Path,
) -> None:
    file = steering(tmp_path, HANG)
    result = run_cli("run", file, "-p", "2", "--event-timeout", "1")
    assert result.returncode == 3, result.stderr
    assert "400 read, 399 written, 0 dropped, 1 quarantined" in result.stdout
    assert "no result within event_timeout_s=1 s" in result.stderr
    assert "uid 5" in result.stderr
    # item 4: the workers killed for the timeout count their calls too
    assert calls_of(result.stdout, "Hang") >= 399
    assert "killed before they reported: worker-" in result.stdout


def test_first_ctrl_c_during_a_hang_says_what_it_waits_for_and_ends_in_time(
    tmp_path: Path, cli: Any
) -> None:
    mark = tmp_path / "hung"
    proc = cli("run", steering(tmp_path, HANG), "-p", "2", "--", "2", mark=mark)
    wait_for(mark, proc)  # uid 5 hangs (the default timeout is 300 s) ...
    # ... and the other worker goes on with the rest: a pace, not a synchronisation (the
    # assertions hold whatever it wrote; its events are drained after the Ctrl-C)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    # in time: after the stop grace (2 s) and the abort grace (5 s), not the hung event's
    # timeout (300 s): finish() fails a run still going after 60 s
    code, _, err = finish(proc)
    assert code == 130, err
    # (the hung worker; the other may still be busy on a loaded machine)
    assert re.search(r"evflow: stopping \(Ctrl-C\): .*waiting up to 2 s .*[12] busy worker", err)
    summary = re.search(r"evflow: (\d+) read, (\d+) written", err)
    assert summary is not None, err
    read, written = int(summary[1]), int(summary[2])
    assert read >= written > 0
    assert "[interrupted]" in err


def test_parallel_run_keeps_an_ignored_sigint_ignored(tmp_path: Path, cli: Any) -> None:
    mark = tmp_path / "running"
    proc = cli("run", steering(tmp_path, SLOW), "-p", "2", ignore_sigint=True, mark=mark)
    wait_for(mark, proc)
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc)
    assert code == 0, err
    assert "400 read, 400 written" in out and "interrupted" not in out + err


# --- 4. the statistics table with many processes -----------------------------------------
def test_statistics_table_folds_the_columns_of_many_processes() -> None:
    rows = [ModuleStatistics("Reco", 10 + i, 0.01, 0, f"worker-{i}") for i in range(40)]
    killed = tuple(f"worker-{i}" for i in range(30))
    summary = RunSummary(
        events_read=1180,
        events_written=1180,
        workers=40,
        modules=tuple(rows),
        killed_workers=killed,
    )
    text = str(summary)
    assert "killed before they reported: worker-0, " in text and "and 22 more" in text
    width = max(len(line) for line in text.splitlines())
    assert width < 160, text
    assert "40 processes: per-process columns folded" in text
    cells = next(line for line in text.splitlines() if line.lstrip("│┃ ").startswith("Reco"))
    assert re.search(r"1,180 .* 40 .* 10 .* 49", cells), cells


# --- 5. the command line ---------------------------------------------------------------------
def test_steering_arguments_after_options_and_double_dash(tmp_path: Path, capsys) -> None:
    file = steering(
        tmp_path,
        "import sys, evflow\nfrom evflow.io.generators import ToyGenerator\n"
        "assert sys.argv[1:] == ['--outdir', 'D', '-n', '2'], sys.argv\n"
        "evflow.process(evflow.Path([ToyGenerator(n_events=6)]))\n",
    )
    out = tmp_path / "x.evr"
    assert main(["run", file, "-o", str(out), "-q", "--", "--outdir", "D", "-n", "2"]) == 0
    assert out.exists()
    assert main(["run", "-q", "--", file, "--outdir", "D", "-n", "2"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["run", "-q"])
    assert info.value.code == 2
    assert "the following arguments are required: STEERING.py" in capsys.readouterr().err


class PassThrough(Module):
    parallel = True

    def event(self, store: DataStore) -> None:
        return None


class Nap(Module):
    parallel = True

    def event(self, store: DataStore) -> None:
        time.sleep(0.001)


def test_many_workers_per_core_get_a_warning(tmp_path: Path, monkeypatch, capsys) -> None:
    import evflow
    from evflow.io.generators import ToyGenerator

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    path = evflow.Path([ToyGenerator(n_events=20, payload_bytes=16), PassThrough()])
    summary = evflow.process(path, workers=5, quiet=True)
    assert summary.events_written == 20
    err = capsys.readouterr().err
    assert "evflow: warning: 5 workers on 1 core (more than 4 per core)" in err


# --- smaller ones -------------------------------------------------------------------------------
def test_restarted_input_checkpoints_at_its_first_progress(tmp_path: Path) -> None:
    now = [0.0]
    ckpt = CheckpointFile(str(tmp_path / "out.evr.ckpt"))
    writer = CheckpointWriter(
        ckpt, "run", interval_s=2.0, clock=lambda: now[0], first_interval_s=0.1, start_position=40
    )
    now[0] = 0.15
    assert not writer.maybe_write(40)  # where it started: nothing new
    now[0] = 0.3
    assert writer.maybe_write(52)  # soon after the restart, not 2 s later
    loaded = ckpt.load()
    assert loaded is not None and loaded.position == 52
    now[0] = 0.5
    assert not writer.maybe_write(60)  # then the usual interval
    now[0] = 2.4
    assert writer.maybe_write(60)


def test_ctrl_c_while_the_package_imports_is_one_line(tmp_path: Path) -> None:
    # a stdlib module evflow imports, shadowed: the interrupt arrives mid-import
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "contextvars.py").write_text("raise KeyboardInterrupt\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(SRC)])}
    result = run_cli("--version", env=env)
    assert result.returncode == 130
    assert result.stderr == "evflow: interrupted\n"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 kB tmpfs: writes beyond it fail with ENOSPC (needs root and mount)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "evflow-test-disk", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_full_disk_is_one_line(tmp_path: Path, small_disk: Path, workers: str) -> None:
    file = steering(
        tmp_path,
        "import evflow\nfrom evflow.io.generators import ToyGenerator\n"
        "class Pass(evflow.Module):\n    parallel = True\n"
        "    def event(self, store):\n        pass\n"
        "path = evflow.Path([ToyGenerator(n_events=4000, payload_bytes=1000), Pass()])\n"
        "evflow.process(path)\n",
    )
    out = small_disk / "o.evr"
    result = run_cli("run", file, "-q", "-p", workers, "-o", str(out))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"evflow: error: cannot write record file '{out}'")
    assert "No space left on device" in lines[0]


def test_a_restarted_input_checkpoints_soon_not_a_whole_interval_later(tmp_path: Path) -> None:
    import threading

    import psutil

    import evflow
    from evflow.io import ToyGenerator
    from evflow.io.records import RecordOutput

    out = tmp_path / "r.evr"
    ckpt = CheckpointFile(f"{out}.ckpt")
    positions: list[int] = []  # the checkpoint's position at each kill of the input

    def kill_input() -> None:
        cp = ckpt.load()
        positions.append(cp.position if cp is not None else -1)
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.name() == "input":
                    p.send_signal(signal.SIGKILL)

    def killer() -> None:
        deadline = time.monotonic() + 30
        while not Path(f"{out}.ckpt").exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # the first checkpoint comes after the 2 s interval
        kill_input()
        # the restarted input makes progress (events written after the kill), then,
        # well within the 2 s interval, only a checkpoint soon after the restart lets
        # this second kill keep the restarted input's work
        size = out.stat().st_size
        while out.stat().st_size < size + 60_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the thing under test: a second kill well within the 2 s interval
        kill_input()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    n = 8000  # ~4 s of work on 2 workers
    path = evflow.Path(
        [
            ToyGenerator(n_events=n, payload_bytes=200),
            Nap(),  # sleeps: the run's length does not grow with the machine's load
            RecordOutput(file=str(out)),
        ]
    )
    summary = evflow.process(path, workers=2, quiet=True)
    thread.join(timeout=30)
    assert summary.counters["input restarts"] == 2
    assert summary.events_written == n
    first, second = positions
    assert 0 <= first < second < n, positions


def test_failure_lines_say_when_every_failed_event_was_retried_successfully() -> None:
    import io

    from evflow.processing.failures import FailureLog, groups_from, report_failures

    log = FailureLog()
    log.add("Calib", "KeyError", "'x'", 3, "Traceback (most recent call last):\n  boom\n")
    log.add("Calib", "KeyError", "'x'", 3, "Traceback (most recent call last):\n  again\n")
    log.add("Calib", "KeyError", "'x'", 9, "")
    groups = groups_from(log.as_list())
    assert groups_from([["garbage"], 7, ["a", "b", "c", "d", "many", []]]) == ()
    stream = io.StringIO()
    report_failures(groups, (), stream)
    text = stream.getvalue()
    assert text.count("Traceback") == 1 and "boom" in text and "again" not in text
    assert text.splitlines()[-1] == (
        "evflow: module 'Calib' failed: KeyError on 2 events (uids 3, 9; 3 failed attempts; "
        "all retried successfully): 'x'"
    )
    summary = RunSummary(events_read=10, events_written=10, workers=2, failures=groups)
    assert not summary.events_failed  # retried successfully: exit code 0
    assert RunSummary(events_quarantined=1).events_failed
    assert not RunSummary(events_quarantined=1, allow_quarantine=True).events_failed


def test_sequential_first_ctrl_c_during_a_hang_says_so_and_the_second_stops(
    tmp_path: Path, cli: Any
) -> None:
    import select

    mark = tmp_path / "hung"
    proc = cli("run", steering(tmp_path, HANG), "-q", mark=mark)
    wait_for(mark, proc)  # at uid 5, hung (the mark is written inside its event())
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + 60
    while "evflow: stopping (Ctrl-C)" not in seen and time.monotonic() < deadline:
        if select.select([proc.stderr], [], [], 0.1)[0]:
            seen += os.read(proc.stderr.fileno(), 4096).decode()
    assert "evflow: stopping (Ctrl-C): the current event finishes" in seen
    proc.send_signal(signal.SIGINT)
    code, _, err = finish(proc)
    assert code == 130
    assert "Traceback" not in seen + err


@pytest.mark.parametrize("workers", ["0", "2"])
def test_allow_quarantine_gives_sequential_and_parallel_runs_the_same_outcome(
    tmp_path: Path, workers: str
) -> None:
    import uproot

    from evflow.io.records import RecordInput

    out = tmp_path / "out.root"
    file = steering(tmp_path, BURN)
    result = run_cli("run", file, "-p", workers, "-q", "-o", str(out), "--allow-quarantine")
    assert result.returncode == 0, result.stderr
    assert "evflow: module 'Burn' failed: ValueError on 1 event (uid 7;" in result.stderr
    with uproot.open(out) as f:
        uids = sorted(f["events"]["evflow_uid"].array(library="np").tolist())
    assert uids == [u for u in range(30) if u not in (7, 11)]
    raw = list(RecordInput(file=f"{out}.quarantine.evr").events())
    assert sorted(s.meta.uid for s in raw) == [7, 11]
    assert all(s.meta.flags & FLAG_QUARANTINED for s in raw)
    assert all("raised in event()" in str(s["evflow_quarantine_reason"]) for s in raw)


class AlwaysFails(Module):
    def event(self, store: DataStore) -> None:
        raise RuntimeError(f"no luck on {store.meta.uid}")


def test_sequential_allow_quarantine_stops_past_max_quarantined(tmp_path: Path) -> None:
    import evflow
    from evflow.errors import ModuleError
    from evflow.io.generators import ToyGenerator

    out = tmp_path / "q.evr"
    path = evflow.Path([ToyGenerator(n_events=10), AlwaysFails()])
    summary = evflow.process(path, quiet=True, allow_quarantine=True, output=str(out))
    assert (summary.events_read, summary.events_written, summary.events_quarantined) == (10, 0, 10)
    assert [u for u, _ in summary.quarantined] == list(range(10))
    assert not summary.events_failed
    from evflow.io.records import RecordInput

    raw = list(RecordInput(file=str(out)).events())  # written flagged, in the output itself
    assert [s.meta.uid for s in raw] == list(range(10))
    assert all(s.meta.flags & FLAG_QUARANTINED for s in raw)
    with pytest.raises(ModuleError, match="no luck on 3"):
        evflow.process(path, quiet=True, allow_quarantine=True, extra={"max_quarantined": 3})

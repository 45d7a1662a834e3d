"""``evflow run -p N`` against faults at its start: a zygote SIGKILLed during start-up
(or later) is replaced and the run completes with every event once; ``--resume`` of a
run killed before its first checkpoint and its first write starts from the beginning
and says so in one line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from evflow.io.records import RecordReader

STEERING = """
import evflow
from evflow.io import BusyWork, ToyGenerator
evflow.process(evflow.Path([ToyGenerator(n_events={n}, payload_bytes=100), BusyWork(work_ms=1.0)]))
"""
N = 3000


def steering(tmp_path: Path, n: int = N) -> Path:
    path = tmp_path / "steer.py"
    path.write_text(STEERING.format(n=n))
    return path


def uids(file: Path) -> list[int]:
    with RecordReader(str(file)) as reader:
        return [rec.uid for rec in reader]


def run(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "evflow", "run", str(steering(tmp_path)), "--quiet", *args],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def kill_zygote_when(
    proc: subprocess.Popen[str], ready: Callable[[], bool], timeout_s: float = 60
) -> int:
    """SIGKILL the run's zygote (a child named evflow-zygote) once ``ready()``; its pid."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            try:
                for child in psutil.Process(proc.pid).children():
                    if child.name() == "evflow-zygote":
                        child.send_signal(signal.SIGKILL)
                        return child.pid
            except psutil.Error:
                pass
        time.sleep(0.001)
    raise AssertionError("the run's zygote was never seen")


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the run did not end; stderr:\n{err[-3000:]}") from None
    return proc.returncode, err


def test_a_zygote_killed_during_start_up_is_replaced_and_the_run_completes(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.evr"
    proc = run(tmp_path, "-p", "2", "-o", str(out))
    pid = kill_zygote_when(proc, lambda: True)  # as soon as it exists: roles are forking
    code, err = finish(proc)
    assert code == 0, err
    assert f"zygote pid {pid} died; a new zygote" in err
    assert "cannot spawn" not in err and "Traceback" not in err
    got = uids(out)
    assert sorted(got) == list(range(N))  # every event once


def test_a_zygote_killed_mid_run_is_replaced_and_every_event_is_written_once(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.evr"
    proc = run(tmp_path, "-p", "2", "-o", str(out))
    pid = kill_zygote_when(proc, lambda: out.exists() and out.stat().st_size > 16)
    code, err = finish(proc)
    assert code == 0, err
    assert f"zygote pid {pid} died; a new zygote" in err
    assert sorted(uids(out)) == list(range(N))


def test_resume_with_nothing_there_starts_from_the_beginning_in_one_line(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.evr"
    code, err = finish(run(tmp_path, "-p", "1", "-o", str(out), "--resume"))
    assert code == 0, err
    assert err.splitlines() == [
        f"evflow: nothing to resume (no checkpoint {out}.ckpt and no output {out}): "
        "starting from the beginning"
    ]
    assert sorted(uids(out)) == list(range(N))
    assert not Path(f"{out}.ckpt").exists()  # complete

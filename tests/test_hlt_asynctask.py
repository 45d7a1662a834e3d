"""Asynchronous tasks in isolated processes: results fed back, crashes survived."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import evflow
from evflow.errors import ConfigurationError
from evflow.event import DataStore
from evflow.hlt.asyncmodule import AsyncTaskModule
from evflow.hlt.asynctask import AsyncTask
from evflow.io import RecordOutput, RecordReader, ToyGenerator
from evflow.io.records import decode_record


def mean_task(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Segfaults on every 3rd call (call index 2, 5, 8, ...)."""
    if int(arrays["call"][0]) % 3 == 2:
        ctypes.string_at(0)  # SIGSEGV
    return {"mean": float(arrays["x"].mean()), "call": int(arrays["call"][0])}


def slow_task(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    time.sleep(float(arrays["sleep"][0]))
    return {"ok": 1}


def gate(path: Path) -> np.ndarray:
    """``path`` as the input of :func:`gated_task`."""
    return np.frombuffer(str(path).encode(), np.uint8)


def gated_task(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Returns once the file named by ``arrays["gate"]`` exists (the test opens it):
    busy for as long as the test needs. ``ok`` 0: it never opened (within 60 s)."""
    path = Path(arrays["gate"].tobytes().decode())
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            return {"ok": 0}
        time.sleep(0.01)
    return {"ok": 1}


def raising_task(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    raise RuntimeError("calibration diverged")


def hungry_task(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return {"big": np.ones(1 << 28)}  # 2 GB: beyond the memory limit


def test_results_come_back_and_submit_never_waits(tmp_path: Path) -> None:
    opened = tmp_path / "gate"
    task = AsyncTask(gated_task, policy="queue", queue_size=10, timeout_s=90)
    try:
        answers = [task.submit({"gate": gate(opened)}, tag=7) for _ in range(3)]
        # the caller went on while the task cannot finish (its gate is shut)
        assert answers == ["started", "queued", "queued"]
        assert task.busy and task.poll() == []
        opened.touch()
        results = task.wait(60)
    finally:
        task.close()
    assert [r.result for r in results] == [{"ok": 1}] * 3
    assert [r.tag for r in results] == [7, 7, 7]


def test_segfault_every_third_call_restarts_and_the_rest_come_back() -> None:
    task = AsyncTask(mean_task, policy="queue", queue_size=100, timeout_s=30)
    x = np.arange(1000, dtype=np.float64)
    try:
        for k in range(12):
            task.submit({"x": x + k, "call": np.array([k])}, tag=k)
        results = task.wait(60)
    finally:
        task.close()
    assert sorted(r.tag for r in results) == [k for k in range(12) if k % 3 != 2]
    assert all(r.result["mean"] == pytest.approx(499.5 + r.tag) for r in results)
    # restarted for the calls after each crash (none came after the last one)
    assert task.stats.failed == 4 and task.stats.restarts == 3 and task.stats.started == 4
    assert [f.tag for f in task.failures] == [2, 5, 8, 11]
    assert all(f.reason == "killed by SIGSEGV" for f in task.failures)


def test_exception_and_out_of_memory_are_reported() -> None:
    for func, text, kw in (
        (raising_task, "RuntimeError: calibration diverged", {}),
        (hungry_task, "MemoryError", {"memory_mb": 400}),
    ):
        task = AsyncTask(func, timeout_s=30, **kw)
        try:
            task.submit({"x": np.zeros(3)}, tag=1)
            assert task.wait(30) == []
            assert len(task.failures) == 1 and text in task.failures[0].reason
            task.func = mean_task  # a restarted task works again (a fresh fork)
            task.submit({"x": np.ones(3), "call": np.array([0])}, tag=2)
            (r,) = task.wait(30)
            assert r.result["mean"] == 1.0 and task.stats.restarts == 1
        finally:
            task.close()


def test_a_task_that_never_returns_times_out_and_restarts() -> None:
    # a time-out a loaded machine never reaches for a call that returns at once
    task = AsyncTask(slow_task, timeout_s=5, policy="queue")
    try:
        task.submit({"sleep": np.array([1000.0])}, tag=1)
        task.submit({"sleep": np.array([0.0])}, tag=2)
        results = task.wait(60)
    finally:
        task.close()
    assert [r.tag for r in results] == [2]
    assert task.stats.timeouts == 1 and task.failures[0].reason.startswith("timeout")


@pytest.mark.parametrize(
    ("policy", "answers", "done"),
    [
        ("skip", ["started", "skipped", "skipped", "skipped"], [0]),
        ("replace", ["started", "queued", "replaced", "replaced"], [0, 3]),
        ("queue", ["started", "queued", "queued", "skipped"], [0, 1, 2]),
    ],
)
def test_policies_when_busy(
    tmp_path: Path, policy: str, answers: list[str], done: list[int]
) -> None:
    opened = tmp_path / "gate"
    task = AsyncTask(gated_task, policy=policy, queue_size=2)
    try:
        # the first call is busy until the gate opens, the others return at once
        got = [task.submit({"gate": gate(opened if k == 0 else tmp_path)}, tag=k) for k in range(4)]
        opened.touch()
        results = task.wait(60)
    finally:
        task.close()
    assert got == answers
    assert [r.tag for r in results] == done


def test_bad_configuration() -> None:
    with pytest.raises(ConfigurationError, match="policy"):
        AsyncTask(mean_task, policy="drop")
    task = AsyncTask(mean_task, buffer_bytes=4096)
    try:
        with pytest.raises(ConfigurationError, match="does not fit"):
            task.submit({"x": np.zeros(10_000)})
    finally:
        task.close()


class Calibration(AsyncTaskModule):
    """Hands the values of every 50th event to the task; subtracts the mean it returns."""

    task = staticmethod(mean_task)

    def initialize(self) -> None:
        super().initialize()
        self.calls = 0
        self.buf: list[float] = []

    def inputs(self, store: DataStore) -> dict[str, np.ndarray] | None:
        self.buf.append(float(store["value"]))
        if len(self.buf) < 50:
            return None
        x, self.buf = np.array(self.buf), []
        self.calls += 1
        return {"x": x, "call": np.array([self.calls - 1])}

    def apply(self, store: DataStore, constants: dict[str, Any] | None) -> None:
        store["corrected"] = float(store["value"]) - (constants["mean"] if constants else 0.0)


@pytest.mark.parametrize("workers", [0, 2])
def test_module_feeds_back_and_survives_segfaults(tmp_path: Path, workers: int) -> None:
    n = 3000
    out = tmp_path / "out.evr"
    path = evflow.Path(
        [
            ToyGenerator(n_events=n, payload_bytes=16, work_ms=0.05),
            Calibration(policy="queue", queue_size=100),
            RecordOutput(file=str(out), fsync=False),
        ]
    )
    summary = evflow.process(path, workers=workers, quiet=True)
    assert summary.events_written == n  # the chain finished every event
    p = summary.persistent
    assert p["Calibration_failures"] >= 1 and p["Calibration_restarts"] >= 1
    assert p["Calibration_results"] >= 1
    with RecordReader(str(out)) as reader:
        stores = [decode_record(str(out), r) for r in reader]
    assert sorted(s.meta.uid for s in stores) == list(range(n))
    firsts = [s for s in stores if s.get("Calibration_first")]
    # every applied result is recorded once, on the first event it was applied to (a
    # result that came back after a process's last event is never applied)
    assert 1 <= len(firsts) <= p["Calibration_results"]
    for s in firsts:
        # applied to a later event than the one whose input produced it
        assert s["Calibration_from_event"] < s.meta.event
    assert any(s["Calibration_version"] > 0 and s["corrected"] != s["value"] for s in stores)

"""Shared-memory transport: the arena, its readers, and real parallel runs over it.

The runs check what a user relies on: the same events and content as the sequential
run, every uid exactly once when workers, the input or the output are SIGKILLed, a
full arena falling back to the sockets, and no segment left in /dev/shm (conftest).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path as FsPath
from typing import Any

import numpy as np
import pytest

import evflow
from evflow import DataStore, Module, Path
from evflow.errors import ConfigurationError, PeerLostError
from evflow.io import BusyWork, RecordOutput, RecordReader, ToyGenerator
from evflow.io.records import decode_record
from evflow.processing.options import ProcessOptions
from evflow.transport.paths import ipc_listening, runtime_base_dir
from evflow.transport.shm import RESERVE_STEP_B, ShmArena, ShmViews, segment_prefix
from test_chaos import WorkerKiller, _kill_role_when, assert_exactly_once

ARENA_B = RESERVE_STEP_B  # the smallest arena


# --- the arena and its readers ------------------------------------------------------------
def test_placed_frames_read_back_through_a_reader_without_a_copy() -> None:
    arena = ShmArena("s-read", ARENA_B)
    try:
        batch = arena.place([[b"header", np.arange(1000, dtype=np.float64)], [b"second"]])
        assert batch is not None
        frames = ShmViews("s-read").frames(batch.where)
        assert bytes(frames[0]) == b"header"
        assert np.array_equal(np.frombuffer(frames[1], dtype=np.float64), np.arange(1000))
        assert bytes(frames[2]) == b"second"
        assert frames[1].readonly  # readers map the segment read-only
        assert [len(e) for e in batch] == [2, 1]
        assert arena.events == 2
    finally:
        arena.close()


def test_an_extent_returns_to_the_arena_when_its_last_event_is_dropped() -> None:
    arena = ShmArena("s-free", ARENA_B)
    try:
        batch = arena.place([[b"a" * 100], [b"b" * 100]])
        # a 64-byte generation header and two 64-byte aligned frames
        assert batch is not None and arena.used_b == 64 + 2 * 128
        kept = batch[1]  # the ledger may keep one event of a batch
        del batch
        assert arena.used_b == 320
        del kept
        gc.collect()
        assert arena.used_b == 0
        again = arena.place([[b"c" * 10]])
        assert again is not None and again[0].offsets == [64]  # the freed space is reused
    finally:
        arena.close()


def test_freed_neighbours_merge_into_one_free_extent() -> None:
    arena = ShmArena("s-merge", ARENA_B)
    try:
        parts = [arena.allocate(1000) for _ in range(3)]
        del parts[0], parts[1]  # the first and the third
        assert len(arena._free.starts) == 2
        parts.clear()  # the middle one joins both
        assert arena._free.starts == [0] and arena._free.sizes == [ARENA_B]
    finally:
        arena.close()


def test_a_reader_sees_when_the_extent_of_a_message_was_freed_and_reused() -> None:
    arena = ShmArena("s-gen", ARENA_B)
    try:
        reader = ShmViews("s-gen")
        batch = arena.place([[b"first"]])
        assert batch is not None
        where = batch.where
        assert reader.current(where)
        del batch
        assert not reader.current(where)  # freed: its events were confirmed
        reused = arena.place([[b"second"]])
        assert reused is not None and reused.where["xh"] == where["xh"]
        assert not reader.current(where)  # reused: another generation
        assert reader.current(reused.where)
        with pytest.raises(ValueError, match="invalid shared-memory extent offset"):
            reader.current({**where, "xh": 3})
    finally:
        arena.close()


def test_a_resent_event_keeps_its_place_and_is_not_copied_again() -> None:
    arena = ShmArena("s-resend", ARENA_B)
    try:
        first = arena.place([[b"x" * 5000]])
        assert first is not None
        used = arena.used_b
        again = arena.place([first[0]])
        assert again is not None and again.where == first.where
        assert arena.used_b == used and arena.events == 1
    finally:
        arena.close()


def test_a_full_arena_says_so_instead_of_failing() -> None:
    arena = ShmArena("s-full", ARENA_B)
    try:
        held = arena.place([[bytes(ARENA_B - 64)]])
        assert held is not None
        assert arena.place([[bytes(128)]]) is None
        assert arena.full == 1
    finally:
        arena.close()


def test_closing_removes_the_segment_but_a_reader_keeps_its_mapping() -> None:
    arena = ShmArena("s-close", ARENA_B)
    batch = arena.place([[b"still readable"]])
    assert batch is not None
    frames = ShmViews("s-close").frames(batch.where)
    arena.close()
    assert not os.path.exists(arena.path)
    assert bytes(frames[0]) == b"still readable"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"x": "evflow-another-run-input-1"}, "not of this run"),
        ({"x": f"{segment_prefix('s-bad')}../../etc/passwd"}, "invalid shared-memory segment"),
        ({"x": 7}, "not of this run"),
        ({"xo": np.array([ARENA_B], dtype=np.uint64).tobytes()}, "beyond the end"),
        ({"xl": b""}, "offsets for 0 lengths"),
    ],
)
def test_a_bad_descriptor_is_a_value_error_naming_the_problem(
    change: dict[str, Any], error: str
) -> None:
    arena = ShmArena("s-bad", ARENA_B)
    try:
        batch = arena.place([[b"payload"]])
        assert batch is not None
        with pytest.raises(ValueError, match=error):
            ShmViews("s-bad").frames({**batch.where, **change})
    finally:
        arena.close()


def test_a_segment_removed_under_a_run_is_a_clear_error() -> None:
    arena = ShmArena("s-gone", ARENA_B)
    batch = arena.place([[b"payload"]])
    assert batch is not None
    where = batch.where
    arena.close()
    with pytest.raises(PeerLostError, match="was removed while the run used it"):
        ShmViews("s-gone").frames(where)


def test_an_arena_smaller_than_one_step_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="too small"):
        ShmArena("s-small", 1024)


def test_an_unknown_transport_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigurationError, match="option transport must be one of zmq, shm"):
        ProcessOptions(transport="udp")


# --- parallel runs over shared memory -----------------------------------------------------
class Scale(Module):
    """Reads the payload and adds a derived array: the worker re-encodes its events."""

    parallel = True

    def event(self, store: DataStore) -> bool:
        payload = store["payload"]
        store["scaled"] = payload[:1000].astype(np.float32) * 2.0
        return store.meta.uid % 7 != 3  # and drops some


def read(file: FsPath) -> dict[int, dict[str, Any]]:
    out = {}
    with RecordReader(str(file)) as reader:
        for record in reader:
            store = decode_record(str(file), record)
            out[store.meta.uid] = {
                k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in store.items()
            }
    return out


def large_path(out: FsPath, n: int, module: Module, payload: int = 150_000) -> Path:
    source = ToyGenerator(n_events=n, payload_bytes=payload, seed=3)
    return Path([source, module, RecordOutput(file=str(out))])


@pytest.mark.parametrize("module", [BusyWork, Scale], ids=["forwarded", "re-encoded"])
def test_shm_run_writes_the_same_events_and_content_as_sequential(
    tmp_path: FsPath, module: type[Module]
) -> None:
    seq = evflow.process(large_path(tmp_path / "seq.evr", 120, module()), quiet=True)
    par = evflow.process(
        large_path(tmp_path / "shm.evr", 120, module()), workers=2, quiet=True, transport="shm"
    )
    assert read(tmp_path / "shm.evr") == read(tmp_path / "seq.evr")
    assert par.events_written == seq.events_written > 0
    assert par.counters["events through shared memory"] == 120
    assert "batches not in shared memory (arena full)" not in par.counters


def test_ordered_shm_run_keeps_input_order(tmp_path: FsPath) -> None:
    out = tmp_path / "ordered.evr"
    evflow.process(
        large_path(out, 80, BusyWork(work_ms=0.2)),
        workers=2,
        quiet=True,
        transport="shm",
        ordered=True,
    )
    assert list(read(out)) == list(range(80))


def test_a_full_arena_sends_over_the_sockets_and_loses_nothing(tmp_path: FsPath) -> None:
    out = tmp_path / "full.evr"
    summary = evflow.process(
        large_path(out, 60, BusyWork(work_ms=1.0), payload=1_500_000),
        workers=2,
        quiet=True,
        transport="shm",
        event_buffer=12,
        extra={"shm_mb": 16},  # ~10 events of 1.5 MB fit
    )
    assert summary.counters["batches not in shared memory (arena full)"] > 0
    assert 0 < summary.counters["events through shared memory"] < 60
    assert_exactly_once(out, 60)
    seq = tmp_path / "seq.evr"
    evflow.process(large_path(seq, 60, BusyWork(), payload=1_500_000), quiet=True)
    assert read(out) == read(seq)


@pytest.mark.chaos
def test_killed_workers_lose_nothing_over_shared_memory(tmp_path: FsPath) -> None:
    out = tmp_path / "kill.evr"
    n = 1500
    killer = WorkerKiller(0.15, until=lambda: out.exists() and out.stat().st_size > 180_000_000)
    killer.start()
    try:
        summary = evflow.process(
            large_path(out, n, BusyWork(work_ms=2.0)),
            workers=3,
            quiet=True,
            transport="shm",
            extra={"max_restarts": 1000},
        )
    finally:
        killer.stop.set()
        killer.join(timeout=5)
    assert killer.kills >= 3, "the killer never got to kill"
    assert summary.counters["events lost"] == 0
    assert_exactly_once(out, n)


@pytest.mark.chaos
@pytest.mark.parametrize("role", ["input", "output"])
def test_a_killed_input_or_output_restarts_and_every_uid_is_written_once(
    tmp_path: FsPath, role: str
) -> None:
    out = tmp_path / f"{role}.evr"
    ckpt = FsPath(str(out) + ".ckpt")
    killer = _kill_role_when(
        role, lambda: ckpt.exists() and out.exists() and out.stat().st_size > 40_000_000
    )
    summary = evflow.process(
        large_path(out, 1000, BusyWork(work_ms=1.0)),
        workers=2,
        quiet=True,
        transport="shm",
        extra={"checkpoint_interval_s": 0.1},
    )
    killer.finish()
    assert summary.counters[f"{role} restarts"] == 1
    assert summary.counters["events lost"] == 0
    assert_exactly_once(out, 1000)


def test_cli_transport_shm_runs_a_steering_file(tmp_path: FsPath) -> None:
    steering = tmp_path / "steer.py"
    out = tmp_path / "cli.evr"
    steering.write_text(
        "import evflow\n"
        "from evflow.io import BusyWork, ToyGenerator\n"
        "path = evflow.Path([ToyGenerator(n_events=40, payload_bytes=200_000), BusyWork()])\n"
        "evflow.process(path)\n"
    )
    command = [sys.executable, "-m", "evflow", "run", str(steering), "-p", "2", "-o", str(out)]
    proc = subprocess.run(
        [*command, "--transport", "shm"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "events through shared memory" in proc.stdout + proc.stderr
    assert len(read(out)) == 40
    bad = subprocess.run(
        [sys.executable, "-m", "evflow", "run", str(steering), "--transport", "udp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "invalid choice: 'udp'" in bad.stderr


_KILL9_SHM_RUN = """
import sys, evflow
from evflow.io import BusyWork, ToyGenerator
path = evflow.Path([ToyGenerator(n_events=100_000, payload_bytes=200_000), BusyWork(work_ms=5)])
evflow.process(path, workers=2, quiet=True, transport="shm")
"""


def _segments() -> set[str]:
    """Path-run arenas (not the regions of device shm channels, ``evflow-dc-``, which
    other tests on the machine may make and remove meanwhile)."""
    return {
        n
        for n in os.listdir("/dev/shm")
        if n.startswith("evflow-") and not n.startswith("evflow-dc-")
    }


def _arena_in_use(names: set[str]) -> bool:
    """A segment among ``names`` holds data (the input placed events in it)."""
    for name in names:
        try:
            if os.stat(f"/dev/shm/{name}").st_blocks > 0:
                return True
        except FileNotFoundError:
            continue
    return False


def _run_alive(segments: set[str]) -> bool:
    """A process of a killed run still maps one of its ``segments`` or listens on a
    socket of a session under the (test's own) runtime directory."""
    if any(_mapped(name) for name in segments):
        return True
    for session in runtime_base_dir().iterdir():
        try:
            if any(ipc_listening(p) for p in session.iterdir() if p.is_socket()):
                return True
        except OSError:  # (not a directory, or gone meanwhile)
            continue
    return False


def _mapped(name: str) -> bool:
    """True while a running process maps /dev/shm/``name``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                if f"/dev/shm/{name}" in maps.read():
                    return True
        except OSError:
            continue
    return False


@pytest.mark.chaos
def test_the_segment_of_a_run_killed_with_kill_9_is_removed_by_the_next_run() -> None:
    before = _segments()
    proc = subprocess.Popen([sys.executable, "-c", _KILL9_SHM_RUN], start_new_session=True)
    try:
        # events in flight through the arena: its segment exists and holds data
        deadline = time.monotonic() + 60
        while not _arena_in_use(_segments() - before) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # parent, zygote and roles: nobody cleans up
        proc.wait(timeout=10)
    left = _segments() - before
    assert left, "the killed run never made its arena"
    # its roles die with their parent (PDEATHSIG), a moment later under load; until
    # then the run is not dead yet and nothing may remove its files. Wait for what the
    # next run's clean-up looks at: no process maps the segment and nothing listens on
    # the session's sockets (bounded; under load this took longer than a fixed wait)
    deadline = time.monotonic() + 90
    while _run_alive(left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _run_alive(left), "the killed run's roles outlived it by 90 s"
    path = Path([ToyGenerator(n_events=20, payload_bytes=100_000), BusyWork()])
    evflow.process(path, workers=1, quiet=True, transport="shm")
    assert not (_segments() & left), "the next run left the dead run's segment behind"

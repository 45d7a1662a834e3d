"""Durable checkpoints: atomic replace, version and crc checks, survival of kill -9."""

from __future__ import annotations

import json
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evflow.errors import CheckpointError, ConfigurationError
from evflow.processing.parallel.input.checkpoint import (
    Checkpoint,
    CheckpointFile,
    CheckpointWriter,
    decode,
    encode,
)

DATA = Path(__file__).parent / "data"


def test_write_then_load_round_trips(tmp_path: Path) -> None:
    f = CheckpointFile(tmp_path / "run.ckpt")
    assert f.load() is None
    f.write(Checkpoint("run-1", 42, {"read": 50, "written": 42}, 1.5))
    cp = f.load(run_id="run-1")
    assert cp == Checkpoint("run-1", 42, {"read": 50, "written": 42}, 1.5)
    assert [p.name for p in tmp_path.iterdir()] == ["run.ckpt"]  # no temp file left
    f.remove()
    assert f.load() is None


def test_old_version_fixture_still_loads() -> None:
    cp = CheckpointFile(DATA / "checkpoint_v1.json").load()
    assert cp is not None and cp.position == 1234 and cp.run_id == "fixture-v1"
    assert cp.counts == {"quarantined": 2, "read": 1500, "written": 1498}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not JSON"),
        (b'{"position": 3', "not JSON"),
        (b"[1, 2]", "not an evflow checkpoint"),
        (b'{"format": "evflow-checkpoint", "version": 99}', "version 99"),
    ],
)
def test_corrupt_files_give_one_clear_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.ckpt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as info:
        CheckpointFile(path).load()
    assert str(path) in str(info.value)


def test_a_changed_byte_fails_the_crc(tmp_path: Path) -> None:
    data = encode(Checkpoint("r", 1000, {"read": 1}))
    damaged = data.replace(b'"position":1000', b'"position":1900')
    with pytest.raises(CheckpointError, match="crc32"):
        decode(damaged)


def test_checkpoint_of_another_run_is_refused(tmp_path: Path) -> None:
    f = CheckpointFile(tmp_path / "c")
    f.write(Checkpoint("run-a", 1))
    with pytest.raises(CheckpointError, match="belongs to run 'run-a', not 'run-b'"):
        f.load(run_id="run-b")


def test_writer_writes_only_every_interval_and_when_position_moved(tmp_path: Path) -> None:
    now = [0.0]
    w = CheckpointWriter(CheckpointFile(tmp_path / "c"), "r", interval_s=2.0, clock=lambda: now[0])
    assert not w.maybe_write(5)
    now[0] = 2.1
    assert w.maybe_write(5, {"read": 9})
    now[0] = 4.5
    assert not w.maybe_write(5)  # time passed but nothing moved
    now[0] = 7.0
    assert w.maybe_write(8)
    assert w.writes == 2 and w.file.load().position == 8
    with pytest.raises(ConfigurationError):
        CheckpointWriter(w.file, "r", interval_s=0)


_CHILD = r"""
import os, sys, json
sys.path.insert(0, {src!r})
from evflow.processing.parallel.input.checkpoint import Checkpoint, CheckpointFile, encode
path, naive = sys.argv[1], sys.argv[2] == "naive"
f = CheckpointFile(path)
cp = f.load() if os.path.exists(path) else None
pos = cp.position if cp else 0
counts = {{f"counter_{{i}}": i for i in range(3000)}}  # a ~60 kB file: writes take a while
print("writing", flush=True)  # the parent kills only once the write loop runs
while True:
    pos += 1
    if naive:  # what not to do: overwrite in place
        data = encode(Checkpoint("kill9", pos, counts))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for i in range(0, len(data), 4096):
            os.write(fd, data[i:i + 4096]); os.fsync(fd)
        os.close(fd)
    else:
        f.write(Checkpoint("kill9", pos, counts))
"""


def _kill_during_writes(tmp_path: Path, mode: str, rounds: int) -> tuple[list[int], int]:
    """Kill a busy checkpoint writer ``rounds`` times; return loaded positions and tears."""
    src = str(Path(__file__).parents[1] / "src")
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(src=src))
    path = tmp_path / "kill9.ckpt"
    rng = random.Random(1234)
    positions, torn = [], 0
    for _ in range(rounds):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(path), mode], stdout=subprocess.PIPE
        )
        try:
            # interpreter start-up takes 30-150 ms on a loaded machine: wait for the
            # loop itself, then let it write for a random while before the kill
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 20)
            assert ready and proc.stdout.readline() == b"writing\n"
            time.sleep(0.05 + rng.random() * 0.1)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        try:
            cp = CheckpointFile(path).load()
            assert cp is not None
            positions.append(cp.position)
        except CheckpointError:
            torn += 1
            path.unlink()
    return positions, torn


def test_kill_9_during_writing_leaves_old_or_new_checkpoint_never_torn(tmp_path: Path) -> None:
    positions, torn = _kill_during_writes(tmp_path, "atomic", rounds=12)
    assert torn == 0
    assert positions == sorted(positions) and positions[-1] > positions[0]
    # the killed writers' temp files are cleaned up by the next writer
    f = CheckpointFile(tmp_path / "kill9.ckpt")
    f.remove_stale_temps()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py", "kill9.ckpt"]


def test_the_kill_9_test_can_fail_an_in_place_writer_tears(tmp_path: Path) -> None:
    _, torn = _kill_during_writes(tmp_path, "naive", rounds=8)
    assert torn >= 1


def test_fixture_is_canonical_json() -> None:
    body = json.loads((DATA / "checkpoint_v1.json").read_text())
    assert body["version"] == 1 and body["format"] == "evflow-checkpoint"

"""A durable checkpoint: where a restarted input (or ``evflow run --resume``) starts.

The checkpoint holds the ledger's ``checkpoint_position()`` (every source position
below it is confirmed written), the run id and a few counters. It is written atomically
(temp file, fsync, rename, fsync of the directory), so after a ``kill -9`` or a power
cut the file is the old checkpoint or the new one, never a torn mix. A crc32 over the
content catches a file damaged some other way.

File format (version 1): one JSON object
``{"format": "evflow-checkpoint", "version": 1, "run_id": str, "position": int,
"counts": {str: int}, "written_unix_s": float, "crc32": int}`` where ``crc32`` covers
the canonical JSON (sorted keys, no spaces) of every other field. An ``--ordered`` run
adds ``counts["seq"]``: the input sequence number of the event at ``position`` (a
restarted or resumed input numbers its events from there, as the output expects).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evflow.errors import CheckpointError, ConfigurationError, OutputError
from evflow.processing.parallel.notices import say

FORMAT = "evflow-checkpoint"
VERSION = 1


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Every source position below ``position`` is written; ``counts`` are run totals."""

    run_id: str
    position: int
    counts: Mapping[str, int] = field(default_factory=dict)
    written_unix_s: float = 0.0


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode(cp: Checkpoint) -> bytes:
    body: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "run_id": cp.run_id,
        "position": int(cp.position),
        "counts": {str(k): int(v) for k, v in cp.counts.items()},
        "written_unix_s": float(cp.written_unix_s),
    }
    body["crc32"] = zlib.crc32(_canonical(body))
    return _canonical(body) + b"\n"


def decode(data: bytes, where: str = "checkpoint") -> Checkpoint:
    """Parse a checkpoint; raise CheckpointError naming the problem."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{where} is not a valid checkpoint ({len(data)} bytes, not JSON: {exc}); "
            f"delete it to start the run from the beginning"
        ) from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not an evflow checkpoint (no format={FORMAT!r})")
    version = body.get("version")
    if version != VERSION:
        raise CheckpointError(
            f"{where} has checkpoint version {version!r}; this evflow reads version "
            f"{VERSION} (was it written by another evflow release?)"
        )
    crc = body.pop("crc32", None)
    if crc != zlib.crc32(_canonical(body)):
        raise CheckpointError(f"{where} fails its crc32 check (damaged file)")
    try:
        position = body["position"]
        run_id = body["run_id"]
        counts = body["counts"]
        if not (isinstance(position, int) and position >= 0 and isinstance(run_id, str)):
            raise TypeError("position must be an int >= 0 and run_id a string")
        if not isinstance(counts, dict) or not all(isinstance(v, int) for v in counts.values()):
            raise TypeError("counts must map names to ints")
        return Checkpoint(run_id, position, dict(counts), float(body["written_unix_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where} has a bad field: {exc}") from None


class CheckpointFile:
    """One checkpoint file on disk: ``write`` atomically, ``load`` with checks."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp.{os.getpid()}")

    def write(self, cp: Checkpoint) -> None:
        """Replace the file with ``cp``: temp + fsync + rename + fsync(dir)."""
        data = encode(cp)
        try:
            fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self._tmp, self.path)
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._tmp.unlink()
            raise OutputError(f"cannot write checkpoint {self.path}: {exc}") from None

    def load(self, run_id: str | None = None) -> Checkpoint | None:
        """The checkpoint, or None if there is no file. ``run_id`` given: it must match."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {self.path}: {exc}") from None
        cp = decode(data, where=f"checkpoint {self.path}")
        if run_id is not None and cp.run_id != run_id:
            raise CheckpointError(
                f"checkpoint {self.path} belongs to run {cp.run_id!r}, not {run_id!r}"
            )
        return cp

    def remove_stale_temps(self) -> int:
        """Delete temp files left by writers that were killed mid-write; return how many."""
        removed = 0
        for tmp in self.path.parent.glob(f".{self.path.name}.tmp.*"):
            pid = tmp.name.rsplit(".", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                continue
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed += 1
        return removed

    def remove(self) -> None:
        """Delete the checkpoint (the run finished; nothing to resume)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __repr__(self) -> str:
        return f"<CheckpointFile {str(self.path)!r}>"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointWriter:
    """Writes a checkpoint every ``interval_s`` seconds when the position moved.

    The input calls ``maybe_write(ledger.checkpoint_position(), counts)`` from its loop
    (cheap when it is not yet time) and ``write_now`` at the end of the run.
    """

    def __init__(
        self,
        file: CheckpointFile,
        run_id: str,
        interval_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        first_interval_s: float | None = None,
        start_position: int | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ConfigurationError(f"checkpoint interval_s must be > 0, got {interval_s}")
        self.file = file
        self.run_id = run_id
        self.interval_s = interval_s
        # a restarted input checkpoints as soon as it got past where it started
        # (first_interval_s), or repeated input kills redo the same work
        self.first_interval_s = interval_s if first_interval_s is None else first_interval_s
        self._clock = clock
        self._next_s = clock() + self.first_interval_s
        self._last_position: int | None = start_position
        self.writes = 0

    def due(self) -> bool:
        """True when ``interval_s`` has passed: the caller may compute the position now."""
        return self._clock() >= self._next_s

    def due_in_s(self) -> float:
        """Seconds until :meth:`due` turns true (0 when it is)."""
        return max(0.0, self._next_s - self._clock())

    def maybe_write(self, position: int, counts: Mapping[str, int] | None = None) -> bool:
        """Write if ``interval_s`` passed since the last write and ``position`` moved."""
        now = self._clock()
        if now < self._next_s:
            return False
        if position == self._last_position:
            self._next_s = now + (self.interval_s if self.writes else self.first_interval_s)
            return False
        self._next_s = now + self.interval_s
        self.write_now(position, counts)
        return True

    def write_now(self, position: int, counts: Mapping[str, int] | None = None) -> None:
        self.file.write(Checkpoint(self.run_id, position, dict(counts or {}), time.time()))
        self._last_position = position
        self.writes += 1


# --- how a parallel run uses its checkpoint ----------------------------------------------
CHECKPOINT_SUFFIX = ".ckpt"


def checkpoint_path_for(output_file: str) -> str:
    """The checkpoint of a run writing ``output_file``: next to it, ``<file>.ckpt``."""
    return output_file + CHECKPOINT_SUFFIX


def plan(output_files: list[str], resume: bool, interval_s: float = 2.0) -> dict[str, Any]:
    """The checkpoint settings of a parallel run (role options for the input and output).

    A run with an output file keeps a checkpoint next to it. ``resume``: continue from
    that checkpoint (the input reads from its position; the output appends to its file
    and drops the uids already there). With neither a checkpoint nor an output (the run
    was killed before its first checkpoint and its first write) there is nothing to
    continue: the run starts from the beginning and says so in one line, so that a batch
    system re-queueing the same command line does not fail for ever.
    """
    if not output_files:
        if resume:
            raise ConfigurationError(
                "--resume needs an output file (a writer with a 'file' parameter): "
                "the checkpoint and the events already written are found through it"
            )
        return {"checkpoint": None, "resume": False, "start_position": 0, "start_seq": 0}
    path = checkpoint_path_for(output_files[0])
    start = seq = 0
    if resume:
        cp = CheckpointFile(path).load()
        if cp is None:
            if not os.path.exists(output_files[0]):
                say(
                    f"evflow: nothing to resume (no checkpoint {path} and no output "
                    f"{output_files[0]}): starting from the beginning"
                )
                resume = False
            start = 0  # stopped before the first checkpoint: the output dedups
        else:
            start = cp.position
            seq = int(cp.counts.get("seq", 0))  # --ordered: the input's numbering goes on
    return {
        "checkpoint": path,
        "resume": resume,
        "start_position": start,
        "start_seq": seq,
        "checkpoint_interval_s": interval_s,
    }


def open_writers_for_append(writers: list[Any]) -> set[int]:
    """Make every writer continue its file; return the uids already written in them.

    Called in the output process before its path initializes, on ``--resume`` and when
    the output is restarted after a crash. A writer without an ``append`` parameter
    cannot continue a file: a clear ConfigurationError names it.
    """
    uids: set[int] = set()
    for w in writers:
        if "append" not in type(w).declared_params():
            raise ConfigurationError(
                f"writer {w.name!r} ({type(w).__name__}) cannot continue an existing file "
                f"(no 'append' parameter): resuming or restarting the output needs one, "
                f"e.g. RecordOutput"
            )
        w.append = True
    for w in writers:
        uids |= w.written_uids()
    return uids

"""The output's account of persistent-object fills: which deltas to merge, kept on disk.

Merging (see :mod:`deltas`): a batch's delta is merged when the output accepts the
batch, unless every event of it is already *in the merged state* (a late result after
a re-send: dropped with its events). A batch mixing such events with new ones cannot
be split: its delta is merged and the events counted in ``mixed`` (their fills count
twice). The input re-sends failed or lost events one per batch, except those from a
message the worker never began (``LedgerEntry.unstarted``: no result of them can
exist), so mixed batches are rare (a late result racing its own re-send, or an input
restarted from its checkpoint re-reading events already written).

Output restarts. The merged state lives in the output's memory, so it is also kept
in the session directory, in two parts:

- a *journal*: before a batch's events are written, its delta and uids are appended
  (one ``write``, a length-prefixed msgpack record; a torn last record is ignored);
- a *snapshot*: at a confirm (after the flush, before CONFIRM goes out), at most
  every ``SNAPSHOT_INTERVAL_S``, the whole merged state is written (temp file,
  rename) with the uids it holds that the input may still re-send (merged, not yet
  confirmed); the journal then starts over.

A restarted output loads the snapshot and replays the journal: the merged state is
exactly what the dead output had merged. An event is in that state if the reopened
file holds it, or the snapshot or the journal names it; its delta is then dropped
when it comes again (re-sent: one per batch), and merged otherwise. Only an
unreadable snapshot loses fills: every event of the file is then counted in
``lost``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from evflow.errors import CodecError
from evflow.processing.parallel.deltas import DeltaEncoder, DeltaMerger

log = logging.getLogger("evflow.parallel")

STATE_FORMAT = "evflow-output-fills"
STATE_VERSION = 1
STATE_NAME = "output-fills.state"
#: a snapshot at most this often (s): each costs a file write and a rename (~0.3-2 ms
#: here); between them the journal holds the deltas (one append per batch)
SNAPSHOT_INTERVAL_S = 1.0
_LEN = struct.Struct("<I")

#: summary counter names (engine ``counters``), shown when not zero
COUNTER_NAMES = {
    "mixed": "histogram fills not excluded (duplicates in a mixed batch)",
    "failed": "histogram fills of failed events not excluded",
    "bad": "histogram deltas dropped (malformed)",
    "dup": "histogram deltas dropped (late duplicates)",
    "lost": "histogram fills lost (output restart)",
}


class Fills:
    """Merged persistent deltas of one output process, with journal and snapshot.

    ``directory`` is where they go (the session directory); ``None`` keeps nothing on
    disk. ``in_file`` (on restart) is the set of uids the reopened output file holds.
    """

    def __init__(
        self, directory: Path | None, ordered: bool, in_file: set[int] | None = None
    ) -> None:
        self.merger = DeltaMerger()
        self.encoder = DeltaEncoder()
        self.ordered = ordered
        self.counts = dict.fromkeys(COUNTER_NAMES, 0)
        self.state_path = directory / STATE_NAME if directory is not None else None
        self.gen = 0
        self.open: list[bytes] = []  # uids (uint64 bytes) merged, not yet confirmed
        self.dirty = False
        self.snapshot_at = time.monotonic()
        self._journal_fd = -1
        # restarted: uids in the reloaded state that the file does not hold
        self.covered: set[int] = set()
        self.restarted = in_file is not None
        if in_file is not None:
            self._reload(in_file)

    @property
    def merged(self) -> dict[str, Any]:
        return self.merger.merged

    # --- per batch ------------------------------------------------------------------------
    def accept(
        self, delta: Sequence[Any], uid_bytes: bytes, uids: list[int], seen: Any, failed: int
    ) -> str | None:
        """Merge or drop the ``delta`` of a batch; call before its events are written.

        ``uid_bytes``/``uids``: the batch's uids (uint64 bytes and list); ``seen``: the
        output's WrittenUids before the batch; ``failed``: events of the batch that
        failed in a module (their partial fills are in the delta). Returns the reason
        a malformed delta was dropped (counted), else None.
        """
        n_in = seen.count_seen(uids)
        if self.covered:
            covered = self.covered
            n_in += sum(1 for u in uids if u in covered and u not in seen)
        if n_in == len(uids):
            self.counts["dup"] += 1
            return None
        try:
            decoded = self.merger.decode(delta)
        except CodecError as exc:
            self.counts["bad"] += 1
            return str(exc)
        self._journal(uid_bytes, delta)  # before the events reach the file
        self.merger.add(decoded)
        self.dirty = True
        self.counts["mixed"] += n_in
        self.counts["failed"] += failed
        if self.state_path is not None:
            self.open.append(uid_bytes)
        return None

    # --- at each confirm ----------------------------------------------------------------
    def confirmed(self, confirming: np.ndarray) -> None:
        """The output flushed and is about to confirm ``confirming``: maybe snapshot."""
        if self.state_path is None or not self.open:
            return
        now = time.monotonic()
        if self.dirty and now - self.snapshot_at >= SNAPSHOT_INTERVAL_S:
            self._snapshot(self._open_uids())
            self.snapshot_at = now
        if self.ordered:  # events still in the reorder buffer stay open
            # not assume_unique: a confirm may list a uid twice (a re-sent duplicate)
            still = np.setdiff1d(self._open_uids(), confirming)
            self.open = [still.tobytes()] if len(still) else []
        else:
            self.open = []  # every accepted batch is in this confirm

    def _open_uids(self) -> np.ndarray:
        return np.frombuffer(b"".join(self.open), dtype=np.uint64)

    def _snapshot(self, open_uids: np.ndarray) -> None:
        assert self.state_path is not None
        if self.covered:  # still re-sendable, and in the state: say so again
            covered = np.fromiter(self.covered, dtype=np.uint64, count=len(self.covered))
            open_uids = np.union1d(open_uids, covered)
        frames = self.encoder.snapshot(self.merged) or []
        body = {
            "format": STATE_FORMAT,
            "v": STATE_VERSION,
            "gen": self.gen + 1,
            "open": open_uids.tobytes(),
            "counts": self.counts,
            "delta": [bytes(f) for f in frames],
        }
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(body))
        os.replace(tmp, self.state_path)  # the old snapshot or the new one, never a mix
        old = self._journal_path(self.gen)
        self.gen += 1
        self._close_journal()
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
        self.dirty = False

    # --- the end ----------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Summary counters (non-zero ones), named for the run summary."""
        return {COUNTER_NAMES[k]: v for k, v in self.counts.items() if v}

    def not_merged(self) -> list[str]:
        return sorted(self.merger.not_merged)

    def remove_files(self) -> None:
        """The run ended: journal and snapshot are no longer needed."""
        self._close_journal()
        if self.state_path is None:
            return
        for path in (self.state_path, self._journal_path(self.gen)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # --- internals ------------------------------------------------------------------------
    def _journal_path(self, gen: int) -> Path:
        assert self.state_path is not None
        return self.state_path.with_name(f"{self.state_path.name}.{gen}.journal")

    def _journal(self, uid_bytes: bytes, delta: Sequence[Any]) -> None:
        if self.state_path is None:
            return
        if self._journal_fd < 0:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            self._journal_fd = os.open(self._journal_path(self.gen), flags, 0o600)
        # record: total length, uid bytes length, frame count, frame lengths, then the
        # uids and frames as they are (one writev, no copy)
        sizes = [len(uid_bytes), *(memoryview(f).nbytes for f in delta)]
        head = struct.pack(f"<III{len(delta)}I", 0, len(uid_bytes), len(delta), *sizes[1:])
        total = len(head) - _LEN.size + sum(sizes)
        os.writev(self._journal_fd, [_LEN.pack(total) + head[_LEN.size :], uid_bytes, *delta])

    def _close_journal(self) -> None:
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
            self._journal_fd = -1

    def _reload(self, in_file: set[int]) -> None:
        """A restarted output: take over the dead one's snapshot and journal."""
        assert self.state_path is not None
        covered: set[int] = set()
        if self.state_path.exists():
            try:
                body = msgpack.unpackb(self.state_path.read_bytes())
                if body.get("format") != STATE_FORMAT or body.get("v") != STATE_VERSION:
                    raise CodecError(f"unknown state format {body.get('format')!r}")
                self.merger.merge(body["delta"], "the saved state")
                self.gen = int(body["gen"])
                covered.update(np.frombuffer(body["open"], dtype=np.uint64).tolist())
                for key, value in body["counts"].items():
                    if key in self.counts:
                        self.counts[key] = int(value)
            except Exception as exc:  # damaged: say so, count what may be missing
                log.warning("output restart: persistent state unreadable (%s)", exc)
                self.merger = DeltaMerger()
                self.counts["lost"] += len(in_file)
                return
        for uid_bytes, delta in _read_journal(self._journal_path(self.gen)):
            try:
                self.merger.merge(delta, "the journal")
            except CodecError:  # was checked before it was written: a damaged file
                self.counts["lost"] += len(uid_bytes) // 8
                continue
            covered.update(np.frombuffer(uid_bytes, dtype=np.uint64).tolist())
        self.covered = covered - in_file  # what the file holds counts as covered anyway
        self.dirty = True  # the next snapshot is this process's


def _read_journal(path: Path) -> list[tuple[bytes, list[bytes]]]:
    """The records of a journal; a torn or damaged tail (a crash mid-append) ends it."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    out: list[tuple[bytes, list[bytes]]] = []
    at = 0
    while at + 12 <= len(raw):
        total, n_uid_b, n_frames = struct.unpack_from("<III", raw, at)
        end = at + _LEN.size + total
        if end > len(raw) or n_frames > 4096 or 8 + 4 * n_frames > total:
            break  # torn: the batch was never written (the crash came first)
        sizes = struct.unpack_from(f"<{n_frames}I", raw, at + 12)
        pos = at + 12 + 4 * n_frames
        if pos + n_uid_b + sum(sizes) != end or n_uid_b % 8:
            break
        uid_bytes = raw[pos : pos + n_uid_b]
        pos += n_uid_b
        frames = []
        for size in sizes:
            frames.append(raw[pos : pos + size])
            pos += size
        out.append((uid_bytes, frames))
        at = end
    return out

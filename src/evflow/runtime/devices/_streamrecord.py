"""What a device has counted on its streams, kept where its restarted process finds it.

A device that its agent may restart (``restart = "on-failure"``) keeps its message
counters and the ENDs it took (sender -> announced count) in two small files of its
host session's directory: the counters in a shared file mapping (one 8-byte store per
message, and a SIGKILL loses none: the page belongs to the file, not the process), the
ENDs in a JSON file replaced atomically (before the END is acknowledged). Its next
process, forked on the same host into the same session, starts from them:

- a receiver does not wait again for ENDs its dead predecessor already took (their
  senders may have exited long ago), and its count check covers both processes: what
  arrived at either, against what the senders announced. Messages that died with the
  old process (read from the socket but not yet counted, or queued in its libzmq
  buffers) are what is missing, and the check names them;
- a forwarder announces downstream everything either process sent.

Without a directory (a device run alone, or ``restart = "never"``) the counters live in
memory and nothing is written.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger("evflow.device")

_SLOT = 8  # bytes per counter (int64)


class StreamRecord:
    """``counts[i]`` (int64 slots, ``slots`` of them) and ``ends`` of one device.

    ``restarted``: a record of a dead predecessor was found (counts or ENDs)."""

    def __init__(self, directory: Path | None, device_id: str, slots: int) -> None:
        self._ends_path: Path | None = None
        self._map: mmap.mmap | None = None
        self.ends: dict[str, int] = {}
        self.restarted = False
        if directory is None:
            self._buf = bytearray(slots * _SLOT)
            self.counts = memoryview(self._buf).cast("q")
            return
        counts_path = directory / f"{device_id}.counts"
        self._ends_path = directory / f"{device_id}.ends"
        fd = os.open(counts_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size < slots * _SLOT:
                os.ftruncate(fd, slots * _SLOT)
            self._map = mmap.mmap(fd, slots * _SLOT)
        finally:
            os.close(fd)
        self.counts = memoryview(self._map).cast("q")
        self.ends = self._read_ends()
        self.restarted = bool(self.ends) or any(self.counts)
        if self.restarted:
            log.warning(
                "%s: restarted: going on from its dead process's counts %s and the END of "
                "%s", device_id, list(self.counts), ", ".join(sorted(self.ends)) or "no sender",
            )  # fmt: skip

    def _read_ends(self) -> dict[str, int]:
        assert self._ends_path is not None
        try:
            data = json.loads(self._ends_path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(k, str) and type(v) is int}

    def add_end(self, sender: str, count: int) -> None:
        """Note ``sender``'s END (durable before the caller acknowledges it)."""
        self.ends[sender] = count
        if self._ends_path is None:
            return
        tmp = self._ends_path.with_name(self._ends_path.name + ".tmp")
        tmp.write_text(json.dumps(self.ends))
        os.replace(tmp, self._ends_path)

    def reset(self) -> None:
        """A new task in the same process (RESET_TASK, INIT_TASK): counting starts afresh."""
        for i in range(len(self.counts)):
            self.counts[i] = 0
        self.ends = {}
        self.restarted = False
        if self._ends_path is not None:
            self._ends_path.unlink(missing_ok=True)

    def close(self) -> None:
        counts, self.counts = self.counts, memoryview(bytearray(len(self.counts) * _SLOT)).cast("q")
        counts.release()
        if self._map is not None:
            self._map.close()
            self._map = None

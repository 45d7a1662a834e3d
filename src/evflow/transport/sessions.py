"""Session directories whose owner is gone: recognise and remove them.

A run removes its session directory (``<runtime base>/<session>/``, its ipc files)
when it ends. A run killed with ``kill -9`` cannot: its directory stays behind. So the
process that owns a session writes ``owner.json`` into it (:func:`claim_session`: pid,
the process's start time, host), and the next run removes every sibling directory
whose owner is gone (:func:`remove_stale_sessions`).

A directory is removed only when all of these hold, so a live run's is never touched:

- it has a readable ``owner.json`` (directories without one, e.g. those of standalone
  devices that share a session, are left alone) written on this host;
- no process with that pid runs, or the one that does started at another time (the pid
  was reused), or it is a zombie;
- no ipc socket file in it has a listener (an orphaned child still serving).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import psutil  # type: ignore[import-untyped]

from evflow.transport.paths import (
    ipc_listening,
    remove_session_files,
    runtime_base_dir,
    session_dir,
)

__all__ = ["OWNER_FILE", "Owner", "claim_session", "read_owner", "remove_stale_sessions"]

log = logging.getLogger(__name__)

#: the file in a session directory that names its owner
OWNER_FILE = "owner.json"
#: a process whose start time differs from the recorded one by more is another process (s)
_START_TOLERANCE_S = 1.0


@dataclass(frozen=True, slots=True)
class Owner:
    """Who owns a session: ``pid``, its start time ``started_s`` (seconds since the
    epoch, as ``psutil.Process.create_time``) and the ``host`` name."""

    pid: int
    started_s: float
    host: str

    def alive(self) -> bool:
        """True while the owning process runs (not a zombie, not a reused pid)."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.started_s) > _START_TOLERANCE_S:
                return False  # the pid was reused by another process
            return bool(proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:
            return True  # cannot tell (e.g. access denied): treat as alive


def claim_session(session: str) -> Path:
    """Create the directory of ``session`` and record this process as its owner."""
    path = session_dir(session)
    me = psutil.Process()
    text = json.dumps(
        {"version": 1, "pid": me.pid, "started_s": me.create_time(), "host": socket.gethostname()}
    )
    tmp = path / f".{OWNER_FILE}.{me.pid}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path / OWNER_FILE)  # atomic: a reader sees no file or a whole one
    return path


def read_owner(path: Path) -> Owner | None:
    """The owner recorded in session directory ``path``; None if none or unreadable."""
    try:
        data = json.loads((path / OWNER_FILE).read_text())
        return Owner(int(data["pid"]), float(data["started_s"]), str(data["host"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_stale_sessions() -> list[str]:
    """Remove the session directories under the runtime base directory whose owner is
    gone (and their ``/dev/shm`` segments); return their names. A directory that
    cannot be inspected or removed is skipped, never an error."""
    base = runtime_base_dir()
    try:
        entries = list(base.iterdir())
    except OSError:
        return []
    host = socket.gethostname()
    removed = []
    for path in entries:
        if path.is_symlink() or not path.is_dir():
            continue
        owner = read_owner(path)
        if owner is None or owner.host != host or owner.alive() or _in_use(path):
            continue
        remove_session_files(path.name)
        if not path.exists():
            removed.append(path.name)
            log.info("removed session directory %s of dead process %d", path, owner.pid)
    return removed


def _in_use(path: Path) -> bool:
    """True if a unix socket file in ``path`` has a listener."""
    try:
        files = [p for p in path.iterdir() if p.is_socket()]
    except OSError:
        return True  # cannot look inside: leave it
    return any(ipc_listening(file) for file in files)

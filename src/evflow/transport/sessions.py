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
import stat
from dataclasses import dataclass
from pathlib import Path

import psutil  # type: ignore[import-untyped]

from evflow.errors import ConfigurationError
from evflow.transport.paths import (
    ipc_listening,
    remove_session_files,
    runtime_base_dir,
    session_dir,
)

__all__ = [
    "OWNER_FILE",
    "Owner",
    "claim_session",
    "owner_gone",
    "read_owner",
    "remove_stale_sessions",
    "secure_dir",
]

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


def secure_dir(path: Path) -> None:
    """Make ``path`` (a directory of ours) readable and searchable by its owner only.

    Whoever can search a session directory can connect to its ipc sockets, so the
    runtime base directory and every session directory are mode 0700. A directory
    that is a symbolic link or belongs to another user is refused: in a shared /tmp
    someone else may have made it first, to watch or hijack our sockets.
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigurationError(f"cannot inspect session directory {path}: {exc}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigurationError(
            f"{path} is not a directory (a symbolic link?); remove it or set "
            "EVFLOW_RUNTIME_DIR to a directory of your own"
        )
    if st.st_uid != os.getuid():
        raise ConfigurationError(
            f"{path} belongs to user {st.st_uid}, not to you ({os.getuid()}): another user "
            "could reach the run's sockets; set EVFLOW_RUNTIME_DIR to a directory of your own"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def claim_session(session: str) -> Path:
    """Create the directory of ``session`` (mode 0700, in a base directory of ours,
    mode 0700) and record this process as its owner."""
    path = session_dir(session)
    secure_dir(path.parent)
    secure_dir(path)
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


def owner_gone(path: Path) -> Owner | None:
    """The owner recorded in session directory ``path`` if it ran on this host and is
    gone; None when it runs, or when nothing tells (no owner file, another host)."""
    owner = read_owner(path)
    if owner is None or owner.host != socket.gethostname() or owner.alive():
        return None
    return owner


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

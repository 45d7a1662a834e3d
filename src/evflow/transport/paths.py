"""Where a session's ipc socket files live.

Every session owns ``<base>/<session>/``; whoever creates it removes it (the
supervisor for a run, the device for a standalone device). Tests check that nothing
is left under the base directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path

#: names of shared-memory segments evflow creates start with this
SHM_PREFIX = "evflow-"


def runtime_base_dir() -> Path:
    """``$EVFLOW_RUNTIME_DIR`` or ``/tmp/evflow-<uid>``.

    Kept short on purpose: ipc socket paths are limited to about 100 bytes.
    """
    env = os.environ.get("EVFLOW_RUNTIME_DIR")
    return Path(env) if env else Path(f"/tmp/evflow-{os.getuid()}")


def session_dir(session: str) -> Path:
    """The ipc directory of ``session`` (created on demand, mode 0700)."""
    path = runtime_base_dir() / session
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def remove_session_files(session: str) -> None:
    """Remove the ipc directory of ``session`` and its ``/dev/shm`` segments (if any)."""
    path = runtime_base_dir() / session
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    prefix = f"{SHM_PREFIX}{session}"
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir("/dev/shm"):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    Path("/dev/shm", name).unlink()


def ipc_listening(path: Path | str) -> bool:
    """True if something listens on the unix socket file ``path`` (a stale file: False)."""
    if not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()

"""Helpers to run ``evflow device`` processes in tests (always reaped, never hanging)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).parent


def device_cmd(cls: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "evflow", "device", cls, *args]


def start_device(
    cls: str, *args: str, env: dict[str, str] | None = None, stdin: int | None = None
) -> subprocess.Popen[str]:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS_DIR), *filter(None, [full_env.get("PYTHONPATH")])]
    )
    full_env.update(env or {})
    return subprocess.Popen(
        device_cmd(cls, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=stdin,
        text=True,
        env=full_env,
    )


def finish(proc: subprocess.Popen[str], timeout_s: float = 60) -> tuple[int, str, str]:
    """Wait for ``proc`` (kill it after ``timeout_s``); return (code, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"device did not finish in {timeout_s} s; stderr:\n{err}") from None
    _unread.pop(proc.pid, None)
    return proc.returncode, _early.pop(proc.pid, "") + out, err


def read_stats(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


_early: dict[int, str] = {}
#: text read by wait_for_line after the line it waited for: where its next call starts
_unread: dict[int, str] = {}


def wait_for_line(proc: subprocess.Popen[str], wanted: str, timeout_s: float = 60) -> list[str]:
    """Read stdout lines until one equals ``wanted`` (bounded by ``timeout_s``); return them.

    Reads the raw pipe with select so that it cannot block past the deadline; what it
    read is given back by :func:`finish`. Calls follow each other: a second call looks
    first at what the first one read after its line.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = _unread.pop(proc.pid, "")
    deadline = time.monotonic() + timeout_s
    while True:
        lines = buf.split("\n")
        if wanted in lines[:-1]:
            after = lines.index(wanted) + 1
            _unread[proc.pid] = "\n".join(lines[after:])
            return [line.strip() for line in lines[:-1]]
        if time.monotonic() >= deadline:
            break
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        chunk = os.read(fd, 65536).decode()
        if not chunk:
            break
        buf += chunk
        _early[proc.pid] = _early.get(proc.pid, "") + chunk
    proc.kill()
    _, err = proc.communicate()
    _unread.pop(proc.pid, None)
    _early.pop(proc.pid, None)
    raise AssertionError(f"never saw {wanted!r}; stdout {buf!r}; stderr {(err or '')[-2000:]}")


def wait_for_stderr(proc: subprocess.Popen[str], wanted: str, timeout_s: float = 60) -> str:
    """Read the process's log (stderr) until a line contains ``wanted``; bounded.

    Returns what it read; that text is not given back by :func:`finish`.
    """
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    buf = ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 65536).decode()
            if not chunk:
                break
            buf += chunk
            if wanted in buf:
                return buf
    proc.kill()
    proc.communicate()
    raise AssertionError(f"never saw {wanted!r} in the log: {buf[-2000:]!r}")

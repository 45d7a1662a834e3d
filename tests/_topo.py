"""Helpers for the topology tests: read ``evflow up``'s stderr with deadlines, wait for
a controller to start."""

from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path

from _wait import wait_until


def wait_for_controller(session: str, proc: subprocess.Popen[str]) -> None:
    """Until ``evflow up`` (``proc``) has its controller running: the session's
    ``topology.json`` exists (or the command ended). A moment counted from there, not
    from the command's start, falls while the controller starts the devices even where
    a loaded machine takes seconds to start the interpreter."""
    started = Path(os.environ["EVFLOW_RUNTIME_DIR"], session, "topology.json")
    wait_until(lambda: started.exists() or proc.poll() is not None, 60,
               f"the controller of session {session!r}")  # fmt: skip


class Lines:
    """Read a process's stderr line by line with deadlines (never blocks past them)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[tuple[float, str]] = []
        self._buf = b""

    def _read(self, wait_s: float) -> list[str] | None:
        """The whole lines that arrived within ``wait_s`` (kept in ``seen``); None at EOF."""
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        ready, _, _ = select.select([fd], [], [], wait_s)
        if not ready:
            return []
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        now = time.monotonic()
        text = [raw.decode(errors="replace") for raw in lines]
        self.seen.extend((now, line) for line in text)
        return text

    def wait_for(self, text: str, timeout_s: float) -> float:
        """The monotonic time at which a line containing ``text`` was read."""
        for t, line in self.seen:
            if text in line:
                return t
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = self._read(0.05)
            if lines is None:
                break
            if any(text in line for line in lines):
                return self.seen[-1][0]
        raise AssertionError(
            f"no line with {text!r} within {timeout_s} s; got:\n"
            + "\n".join(line for _, line in self.seen[-30:])
        )

    def wait_exit(self, timeout_s: float) -> bool:
        """Read lines until the process closes stderr (it is ending: True) or ``timeout_s``
        (False; the process may then be stopped gently, e.g. by SIGINT, and ``finish``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._read(0.05) is None:
                return True
        return False

    def finish(self, timeout_s: float = 60) -> tuple[int, str]:
        try:
            _, rest = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, rest = self.proc.communicate()
            lines = [line for _, line in self.seen] + (self._buf.decode() + rest).splitlines()
            said = [line for line in lines if "msg/s" not in line]  # not the rate lines
            raise AssertionError(
                "evflow up did not finish; its last lines (rates left out):\n"
                + "\n".join(said[-80:])
            ) from None
        text = "\n".join(line for _, line in self.seen) + "\n" + self._buf.decode() + rest
        return self.proc.returncode, text

"""Helpers for the topology tests: read ``evflow up``'s stderr with deadlines."""

from __future__ import annotations

import os
import select
import subprocess
import time


class Lines:
    """Read a process's stderr line by line with deadlines (never blocks past them)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[tuple[float, str]] = []
        self._buf = b""

    def wait_for(self, text: str, timeout_s: float) -> float:
        """The monotonic time at which a line containing ``text`` was read."""
        for t, line in self.seen:
            if text in line:
                return t
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            self._buf += chunk
            *lines, self._buf = self._buf.split(b"\n")
            now = time.monotonic()
            for raw in lines:
                line = raw.decode(errors="replace")
                self.seen.append((now, line))
                if text in line:
                    return now
        raise AssertionError(
            f"no line with {text!r} within {timeout_s} s; got:\n"
            + "\n".join(line for _, line in self.seen[-30:])
        )

    def wait_exit(self, timeout_s: float) -> bool:
        """Read lines until the process closes stderr (it is ending: True) or ``timeout_s``
        (False; the process may then be stopped gently, e.g. by SIGINT, and ``finish``)."""
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return True
            self._buf += chunk
            *lines, self._buf = self._buf.split(b"\n")
            now = time.monotonic()
            self.seen.extend((now, raw.decode(errors="replace")) for raw in lines)
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

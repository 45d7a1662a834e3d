"""The controller's side of a guarded launch (ssh, srun): one local client process.

The client (``ssh`` or ``srun``) runs the guard (``_guard``) on the host, which runs the
command. Its stdin is a pipe we hold open: closing it (``terminate``) or dying closes
it, and the guard then ends the command's process tree. stderr is read by a thread
that keeps the last lines for error messages and spots the guard's ready line.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO

from evflow.topology.launch._guard import READY_PREFIX
from evflow.transport.hosts import HostSpec

log = logging.getLogger("evflow.launch")

#: lines of the client's stderr kept for error messages (the agent logs there too)
ERROR_LINES = 200


def guarded(python: str, argv: list[str], env: dict[str, str] | None, *, detached: bool = False
            ) -> list[str]:  # fmt: skip
    """``env K=V... <python> -m ..._guard [--detached] -- argv...`` as an argv list."""
    head = ["env", *(f"{k}={v}" for k, v in sorted((env or {}).items()))] if env else []
    mode = ["--detached"] if detached else []
    return [*head, python, "-m", "evflow.topology.launch._guard", *mode, "--", *argv]


class GuardedProcess:
    """An :class:`~evflow.topology.launch.base.AgentHandle` for ssh and srun launches.

    ``stdout`` is the command's stdout (a binary pipe) when the launch asked for it.
    ``remote_pid`` is the command's pid on its host once it started.
    """

    def __init__(
        self,
        host: HostSpec,
        client_argv: list[str],
        *,
        what: str,
        capture_stdout: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.host = host
        self.what = what
        self.remote_pid: int | None = None
        self._lines: collections.deque[str] = collections.deque(maxlen=ERROR_LINES)
        self._ready = threading.Event()
        self._done = threading.Event()
        self.process = subprocess.Popen(
            client_argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if capture_stdout else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.stdout: IO[bytes] | None = self.process.stdout
        self._reader = threading.Thread(target=self._read_stderr, daemon=True,
                                        name=f"launch-{host.name}")  # fmt: skip
        self._reader.start()

    def __repr__(self) -> str:
        state = "running" if self.poll() is None else f"exit {self.process.returncode}"
        return f"<{self.what} agent on {self.host.name} pid={self.process.pid} {state}>"

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        try:
            for raw in self.process.stderr:
                line = raw.decode(errors="replace").rstrip()
                if line.startswith(READY_PREFIX):
                    with contextlib.suppress(ValueError):
                        self.remote_pid = int(line[len(READY_PREFIX) :])
                    self._ready.set()
                    continue
                if line:
                    self._lines.append(line)
                    # at the remote line's own level: a quiet controller (warnings only)
                    # still shows a host's warnings, e.g. the CURVE refusals of its devices
                    log.log(_level_of(line), "%s %s: %s", self.what, self.host.name, line)
        except (OSError, ValueError):
            pass
        finally:
            self._done.set()

    # --- start-up ------------------------------------------------------------------------
    def wait_started(
        self, timeout_s: float, describe_failure: Callable[[int | None, str], Exception]
    ) -> None:
        """Return once the guard reported the command started; else raise the error
        ``describe_failure(exit_code, last_line)`` builds (and leave nothing running)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.02):
            code = self.process.poll()
            if code is not None:
                self._done.wait(1.0)  # the last lines of stderr
                if self._ready.is_set():
                    return
                self.terminate(0.0)  # closes the pipes
                raise describe_failure(code, self.last_error_line())
            if time.monotonic() > deadline:
                self.terminate(0.5)
                raise describe_failure(None, f"no answer within {timeout_s:g} s")

    def last_error_line(self) -> str:
        for line in reversed(self._lines):
            if line.strip():
                return line.strip()
        return "(no error output)"

    def send_line(self, text: str) -> None:
        """Pass one line to the command's stdin (through the guard's ``stdin`` line)."""
        stdin = self.process.stdin
        if stdin is None or stdin.closed:
            return
        with contextlib.suppress(OSError, ValueError):
            stdin.write(f"stdin {text}\n".encode())
            stdin.flush()

    # --- AgentHandle -----------------------------------------------------------------------
    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def error_output(self) -> str:
        return "\n".join(self._lines)

    def terminate(self, grace_s: float = 2.0) -> None:
        """Ask the guard to end the command (SIGTERM, SIGKILL after ``grace_s``), then
        wait for the client; a client that hangs (a cut link) is killed, which closes
        the connection: the guard then sees EOF and sweeps on its own."""
        stdin = self.process.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError, ValueError):
                stdin.write(f"term {grace_s:g}\n".encode())
                stdin.flush()
            with contextlib.suppress(OSError, ValueError):
                stdin.close()
        if self.wait(grace_s + 3.0) is None:
            log.warning("%s: %s client did not end; killing it", self.host.name, self.what)
            self._signal(signal.SIGTERM)
            if self.wait(1.0) is None:
                self._signal(signal.SIGKILL)
                self.process.wait()
        self._reader.join(2.0)
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, sig)


def _level_of(line: str) -> int:
    """The logging level an agent's stderr line was written at (``[WARNING]`` etc. in
    its head); INFO for anything else (a program's own output)."""
    head = line[:64]
    for name in ("CRITICAL", "ERROR", "WARNING", "DEBUG"):
        if f"[{name}]" in head:
            return int(getattr(logging, name))
    return logging.INFO

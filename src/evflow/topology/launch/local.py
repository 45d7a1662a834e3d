"""The ``local`` launcher: every agent is a child process of the controller.

Each agent dies with the controller (``PR_SET_PDEATHSIG``), and its devices die with it
in turn, so a ``kill -9`` of ``evflow up`` leaves no process behind. Hosts of the
topology may be named freely (``h1``, ``h2`` at ``127.0.0.1``): each gets its own agent,
which is how tests simulate several hosts on one machine.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
from typing import IO

from evflow.errors import ConfigurationError
from evflow.transport.hosts import HostSpec

__all__ = ["LAUNCHER", "LocalAgent", "LocalLauncher"]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    from evflow.runtime.zygote import die_with_parent

    die_with_parent(_PARENT_PID)


#: the controller's pid, set before each fork (PDEATHSIG checks it is still our parent)
_PARENT_PID = os.getpid()


class LocalAgent:
    """A started local agent: the child process and the tail of its stderr."""

    def __init__(self, host: HostSpec, proc: subprocess.Popen[bytes]) -> None:
        self.host = host
        self.proc = proc
        self.pid = proc.pid
        self._tail: collections.deque[str] = collections.deque(maxlen=20)
        assert proc.stderr is not None
        self._reader = threading.Thread(
            target=self._pump, args=(proc.stderr,), name=f"agent-{host.name}-stderr", daemon=True
        )
        self._reader.start()

    def _pump(self, stream: IO[bytes]) -> None:
        import sys

        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            self._tail.append(line.rstrip("\n"))
            sys.stderr.write(line)  # the agents' logs go where the controller's go
        stream.close()

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self, grace_s: float = 2.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=2.0)

    def error_output(self) -> str:
        if self.proc.poll() is not None:
            self._reader.join(timeout=0.5)  # its last lines, not a race with the reader
        return "\n".join(self._tail)


class LocalLauncher:
    name = "local"

    def start_agent(
        self, host: HostSpec, agent_args: list[str], env: dict[str, str] | None = None
    ) -> LocalAgent:
        global _PARENT_PID
        _PARENT_PID = os.getpid()
        full_env = dict(os.environ)
        full_env.update(env or {})
        try:
            proc = subprocess.Popen(
                [host.python, "-m", "evflow", "agent", *agent_args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=full_env,
                preexec_fn=_die_with_parent,
                start_new_session=True,  # a terminal's Ctrl-C goes to the controller only
            )
        except OSError as exc:
            raise ConfigurationError(
                f"host {host.name!r}: cannot start the agent with {host.python!r}: {exc}"
            ) from None
        return LocalAgent(host, proc)


LAUNCHER = LocalLauncher()

"""The launcher interface shared by the local, ssh and slurm launchers.

The controller asks a launcher to start ``python -m evflow agent ARGS`` on a host and
gets an ``AgentHandle`` back. The handle is the controller's only grip on that host's
process tree from outside the bus: it polls for the agent's exit, shows the launcher's
own error output (ssh's "Connection refused", srun's "Requested node configuration is
not available") and ends the agent (SIGTERM, then SIGKILL after a grace).
"""

from __future__ import annotations

import importlib
from typing import Protocol

from evflow.errors import ConfigurationError
from evflow.transport.hosts import HostSpec

LAUNCHERS = ("local", "ssh", "slurm")


class AgentHandle(Protocol):
    """A started agent (or the launcher process standing for it, e.g. ssh or srun)."""

    host: HostSpec

    def poll(self) -> int | None:
        """The exit code once the agent (or its launcher process) ended, else None."""

    def terminate(self, grace_s: float = 2.0) -> None:
        """End the agent: SIGTERM (forwarded to the remote side), SIGKILL after grace_s.

        Must leave no process of this launch behind on either host.
        """

    def error_output(self) -> str:
        """The last lines the launcher itself printed on stderr (for error messages)."""


class Launcher(Protocol):
    name: str

    def start_agent(
        self, host: HostSpec, agent_args: list[str], env: dict[str, str] | None = None
    ) -> AgentHandle:
        """Run ``<host.python> -m evflow agent <agent_args>`` on ``host``.

        ``env`` holds extra environment variables for the agent. Raises
        ConfigurationError (naming the host and the launcher's own error line) when the
        host cannot be reached at all.
        """


def get_launcher(name: str) -> Launcher:
    """The launcher called ``name`` (local, ssh, slurm)."""
    if name not in LAUNCHERS:
        raise ConfigurationError(f"unknown launcher {name!r} (known: {', '.join(LAUNCHERS)})")
    module = importlib.import_module(f"evflow.topology.launch.{name}")
    launcher: Launcher = module.LAUNCHER
    return launcher

"""What the supervisor manages: process specs, their runtime records, exit events."""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from evflow.errors import ConfigurationError

__all__ = ["RESTART_POLICIES", "ExitEvent", "ManagedProcess", "ProcessSpec", "describe_exit"]

RESTART_POLICIES = ("never", "on-failure")


def describe_exit(returncode: int) -> str:
    """``exited with code 3`` / ``was killed by SIGKILL``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


@dataclass
class ProcessSpec:
    """What to run and how to treat its death. Give ``target`` or ``argv``, not both.

    ``target``: a module-level function run in a fork of the zygote (``args`` picklable).
    ``argv``: a command exec'd from a fork of the zygote (``env``/``cwd`` optional).
    ``device_id``: the process is a device on the control bus (orderly bus shutdown).
    ``stop_order``: groups stop in ascending order (None: the order of ``add``).
    """

    name: str
    target: Callable[..., int | None] | None = None
    args: tuple[Any, ...] = ()
    argv: Sequence[str] | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    restart: str = "never"
    max_restarts: int = 3
    backoff_s: float = 0.1
    backoff_max_s: float = 10.0
    device_id: str | None = None
    stop_order: int | None = None
    grace_s: float = 3.0

    def __post_init__(self) -> None:
        if (self.target is None) == (self.argv is None):
            raise ConfigurationError(f"process {self.name!r}: give exactly one of target or argv")
        if self.restart not in RESTART_POLICIES:
            raise ConfigurationError(
                f"process {self.name!r}: unknown restart policy {self.restart!r}; "
                f"expected one of {', '.join(RESTART_POLICIES)}"
            )
        if self.max_restarts < 0 or self.backoff_s < 0 or self.grace_s < 0:
            raise ConfigurationError(
                f"process {self.name!r}: max_restarts, backoff_s and grace_s must be >= 0"
            )

    def backoff_for(self, restarts_done: int) -> float:
        """Delay before restart number ``restarts_done + 1`` (seconds)."""
        return min(self.backoff_max_s, self.backoff_s * (2.0**restarts_done))


@dataclass
class ManagedProcess:
    """A process under supervision. ``state``: running, backoff, done, failed, stopped."""

    spec: ProcessSpec
    order: int
    pid: int | None = None
    state: str = "new"
    restarts: int = 0
    returncode: int | None = None
    restart_at_s: float | None = None
    started_at_s: float = 0.0
    pids: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def alive(self) -> bool:
        return self.state == "running"


@dataclass(frozen=True)
class ExitEvent:
    """One death. ``outcome``: restarting, done (exit 0), failed, stopped (by shutdown),
    or unmanaged (a child that someone else spawned on the same zygote; ``name`` is "")."""

    name: str
    pid: int
    returncode: int
    outcome: str
    restarts: int
    message: str
    at_s: float

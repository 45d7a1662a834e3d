"""What the supervisor manages: process specs, their runtime records, exit events."""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from evflow.errors import ConfigurationError

__all__ = [
    "RESTART_POLICIES",
    "Decision",
    "ExitEvent",
    "ManagedProcess",
    "ProcessSpec",
    "RestartBudget",
    "describe_exit",
]

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
class RestartBudget:
    """Restarts shared by a group of processes (e.g. a path's workers): every restart
    of a process whose spec names this budget takes one; a restart cancelled before
    it happened (:meth:`Supervisor.cancel_restarts`) gives it back."""

    limit: int
    used: int = 0

    @property
    def left(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class Decision:
    """What a spec's ``decide`` hook says about a death (see :class:`ProcessSpec`).

    ``action``: ``restart`` (after ``delay_s``; ``args`` replace the target's arguments
    from then on; ``counts``: it takes one restart of the spec's budget), ``end`` (the
    death is accepted: no restart, not a failure) or ``give-up`` (the process failed,
    with ``message``).
    """

    action: str
    delay_s: float = 0.0
    args: tuple[Any, ...] | None = None
    counts: bool = True
    message: str = ""

    @classmethod
    def restart(
        cls, delay_s: float = 0.0, args: tuple[Any, ...] | None = None, counts: bool = True
    ) -> Decision:
        return cls("restart", delay_s, args, counts)

    @classmethod
    def end(cls) -> Decision:
        return cls("end")

    @classmethod
    def give_up(cls, message: str) -> Decision:
        return cls("give-up", message=message)


@dataclass
class ProcessSpec:
    """What to run and how to treat its death. Give ``target`` or ``argv``, not both.

    ``target``: a module-level function run in a fork of the zygote (``args`` picklable).
    ``argv``: a command exec'd from a fork of the zygote (``env``/``cwd`` optional).
    ``device_id``: the process is a device on the control bus (orderly bus shutdown).
    ``stop_order``: groups stop in ascending order (None: the order of ``add``).

    A caller with its own idea of what a death means (e.g. a path run: a worker's death
    is reported to the input, the input restarts from its checkpoint) gives ``decide``:
    ``decide(proc, returncode) -> Decision`` replaces ``restart``/``max_restarts``/
    ``backoff_s`` for every death outside a shutdown (exit 0 included); the supervisor
    still does the mechanics (the delay, the budget, the fork). ``budget``: a
    :class:`RestartBudget` shared with other specs. ``before_launch(proc)`` runs before
    every fork (it may set ``proc.args`` and ``proc.label``), ``after_launch(proc)``
    after it.
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
    decide: Callable[[ManagedProcess, int], Decision] | None = None
    budget: RestartBudget | None = None
    before_launch: Callable[[ManagedProcess], None] | None = None
    after_launch: Callable[[ManagedProcess], None] | None = None
    #: exit codes that end the process for good under ``on-failure``: it failed in a
    #: way a new process cannot mend (a device whose stream counts do not hold)
    final_codes: tuple[int, ...] = ()

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
    """A process under supervision. ``state``: running, backoff, done, ended, failed,
    stopped. ``args``: the target's arguments of the next fork (a ``decide`` hook may
    replace them); ``label``: the name of the current incarnation (default: the spec's)."""

    spec: ProcessSpec
    order: int
    pid: int | None = None
    state: str = "new"
    restarts: int = 0
    returncode: int | None = None
    restart_at_s: float | None = None
    started_at_s: float = 0.0
    pids: list[int] = field(default_factory=list)
    args: tuple[Any, ...] = ()
    label: str = ""
    budgeted: bool = False  # the restart waiting for its backoff took one of the budget

    def __post_init__(self) -> None:
        self.args = self.args or self.spec.args
        self.label = self.label or self.spec.name

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def alive(self) -> bool:
        return self.state == "running"


@dataclass(frozen=True)
class ExitEvent:
    """One death. ``outcome``: restarting, done (exit 0), ended (a death the ``decide``
    hook accepted), failed, stopped (by shutdown), or unmanaged (a child that someone
    else spawned on the same zygote; ``name`` is "")."""

    name: str
    pid: int
    returncode: int
    outcome: str
    restarts: int
    message: str
    at_s: float

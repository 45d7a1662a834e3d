"""The options of one run: what ``evflow.process(path, **options)`` accepts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from evflow.errors import ConfigurationError

#: the values of ``ProcessOptions.transport``
TRANSPORTS = ("zmq", "shm")
#: parallel runs: seconds a worker may spend on one event when no ``event_timeout_s``
#: is given. Far above the time per event of reconstruction or selection (ms to s) and
#: of all but pathological simulated events, so a healthy event is not killed; a hung
#: one costs at most max_attempts times this, then it is quarantined (exit code 3)
DEFAULT_EVENT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class ProcessOptions:
    """How to run a path. Every field is a keyword of ``evflow.process``.

    Sequential and parallel processing read the same object; fields that only the
    parallel processor uses are marked so.
    """

    max_events: int | None = None
    """Stop after this many events read from the source (None: all)."""
    workers: int = 0
    """0: run in this process; N > 0: N worker processes (parallel processing)."""
    output: str | None = None
    """Append a writer for this file to the path (``.root``: RootOutput, else RecordOutput)."""
    quiet: bool = False
    """No progress bar and no summary printout."""
    progress: bool | None = None
    """Progress bar: None = only on a terminal, True = always, False = never."""
    progress_interval_s: float = 0.1
    """Seconds between progress-bar refreshes (never per event)."""
    ordered: bool = False
    """Parallel: write events in input order (bounded reorder buffer)."""
    event_buffer: int = 4
    """Parallel: events in flight per worker (its credit)."""
    event_timeout_s: float | None = None
    """Parallel: a worker busy longer than this on one event is killed and the event
    retried (then quarantined). None: ``DEFAULT_EVENT_TIMEOUT_S``; 0: no limit."""
    max_attempts: int = 3
    """Parallel: failed attempts before an event is written raw and flagged quarantined."""
    allow_quarantine: bool = False
    """Quarantined events are acceptable: ``evflow run`` then exits 0 with them (default:
    exit code 3, ``EXIT_EVENTS_FAILED``), and a sequential run quarantines an event a
    module raises on and goes on instead of stopping (processing/quarantine.py)."""
    resume: bool = False
    """Parallel: continue a stopped run from its output file (skip uids already written)."""
    transport: str = "zmq"
    """Parallel: how large events reach the workers and the output: ``"zmq"`` (through
    the sockets) or ``"shm"`` (copied once into shared memory, their place sent over the
    sockets; arrays are then valid only during ``event()``: copy what a module keeps)."""
    hosts: Any = None
    """Parallel: run the workers on other hosts: a hosts file (``HOSTS.toml``) or a dict
    name -> {address, ssh, slurm, python, workers} (docs/farm_paths.md). None: this host."""
    launcher: str = "ssh"
    """Parallel with ``hosts``: how agents are started there: ``ssh``, ``slurm`` or ``local``."""
    host_workers: dict[str, int] | None = None
    """Parallel with ``hosts``: workers per host by name (else ``workers`` on each host)."""
    insecure: bool = False
    """Parallel with ``hosts`` started by ssh or Slurm: allow plaintext tcp when no CURVE
    keys are configured (``EVFLOW_CURVE_KEYS``); without it such a run is refused."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Settings for later parts (e.g. codec, batch sizes) that have no field yet."""

    def __post_init__(self) -> None:
        _check_optional_int("max_events", self.max_events, minimum=0)
        _check_int("workers", self.workers, minimum=0)
        _check_int("event_buffer", self.event_buffer, minimum=1)
        _check_int("max_attempts", self.max_attempts, minimum=1)
        if self.transport not in TRANSPORTS:
            raise ConfigurationError(
                f"option transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        if self.host_workers and not self.hosts:
            raise ConfigurationError("workers per host (-p HOST=N) need hosts (--hosts FILE)")
        if self.output is not None and not isinstance(self.output, str):
            # accept pathlib paths: convert instead of refusing
            object.__setattr__(self, "output", str(self.output))
        if self.event_timeout_s is not None and (
            isinstance(self.event_timeout_s, bool)
            or not isinstance(self.event_timeout_s, int | float)
            or not self.event_timeout_s >= 0
            or self.event_timeout_s == float("inf")
        ):
            raise ConfigurationError(
                f"option event_timeout_s must be a number of seconds >= 0 (0: no limit) or "
                f"None (default {DEFAULT_EVENT_TIMEOUT_S:g} s), got {self.event_timeout_s!r}"
            )
        if not isinstance(self.progress_interval_s, int | float) or self.progress_interval_s <= 0:
            raise ConfigurationError(
                f"option progress_interval_s must be > 0, got {self.progress_interval_s!r}"
            )

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> ProcessOptions:
        """Build from ``process()`` keywords; an unknown name is a ConfigurationError."""
        names = cls.field_names()
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigurationError(
                f"evflow.process() got an unknown option {unknown[0]!r} "
                f"(known: {', '.join(sorted(names))})"
            )
        return cls(**options)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def replace(self, **changes: Any) -> ProcessOptions:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    def effective_event_timeout_s(self) -> float | None:
        """The event timeout a parallel run applies: None for no limit."""
        if self.event_timeout_s is None:
            return DEFAULT_EVENT_TIMEOUT_S
        return float(self.event_timeout_s) or None

    def show_progress(self, is_tty: bool) -> bool:
        """Whether to draw the progress bar on a stream that is (or is not) a terminal."""
        if self.quiet or self.progress is False:
            return False
        return bool(self.progress) or is_tty


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"option {name} must be an integer >= {minimum}, got {value!r}")


def _check_optional_int(name: str, value: Any, minimum: int) -> None:
    if value is not None:
        _check_int(name, value, minimum)

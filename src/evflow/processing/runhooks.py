"""The hooks a parallel run calls on its control bus, installed from above.

``evflow run --dashboard/--report`` needs the run's bus once it is up and a word when
the roles have exited. The monitor layer (``monitor/runhook.py``) installs a
:class:`RunHooks` here; the parallel engine calls whatever is installed, so
processing never imports monitor. Nothing installed: one attribute read per run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from evflow.runtime.busclient import BusEndpoints

__all__ = ["RunHooks", "install", "installed"]


@dataclass(frozen=True)
class RunHooks:
    """``on_bus(endpoints, info)`` when the bus is up (returns a handle, or None);
    ``on_end(handle, ok, cut)`` after the roles exited (``cut()`` True ends a linger
    early, e.g. after Ctrl-C). Neither may raise into the run."""

    on_bus: Callable[[BusEndpoints, Callable[[], dict[str, Any]]], Any]
    on_end: Callable[[Any, bool, Callable[[], bool]], None]


_installed: RunHooks | None = None


def install(hooks: RunHooks | None) -> None:
    """The hooks of the next parallel runs of this process (None: none)."""
    global _installed
    _installed = hooks


def installed() -> RunHooks | None:
    return _installed

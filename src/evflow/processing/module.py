"""User modules and sources (the first module of a path)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from evflow.event import DataStore, RunMeta
from evflow.params import REQUIRED, Param, declared_params, resolve_params

__all__ = ["REQUIRED", "Module", "Param", "Source"]


class Module:
    """Base class of user processing code.

    Override the hooks you need. ``event`` may return ``False`` to drop the event from
    the rest of the path and from the output (a trigger decision). Set the class
    attribute ``parallel = True`` when the module does all its I/O through the store,
    so that it may run in many worker processes at once; list in ``preload`` the
    modules it imports inside its hooks.
    """

    parallel: ClassVar[bool] = False
    #: modules this one imports lazily in its processes (say, a large ML library): a
    #: parallel run imports them once, before it forks, instead of once per process
    preload: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str | None = None, **params: Any) -> None:
        self.name = name or type(self).__name__
        self._params: dict[str, Any] = resolve_params(
            f"module {self.name!r}", self.declared_params(), params
        )

    @classmethod
    def declared_params(cls) -> dict[str, Param[Any]]:
        return declared_params(cls)

    @property
    def params(self) -> dict[str, Any]:
        """The parameter values of this instance (a copy)."""
        return dict(self._params)

    # --- hooks --------------------------------------------------------------------------
    def initialize(self) -> None:
        """Once per process, before the first run."""

    def begin_run(self, run: RunMeta) -> None:
        """At the start of every run."""

    def event(self, store: DataStore) -> bool | None:
        """Once per event. Return ``False`` to drop the event."""
        return None

    def end_run(self, run: RunMeta) -> None:
        """At the end of every run."""

    def terminate(self) -> None:
        """Once per process, after the last run."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params.items())
        return f"{type(self).__name__}({args})" if args else f"{type(self).__name__}()"


class Source(Module):
    """The first module of a path: makes each new event and says when the data ends.

    Subclasses implement ``events(start)``, yielding stores in a fixed order from
    position ``start`` on (a position is the event's index in that order; resumed runs
    restart from a checkpointed position). Each store's ``meta.uid`` must be unique
    within the input. ``total()`` gives the number of events when known (for the
    progress bar's ETA).
    """

    def events(self, start: int = 0) -> Iterator[DataStore]:
        raise NotImplementedError(f"source {self.name!r} does not implement events()")

    def total(self) -> int | None:
        return None

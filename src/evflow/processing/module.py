"""User modules, their declared parameters, and sources (the first module of a path)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Generic, TypeVar, overload

from evflow.errors import ParameterError
from evflow.processing.datastore import DataStore, RunMeta

T = TypeVar("T")


class _Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Required()


class Param(Generic[T]):
    """A declared module parameter: ``threshold = Param(float, 1.0, "minimum pT in GeV")``.

    Values are checked at construction; an ``int`` is accepted for a ``float``
    parameter. ``choices`` limits the value to a set.
    """

    def __init__(
        self,
        type_: type[T] | tuple[type, ...],
        default: T = REQUIRED,
        doc: str = "",
        choices: tuple[Any, ...] | None = None,
    ) -> None:
        self.type = type_
        self.default = default
        self.doc = doc
        self.choices = choices
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type) -> Param[T]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> T: ...
    def __get__(self, instance: object | None, owner: type) -> Param[T] | T:
        if instance is None:
            return self
        return instance._params[self.name]  # type: ignore[attr-defined,no-any-return]

    def __set__(self, instance: object, value: T) -> None:
        instance._params[self.name] = self.check(type(instance).__name__, value)  # type: ignore[attr-defined]

    @property
    def type_name(self) -> str:
        if isinstance(self.type, tuple):
            return " or ".join(t.__name__ for t in self.type)
        return self.type.__name__

    def check(self, module: str, value: Any) -> Any:
        """Return ``value`` converted to the declared type or raise ParameterError."""
        expected = self.type
        ok = isinstance(value, expected) and not (
            isinstance(value, bool) and expected in (int, float)
        )
        if not ok and expected is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ParameterError(
                f"module {module!r}: parameter {self.name!r} expects {self.type_name}, "
                f"got {type(value).__name__} {value!r}"
            )
        if self.choices is not None and value not in self.choices:
            raise ParameterError(
                f"module {module!r}: parameter {self.name!r} must be one of "
                f"{list(self.choices)}, got {value!r}"
            )
        return value


class Module:
    """Base class of user processing code.

    Override the hooks you need. ``event`` may return ``False`` to drop the event from
    the rest of the path and from the output (a trigger decision). Set the class
    attribute ``parallel = True`` when the module does all its I/O through the store,
    so that it may run in many worker processes at once.
    """

    parallel: ClassVar[bool] = False

    def __init__(self, name: str | None = None, **params: Any) -> None:
        self.name = name or type(self).__name__
        self._params: dict[str, Any] = {}
        declared = self.declared_params()
        unknown = sorted(set(params) - set(declared))
        if unknown:
            known = ", ".join(sorted(declared)) or "none"
            raise ParameterError(
                f"module {self.name!r} has no parameter {unknown[0]!r} (known: {known})"
            )
        for pname, spec in declared.items():
            if pname in params:
                self._params[pname] = spec.check(self.name, params[pname])
            elif spec.default is REQUIRED:
                raise ParameterError(
                    f"module {self.name!r}: parameter {pname!r} ({spec.type_name}) is required"
                )
            else:
                self._params[pname] = spec.default

    @classmethod
    def declared_params(cls) -> dict[str, Param[Any]]:
        found: dict[str, Param[Any]] = {}
        for klass in reversed(cls.__mro__):
            for key, value in vars(klass).items():
                if isinstance(value, Param):
                    found[key] = value
        return found

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

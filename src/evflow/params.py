"""Declared parameters, shared by processing modules and runtime devices.

A class declares ``name = Param(type, default, doc)``; ``resolve_params`` checks the
values given at construction against the declarations, with errors that name the
owner and the parameter.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

from evflow.errors import ParameterError

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
        instance._params[self.name] = self.check(repr(instance), value)  # type: ignore[attr-defined]

    @property
    def type_name(self) -> str:
        if isinstance(self.type, tuple):
            return " or ".join(t.__name__ for t in self.type)
        return self.type.__name__

    def check(self, owner: str, value: Any) -> Any:
        """Return ``value`` converted to the declared type or raise ParameterError."""
        expected = self.type
        ok = isinstance(value, expected) and not (
            isinstance(value, bool) and expected in (int, float)
        )
        if not ok and expected is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ParameterError(
                f"{owner}: parameter {self.name!r} expects {self.type_name}, "
                f"got {type(value).__name__} {value!r}"
            )
        if self.choices is not None and value not in self.choices:
            raise ParameterError(
                f"{owner}: parameter {self.name!r} must be one of "
                f"{list(self.choices)}, got {value!r}"
            )
        return value


def declared_params(cls: type) -> dict[str, Param[Any]]:
    """Every ``Param`` declared on ``cls`` and its bases (subclasses override)."""
    found: dict[str, Param[Any]] = {}
    for klass in reversed(cls.__mro__):
        for key, value in vars(klass).items():
            if isinstance(value, Param):
                found[key] = value
    return found


def resolve_params(
    owner: str, declared: dict[str, Param[Any]], given: dict[str, Any]
) -> dict[str, Any]:
    """Check ``given`` against ``declared``; fill defaults; return the values.

    ``owner`` names the object in error messages, e.g. ``"module 'Calib'"``.
    """
    unknown = sorted(set(given) - set(declared))
    if unknown:
        known = ", ".join(sorted(declared)) or "none"
        raise ParameterError(f"{owner} has no parameter {unknown[0]!r} (known: {known})")
    values: dict[str, Any] = {}
    for pname, spec in declared.items():
        if pname in given:
            values[pname] = spec.check(owner, given[pname])
        elif spec.default is REQUIRED:
            raise ParameterError(f"{owner}: parameter {pname!r} ({spec.type_name}) is required")
        else:
            values[pname] = spec.default
    return values

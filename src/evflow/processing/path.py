"""A path: the ordered modules an event goes through."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from evflow.errors import ConfigurationError
from evflow.processing.module import Module, Source


class Path:
    """Ordered modules; the first one is usually a ``Source``."""

    def __init__(self, modules: Iterable[Module] = ()) -> None:
        self._modules: list[Module] = []
        for module in modules:
            self.add(module)

    def add(self, module: Module) -> Module:
        """Append ``module`` and return it (so steering files can keep a handle)."""
        if not isinstance(module, Module):
            raise ConfigurationError(
                f"path.add() takes a Module instance, got {type(module).__name__} {module!r}"
            )
        if isinstance(module, Source) and self._modules:
            raise ConfigurationError(
                f"source {module.name!r} must be the first module of the path "
                f"(the path already has {len(self._modules)} module(s))"
            )
        if any(m.name == module.name for m in self._modules):
            raise ConfigurationError(
                f"the path already has a module named {module.name!r}; "
                f"pass name=... to tell them apart"
            )
        self._modules.append(module)
        return module

    @property
    def modules(self) -> list[Module]:
        return list(self._modules)

    @property
    def source(self) -> Source | None:
        first = self._modules[0] if self._modules else None
        return first if isinstance(first, Source) else None

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)

    def __str__(self) -> str:
        lines = [f"Path with {len(self._modules)} module(s):"]
        for i, m in enumerate(self._modules):
            tag = " [parallel]" if m.parallel else ""
            lines.append(f"  {i}: {m!r}{tag}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Path([{', '.join(m.name for m in self._modules)}])"

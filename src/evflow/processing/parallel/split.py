"""Split a path into the input (serial), worker (parallel) and output (serial) paths."""

from __future__ import annotations

from dataclasses import dataclass

from evflow.errors import ConfigurationError
from evflow.processing.module import Module
from evflow.processing.path import Path


@dataclass(frozen=True, slots=True)
class SplitPath:
    """The three parts of a path run in parallel.

    ``input`` holds the source and every module before the first parallel one;
    ``worker`` the run of parallel modules; ``output`` everything after it.
    """

    input: tuple[Module, ...]
    worker: tuple[Module, ...]
    output: tuple[Module, ...]


def split_path(path: Path) -> SplitPath | None:
    """Return the split of ``path``, or ``None`` when it has no parallel module.

    Raises ConfigurationError naming the module when a parallel module follows a
    non-parallel one that itself follows the worker part (a second parallel run), or
    when the path has no source to read from.
    """
    modules = list(path)
    first = next((i for i, m in enumerate(modules) if m.parallel), None)
    if first is None:
        return None
    if path.source is None:
        raise ConfigurationError(
            "a parallel path needs a source as its first module "
            f"(the path starts with {modules[0].name!r})"
        )
    if first == 0:
        raise ConfigurationError(
            f"source {modules[0].name!r} is marked parallel = True; a source runs in the "
            "input process only (set parallel = False on it)"
        )
    last = first
    while last + 1 < len(modules) and modules[last + 1].parallel:
        last += 1
    for i in range(last + 1, len(modules)):
        if modules[i].parallel:
            serial = modules[last + 1].name
            raise ConfigurationError(
                f"parallel module {modules[i].name!r} comes after the non-parallel module "
                f"{serial!r}, which follows the parallel part of the path; a path may have "
                f"one parallel part only (move {modules[i].name!r} before {serial!r} or "
                f"set parallel = False on it)"
            )
    return SplitPath(
        input=tuple(modules[:first]),
        worker=tuple(modules[first : last + 1]),
        output=tuple(modules[last + 1 :]),
    )


def describe(split: SplitPath) -> str:
    """One line per part, e.g. for ``--dry-run`` and logs."""

    def names(part: tuple[Module, ...]) -> str:
        return ", ".join(m.name for m in part) or "-"

    return (
        f"input: {names(split.input)} | worker: {names(split.worker)} | "
        f"output: {names(split.output)}"
    )

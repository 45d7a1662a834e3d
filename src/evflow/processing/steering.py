"""Steering files: plain Python that builds a path and calls ``evflow.process(path)``.

``run_steering`` executes one as ``__main__`` (so ``if __name__ == "__main__":`` works
and the parallel zygote inherits its modules). Options given on the command line
(``-n``, ``-o``, ``-p``) reach ``process()`` through a ``SteeringContext``; the
steering file needs to know nothing about them. Errors while the file builds its path
become one ``SteeringError``/``ParameterError`` naming the file and line; errors of the
run itself (raised inside ``process()``) pass through unchanged.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import TYPE_CHECKING, Any

from evflow.errors import EvflowError, ModuleError, SteeringError, caused_by_interrupt

if TYPE_CHECKING:
    from evflow.processing.summary import RunSummary


@dataclass
class SteeringContext:
    """What the runner of a steering file passes to every ``process()`` call in it."""

    file: FsPath
    overrides: dict[str, Any] = field(default_factory=dict)
    summaries: list[RunSummary] = field(default_factory=list)
    _run_errors: list[BaseException] = field(default_factory=list)

    def mark_run_error(self, exc: BaseException) -> None:
        """Remember that ``exc`` came out of a run (it is reported as it is)."""
        self._run_errors.append(exc)

    def is_run_error(self, exc: BaseException) -> bool:
        return any(exc is e for e in self._run_errors)


_CURRENT: ContextVar[SteeringContext | None] = ContextVar("evflow_steering", default=None)


def current_context() -> SteeringContext | None:
    """The context of the steering file being run, or None outside ``evflow run``."""
    return _CURRENT.get()


def run_steering(
    file: str | FsPath,
    overrides: dict[str, Any] | None = None,
    argv: Sequence[str] = (),
) -> list[RunSummary]:
    """Execute the steering file ``file``; return the summaries of its runs.

    ``overrides`` are ``process()`` options that win over the file's own (command-line
    ``-n``, ``-o``, ``-p``); ``argv`` becomes ``sys.argv[1:]`` for the file.
    """
    path = FsPath(file)
    code = _compile(path)
    ctx = SteeringContext(path, dict(overrides or {}))
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    module.__dict__["__builtins__"] = __builtins__
    saved = sys.modules.get("__main__"), sys.argv, list(sys.path)
    sys.modules["__main__"] = module
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.resolve().parent))  # steering files import their neighbours
    token = _CURRENT.set(ctx)
    try:
        exec(code, module.__dict__)
    except SystemExit as exc:
        if ctx.is_run_error(exc):
            raise  # SIGTERM during a run: exit 143 after the run closed its files
        if exc.code not in (None, 0):
            raise SteeringError(f"steering file {str(path)!r} called exit({exc.code!r})") from None
    except EvflowError as exc:
        if ctx.is_run_error(exc) or isinstance(exc, ModuleError):
            raise
        located = _located(exc, path)
        if located is exc:
            raise
        raise located from exc
    except Exception as exc:
        if caused_by_interrupt(exc):
            # Ctrl-C inside an extension's import comes back as ImportError: still Ctrl-C
            raise KeyboardInterrupt from None
        line = _line_in(exc, path)
        err = SteeringError(f"{path}:{line}: {type(exc).__name__}: {exc}")
        err.traceback_text = _traceback_from(exc, path)  # type: ignore[attr-defined]
        raise err from exc
    finally:
        _CURRENT.reset(token)
        main, sys.argv, sys.path[:] = saved
        if main is not None:
            sys.modules["__main__"] = main
    if not ctx.summaries:
        raise SteeringError(
            f"steering file {str(path)!r} never called evflow.process(path): "
            f"build a path and end the file with evflow.process(path)"
        )
    return ctx.summaries


@contextmanager
def steering_overrides(**overrides: Any) -> Iterator[SteeringContext]:
    """Apply ``overrides`` to every ``process()`` call inside the block (tests, tools)."""
    ctx = SteeringContext(FsPath("<inline>"), overrides)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def _compile(path: FsPath) -> types.CodeType:
    if not path.exists():
        raise SteeringError(f"steering file {str(path)!r} does not exist")
    if path.is_dir():
        raise SteeringError(f"steering file {str(path)!r} is a directory, expected a .py file")
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise SteeringError(f"cannot read steering file {str(path)!r}: {exc.strerror}") from None
    try:
        return compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f"{path}:{exc.lineno}" if exc.lineno else str(path)
        text = f" in {exc.text.strip()!r}" if exc.text and exc.text.strip() else ""
        raise SteeringError(f"{where}: syntax error: {exc.msg}{text}") from None
    except ValueError as exc:  # e.g. null bytes
        raise SteeringError(f"{path}: not a Python file: {exc}") from None


def _line_in(exc: BaseException, path: FsPath) -> int | None:
    """The last line of the steering file on ``exc``'s traceback."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _traceback_from(exc: BaseException, path: FsPath) -> str:
    """The traceback from the steering file's first frame on (not our runner's)."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != str(path):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _located(exc: EvflowError, path: FsPath) -> EvflowError:
    """The same kind of error, its message prefixed with the steering file and line."""
    line = _line_in(exc, path)
    where = f"{path}:{line}" if line else str(path)
    try:
        return type(exc)(f"{where}: {exc}")
    except TypeError:  # an error class with another constructor: keep it as it is
        return exc

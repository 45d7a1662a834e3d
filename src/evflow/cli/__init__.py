"""The ``evflow`` command: one sub-command per module of this package.

Each sub-command module defines ``register(subparsers)`` that adds its parser and sets
``func`` (taking the parsed args, returning an exit code). Sub-command modules import
heavy dependencies inside their handlers so that ``evflow --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from typing import NoReturn

from evflow.errors import EvflowError, caused_by_interrupt, count_interrupts

# module names under evflow.cli, each with register(subparsers)
SUBCOMMANDS = ("run", "demo", "device", "ctl", "qc", "keys", "dashboard", "up", "agent", "status")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evflow", description="Reliable parallel event processing over ZeroMQ."
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"evflow.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"evflow.cli.{name}":
                continue  # sub-command not built yet
            raise
        module.register(sub)
    return parser


def _version() -> str:
    from evflow import __version__

    return f"evflow {__version__}"


def main(argv: list[str] | None = None) -> int:
    # a Ctrl-C that an extension's import turns into a plain ImportError is still a Ctrl-C
    count_interrupts()
    try:
        parser = build_parser()  # imports every sub-command: a Ctrl-C may come here too
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except EvflowError as exc:
        # one clear line, no traceback storm: the error message names the problem
        # (messages that wrap a library's multi-line text are joined into one line)
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"evflow: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("evflow: interrupted", file=sys.stderr)
        return 130
    except ImportError as exc:
        # Ctrl-C while a C extension initialises comes back as an ImportError
        if not caused_by_interrupt(exc):
            raise
        print("evflow: interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The ``evflow`` program: :func:`main`, then exit with its code.

    Once the command is done there is nothing left to interrupt, so SIGINT is ignored
    from then on: the interpreter's teardown puts the signal back to its default, and a
    Ctrl-C arriving then would end a clean run by the signal (exit -2) instead of with
    the command's code. (Not in :func:`main`, which tests call in-process.)"""
    try:
        code = main()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:  # between main's return and the line above
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("evflow: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    run()

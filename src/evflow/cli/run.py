"""``evflow run STEERING.py [-n N] [-o OUT] [-p N] [--quiet] [-- ARGS...]``.

Runs a steering file (plain Python that builds a path and calls ``evflow.process``).
``-n``/``-o``/``-p``/``--quiet`` override the file's own ``process()`` options. Exit
codes: 0 done, 1 an error (one line ``evflow: error: ...``; for an exception in user
code its traceback is printed once before it), 2 bad command line, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from evflow.errors import EvflowError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a steering file",
        description="Run a steering file: plain Python that builds a path and calls "
        "evflow.process(path). Options given here override the file's own.",
    )
    parser.add_argument("steering", metavar="STEERING.py", help="the steering file")
    parser.add_argument(
        "-n",
        "--max-events",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="process at most N events",
    )
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="OUT",
        help="also write the events that reach the end of the path to OUT "
        "(.root: a ROOT TTree, otherwise an evflow record file)",
    )
    parser.add_argument(
        "-p",
        "--workers",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="run the parallel modules on N worker processes (0: in this process)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    parser.add_argument(
        "--ordered",
        action="store_true",
        help="parallel runs: write the events in input order (a bounded reorder buffer "
        "in the output; default: the order they finish in)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue a parallel run that was stopped or killed: read from its checkpoint "
        "(OUT.ckpt), append to its output and skip the events already in it",
    )
    parser.add_argument(
        "--transport",
        choices=("zmq", "shm"),
        default=None,
        help="parallel runs: shm copies large events once into shared memory and sends "
        "only their place over the sockets (faster for events of 64 kB and more; "
        "modules must copy arrays they keep after event()); default zmq",
    )
    parser.add_argument(
        "args",
        nargs="*",
        metavar="ARGS",
        help="arguments for the steering file (sys.argv[1:]); put them after --",
    )
    parser.set_defaults(func=handle)


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The ``process()`` options the command line sets (only those given)."""
    overrides: dict[str, Any] = {}
    if args.max_events is not None:
        overrides["max_events"] = args.max_events
    if args.output is not None:
        overrides["output"] = args.output
    if args.workers is not None:
        overrides["workers"] = args.workers
    if args.quiet:
        overrides["quiet"] = True
    if getattr(args, "ordered", False):
        overrides["ordered"] = True
    if getattr(args, "resume", False):
        overrides["resume"] = True
    if getattr(args, "transport", None):
        overrides["transport"] = args.transport
    return overrides


def handle(args: argparse.Namespace) -> int:
    from evflow.processing.steering import run_steering

    try:
        run_steering(args.steering, overrides_from(args), argv=args.args)
    except EvflowError as exc:
        show_user_traceback(exc)
        raise  # the dispatcher prints the one-line error and returns 1
    return 0


def show_user_traceback(exc: BaseException) -> None:
    """Print the traceback of the user's code carried by ``exc`` (once), if any."""
    text = getattr(exc, "traceback_text", "")
    if text:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()

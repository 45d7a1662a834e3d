"""``evflow agent --bus PUB,SUB --session S --host NAME``: the host agent of a topology.

Started by ``evflow up`` through a launcher (local, ssh, srun), never by hand in normal
use. Everything but these options comes over the control bus; see
``evflow.topology.agent`` and ``docs/topology.md``.
"""

from __future__ import annotations

import argparse
import logging
import sys


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "agent",
        help="the per-host agent of a topology (started by evflow up)",
        description="Run the host agent: a zygote and supervisor for the devices that "
        "`evflow up` places on this host; it takes its orders over the control bus.",
    )
    parser.add_argument(
        "--bus",
        required=True,
        metavar="PUB,SUB",
        help="controller's bus ('-': read it from the first line of stdin, once the "
        "agent's zygote runs: evflow up starts agents before its bus exists)",
    )
    parser.add_argument("--session", required=True, help="the topology's session name")
    parser.add_argument("--host", required=True, help="this host's name in the topology")
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE before forking devices (user device classes; repeatable)",
    )
    parser.add_argument(
        "--controller-lost-s",
        type=float,
        default=None,
        metavar="S",
        help="stop every device after S seconds without the controller's heartbeat",
    )
    parser.add_argument(
        "--steering",
        default=None,
        metavar="FILE",
        help="a path run's steering file: load it and fork its workers on request",
    )
    parser.add_argument("--steering-argv", default=None, metavar="JSON", help=argparse.SUPPRESS)
    parser.add_argument("--cwd", default=None, metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--severity", default="info", choices=("debug", "info", "warn", "error"))
    parser.set_defaults(func=_handle)


def _handle(args: argparse.Namespace) -> int:
    from evflow.runtime.busclient import BusEndpoints
    from evflow.topology.agent import run_agent
    from evflow.topology.protocol import CONTROLLER_LOST_S

    if args.bus != "-":
        BusEndpoints.parse(args.bus)  # one clear error for a bad --bus
    level = {"warn": logging.WARNING}.get(args.severity, getattr(logging, args.severity.upper()))
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"[%(asctime)s][%(levelname)s][{args.host}] %(message)s",
    )
    lost_s = args.controller_lost_s if args.controller_lost_s is not None else CONTROLLER_LOST_S
    extension = None
    if args.steering:  # a path run's workers on this host
        from evflow.processing.parallel.run.pathworkers import PathRunShare, parse_argv

        extension = PathRunShare(args.steering, parse_argv(args.steering_argv), args.cwd)
    return run_agent(args.bus, args.session, args.host, args.preload, lost_s, extension)

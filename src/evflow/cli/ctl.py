"""``evflow ctl``: ask running processes over the control bus; prints JSON.

::

    evflow ctl check-state [ID]          # one node, or every node that answers
    evflow ctl get-metrics [ID]
    evflow ctl get-run [ID]              # a parallel run's processes (node 'parallel')
    evflow ctl transition ID RUN|STOP|END|...
    evflow ctl STOP --select 'sampler_.*'   # every node whose id matches (a topology)

The bus is ``--bus PUBLISH,SUBSCRIBE`` (the proxy's XSUB and XPUB endpoints), or the
local bus of ``--session S``, or, when neither is given, the only session with a bus
under the runtime directory. A node that does not answer within ``--timeout`` seconds
is one error line and exit code 1, never a hang.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from evflow.errors import ConfigurationError, EvflowError

TRANSITIONS = (
    "RUN",
    "STOP",
    "END",
    "INIT_DEVICE",
    "COMPLETE_INIT",
    "BIND",
    "CONNECT",
    "INIT_TASK",
    "RESET_TASK",
    "RESET_DEVICE",
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "ctl",
        help="query and steer running processes over the control bus",
        description="Send a command on the control bus and print the replies as JSON.",
    )
    _add_options(parser, main=True)
    sub = parser.add_subparsers(dest="ctl_command", metavar="COMMAND", required=True)
    for name, what in (("check-state", "state"), ("get-metrics", "metrics")):
        p = sub.add_parser(name, help=f"print the {what} of node ID, or of every node")
        p.add_argument("node_id", nargs="?", default="", metavar="ID")
        _add_options(p, main=False)
    p = sub.add_parser(
        "get-run",
        help="print a parallel run's processes: alive, lost, restarted, waiting to restart",
    )
    p.add_argument("node_id", nargs="?", default="parallel", metavar="ID", help="default: parallel")
    _add_options(p, main=False)
    p = sub.add_parser("transition", help="ask node ID to take a state transition")
    p.add_argument("node_id", metavar="ID")
    p.add_argument(
        "transition",
        type=str.upper,
        choices=TRANSITIONS,
        metavar="TRANSITION",
        help=f"one of {', '.join(TRANSITIONS)}",
    )
    _add_options(p, main=False)
    for name in TRANSITIONS:
        p = sub.add_parser(
            name,
            aliases=[name.lower()],
            help=f"ask every node matching --select to take {name}" if name == "RUN" else None,
        )
        p.add_argument(
            "--select",
            required=True,
            metavar="REGEX",
            help="node ids to address (a regular expression matching the whole id)",
        )
        p.set_defaults(ctl_command="transition", node_id="", transition=name)
        _add_options(p, main=False)
    parser.set_defaults(func=_handle)


def _add_options(parser: argparse.ArgumentParser, main: bool) -> None:
    """The options, accepted before and after the command (``ctl check-state X --timeout 1``)."""

    def default(value: Any) -> Any:
        return value if main else argparse.SUPPRESS  # keep what the main parser saw

    parser.add_argument(
        "--bus",
        default=default(""),
        metavar="PUB,SUB",
        help="bus endpoints: the proxy's XSUB and XPUB (default: the local session's)",
    )
    parser.add_argument("--session", default=default(""), help="use this local session's bus")
    parser.add_argument(
        "--timeout",
        type=float,
        default=default(None),
        metavar="SECONDS",
        help="how long to wait for replies (default 2 s for one node, 1.5 s to collect from all)",
    )


def resolve_bus(bus: str, session: str) -> Any:
    """BusEndpoints from ``--bus``, ``--session`` or the single local session with a bus."""
    from evflow.runtime.bus import BUS_IN, BusEndpoints, find_bus_sessions
    from evflow.transport.paths import runtime_base_dir

    if bus:
        return BusEndpoints.parse(bus)
    if session:
        path = runtime_base_dir() / session / BUS_IN
        if not path.exists():
            raise ConfigurationError(f"session {session!r} has no control bus (no {path})")
        return BusEndpoints.for_session(session)
    from evflow.cli.status import sweep_dead_sessions
    from evflow.transport.sessions import owner_gone

    sweep_dead_sessions()
    base = runtime_base_dir()
    found = [name for name in find_bus_sessions() if owner_gone(base / name) is None]
    if not found:
        raise ConfigurationError(
            f"no control bus found under {runtime_base_dir()} (is a run or topology up? "
            "else pass --bus PUB,SUB or --session S)"
        )
    if len(found) > 1:
        raise ConfigurationError(
            f"several sessions have a control bus ({', '.join(found)}); choose one with --session"
        )
    return BusEndpoints.for_session(found[0])


def _handle(args: argparse.Namespace) -> int:
    import zmq

    from evflow.runtime.bus import BusController

    endpoints = resolve_bus(args.bus, args.session)
    to = args.node_id or "*"
    timeout_s = args.timeout if args.timeout is not None else (2.0 if to != "*" else 1.5)
    if timeout_s <= 0:
        raise ConfigurationError(f"--timeout must be > 0, got {timeout_s}")
    cmd_args = {"transition": args.transition} if args.ctl_command == "transition" else None
    select = getattr(args, "select", None)
    if select is not None:
        import re

        try:
            re.compile(select)
        except re.error as exc:
            raise ConfigurationError(
                f"--select {select!r} is not a regular expression: {exc}"
            ) from None
        to = "*"
    context: zmq.Context[Any] = zmq.Context()
    try:
        controller = BusController(context, endpoints)
        try:
            replies = controller.request(
                args.ctl_command, to, cmd_args, timeout_s=timeout_s, select=select
            )
        finally:
            controller.close()
    finally:
        context.term()
    failed = [r for r in replies if not r.get("ok")]
    for r in failed:
        print(f"evflow: error: node {r.get('from')!r}: {r.get('error')}", file=sys.stderr)
    data = [r.get("data") for r in replies if r.get("ok")]
    if to != "*":
        if data:
            print(json.dumps(data[0], indent=2, sort_keys=True))
        return 1 if failed else 0
    if not replies:
        raise EvflowError(f"no node answered {args.ctl_command!r} within {timeout_s} s")
    print(json.dumps(data, indent=2, sort_keys=True))
    return 1 if failed else 0

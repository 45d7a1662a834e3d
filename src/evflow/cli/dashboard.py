"""``evflow dashboard --bus PUB,SUB [--bus ...] | --session S | --repo PATH [--port P]``.

The dashboard on its own, against any running bus (a run's, a topology's) and/or a QC
repository: the run page, the QC viewer, the quality summary and ``/metrics``. Runs until
Ctrl-C (or ``--duration S``). Exit 1 with one line for a port in use or a repository
that does not exist.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from evflow.cli.run import port_arg
from evflow.errors import ConfigurationError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "dashboard",
        help="serve the live dashboard and /metrics for a bus and/or a QC repository",
        description="Serve the dashboard (run page, QC viewer, /metrics) for a running "
        "bus and/or a QC repository, until Ctrl-C.",
    )
    parser.add_argument(
        "--bus",
        action="append",
        default=[],
        metavar="PUB,SUB",
        help="a bus proxy's two endpoints (repeat for several buses)",
    )
    parser.add_argument("--session", default=None, help="the bus of this local session")
    parser.add_argument("--repo", default=None, metavar="PATH", help="a QC repository file")
    parser.add_argument(
        "--port", type=port_arg, default="auto", help="port number or 'auto' (default)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--prometheus", default=None, metavar="URL", help="history from here")
    parser.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S s")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from evflow.monitor.web.server import start_dashboard
    from evflow.runtime.busclient import BusEndpoints, find_bus_sessions

    buses = [BusEndpoints.parse(b) for b in args.bus]
    if args.session:
        if args.session not in find_bus_sessions():
            found = ", ".join(find_bus_sessions()) or "none"
            raise ConfigurationError(
                f"no bus in session {args.session!r} (sessions with a bus here: {found}; "
                "is the run still going? give a remote bus with --bus PUB,SUB)"
            )
        buses.append(BusEndpoints.for_session(args.session))
    if not buses and args.repo is None:
        raise ConfigurationError(
            "evflow dashboard needs something to show: --bus PUB,SUB, --session S or --repo PATH"
        )
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with start_dashboard(
            buses,
            args.port,
            host=args.host,
            port_option="--port",
            repo=args.repo,
            prometheus_url=args.prometheus,
        ) as dash:
            print(f"evflow: dashboard at {dash.url}", file=sys.stderr, flush=True)
            stop.wait(args.duration)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0

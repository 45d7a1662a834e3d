"""``evflow status`` and ``evflow down``: a running topology, found by session name.

::

    evflow status [--session S] [--json]     # device, host, state, msg/s
    evflow down [--session S] [--timeout S]  # orderly shutdown of every host; waits

Without ``--session``, the only topology session under the runtime directory is used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

from evflow.errors import ConfigurationError, TimeoutError_

MARKER = "topology.json"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = subparsers.add_parser(
        "status", help="show the devices of a running topology", description=__doc__
    )
    status.add_argument("--session", default="", help="the topology's session")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--timeout", type=float, default=3.0, metavar="S")
    status.set_defaults(func=_status)
    down = subparsers.add_parser(
        "down", help="stop a running topology (orderly, every host)", description=__doc__
    )
    down.add_argument("--session", default="", help="the topology's session")
    down.add_argument("--timeout", type=float, default=60.0, metavar="S")
    down.set_defaults(func=_down)


def topology_sessions() -> list[str]:
    """Sessions under the runtime directory run by a topology controller."""
    from evflow.transport.paths import runtime_base_dir

    base = runtime_base_dir()
    try:
        return sorted(d.name for d in base.iterdir() if (d / MARKER).exists())
    except OSError:
        return []


def find_session(session: str) -> str:
    from evflow.transport.paths import runtime_base_dir

    if session:
        if not (runtime_base_dir() / session / MARKER).exists():
            known = ", ".join(topology_sessions()) or "none"
            raise ConfigurationError(
                f"no running topology with session {session!r} (running: {known})"
            )
        return session
    found = topology_sessions()
    if not found:
        raise ConfigurationError(
            f"no running topology under {runtime_base_dir()} (start one with evflow up)"
        )
    if len(found) > 1:
        raise ConfigurationError(
            f"several topologies run ({', '.join(found)}); choose one with --session"
        )
    return found[0]


def ask_controller(session: str, cmd: str, timeout_s: float) -> dict[str, Any]:
    import zmq

    from evflow.runtime.bus import BusController, BusEndpoints
    from evflow.topology.protocol import CONTROLLER_ID

    context: zmq.Context[Any] = zmq.Context()
    try:
        ctl = BusController(context, BusEndpoints.for_session(session))
        try:
            reply = ctl.request(cmd, CONTROLLER_ID, timeout_s=timeout_s)[0]
        finally:
            ctl.close()
    finally:
        context.term()
    if not reply.get("ok"):
        raise ConfigurationError(f"controller of {session!r}: {reply.get('error')}")
    data: dict[str, Any] = reply.get("data") or {}
    return data


def _status(args: argparse.Namespace) -> int:
    session = find_session(args.session)
    data = ask_controller(session, "status", args.timeout)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    from rich.console import Console

    from evflow.topology.view import status_table

    Console().print(status_table(data))
    return 0


def _down(args: argparse.Namespace) -> int:
    from evflow.cli.up import SUMMARY_FILE
    from evflow.transport.paths import runtime_base_dir

    session = find_session(args.session)
    ask_controller(session, "down", 5.0)
    path = runtime_base_dir() / session
    summary = ""
    deadline = time.monotonic() + args.timeout
    while path.exists():
        if not summary:  # the controller's end summary, left for us before it goes
            with contextlib.suppress(OSError):
                summary = (path / SUMMARY_FILE).read_text()
                (path / SUMMARY_FILE).unlink()  # read: the controller need not wait
        if time.monotonic() > deadline:
            raise TimeoutError_(
                f"session {session!r}: the controller did not finish within {args.timeout:g} s"
            )
        time.sleep(0.02)
    print(summary, end="")
    print(f"session {session}: down")
    return 0

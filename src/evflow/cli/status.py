"""``evflow status`` and ``evflow down``: a running topology, found by session name.

::

    evflow status [--session S] [--json]     # device, host, state, msg/s
    evflow down [--session S] [--timeout S]  # orderly shutdown of every host; waits

Without ``--session``, the only live topology session under the runtime directory is
used. What sessions of dead controllers (``kill -9``) left is removed first, in one
line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
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


def sweep_dead_sessions(named: str = "") -> list[str]:
    """Remove what sessions of dead owners left (a run killed with ``kill -9``: its
    directory, ipc files and shm segments) and say so in one line on stderr (the
    caller's own message speaks of session ``named``)."""
    from evflow.transport.sessions import remove_stale_sessions

    removed = remove_stale_sessions()
    others = [name for name in removed if name != named and not name.startswith(f"{named}-")]
    if others:
        many = "s" if len(others) > 1 else ""
        print(
            f"evflow: removed what dead session{many} {', '.join(sorted(others))} left (killed; "
            "no process of them runs)",
            file=sys.stderr,
        )
    return removed


def topology_sessions() -> list[str]:
    """Sessions under the runtime directory run by a live topology controller (a
    session whose controller is gone is left out)."""
    from evflow.transport.paths import runtime_base_dir
    from evflow.transport.sessions import owner_gone

    base = runtime_base_dir()
    try:
        found = sorted(d for d in base.iterdir() if (d / MARKER).exists())
    except OSError:
        return []
    return [d.name for d in found if owner_gone(d) is None]


def find_session(session: str) -> str | None:
    """The topology session to talk to: ``session``, or the only live one. Sessions of
    dead controllers are cleaned first; None: ``session`` was one of them."""
    from evflow.transport.paths import runtime_base_dir
    from evflow.transport.sessions import owner_gone

    removed = sweep_dead_sessions(session)
    if session:
        path = runtime_base_dir() / session
        if session in removed:
            return None
        if not (path / MARKER).exists():
            known = ", ".join(topology_sessions()) or "none"
            raise ConfigurationError(
                f"no running topology with session {session!r} (running: {known})"
            )
        gone = owner_gone(path)
        if gone is not None:  # something of it still listens: not removed
            raise ConfigurationError(
                f"session {session!r} is not running: its controller (pid {gone.pid}) is "
                f"gone, but a process still listens in {path}"
            )
        return session
    found = topology_sessions()
    if not found:
        raise ConfigurationError(
            f"no running session under {runtime_base_dir()} (start a topology with evflow up)"
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
    if session is None:
        raise ConfigurationError(
            f"session {args.session!r} is not running: its controller was killed "
            "(what it left is removed now)"
        )
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
    if session is None:  # dead, and cleaned above: down already
        print(f"session {args.session}: down (its controller was killed; what it left is removed)")
        return 0
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

"""``evflow up TOPOLOGY.toml [--launcher local|ssh|slurm] [--hosts HOSTS.toml] [--detach]``.

Starts one agent per host, walks every device to RUNNING, shows a live table, and
returns when the topology ends: 0 when every device ended cleanly (or its loss was
allowed by ``n_min``/``expendable``), 1 with one error line otherwise, 130 after
Ctrl-C (an orderly shutdown of every host; a second Ctrl-C is fast). ``--detach``
returns once every device is RUNNING; the controller goes on in the background
(``evflow status``, ``evflow ctl``, ``evflow down`` reach it by session name).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import time
from typing import Any

from evflow.errors import ConfigurationError, EvflowError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start a topology of devices on one or many hosts",
        description="Start every device of a topology file, walk them to RUNNING and "
        "watch them until the topology ends (or Ctrl-C).",
    )
    parser.add_argument("topology", metavar="TOPOLOGY.toml")
    parser.add_argument("--launcher", default="local", choices=("local", "ssh", "slurm"))
    parser.add_argument("--hosts", default=None, metavar="HOSTS.toml", help="a [hosts] file")
    parser.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="CURVE keys (evflow keys DIR --names controller HOST...): every tcp socket, "
        "the control bus included, uses CURVE (default: $EVFLOW_CURVE_KEYS)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a topology that spans hosts to run with plaintext tcp (no keys)",
    )
    parser.add_argument("--session", default="", help="session name (default: NAME-xxxxxx)")
    parser.add_argument("--detach", action="store_true", help="return once all devices are RUNNING")
    parser.add_argument(
        "--stats-dir", default="", metavar="DIR", help="each device writes DIR/<id>.json at exit"
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="modules the agents import before forking devices (user device classes)",
    )
    parser.add_argument("--connect-timeout", type=float, default=None, metavar="S")
    parser.add_argument("--start-timeout", type=float, default=60.0, metavar="S")
    parser.add_argument("--grace", type=float, default=3.0, metavar="S", help="per stop group")
    parser.add_argument(
        "--quiet", action="store_true", help="no live table, state lines or end summary"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log what every process does (INFO) and, without a terminal, one line per "
        "change of the device states (default: warnings and errors, then a summary)",
    )
    parser.add_argument(
        "--severity",
        default=None,
        choices=("debug", "info", "warn", "error"),
        help="log level of the controller, agents and devices (default: warn; -v: info)",
    )
    parser.add_argument("--notify-fd", type=int, default=-1, help=argparse.SUPPRESS)
    parser.set_defaults(func=_handle)


def session_name(name: str) -> str:
    import uuid

    base = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:20] or "topology"
    return f"{base}-{uuid.uuid4().hex[:6]}"


def _load(args: argparse.Namespace) -> Any:
    from evflow.topology.loader import load_topology
    from evflow.topology.resolve import resolve
    from evflow.transport.hosts import load_hosts

    hosts = load_hosts(args.hosts) if args.hosts else None
    return resolve(load_topology(args.topology, hosts))


def _security(args: argparse.Namespace, topology: Any) -> Any:
    """The topology's CURVE keys (None: plaintext), or one error naming the fix."""
    from evflow.topology.keypolicy import farm_security

    used = {d.host for d in topology.devices.values()}
    hosts_file = args.hosts or (args.topology if "hosts" in _toml_tables(args.topology) else "")
    return farm_security(
        topology_name=topology.name,
        launcher=args.launcher,
        hosts={h: topology.hosts[h] for h in used},
        hosts_file=hosts_file,
        keys_dir=args.keys,
        insecure=args.insecure,
    )


def _toml_tables(path: str) -> set[str]:
    import tomllib

    with open(path, "rb") as f:
        return set(tomllib.load(f))


def _handle(args: argparse.Namespace) -> int:
    holder: dict[str, Any] = {"ctrl": None, "early": 0}

    def on_signal(signum: int, frame: Any) -> None:
        if holder["ctrl"] is not None:
            holder["ctrl"].request_stop()
        else:
            holder["early"] += 1

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        topology = _load(args)
        if args.session and not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", args.session):
            raise ConfigurationError(
                f"--session {args.session!r}: use letters, digits, '_' and '-' (at most 40)"
            )
        session = args.session or session_name(topology.name)
        security = _security(args, topology)
        if args.detach:
            return _detach(args, session)
        if holder["early"]:  # Ctrl-C before anything started: nothing to stop
            raise KeyboardInterrupt  # the dispatcher says "evflow: interrupted", exit 130
        return _run(args, topology, session, holder, security)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _run(
    args: argparse.Namespace, topology: Any, session: str, holder: dict[str, Any], security: Any
) -> int:
    from evflow.topology.controller import Controller
    from evflow.topology.protocol import CONNECT_TIMEOUT_S
    from evflow.topology.view import make_view

    notify_fd = args.notify_fd
    if notify_fd >= 0:
        _log_to_session(session)
    severity = args.severity or ("info" if args.verbose else "warn")
    level = {"warn": logging.WARNING}.get(severity, getattr(logging, severity.upper()))
    logging.basicConfig(
        level=level, stream=sys.stderr, format="[%(asctime)s][%(levelname)s] %(message)s"
    )
    view = None if args.quiet or notify_fd >= 0 else make_view(lines=args.verbose)

    def on_up(ctrl: Any) -> None:
        print(
            f"{topology.name}: {len(ctrl.records)} devices RUNNING on {len(ctrl.hosts)} "
            f"host(s) after {ctrl.running_after_s:.2f} s (session {session})",
            file=sys.stderr,
            flush=True,
        )
        _notify(args, "up\n")

    if args.stats_dir:
        os.makedirs(args.stats_dir, exist_ok=True)
    ctrl = Controller(
        topology,
        session=session,
        launcher=args.launcher,
        stats_dir=os.path.abspath(args.stats_dir) if args.stats_dir else "",
        connect_timeout_s=args.connect_timeout or CONNECT_TIMEOUT_S,
        start_timeout_s=args.start_timeout,
        grace_s=args.grace,
        preload=tuple(args.preload),
        view=view,
        on_up=on_up,
        on_end=_write_summary if notify_fd >= 0 else None,
        security=security,
        severity=severity,
    )
    holder["ctrl"] = ctrl
    for _ in range(holder["early"]):
        ctrl.request_stop()
    try:
        code = ctrl.run()
    finally:
        if view is not None:
            view.close(ctrl)
    _report(ctrl, quiet=args.quiet or notify_fd >= 0)
    if ctrl.failure:
        _notify(args, f"error: {ctrl.failure}\n")
        if code != 130:
            raise EvflowError(ctrl.failure)
    _notify(args, "error: the topology stopped before all devices were RUNNING\n")
    if code == 130:
        print("evflow: interrupted", file=sys.stderr)
    return code


def _report(ctrl: Any, quiet: bool = False) -> None:
    """The end in a few lines: a summary per device kind, which devices were lost."""
    from evflow.topology.view import end_summary

    if not quiet and ctrl.running_after_s is not None:  # (a failed start: its error line)
        for line in end_summary(ctrl, time.monotonic() - ctrl.started_s):
            print(line, file=sys.stderr)
    lost = [r for r in ctrl.records.values() if r.lost]
    for rec in lost[:20]:
        print(f"{rec.id} ({rec.host}): lost: {rec.error or rec.message}", file=sys.stderr)
    if len(lost) > 20:
        print(f"... and {len(lost) - 20} more lost", file=sys.stderr)
    # devices that hung on their way out (e.g. waiting for a lost peer) and were killed
    # by their agent's shutdown: a consequence of the stop, named once, not as losses
    stopped = [r.id for r in ctrl.records.values() if r.killed_at_shutdown]
    if stopped:
        shown = ", ".join(stopped[:10]) + (
            f" and {len(stopped) - 10} more" if len(stopped) > 10 else ""
        )
        print(f"stopped by the controller at shutdown: {len(stopped)} ({shown})", file=sys.stderr)


#: a detached controller's end summary, in its session directory, for ``evflow down``
SUMMARY_FILE = "summary.txt"
#: how long a detached controller keeps its session for ``evflow down`` to read it
SUMMARY_WAIT_S = 3.0


def _write_summary(ctrl: Any) -> None:
    """Detached: leave the end summary where ``evflow down`` (waiting for the session to
    go) reads it, and give it a moment to (it removes the file once read)."""
    from evflow.topology.view import end_summary
    from evflow.transport.paths import runtime_base_dir

    folder = runtime_base_dir() / ctrl.session
    if not folder.is_dir():
        return
    lines = end_summary(ctrl, time.monotonic() - ctrl.started_s)
    tmp = folder / f".{SUMMARY_FILE}.tmp"
    try:
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(folder / SUMMARY_FILE)  # whole or not at all for the reader
    except OSError as exc:  # (a full disk): the topology ended all the same
        print(f"evflow: warning: cannot leave the summary for evflow down: {exc}", file=sys.stderr)
        return
    if ctrl.down_requested:  # somebody waits for it
        deadline = time.monotonic() + SUMMARY_WAIT_S
        while (folder / SUMMARY_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.02)


def _notify(args: argparse.Namespace, text: str) -> None:
    if args.notify_fd < 0:
        return
    try:
        os.write(args.notify_fd, text.encode())
        os.close(args.notify_fd)
    except OSError:
        pass
    args.notify_fd = -1


def _log_to_session(session: str) -> None:
    """A detached controller writes its log into its session directory."""
    from evflow.transport.paths import session_dir

    fd = os.open(session_dir(session) / "controller.log", os.O_WRONLY | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _detach(args: argparse.Namespace, session: str) -> int:
    """Start the controller in the background; return once it says all are RUNNING."""
    import subprocess

    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "evflow", "up", args.topology, "--launcher", args.launcher]
    argv += ["--session", session, "--notify-fd", str(write_fd), "--grace", str(args.grace)]
    argv += ["--start-timeout", str(args.start_timeout)]
    if args.verbose:
        argv.append("-v")
    if args.severity:
        argv += ["--severity", args.severity]
    if args.hosts:
        argv += ["--hosts", args.hosts]
    if args.keys:
        argv += ["--keys", os.path.abspath(args.keys)]
    if args.insecure:
        argv += ["--insecure"]
    if args.stats_dir:
        argv += ["--stats-dir", os.path.abspath(args.stats_dir)]
    if args.connect_timeout:
        argv += ["--connect-timeout", str(args.connect_timeout)]
    for module in args.preload:
        argv += ["--preload", module]
    subprocess.Popen(
        argv,
        pass_fds=(write_fd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        answer = pipe.readline().decode(errors="replace").strip()
    if answer == "up":
        print(f"session {session}: every device RUNNING", flush=True)
        print(
            f"  evflow status --session {session}\n  evflow down --session {session}",
            flush=True,
        )
        return 0
    if answer.startswith("error: "):
        raise EvflowError(answer[len("error: ") :])
    raise EvflowError(f"session {session}: the controller exited before the topology was up")

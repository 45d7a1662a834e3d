"""``evflow run STEERING.py [-n N] [-o OUT] [-p N] [--quiet] [-- ARGS...]``.

Runs a steering file (plain Python that builds a path and calls ``evflow.process``).
``-n``/``-o``/``-p``/``--quiet`` override the file's own ``process()`` options. Exit
codes: 0 done, 1 an error (one line ``evflow: error: ...``; for an exception in user
code its traceback is printed once before it), 2 bad command line, 3 events failed in
a module (parallel: quarantined, unless ``--allow-quarantine``; sequential: the run
stopped at the first), 130 interrupted (143 for SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from evflow.errors import EvflowError, ModuleError
from evflow.processing.failures import EXIT_EVENTS_FAILED

EPILOG = f"""\
exit codes: 0 done; 1 an error (one line 'evflow: error: ...'); 2 bad command line;
{EXIT_EVENTS_FAILED} events failed in a module: a parallel run quarantined events (each
failing module is named on stderr, even with -q), a sequential run stopped at the
first; with --allow-quarantine both quarantine them and exit 0; 130 interrupted
(Ctrl-C); 143 terminated (SIGTERM).
"""


class _RunParser(argparse.ArgumentParser):
    """Everything after the first ``--`` belongs to the steering file, wherever the
    options of ``evflow run`` stand (``run steer.py -o X -- --outdir D``): argparse
    alone fills the positional ARGS at the steering file's name and would refuse the
    arguments that follow ``--`` after an option."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        words = list(sys.argv[1:] if args is None else args)
        cut = words.index("--") if "--" in words else len(words)
        tail = words[cut + 1 :]
        ns, extras = super().parse_known_args(words[:cut], namespace)
        if ns.steering is None:
            if not tail:
                self.error("the following arguments are required: STEERING.py")
            ns.steering = tail.pop(0)
        ns.args = [*ns.args, *tail]
        return ns, extras


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a steering file",
        description="Run a steering file: plain Python that builds a path and calls\n"
        "evflow.process(path). Options given here override the file's own.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.__class__ = _RunParser  # ``--`` splits off the steering file's arguments
    parser.add_argument("steering", nargs="?", metavar="STEERING.py", help="the steering file")
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
        type=workers_arg,
        default=None,
        metavar="N",
        help="run the parallel modules on N worker processes (0: in this process); with "
        "--hosts: N per host, or per host by name (h1=2,h2=1)",
    )
    parser.add_argument(
        "--hosts",
        default=None,
        metavar="HOSTS.toml",
        help="parallel runs: fork the workers on these hosts (input and output stay here; "
        "the hosts share this filesystem); see docs/farm_paths.md",
    )
    parser.add_argument(
        "--launcher",
        choices=("ssh", "slurm", "local"),
        default=None,
        help="with --hosts: how the host agents are started (default ssh)",
    )
    parser.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="with --hosts: CURVE keys (evflow keys DIR --names controller HOST...) for every "
        "tcp socket of the run (default: $EVFLOW_CURVE_KEYS)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="with --hosts over ssh or slurm: allow plaintext tcp when no keys are given",
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar and no summary (failed events are still named on stderr)",
    )
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
    add_monitor_options(parser)
    parser.add_argument(
        "--event-timeout",
        type=non_negative_float,
        default=None,
        metavar="S",
        help="parallel runs: kill a worker busy longer than S seconds on one event; the "
        "event is retried, then quarantined (default: 300; 0: no limit)",
    )
    parser.add_argument(
        "--allow-quarantine",
        action="store_true",
        help=f"an event a module raises on is quarantined (written flagged, the run "
        f"goes on) and the run exits 0 (default: exit code {EXIT_EVENTS_FAILED}; a "
        f"sequential run stops at the first)",
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


def workers_arg(text: str) -> int | dict[str, int]:
    """``-p 4`` or ``-p h1=2,h2=1`` (workers per host of --hosts)."""
    if "=" not in text:
        return non_negative_int(text)
    counts: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if not name.strip():
            raise argparse.ArgumentTypeError(f"expected HOST=N in {text!r}, got {part!r}")
        counts[name.strip()] = non_negative_int(value.strip())
    return counts


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def port_arg(text: str) -> int | str:
    """A dashboard port: 1-65535 or ``auto`` (a bad one is a bad command line: exit 2)."""
    if text == "auto":
        return "auto"
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected a port number (1-65535) or 'auto', got {text!r}"
        )
    return port


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The ``process()`` options the command line sets (only those given)."""
    overrides: dict[str, Any] = {}
    if args.max_events is not None:
        overrides["max_events"] = args.max_events
    if args.output is not None:
        overrides["output"] = args.output
    if isinstance(args.workers, dict):  # -p h1=2,h2=1 (with --hosts)
        overrides["host_workers"] = args.workers
        overrides["workers"] = sum(args.workers.values())
    elif args.workers is not None:
        overrides["workers"] = args.workers
    if getattr(args, "hosts", None):
        overrides["hosts"] = args.hosts
    if getattr(args, "launcher", None):
        overrides["launcher"] = args.launcher
    if getattr(args, "insecure", False):
        overrides["insecure"] = True
    if getattr(args, "keys", None):
        # the farm keys travel in the environment, as for evflow up (transport/farmkeys.py)
        os.environ["EVFLOW_CURVE_KEYS"] = os.path.abspath(args.keys)
    if args.quiet:
        overrides["quiet"] = True
    if getattr(args, "ordered", False):
        overrides["ordered"] = True
    if getattr(args, "resume", False):
        overrides["resume"] = True
    if getattr(args, "transport", None):
        overrides["transport"] = args.transport
    if getattr(args, "event_timeout", None) is not None:
        overrides["event_timeout_s"] = args.event_timeout
    if getattr(args, "allow_quarantine", False):
        overrides["allow_quarantine"] = True
    return overrides


def add_monitor_options(parser: argparse.ArgumentParser) -> None:
    """``--dashboard``, ``--report`` and friends (monitor/runhook.py; parallel runs)."""
    g = parser.add_argument_group("monitoring (parallel runs, see docs/monitoring.md)")
    g.add_argument(
        "--dashboard",
        metavar="PORT",
        type=port_arg,
        default=None,
        help="serve the live dashboard and /metrics on 127.0.0.1:PORT ('auto': the first "
        "free port from 8050)",
    )
    g.add_argument(
        "--dashboard-host",
        default="127.0.0.1",
        metavar="ADDR",
        help="address to bind the dashboard to (not loopback: a token is required in the URL)",
    )
    g.add_argument(
        "--dashboard-linger",
        type=non_negative_float,
        default=0.0,
        metavar="S",
        help="keep the dashboard up S seconds after the run (a last scrape, a last look)",
    )
    g.add_argument("--qc-repo", default=None, metavar="PATH", help="QC repository to show/report")
    g.add_argument("--prometheus", default=None, metavar="URL", help="read history from Prometheus")
    g.add_argument(
        "--report", default=None, metavar="DIR", help="write an HTML report with PNG plots to DIR"
    )


def monitor_request(args: argparse.Namespace) -> Any:
    """The RunMonitor the options ask for, or None."""
    port = getattr(args, "dashboard", None)
    report = getattr(args, "report", None)
    if port is None and report is None:
        return None
    from evflow.monitor.runhook import RunMonitor

    return RunMonitor(
        port=port,
        host=args.dashboard_host,
        repo=args.qc_repo,
        prometheus_url=args.prometheus,
        linger_s=args.dashboard_linger,
        report_dir=report,
        title=f"evflow run {os.path.basename(args.steering)}",
    )


def handle(args: argparse.Namespace) -> int:
    from evflow.processing.steering import run_steering

    monitor = monitor_request(args)
    if monitor is not None:
        from evflow.monitor import runhook

        runhook.request(monitor)
    try:
        summaries = run_steering(args.steering, overrides_from(args), argv=args.args)
    except ModuleError as exc:
        show_user_traceback(exc)
        if exc.hook != "event":
            raise  # the dispatcher prints the one-line error and returns 1
        # an event failed: the same exit code as a parallel run that quarantined it
        _error_line(str(exc))
        return EXIT_EVENTS_FAILED
    except EvflowError as exc:
        show_user_traceback(exc)
        raise  # the dispatcher prints the one-line error and returns 1
    finally:
        if monitor is not None:
            runhook.release()  # later runs in this process are not monitored
    if monitor is not None and not runhook.used:
        print(
            "evflow: warning: --dashboard/--report need a parallel run (-p N with N >= 1); "
            "this run had no bus to monitor",
            file=sys.stderr,
        )
    failed = [s for s in summaries if s.events_failed]
    if failed:
        n = sum(s.events_quarantined for s in failed)
        _error_line(
            f"{n} event{'s' if n != 1 else ''} failed and {'were' if n != 1 else 'was'} "
            f"quarantined (exit code {EXIT_EVENTS_FAILED}; --allow-quarantine accepts "
            "quarantined events)"
        )
        return EXIT_EVENTS_FAILED
    return 0


def _error_line(text: str) -> None:
    message = " ".join(line.strip() for line in text.splitlines() if line.strip())
    sys.stderr.write(f"evflow: error: {message}\n")
    sys.stderr.flush()


def show_user_traceback(exc: BaseException) -> None:
    """Print the traceback of the user's code carried by ``exc`` (once), if any."""
    text = getattr(exc, "traceback_text", "")
    if text:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()

"""How ``evflow run --dashboard/--report`` reaches the parent of a parallel run.

The command line records a :class:`RunMonitor` request (:func:`request`), which
installs :func:`on_bus` (bound to the request) and :func:`on_end` as the run hooks of
``processing/runhooks.py``: the parallel engine, which owns the run's bus, calls the
first once the bus is up and the second when the roles have exited. With no request
nothing is installed, so the engine needs no option of its own and processing does not
import monitor. A topology controller (``evflow up``) calls
:func:`evflow.monitor.web.start_dashboard` directly instead.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from evflow.monitor.collector import BusCollector, MetricsStore
from evflow.processing import runhooks
from evflow.processing.runhooks import RunHooks
from evflow.runtime.busclient import BusEndpoints

log = logging.getLogger("evflow.monitor")


@dataclass(frozen=True)
class RunMonitor:
    """What the user asked for: ``port`` (number, ``"auto"`` or None: no web server)."""

    port: int | str | None = None
    host: str = "127.0.0.1"
    repo: str | None = None
    prometheus_url: str | None = None
    linger_s: float = 0.0
    report_dir: str | None = None
    title: str = "evflow run"


@dataclass
class ActiveMonitor:
    request: RunMonitor
    store: MetricsStore
    dashboard: Any = None  # evflow.monitor.web.Dashboard
    collector: BusCollector | None = None


#: the monitors of the runs so far (the report and tests read them)
used: list[ActiveMonitor] = []


def request(monitor: RunMonitor | None) -> None:
    """Ask the next parallel runs of this process for a dashboard/report (None: stop).

    With a port, the port is tried now (ConfigurationError when it is in use: before
    the run starts anything) and the web modules are imported now, outside the run's
    clock. The run binds it again when its bus is up: a socket bound here would be
    inherited by the zygote and every worker forked from it.
    """
    release()
    used.clear()
    if monitor is not None and monitor.port is not None:
        from evflow.monitor.web.server import bind_socket

        if monitor.port != "auto":
            bind_socket(monitor.host, monitor.port).close()
    if monitor is not None:
        runhooks.install(RunHooks(functools.partial(on_bus, monitor), on_end))


def release() -> None:
    """No more monitoring for later runs (``used`` is kept)."""
    runhooks.install(None)


def on_bus(
    req: RunMonitor, endpoints: BusEndpoints, info: Callable[[], dict[str, Any]]
) -> ActiveMonitor:
    """The run's bus is up: start the collector (and the dashboard when asked)."""
    store = MetricsStore()
    base_info = {"title": req.title}

    def run_info() -> dict[str, Any]:
        return {**base_info, **info()}

    store.run_info = run_info
    active = ActiveMonitor(req, store)
    if req.port is not None:
        from evflow.monitor.web import start_dashboard

        active.dashboard = start_dashboard(
            [endpoints],
            req.port,
            host=req.host,
            repo=req.repo,
            prometheus_url=req.prometheus_url,
            store=store,
        )
        print(f"evflow: dashboard at {active.dashboard.url}", file=sys.stderr, flush=True)
    else:
        active.collector = BusCollector(store, [endpoints]).start()
    used.append(active)
    return active


def on_end(active: ActiveMonitor | None, ok: bool, cut: Callable[[], bool] = lambda: False) -> None:
    """The roles have exited: linger (if asked and the run went well; ``cut()`` True,
    e.g. after Ctrl-C, ends it early), report, stop. Never raises into the run."""
    if active is None:
        return
    req = active.request
    try:
        if ok and req.linger_s > 0 and active.dashboard is not None:
            print(
                f"evflow: run done; the dashboard stays up {req.linger_s:g} s at "
                f"{active.dashboard.url}",
                file=sys.stderr,
                flush=True,
            )
            deadline = time.monotonic() + req.linger_s
            while time.monotonic() < deadline and not cut():
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        elif ok:
            time.sleep(0.3)  # the roles' final metrics are still on their way
        if req.report_dir is not None:
            from evflow.monitor.report import write_report

            try:
                page = write_report(req.report_dir, active.store, repo=req.repo, title=req.title)
                print(f"evflow: report written to {page}", file=sys.stderr, flush=True)
            except Exception as exc:  # the run itself went well: a warning, not a failure
                log.error("the run's report was not written: %s", exc, exc_info=True)
                print(f"evflow: warning: no report: {exc}", file=sys.stderr, flush=True)
    finally:
        try:
            if active.dashboard is not None:
                active.dashboard.stop()
            if active.collector is not None:
                active.collector.stop()
        except Exception as exc:  # the run's own outcome must not be masked
            log.error("stopping the dashboard failed: %s", exc, exc_info=True)

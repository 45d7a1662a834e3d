"""The calling process of a parallel run: start the roles, watch them, stop them.

The caller (the process running the steering file) keeps the split path in
``currentsplit`` and starts the runtime's :class:`~evflow.runtime.supervisor.Supervisor`
*before* it creates any zmq context: its zygote forks the input, N workers and the
output, it reaps them, kills them and restarts them, and it relays SIGINT/SIGTERM to
``self.signals``, as for any device of a topology. What a death means is the path's
policy, given to the supervisor as each role's ``decide`` hook (exitpolicy.py); the
summary is built by runsummary.py. The caller holds the ``ctl`` ROUTER every role
reports to (HELLO, STATE ERROR, RESULT) and reacts to:

- a child's exit (the zygote's notice fd wakes the poll at once): a worker that dies
  unasked is reported to the input (WORKER_LOST: its unconfirmed batches are sent
  again) and replaced by a fresh fork, up to ``max_restarts``; a dead input or output
  is restarted when it can be, else it stops the run with a clear error;
- SIGINT/SIGTERM: the first asks the input to STOP reading (in-flight events finish
  and are written, files close, KeyboardInterrupt / exit 143 afterwards); a second
  kills the workers and tells the output to close its files now.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import secrets
import signal
import sys
import time
from typing import Any

import zmq

from evflow.errors import (
    ConfigurationError,
    EvflowError,
    PeerLostError,
)
from evflow.processing import runhooks
from evflow.processing.chain import output_files
from evflow.processing.console import is_terminal
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import currentsplit, scoreboard, statsboard
from evflow.processing.parallel.common import channel
from evflow.processing.parallel.input import checkpoint
from evflow.processing.parallel.input.input import input_main
from evflow.processing.parallel.notices import say as _say
from evflow.processing.parallel.notices import stopping_line, warn_many_workers
from evflow.processing.parallel.output.output import output_main
from evflow.processing.parallel.run.control import ControlMixin
from evflow.processing.parallel.run.exitpolicy import ExitPolicy
from evflow.processing.parallel.run.restarts import RestartPolicy
from evflow.processing.parallel.run.runsummary import LOST, RunSummaryMixin
from evflow.processing.parallel.split import SplitPath
from evflow.processing.statistics import ModuleStatistics
from evflow.processing.summary import RunSummary
from evflow.runtime.bus import BusProxy
from evflow.runtime.busclient import BusClient
from evflow.runtime.supervisor import RestartBudget, Supervisor
from evflow.transport import security
from evflow.transport.security import RunAuth
from evflow.transport.sessions import claim_session, remove_stale_sessions
from evflow.wire.messages import BadMessageCounter, MsgType

#: after the input and output are done, workers get this long to exit on their own (s)
WORKER_EXIT_GRACE_S = 5.0
#: after an error or a second interrupt, roles get this long to close files (s)
ABORT_GRACE_S = 5.0
#: after the first interrupt, events in flight get this long to finish before the run
#: stops as after a second one (a hung event must not hold the shutdown; option
#: ``extra={"stop_grace_s": s}``)
STOP_GRACE_S = 30.0


class Parent(ControlMixin, ExitPolicy, RunSummaryMixin):
    """Runs one parallel path; ``run()`` returns the RunSummary or raises."""

    def __init__(self, split: SplitPath, options: ProcessOptions) -> None:
        self.split = split
        self.options = options
        self.n_workers = max(1, options.workers)
        extra = options.extra or {}
        self.max_restarts = int(extra.get("max_restarts", 2 * self.n_workers + 2))
        self.budget = RestartBudget(self.max_restarts)  # shared by the worker slots
        self.backoff = RestartPolicy.from_options(extra)  # crash loops: delayed forks
        self.role_options = {
            "max_events": options.max_events,
            "workers": self.n_workers,  # (the input sizes batches by work left per worker)
            "ordered": options.ordered,
            "reorder_window": int(extra.get("reorder_window", 8192)),
            "max_attempts": options.max_attempts,
            "event_timeout_s": options.effective_event_timeout_s(),
            # reliability: a module exception fails its event ("retry") or the run ("stop")
            "on_event_error": str(extra.get("on_event_error", "retry")),
            "max_quarantined": int(extra.get("max_quarantined", 1000)),
            "quarantine_file": extra.get("quarantine_file"),
            # large events through shared memory (transport/shm.py): the input's arena
            "transport": options.transport,
            "shm_mb": int(extra.get("shm_mb", 256)),
            # the output draws the progress bar: it learns every uid's fate
            "progress": options.show_progress(is_terminal(sys.stderr)),
            "progress_total": _progress_total(split, options.max_events),
        }
        # reliability: the input checkpoints next to the output; --resume continues there
        self.role_options.update(
            checkpoint.plan(
                output_files(split.output),
                options.resume,
                float(extra.get("checkpoint_interval_s", 2.0)),
            )
        )
        self.timed_out: set[int] = set()  # worker pids killed for a timeout
        self.output_restarts = 0
        self.input_restarts = 0
        self.max_input_restarts = int(extra.get("max_input_restarts", 3))
        self.recycled = 0
        self.restarts_cancelled = 0  # delayed replacements the end of the run made needless
        self.max_output_restarts = int(extra.get("max_output_restarts", 3))
        self.session = f"par-{os.getpid()}-{secrets.token_hex(3)}"
        self.ids: dict[str, bytes] = {}  # role name -> ctl routing id
        self.results: dict[str, tuple[dict[str, Any], list[Any]]] = {}
        self.error: EvflowError | None = None
        self.signals: list[int] = []
        self.stop_sent = False
        self.stop_grace_s = float(extra.get("stop_grace_s", STOP_GRACE_S))
        self.stop_deadline = 0.0  # monotonic time the first interrupt's grace ends
        self.hard = False
        self.aborting_at = 0.0
        self.lost: list[str] = []
        self.generation: dict[int, int] = {}
        self.done_at = 0.0
        self.started_at = 0.0  # wall clock (s) of the run's start, for start-up figures
        self.worker_hellos = 0
        self.all_ready_at = 0.0
        self.bad = BadMessageCounter("parallel parent")
        self.slot_stats: dict[str, list[ModuleStatistics]] = {}  # exited workers' rows
        # security: a per-run secret every role presents, checked by ZAP at connection
        # time (transport/security.py); ``ipc_auth=False`` turns it off (benchmarks)
        self.ipc_auth = bool(extra.get("ipc_auth", True))
        self.auth: RunAuth | None = None
        self.refused = 0  # connections to ctl the ZAP handler refused

    # --- life cycle ---------------------------------------------------------------------
    def run(self) -> RunSummary:
        warn_many_workers(self.n_workers)
        currentsplit.set_current(self.split)
        # exact blame: one slot per worker index, shared with every fork of the zygote
        self.board = scoreboard.Scoreboard(self.n_workers)
        scoreboard.install(self.board)
        # module statistics of workers that die without a RESULT (statsboard.py)
        self.stats_board = statsboard.StatsBoard(
            self.n_workers, [m.name for m in self.split.worker]
        )
        statsboard.install(self.stats_board)
        # the runtime's supervisor forks, reaps, kills and restarts every role
        self.sup = Supervisor(self.session)
        self.sup.signals = self.signals  # SIGINT/SIGTERM: what _handle_signals reads
        # a killed zygote is replaced, in start-up too; the roles that died with it
        # are restarted by their policies (exitpolicy.py)
        self.sup.replace_lost_zygote = True
        self.sup.on_new_zygote.append(self._new_zygote)
        self.zap: Any = None
        restore = self.sup.install_signal_handlers(keep_ignored=True)
        remove_stale_sessions()  # left by runs killed with kill -9 (their owner is gone)
        _preload(self.split)
        self.sup.start()  # its zygote: before any zmq context in this process
        if self.ipc_auth:
            self.auth = RunAuth.generate(zygote_pid=self.sup.zygote.pid or 0)
            self.role_options["auth"] = self.auth
        ctx: zmq.Context[Any] | None = None
        ctl = None
        zap = None
        proxy: BusProxy | None = None
        self.bus: BusClient | None = None
        hooks = runhooks.installed()  # --dashboard / --report (monitor/runhook.py)
        self.monitor: Any = None
        start = time.monotonic()
        self.started_at = time.time()
        try:
            claim_session(self.session)  # so that a later run can tell if this one died
            ctx = zmq.Context()
            if self.auth is not None:  # only the run's processes may report here
                zap = self.zap = self.auth.handler(ctx, "parallel parent", {})
            security.install(self.auth)
            try:
                ctl = channel(ctx, self.session, "ctl", "router", "bind")
            finally:
                security.install(None)
            self.ctl = ctl.socket
            # the run's control bus: `evflow ctl` finds it in the session directory
            proxy = BusProxy(ctx, self.session)
            proxy.start_thread()
            self.bus = BusClient(ctx, "parallel", proxy.endpoints, state=self._bus_state)
            self.bus.handle("get-run", lambda args: self._progress())
            self.bus.publish_state(new="RUNNING")
            if hooks is not None:
                self.monitor = hooks.on_bus(proxy.endpoints, self._monitor_info)
            self._remote_start(ctx)  # hosts runs: agents on other hosts (farm.py)
            # the first event needs the input and a worker; the output only its result
            self.sup.add(self._role_spec("input", input_main))
            for i in range(self.n_workers):
                self._spawn_worker(i)
            self.sup.add(self._role_spec("output", output_main))
            self._loop()
            wall_s = time.monotonic() - start
        finally:
            self._remote_wind_down()
            self._remote_stop()
            self.sup.close(cleanup=False)  # (nothing runs here unless the loop raised)
            ok = self.error is None and not self.signals
            if hooks is not None and self.monitor is not None:
                hooks.on_end(self.monitor, ok, self._linger_cut)
            if self.bus is not None:
                self.bus.close()
            if proxy is not None:
                proxy.close()
            if ctl is not None:
                ctl.close(linger_ms=0)
            if zap is not None:
                self.refused = sum(zap.refused.values())
                zap.close()
            if ctx is not None:
                ctx.term()
            self.sup.cleanup()  # the session's ipc files and shared-memory segments
            currentsplit.set_current(None)
            scoreboard.install(None)
            self.board.close()
            statsboard.install(None)
            self.stats_board.close()
            restore()
        if self.error is not None:
            raise self.error
        summary = self._summary(wall_s)
        lost = int(summary.counters.get(LOST, 0))
        if lost and not self.signals:  # a run that lost events never ends as a success
            if not self.options.quiet:
                summary.render(sys.stderr)
            error = PeerLostError(
                f"{lost} of the {summary.events_read} events read never reached the output "
                "(see 'events lost' in the summary); the output files are incomplete"
            )
            error.summary = summary  # type: ignore[attr-defined]  # for callers that report
            raise error
        if self.signals:
            if not self.options.quiet:
                summary.render(sys.stderr)
            if self.signals[0] == signal.SIGTERM:
                raise SystemExit(143)
            raise KeyboardInterrupt
        if self.role_options.get("checkpoint"):  # complete: nothing left to resume
            checkpoint.CheckpointFile(str(self.role_options["checkpoint"])).remove()
        return summary

    @property
    def pids(self) -> dict[int, str]:  # type: ignore[override]
        """The live roles: pid -> name (a worker's name changes with each fork)."""
        sup = getattr(self, "sup", None)
        if sup is None:
            return {}
        return {pid: p.label for pid, p in sup.live.items()}

    def _alive(self, role: str) -> bool:
        """Whether the input or the output runs (cheap: the loop asks on every pass)."""
        proc = self.sup.processes.get(role)
        return proc is not None and proc.alive

    @property
    def restarts(self) -> int:  # type: ignore[override]
        """Workers replaced so far (the supervisor's budget; a hosts run adds its own)."""
        return self.budget.used

    @restarts.setter
    def restarts(self, value: int) -> None:
        self.budget.used = value

    def _bus_state(self) -> str:
        if self.error is not None:
            return "ERROR"
        if self.signals or self.done_at:
            return "STOPPING"
        return "RUNNING"

    def _progress(self) -> dict[str, Any]:
        """What ``evflow ctl`` gets for ``get-run``: the processes and their fate so far."""
        return {
            "session": self.session,
            "workers": self.n_workers,
            "processes": sorted(self.pids.values()),
            "workers lost": len(self.lost),
            "workers restarted": self.restarts,
            "workers waiting to restart": len(self.backoff.pending),
            "signals": len(self.signals),
            "elapsed_s": round(time.time() - self.started_at, 3),
        }

    def _monitor_info(self) -> dict[str, Any]:
        """For the dashboard's progress bar (monitor/runhook.py)."""
        return {
            "total": self.role_options.get("progress_total"),
            "session": self.session,
            "workers_restarted": self.restarts,
        }

    def _linger_cut(self) -> bool:
        """Ctrl-C while the dashboard lingers after a complete run ends the linger, not
        the run (which is done: no exit code 130 for it)."""
        if not self.signals:
            return False
        self.signals.clear()
        return True

    # hooks of a run whose workers are on other hosts (farm.py); nothing here
    def _remote_start(self, ctx: zmq.Context[Any]) -> None:
        pass

    def _remote_poll(self, poller: zmq.Poller) -> None:
        pass

    def _remote_tick(self) -> None:
        pass

    def _remote_wind_down(self) -> None:
        pass

    def _remote_stop(self) -> None:
        pass

    # --- the watch loop -----------------------------------------------------------------
    def _new_zygote(self, pid: int) -> None:
        """A new zygote replaced a dead one: the run's processes are its children now."""
        if self.auth is None:
            return
        self.auth = dataclasses.replace(self.auth, zygote_pid=pid)
        self.role_options["auth"] = self.auth
        if self.zap is not None:
            self.zap.parent_pid = pid
        for proc in self.sup.processes.values():  # restarts decided before: their copies
            proc.args = tuple(self._with_auth(arg) for arg in proc.args)

    def _with_auth(self, arg: Any) -> Any:
        if isinstance(arg, RunAuth):
            return self.auth
        if isinstance(arg, dict) and isinstance(arg.get("auth"), RunAuth):
            return {**arg, "auth": self.auth}
        return arg

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        deaths = self.sup.fileno()
        poller.register(deaths, zmq.POLLIN)
        self._remote_poll(poller)
        while self.sup.live:
            if self.sup.fileno() != deaths:  # a new zygote: its notices
                poller.unregister(deaths)
                deaths = self.sup.fileno()
                poller.register(deaths, zmq.POLLIN)
            due_s = self.sup.next_restart_in_s()
            poller.poll(100 if due_s is None else min(100, int(due_s * 1000) + 1))
            self._drain_ctl()
            self.sup.reap()  # the roles' decide hooks (exitpolicy.py) say what a death means
            self._handle_signals()
            self._tend_backoff()
            self._remote_tick()
            if self.bus is not None:
                self.bus.tick()  # metrics once a second, answers check-state / get-run
            now = time.monotonic()
            roles_done = not self._alive("input") and not self._alive("output")
            if roles_done and not self.done_at:
                self.done_at = now
                self._remote_wind_down()  # workers leave now: not CURVE refusals
            stuck = self.done_at and now - self.done_at > WORKER_EXIT_GRACE_S
            late = self.aborting_at and now - self.aborting_at > ABORT_GRACE_S
            if stuck or late:
                for pid in list(self.pids):
                    self._kill(pid)
                self.aborting_at = self.done_at = now  # and wait for the exits
        # a role sends its RESULT just before it exits; under load the exit can be seen
        # first and the loop end with the RESULT still queued: wait for it briefly
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not {"input", "output"} <= set(self.results):
            if self.ctl.poll(50):
                self._drain_ctl()

    def _handle_signals(self) -> None:
        if not self.signals:
            return
        if not self.stop_sent:
            self.stop_sent = True
            self._send("input", MsgType.STOP)
        now = time.monotonic()
        if not self.stop_deadline:
            self.stop_deadline = now + self.stop_grace_s
            self._say_stopping()
        if self.hard:
            return
        if len(self.signals) >= 2:
            self.hard = True
            _say("evflow: stopping now: workers killed, files closed")
            self._abort()
        elif now > self.stop_deadline and not self.error:
            self.hard = True
            _say(
                f"evflow: the events in flight did not finish within {self.stop_grace_s:g} s; "
                "stopping now: workers killed, files closed"
            )
            self._abort()

    def _say_stopping(self) -> None:
        """The first interrupt: say what the shutdown waits for, and for how long."""
        busy = sum(1 for i in range(self.n_workers) if self.board.read(i).state == scoreboard.BUSY)
        _say(stopping_line(self.signals[0], self.stop_grace_s, busy))


def _preload(split: SplitPath) -> None:
    """Import what the path's modules list in ``preload``: every forked role inherits it."""
    for module in [*split.input, *split.worker, *split.output]:
        names = getattr(module, "preload", ())
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise ConfigurationError(
                f"module {module.name!r}: preload must be a tuple of module names, got {names!r}"
            )
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                raise ConfigurationError(
                    f"module {module.name!r}: cannot preload {name!r}: {exc}"
                ) from exc


def _progress_total(split: SplitPath, max_events: int | None) -> int | None:
    """Events the run will read, when the source knows (for the progress bar's ETA)."""
    from evflow.processing.module import Source

    source = split.input[0] if split.input else None
    total = source.total() if isinstance(source, Source) else None
    if total is None:
        return max_events
    return total if max_events is None else min(total, max_events)

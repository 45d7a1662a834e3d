"""The calling process of a parallel run: start the roles, watch them, stop them.

The caller (the process running the steering file) keeps the split path in
``currentsplit`` and starts the runtime's :class:`~evflow.runtime.supervisor.Supervisor`
*before* it creates any zmq context: its zygote forks the input, N workers and the
output, it reaps them, kills them and restarts them, and it relays SIGINT/SIGTERM to
``self.signals``, as for any device of a topology. What a death means is the path's
policy, given to the supervisor as each role's ``decide`` hook (below). The caller
holds the ``ctl`` ROUTER every role reports to (HELLO, STATE ERROR, RESULT) and reacts
to:

- a child's exit (the zygote's notice fd wakes the poll at once): a worker that dies
  unasked is reported to the input (WORKER_LOST: its unconfirmed batches are sent
  again) and replaced by a fresh fork, up to ``max_restarts``; a dead input or output
  is restarted when it can be, else it stops the run with a clear error;
- SIGINT/SIGTERM: the first asks the input to STOP reading (in-flight events finish
  and are written, files close, KeyboardInterrupt / exit 143 afterwards); a second
  kills the workers and tells the output to close its files now.

``Parent`` is one class in four parts: the life cycle and the watch loop; the ``ctl``
ROUTER; the exit policy; the summary.

The ``ctl`` ROUTER: who may report there, what their reports mean. Every role says
HELLO on ctl (its name and pid: accepted only from a live child of the run with that
pid, and over ipc from the pid the kernel names); after that, only the connection that
said HELLO may speak for the name. RESULT carries a role's counts and statistics for
the summary, STATE ERROR fails the run with the role's error rebuilt (module, hook,
uid), STATE TIMEOUT from the input has a worker killed.

What a death means: the path's policy over the runtime's supervisor. The supervisor
(runtime/supervisor.py) forks every role from its zygote, reaps them, kills, holds the
timers of delayed restarts and the workers' shared restart budget (``max_restarts``).
Each role's ``decide`` hook here says, with what only the path knows, what a death
means:

- a worker that dies unasked: the input gets WORKER_LOST (its unconfirmed batches go
  again, blamed on the event the scoreboard shows it busy with) and the slot gets a
  fresh fork under the next name, at once or after the crash-loop backoff
  (restarts.py), while the budget lasts; past it the run stops;
- a worker over ``worker_memory_limit_mb`` (EXIT_RECYCLE): a fresh fork, not counted;
- the output: forked again (it reopens its files), up to ``max_output_restarts``,
  unless a writer cannot append (the run stops at once with the reason);
- the input: forked again from the checkpoint, its workers replaced too, up to
  ``max_input_restarts``;
- otherwise a dead input or output stops the run with a message that names it.

The summary of the run: what the roles reported, as one RunSummary. ``_summary`` reads
the RESULTs the roles sent on ctl (``self.results``), the workers' rows of the stats
board for workers killed before theirs, and the parent's own counts (restarts,
timeouts, recycled workers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import secrets
import signal
import sys
import time
from typing import Any, cast

import zmq

from evflow import errors
from evflow.errors import (
    ConfigurationError,
    EvflowError,
    ModuleError,
    PeerLostError,
    ProtocolError,
)
from evflow.processing import runhooks
from evflow.processing.chain import output_files
from evflow.processing.console import is_terminal
from evflow.processing.failures import groups_from
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import currentsplit, scoreboard, statsboard
from evflow.processing.parallel.common import channel
from evflow.processing.parallel.input import checkpoint
from evflow.processing.parallel.input.input import input_main
from evflow.processing.parallel.notices import say as _say
from evflow.processing.parallel.notices import stopping_line, warn_many_workers
from evflow.processing.parallel.output.output import output_main
from evflow.processing.parallel.persist import decode_persistent
from evflow.processing.parallel.run.restarts import RestartPolicy, output_restart_refusal
from evflow.processing.parallel.split import SplitPath
from evflow.processing.parallel.worker.worker import EXIT_RECYCLE, worker_main
from evflow.processing.statistics import ModuleStatistics
from evflow.processing.summary import RunSummary
from evflow.runtime.bus import BusProxy
from evflow.runtime.busclient import BusClient
from evflow.runtime.supervisor import (
    Decision,
    ManagedProcess,
    ProcessSpec,
    RestartBudget,
    Supervisor,
)
from evflow.transport import security
from evflow.transport.security import RunAuth, peer_pid
from evflow.transport.sessions import claim_session, remove_stale_sessions
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message, field_int, refuse

#: after the input and output are done, workers get this long to exit on their own (s)
WORKER_EXIT_GRACE_S = 5.0
#: after an error or a second interrupt, roles get this long to close files (s)
ABORT_GRACE_S = 5.0
#: after the first interrupt, events in flight get this long to finish before the run
#: stops as after a second one (a hung event must not hold the shutdown; option
#: ``extra={"stop_grace_s": s}``)
STOP_GRACE_S = 30.0
#: the summary's counter of events read and never written (see ``_lost_label``)
LOST = "events lost"
RESUMABLE = "events not written (--resume completes them)"
NOT_WRITTEN = "events not written (interrupted)"


def describe_exit(code: int) -> str:
    """``exit code 3`` or ``signal 9 (SIGKILL)``."""
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class Parent:
    """Runs one parallel path; ``run()`` returns the RunSummary or raises."""

    # (the types of what ``__init__`` and ``run`` set, for the type checker)
    ctl: zmq.Socket[Any]
    bad: BadMessageCounter
    hard: bool
    stop_sent: bool
    n_workers: int
    worker_hellos: int
    all_ready_at: float
    sup: Supervisor
    split: SplitPath
    options: ProcessOptions
    session: str
    role_options: dict[str, Any]
    board: scoreboard.Scoreboard
    stats_board: statsboard.StatsBoard
    backoff: RestartPolicy
    aborting_at: float
    max_restarts: int
    recycled: int
    restarts_cancelled: int
    output_restarts: int
    max_output_restarts: int
    input_restarts: int
    max_input_restarts: int
    budget: RestartBudget  # the workers' shared max_restarts
    started_at: float
    refused: int

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
        # are restarted by their policies (_decide_worker, _decide_role)
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
    def pids(self) -> dict[int, str]:
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
    def restarts(self) -> int:
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
            self.sup.reap()  # the roles' decide hooks (_decide_*) say what a death means
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

    # --- ctl: who may report there, what their reports mean -----------------------------
    def _drain_ctl(self) -> None:
        # ask EVENTS first: on an empty socket a NOBLOCK recv raises zmq.Again, which
        # costs about three times the check (and this runs at every wake-up)
        while cast(int, self.ctl.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = self.ctl.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # (only this thread reads ctl: not expected)
                return
            msg = self.bad.decode(frames[1:])
            if msg is None:
                continue
            try:
                name = self._sender(frames[0], msg)
            except ProtocolError as exc:
                self.bad.record_error(exc)
                continue
            if msg.type == MsgType.HELLO:
                if name.startswith("worker"):
                    self.worker_hellos += 1
                    if self.worker_hellos == self.n_workers:
                        self.all_ready_at = time.time()
                if name == "input" and self.signals and not self.hard:
                    self._send("input", MsgType.STOP)
                    self.stop_sent = True
            elif msg.type == MsgType.RESULT:
                self.results[name] = (msg.header, [f.bytes for f in msg.payload])
            elif msg.type == MsgType.STATE and msg.header.get("state") == "ERROR":
                self._fail(_rebuild_error(msg.header))
            elif msg.type == MsgType.STATE and msg.header.get("state") == "TIMEOUT":
                if name == "input":  # only the input watches for timeouts
                    self._kill_worker(str(msg.header.get("worker")))
                else:
                    self.bad.record("unknown-peer", f"TIMEOUT from {name}, not the input")

    def _sender(self, ident_frame: Any, msg: Any) -> str:
        """The role that sent ``msg`` on ctl; raises ProtocolError for anyone else.

        A HELLO registers the sender under its name if that name is a live child of
        this run with the pid it says (and, over ipc, the pid the kernel says sent it);
        every other message must come from the connection that said HELLO for its name.
        """
        ident = ident_frame.bytes
        name = msg.header.get("name")
        if type(name) is not str or len(name) > 64:
            raise refuse("unknown-peer", f"{msg.type.name} on ctl without a role name")
        if msg.type == MsgType.HELLO:
            pid = field_int(msg.header, "pid", 1, 2**31)
            sender = peer_pid(ident_frame)
            if not self._is_role(name, pid) or (sender is not None and sender != pid):
                raise refuse("unknown-peer", f"HELLO of {name!r} pid {pid}: not a role of the run")
            self.ids[name] = ident
            return name
        if self.ids.get(name) != ident:
            raise refuse("unknown-peer", f"{msg.type.name} of {name!r} from another connection")
        return name

    def _is_role(self, name: str, pid: int) -> bool:
        """``name`` with ``pid`` is a role this run forked (a hosts run adds its remote
        workers, whose pids live on other hosts)."""
        proc = self.sup.live.get(pid)
        return proc is not None and proc.label == name

    def _send(self, role: str, kind: MsgType, header: dict[str, Any] | None = None) -> None:
        ident = self.ids.get(role)
        if ident is not None:
            self.ctl.send_multipart([ident, *encode_message(kind, header)])

    # --- the roles as supervised processes ----------------------------------------------
    def _role_spec(self, name: str, target: Any) -> ProcessSpec:
        """The input or the output: forked with the run's role options."""
        after = self._input_launched if name == "input" else None
        return ProcessSpec(
            name,
            target=target,
            args=(self.session, self.role_options),
            decide=self._decide_role,
            after_launch=after,
        )

    def _spawn_worker(self, index: int) -> None:
        """Put worker slot ``index`` under the supervisor (forked at once)."""
        self.sup.add(
            ProcessSpec(
                f"worker-{index}",
                target=worker_main,
                decide=self._decide_worker,
                budget=self.budget,
                before_launch=self._worker_launching,
            )
        )

    def _worker_name(self, index: int) -> str:
        """The name the next worker forked for slot ``index`` gets."""
        return scoreboard.worker_name(index, self.generation.get(index, 0))

    def _worker_launching(self, proc: ManagedProcess) -> None:
        """Before every fork of a worker slot: its next name and arguments."""
        index = scoreboard.slot_of(proc.name)
        name = self._worker_name(index)
        self.generation[index] = self.generation.get(index, 0) + 1
        limit_mb = float((self.options.extra or {}).get("worker_memory_limit_mb", 0.0))
        stale = self.board.read(index).batch  # the worker before's, still in the slot
        proc.label = name
        proc.args = (self.session, name, self.options.event_buffer, limit_mb, self.auth)
        self.backoff.spawned(index, time.monotonic(), stale)

    def _input_launched(self, proc: ManagedProcess) -> None:
        if proc.restarts:  # the output introduces itself to the new input
            self._send("output", MsgType.HELLO)

    # --- deaths -------------------------------------------------------------------------
    def _decide_worker(self, proc: ManagedProcess, code: int) -> Decision:
        name, pid = proc.label, proc.pid or 0
        index = scoreboard.slot_of(name)
        if code != 0:  # what it did up to its last finished batch, if no RESULT comes (killed)
            self.slot_stats[name] = self.stats_board.read(index, name)
        if code == 0 or self.aborting_at:
            return Decision.end()
        if code == EXIT_RECYCLE and not self.hard:
            self.recycled += 1  # over worker_memory_limit_mb after its event: a fresh fork
            return Decision.restart(counts=False)
        if self.hard or self.error is not None:
            return Decision.end()
        self.lost.append(name)
        reading = self.board.read(index)  # which event it died on (or between events)
        self.backoff.observe(index, reading.state, reading.uid, reading.batch)
        # backoff: only crashes count; SIGKILL/SIGTERM come from outside or for a timeout
        crashed = code not in (-signal.SIGKILL, -signal.SIGTERM)
        if self.restarts >= self.max_restarts:
            streak = self.backoff.died(index, time.monotonic(), crashed)
            self._fail(
                PeerLostError(
                    f"{name} (pid {pid}) died with {describe_exit(code)}; {self.restarts} "
                    f"workers were already replaced (limit max_restarts={self.max_restarts}); "
                    f"the run is stopped. {self.backoff.limit_hint(streak)}"
                )
            )
            return Decision.end()
        lost: dict[str, Any] = {"name": name, "pid": pid, "code": code}
        if pid in self.timed_out:
            lost["reason"] = "timeout"
        lost["blame"] = reading.state
        if reading.state == scoreboard.BUSY:
            lost["uid"] = reading.uid
        self.board.clear(index)  # before the replacement exists: nobody else writes it
        # backoff: a streak of workers dying before finishing an event delays the fork
        delay = self.backoff.replace(index, time.monotonic(), crashed)
        if delay == 0.0:  # the input waits for its HELLO before it ends the run
            lost["replacement"] = self._worker_name(index)
        self._send("input", MsgType.WORKER_LOST, lost)
        return Decision.restart(delay)  # the supervisor forks it (now or when due)

    def _decide_role(self, proc: ManagedProcess, code: int) -> Decision:
        name, pid = proc.name, proc.pid or 0
        if code == 0 or self.aborting_at:
            return Decision.end()
        if name in self.results and "aborted" not in self.results[name][0]:
            return Decision.end()
        refusal = output_restart_refusal(self.split.output) if name == "output" else None
        if refusal:  # e.g. ROOT output: say why at once rather than fail the restart
            self._fail(
                PeerLostError(
                    f"the output process (pid {pid}) died with {describe_exit(code)}; "
                    f"the run is stopped: {refusal}"
                )
            )
            return Decision.end()
        restart = self._restart_output() if name == "output" else self._restart_input()
        if restart is not None:
            return restart
        resume = " (continue it with --resume)" if self.role_options.get("checkpoint") else ""
        self._fail(
            PeerLostError(
                f"the {name} process (pid {pid}) died with {describe_exit(code)}; "
                f"the run is stopped (files written so far are closed){resume}"
            )
        )
        return Decision.end()

    def _restart_output(self) -> Decision | None:
        """Reliability: a dead output is forked again; it reopens its files, rebuilds the
        set of uids they hold, and the input sends every unconfirmed event again."""
        if self.hard or self.error is not None:
            return None
        if self.output_restarts >= self.max_output_restarts:
            return None
        self.output_restarts += 1
        options = {**self.role_options, "restart": True}
        return Decision.restart(args=(self.session, options), counts=False)

    def _restart_input(self) -> Decision | None:
        """Reliability: a dead input is forked again and reads from the checkpoint.

        The workers hold messages of the dead input and are unknown to the new one, so
        they are replaced too; the output drops what it already wrote (dedup) and says
        HELLO to the new input (``_input_launched``). Needs a checkpoint (an output
        file); --ordered: the new input numbers its events from the checkpoint's seq,
        as the output expects.
        """
        ckpt = self.role_options.get("checkpoint")
        if self.hard or self.error is not None or not ckpt:
            return None
        if self.input_restarts >= self.max_input_restarts:
            return None
        cp = checkpoint.CheckpointFile(str(ckpt)).load()
        start = cp.position if cp else int(self.role_options.get("start_position") or 0)
        seq = int(self.role_options.get("start_seq") or 0)
        seq = int(cp.counts.get("seq", seq)) if cp else seq
        self.input_restarts += 1
        self._kill_workers()
        options = {
            **self.role_options,
            "start_position": start,
            "start_seq": seq,
            "input_restart": True,  # checkpoint soon: repeated kills must not redo work
        }
        return Decision.restart(args=(self.session, options), counts=False)

    def _tend_backoff(self) -> None:
        """Watch new workers finish events; let the supervisor fork the replacements
        whose backoff is over (none once the run is ending)."""
        for i in self.backoff.watching():
            reading = self.board.read(i)
            self.backoff.observe(i, reading.state, reading.uid, reading.batch)
        if not self.backoff.pending:
            return
        ending = self.hard or self.error is not None or self.aborting_at
        if ending or not self._alive("input"):  # the input is done: no more events
            self.backoff.cancel(time.monotonic())  # scheduled, never forked
            self.restarts_cancelled += self.sup.cancel_restarts()  # (budget given back)
            return
        self.sup.launch_due()

    # --- kills --------------------------------------------------------------------------
    def _kill(self, pid: int) -> None:
        with contextlib.suppress(EvflowError):
            self.sup.kill(pid, signal.SIGKILL)

    def _kill_workers(self) -> None:
        for pid, name in list(self.pids.items()):
            if name.startswith("worker"):
                self._kill(pid)

    def _kill_worker(self, name: str) -> None:
        """The input saw no progress from ``name`` for event_timeout_s: kill it."""
        for pid, role in self.pids.items():
            if role == name:
                self.timed_out.add(pid)
                self._kill(pid)

    def _fail(self, error: EvflowError) -> None:
        """Stop everything: the first error is the one the caller sees."""
        if self.error is None:
            self.error = error
        self._abort()

    def _abort(self) -> None:
        if self.aborting_at:
            return
        self.aborting_at = time.monotonic()
        self._kill_workers()
        self._send("output", MsgType.KILL)
        self._send("input", MsgType.KILL)

    # --- the summary --------------------------------------------------------------------
    def _unwritten(self, inp: dict[str, Any]) -> int | None:
        """Events the input sent that the output never accounted for (its own count).

        The ledger's figure trusts CONFIRMs; this one checks it against what the
        output reports written, dropped or quarantined (every event read, if the
        output never reported). Only for one input and one output over the whole run
        (restarts and resumes split the counts): else None.
        """
        out = self.results.get("output", ({}, []))[0]
        if self.input_restarts or self.output_restarts or self.role_options.get("start_position"):
            return None
        if out.get("already_written"):
            return None
        expected = int(inp.get("read", 0)) - int(inp.get("dropped", 0))
        fates = sum(int(out.get(k, 0)) for k in ("written", "dropped", "quarantined"))
        return max(0, expected - fates)

    def _lost_label(self) -> str:
        """What the events read and never written are: lost, unless the run was stopped
        (Ctrl-C, SIGTERM), when its checkpoint keeps them for ``--resume``."""
        if not self.signals:
            return LOST
        return RESUMABLE if self.role_options.get("checkpoint") else NOT_WRITTEN

    def _summary(self, wall_s: float) -> RunSummary:
        inp = self.results.get("input", ({}, []))[0]
        out_header, out_payload = self.results.get("output", ({}, []))
        rows: list[ModuleStatistics] = []
        # workers killed before their RESULT: their rows from the stats board
        killed = {n: r for n, r in self.slot_stats.items() if n not in self.results and r}
        for role in sorted([*self.results, *killed], key=role_order):
            if role in killed:
                rows.extend(killed[role])
                continue
            for d in self.results[role][0].get("stats", []):
                rows.append(ModuleStatistics.from_dict(d))
        persistent: dict[str, Any] = {}
        if out_payload:
            persistent = decode_persistent(out_payload[0], out_payload[1:])
        counters: dict[str, int | float] = {
            "duplicates dropped": int(out_header.get("duplicates", 0)),
            "timeouts": len(self.timed_out),
            "output restarts": self.output_restarts,
            "input restarts": self.input_restarts,
            "workers recycled": self.recycled,
            "workers lost": len(self.lost),
            "workers restarted": self.restarts,
        }
        if self.lost:  # backoff: forks delayed because workers died before finishing events
            stats = self.backoff.stats()
            counters["restarts delayed"] = stats.delayed
            counters["restart backoff (s)"] = round(stats.total_delay_s, 3)
            counters["restarts not needed (run ended)"] = self.restarts_cancelled
        ledger = inp.get("ledger")
        if ledger:  # reliability: what the input's ledger saw
            counters["retries"] = int(ledger["retries"])
            counters["event failures"] = int(ledger["failures"])
            # every event read was dropped by the input path or confirmed by the output
            lost = int(inp.get("read", 0)) - int(inp.get("dropped", 0)) - int(ledger["confirmed"])
            exact = self._unwritten(inp)
            if exact is not None and self.signals and "output" in self.results:
                # a run stopped at once: CONFIRMs of events the output wrote may still
                # have been on their way, so the output's own count is the figure
                lost = exact
            else:
                lost = max(lost, int(ledger["unconfirmed"]), exact or 0)
            counters[self._lost_label()] = lost
        if out_header.get("already_written"):
            counters["already in the output (resumed)"] = int(out_header["already_written"])
        counters.update(out_header.get("fills", {}))  # persistent deltas: fills.py
        skipped = sorted(set(out_header.get("skipped", [])))
        if skipped:
            counters["persistent objects not merged"] = len(skipped)
        firsts = [
            float(h.get("first_event_at", 0))
            for role, (h, _) in self.results.items()
            if role.startswith("worker") and h.get("first_event_at")
        ]
        if out_header.get("first_result_at"):  # dead workers report nothing: bound it
            firsts.append(float(out_header["first_result_at"]))
        if firsts:
            counters["start-up to first event (s)"] = round(min(firsts) - self.started_at, 4)
        if self.all_ready_at:
            counters["start-up of all workers (s)"] = round(self.all_ready_at - self.started_at, 4)
        for role, head in (("input", inp), ("output", out_header)):
            if "cpu_s" in head:
                counters[f"{role} CPU (s)"] = round(float(head["cpu_s"]), 4)
        worker_cpu = [
            float(h["cpu_s"])
            for role, (h, _) in self.results.items()
            if role.startswith("worker") and "cpu_s" in h
        ]
        if worker_cpu:  # workers that ended normally (a killed one reports nothing)
            counters["workers CPU (s)"] = round(sum(worker_cpu), 4)
        if self.options.transport == "shm":  # how many events the arena carried
            counters["events through shared memory"] = int(inp.get("shm_events", 0))
            counters["re-sent events found confirmed (shm)"] = sum(
                int(h.get("obsolete", 0)) for role, (h, _) in self.results.items()
                if role.startswith("worker")
            )  # fmt: skip
        if inp.get("shm_full"):  # transport shm: batches that went over the socket instead
            counters["batches not in shared memory (arena full)"] = int(inp["shm_full"])
        bad = int(inp.get("bad", 0)) + int(out_header.get("bad", 0)) + self.bad.total
        if bad:
            counters["malformed messages"] = bad
        refused = int(inp.get("refused", 0)) + int(out_header.get("refused", 0)) + self.refused
        if refused:  # security: connections without the run's secret, or from outside it
            counters["connections refused"] = refused
        return RunSummary(
            events_read=int(inp.get("read", 0)),
            events_written=int(out_header.get("written", 0)),
            events_dropped=int(inp.get("dropped", 0)) + int(out_header.get("dropped", 0)),
            events_quarantined=int(out_header.get("quarantined", 0)),
            wall_s=wall_s,
            workers=self.n_workers,
            modules=tuple(rows),
            persistent=persistent,
            counters=counters,
            outputs=tuple(output_files(self.split.output))
            + tuple(str(f) for f in out_header.get("quarantine_files", [])),
            interrupted=bool(self.signals),
            killed_workers=tuple(sorted(killed, key=role_order)),
            quarantined=tuple(
                (int(u), str(r)) for u, r in out_header.get("quarantine_reasons", [])
            ),
            failures=groups_from(inp.get("failures")),
            quarantine_files=tuple(str(f) for f in out_header.get("quarantine_files", [])),
            allow_quarantine=self.options.allow_quarantine,
        )


def _rebuild_error(header: dict[str, Any]) -> EvflowError:
    """The error a role reported, as one clear exception naming module and process."""
    where = str(header.get("name", "?"))
    if "module" in header:
        cause_type = type(str(header.get("cause", "Exception")), (Exception,), {})
        exc = ModuleError(
            str(header["module"]),
            str(header.get("hook", "?")),
            header.get("uid"),
            cause_type(str(header.get("cause_text", ""))),
            str(header.get("traceback", "")),
        )
        exc.args = (f"{exc} (in the {where} process)",)
        return exc
    text = str(header.get("error", "unknown error"))
    kind = getattr(errors, str(header.get("kind", "")), None)
    if isinstance(kind, type) and issubclass(kind, EvflowError) and kind is not ModuleError:
        with contextlib.suppress(Exception):
            return kind(f"{text} (in the {where} process)")
    return ConfigurationError(f"{text} (in the {where} process)")


def role_order(name: str) -> tuple[int, str]:
    if name == "input":
        return (0, "")
    if name == "output":
        return (2, "")
    return (1, f"{name:>20}")


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

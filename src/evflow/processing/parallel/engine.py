"""The calling process of a parallel run: start the roles, watch them, stop them.

The caller (the process running the steering file) keeps the split path in
``state``, starts a zygote *before* it creates any zmq context, then forks the
output, the input and N workers from it. It holds the ``ctl`` ROUTER every role
reports to (HELLO, STATE ERROR, RESULT) and reacts to:

- a child's exit (the zygote's notice fd wakes the poll at once): a worker that dies
  unasked is reported to the input (WORKER_LOST: its unconfirmed batches are sent
  again) and replaced by a fresh fork, up to ``max_restarts``; a dead input or output
  stops the run with a clear error;
- SIGINT/SIGTERM: the first asks the input to STOP reading (in-flight events finish
  and are written, files close, KeyboardInterrupt / exit 143 afterwards); a second
  kills the workers and tells the output to close its files now.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import signal
import sys
import threading
import time
from typing import Any

import zmq

from evflow import errors
from evflow.errors import (
    ConfigurationError,
    EvflowError,
    ModuleError,
    PeerLostError,
    ProtocolError,
)
from evflow.monitor import runhook
from evflow.monitor.console import is_terminal
from evflow.processing.chain import output_files
from evflow.processing.failures import groups_from
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import checkpoint, scoreboard, state, statsboard
from evflow.processing.parallel.common import channel
from evflow.processing.parallel.input import input_main
from evflow.processing.parallel.notices import say as _say
from evflow.processing.parallel.notices import stopping_line, warn_many_workers
from evflow.processing.parallel.output import output_main
from evflow.processing.parallel.persist import decode_persistent
from evflow.processing.parallel.restarts import RestartPolicy, output_restart_refusal
from evflow.processing.parallel.split import SplitPath
from evflow.processing.parallel.worker import EXIT_RECYCLE, worker_main
from evflow.processing.statistics import ModuleStatistics
from evflow.processing.summary import RunSummary
from evflow.runtime.bus import BusProxy
from evflow.runtime.busclient import BusClient
from evflow.runtime.zygote import Zygote
from evflow.transport import security
from evflow.transport.paths import remove_session_files
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

    def __init__(self, split: SplitPath, options: ProcessOptions) -> None:
        self.split = split
        self.options = options
        self.n_workers = max(1, options.workers)
        extra = options.extra or {}
        self.max_restarts = int(extra.get("max_restarts", 2 * self.n_workers + 2))
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
        self.pids: dict[int, str] = {}  # live children: pid -> role name
        self.ids: dict[str, bytes] = {}  # role name -> ctl routing id
        self.results: dict[str, tuple[dict[str, Any], list[Any]]] = {}
        self.error: EvflowError | None = None
        self.signals: list[int] = []
        self.stop_sent = False
        self.stop_grace_s = float(extra.get("stop_grace_s", STOP_GRACE_S))
        self.stop_deadline = 0.0  # monotonic time the first interrupt's grace ends
        self.hard = False
        self.aborting_at = 0.0
        self.restarts = 0
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
        state.set_current(self.split)
        # exact blame: one slot per worker index, shared with every fork of the zygote
        self.board = scoreboard.Scoreboard(self.n_workers)
        scoreboard.install(self.board)
        # module statistics of workers that die without a RESULT (statsboard.py)
        self.stats_board = statsboard.StatsBoard(
            self.n_workers, [m.name for m in self.split.worker]
        )
        statsboard.install(self.stats_board)
        restore = self._install_signals()
        remove_stale_sessions()  # left by runs killed with kill -9 (their owner is gone)
        _preload(self.split)
        zygote = Zygote().start()  # before any zmq context in this process
        if self.ipc_auth:
            self.auth = RunAuth.generate(zygote_pid=zygote.pid or 0)
            self.role_options["auth"] = self.auth
        ctx: zmq.Context[Any] | None = None
        ctl = None
        zap = None
        proxy: BusProxy | None = None
        self.bus: BusClient | None = None
        self.monitor: runhook.ActiveMonitor | None = None
        start = time.monotonic()
        self.started_at = time.time()
        try:
            claim_session(self.session)  # so that a later run can tell if this one died
            ctx = zmq.Context()
            if self.auth is not None:  # only the run's processes may report here
                zap = self.auth.handler(ctx, "parallel parent", {})
            security.install(self.auth)
            try:
                ctl = channel(ctx, self.session, "ctl", "router", "bind")
            finally:
                security.install(None)
            self.zygote, self.ctl = zygote, ctl.socket
            # the run's control bus: `evflow ctl` finds it in the session directory
            proxy = BusProxy(ctx, self.session)
            proxy.start_thread()
            self.bus = BusClient(ctx, "parallel", proxy.endpoints, state=self._bus_state)
            self.bus.handle("get-run", lambda args: self._progress())
            self.bus.publish_state(new="RUNNING")
            # --dashboard / --report (monitor/runhook.py): a no-op unless asked for
            self.monitor = runhook.on_bus(proxy.endpoints, self._monitor_info)
            self._remote_start(ctx)  # hosts runs: agents on other hosts (farm.py)
            # the first event needs the input and a worker; the output only its result
            self.pids[zygote.spawn(input_main, self.session, self.role_options, name="input")] = (
                "input"
            )
            for i in range(self.n_workers):
                self._spawn_worker(i)
            self.pids[zygote.spawn(output_main, self.session, self.role_options, name="output")] = (
                "output"
            )
            self._loop()
            wall_s = time.monotonic() - start
        finally:
            self._remote_stop()
            zygote.stop(grace_s=0.5)
            ok = self.error is None and not self.signals
            runhook.on_end(self.monitor, ok=ok, cut=self._linger_cut)
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
            remove_session_files(self.session)  # ipc files and shared-memory segments
            state.set_current(None)
            scoreboard.install(None)
            self.board.close()
            statsboard.install(None)
            self.stats_board.close()
            restore()
        if self.error is not None:
            raise self.error
        summary = self._summary(wall_s)
        lost = int(summary.counters.get("events lost", 0))
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

    def _install_signals(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        # never over an ignored signal: a run started in the background (nohup, `&` in a
        # non-interactive shell) must not stop on the terminal's Ctrl-C
        old = {s: h for s, h in old.items() if h is not signal.SIG_IGN}
        for s in old:
            signal.signal(s, self._on_signal)

        def restore() -> None:
            for s, handler in old.items():
                signal.signal(s, handler)

        return restore

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)

    def _worker_name(self, index: int) -> str:
        """The name the next worker forked for slot ``index`` gets."""
        return scoreboard.worker_name(index, self.generation.get(index, 0))

    def _spawn_worker(self, index: int) -> None:
        name = self._worker_name(index)
        self.generation[index] = self.generation.get(index, 0) + 1
        buffer = self.options.event_buffer
        limit_mb = float((self.options.extra or {}).get("worker_memory_limit_mb", 0.0))
        stale = self.board.read(index).batch  # the worker before's, still in the slot
        pid = self.zygote.spawn(
            worker_main, self.session, name, buffer, limit_mb, self.auth, name=name
        )
        self.pids[pid] = name
        self.backoff.spawned(index, time.monotonic(), stale)

    # hooks of a run whose workers are on other hosts (farm.py); nothing here
    def _remote_start(self, ctx: zmq.Context[Any]) -> None:
        pass

    def _remote_poll(self, poller: zmq.Poller) -> None:
        pass

    def _remote_tick(self) -> None:
        pass

    def _remote_stop(self) -> None:
        pass

    # --- the watch loop -----------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.zygote.fileno(), zmq.POLLIN)
        self._remote_poll(poller)
        while self.pids:
            due_s = self.backoff.next_due_in_s(time.monotonic())
            poller.poll(100 if due_s is None else min(100, int(due_s * 1000) + 1))
            self._drain_ctl()
            for pid, code in self.zygote.exits():
                self._exited(pid, code)
            self._handle_signals()
            self._tend_backoff()
            self._remote_tick()
            if self.bus is not None:
                self.bus.tick()  # metrics once a second, answers check-state / get-run
            now = time.monotonic()
            roles_done = "input" not in self.pids.values() and "output" not in self.pids.values()
            if roles_done and not self.done_at:
                self.done_at = now
            stuck = self.done_at and now - self.done_at > WORKER_EXIT_GRACE_S
            late = self.aborting_at and now - self.aborting_at > ABORT_GRACE_S
            if stuck or late:
                for pid in list(self.pids):
                    with contextlib.suppress(EvflowError):
                        self.zygote.kill(pid, signal.SIGKILL)
                self.aborting_at = self.done_at = now  # and wait for the exits
        # a role sends its RESULT just before it exits; under load the exit can be seen
        # first and the loop end with the RESULT still queued: wait for it briefly
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not {"input", "output"} <= set(self.results):
            if self.ctl.poll(50):
                self._drain_ctl()

    def _drain_ctl(self) -> None:
        while True:
            try:
                frames = self.ctl.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
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
        return self.pids.get(pid) == name

    def _send(self, role: str, kind: MsgType, header: dict[str, Any] | None = None) -> None:
        ident = self.ids.get(role)
        if ident is not None:
            self.ctl.send_multipart([ident, *encode_message(kind, header)])

    def _kill_worker(self, name: str) -> None:
        """The input saw no progress from ``name`` for event_timeout_s: kill it."""
        for pid, role in self.pids.items():
            if role == name:
                self.timed_out.add(pid)
                with contextlib.suppress(EvflowError):
                    self.zygote.kill(pid, signal.SIGKILL)

    def _exited(self, pid: int, code: int) -> None:
        name = self.pids.pop(pid, None)
        if name is not None and name.startswith("worker") and code != 0:
            # what it did up to its last finished batch, if no RESULT comes (killed)
            self.slot_stats[name] = self.stats_board.read(scoreboard.slot_of(name), name)
        if name is None or code == 0 or self.aborting_at:
            return
        if code == EXIT_RECYCLE and name.startswith("worker") and not self.hard:
            self.recycled += 1  # over worker_memory_limit_mb after its event: a fresh fork
            self._spawn_worker(int(name.split("-")[1].split(".")[0]))
            return
        if not name.startswith("worker"):
            if name in self.results and "aborted" not in self.results[name][0]:
                return
            refusal = output_restart_refusal(self.split.output) if name == "output" else None
            if refusal:  # e.g. ROOT output: say why at once rather than fail the restart
                self._fail(
                    PeerLostError(
                        f"the output process (pid {pid}) died with {describe_exit(code)}; "
                        f"the run is stopped: {refusal}"
                    )
                )
                return
            if name == "output" and self._restart_output(pid, code):
                return
            if name == "input" and self._restart_input():
                return
            resume = " (continue it with --resume)" if self.role_options.get("checkpoint") else ""
            self._fail(
                PeerLostError(
                    f"the {name} process (pid {pid}) died with {describe_exit(code)}; "
                    f"the run is stopped (files written so far are closed){resume}"
                )
            )
            return
        if self.hard or self.error is not None:
            return
        self.lost.append(name)
        index = scoreboard.slot_of(name)
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
            return
        self.restarts += 1
        lost = {"name": name, "pid": pid, "code": code}
        if pid in self.timed_out:
            lost["reason"] = "timeout"
        lost["blame"] = reading.state
        if reading.state == scoreboard.BUSY:
            lost["uid"] = reading.uid
        self.board.clear(index)  # before the replacement exists: nobody else writes it
        # backoff: a streak of workers dying before finishing an event delays the fork
        at_once = self.backoff.replace(index, time.monotonic(), crashed) == 0.0
        if at_once:  # the input waits for its HELLO before it ends the run (or it is orphaned)
            lost["replacement"] = self._worker_name(index)
        self._send("input", MsgType.WORKER_LOST, lost)
        if at_once:
            self._spawn_worker(index)

    def _tend_backoff(self) -> None:
        """Watch new workers finish events; fork the replacements whose backoff is over
        (none once the run is ending)."""
        for i in self.backoff.watching():
            reading = self.board.read(i)
            self.backoff.observe(i, reading.state, reading.uid, reading.batch)
        if not self.backoff.pending:
            return
        ending = self.hard or self.error is not None or self.aborting_at
        if ending or "input" not in self.pids.values():  # the input is done: no more events
            cancelled = self.backoff.cancel(time.monotonic())  # scheduled, never forked
            self.restarts -= cancelled
            self.restarts_cancelled += cancelled
            return
        for index in self.backoff.pop_due(time.monotonic()):
            self._spawn_worker(index)

    def _restart_output(self, pid: int, code: int) -> bool:
        """Reliability: a dead output is forked again; it reopens its files, rebuilds the
        set of uids they hold, and the input sends every unconfirmed event again."""
        if self.hard or self.error is not None:
            return False
        if self.output_restarts >= self.max_output_restarts:
            return False
        self.output_restarts += 1
        options = {**self.role_options, "restart": True}
        self.pids[self.zygote.spawn(output_main, self.session, options, name="output")] = "output"
        return True

    def _restart_input(self) -> bool:
        """Reliability: a dead input is forked again and reads from the checkpoint.

        The workers hold messages of the dead input and are unknown to the new one, so
        they are replaced too; the output drops what it already wrote (dedup) and says
        HELLO to the new input. Needs a checkpoint (an output file); --ordered: the new
        input numbers its events from the checkpoint's seq, as the output expects.
        """
        ckpt = self.role_options.get("checkpoint")
        if self.hard or self.error is not None or not ckpt:
            return False
        if self.input_restarts >= self.max_input_restarts:
            return False
        cp = checkpoint.CheckpointFile(str(ckpt)).load()
        start = cp.position if cp else int(self.role_options.get("start_position") or 0)
        seq = int(self.role_options.get("start_seq") or 0)
        seq = int(cp.counts.get("seq", seq)) if cp else seq
        self.input_restarts += 1
        for pid, name in list(self.pids.items()):
            if name.startswith("worker"):
                with contextlib.suppress(EvflowError):
                    self.zygote.kill(pid, signal.SIGKILL)
        options = {
            **self.role_options,
            "start_position": start,
            "start_seq": seq,
            "input_restart": True,  # checkpoint soon: repeated kills must not redo work
        }
        self.pids[self.zygote.spawn(input_main, self.session, options, name="input")] = "input"
        self._send("output", MsgType.HELLO)  # the output introduces itself to the new input
        return True

    def _fail(self, error: EvflowError) -> None:
        """Stop everything: the first error is the one the caller sees."""
        if self.error is None:
            self.error = error
        self._abort()

    def _abort(self) -> None:
        if self.aborting_at:
            return
        self.aborting_at = time.monotonic()
        for pid, name in list(self.pids.items()):
            if name.startswith("worker"):
                with contextlib.suppress(EvflowError):
                    self.zygote.kill(pid, signal.SIGKILL)
        self._send("output", MsgType.KILL)
        self._send("input", MsgType.KILL)

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

    # --- the summary ----------------------------------------------------------------------
    def _unwritten(self, inp: dict[str, Any]) -> int:
        """Events the input sent that the output never accounted for (its own count).

        The ledger's figure trusts CONFIRMs; this one checks it against what the
        output reports written, dropped or quarantined. Exact only for one input and one
        output over the whole run (restarts and resumes split the counts): else 0.
        """
        out = self.results.get("output", ({}, []))[0]
        if self.input_restarts or self.output_restarts or self.role_options.get("start_position"):
            return 0
        if out.get("already_written"):
            return 0
        expected = int(inp.get("read", 0)) - int(inp.get("dropped", 0))
        fates = sum(int(out.get(k, 0)) for k in ("written", "dropped", "quarantined"))
        return max(0, expected - fates)

    def _summary(self, wall_s: float) -> RunSummary:
        inp = self.results.get("input", ({}, []))[0]
        out_header, out_payload = self.results.get("output", ({}, []))
        rows: list[ModuleStatistics] = []
        # workers killed before their RESULT: their rows from the stats board
        killed = {n: r for n, r in self.slot_stats.items() if n not in self.results and r}
        for role in sorted([*self.results, *killed], key=_role_order):
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
            counters["events lost"] = max(lost, int(ledger["unconfirmed"]), self._unwritten(inp))
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
            killed_workers=tuple(sorted(killed, key=_role_order)),
            quarantined=tuple(
                (int(u), str(r)) for u, r in out_header.get("quarantine_reasons", [])
            ),
            failures=groups_from(inp.get("failures")),
            quarantine_files=tuple(str(f) for f in out_header.get("quarantine_files", [])),
            allow_quarantine=self.options.allow_quarantine,
        )


def _role_order(name: str) -> tuple[int, str]:
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

"""What a death means in a parallel run: the path's policy over the runtime's supervisor.

The supervisor (runtime/supervisor.py) forks every role from its zygote, reaps them,
kills, holds the timers of delayed restarts and the workers' shared restart budget
(``max_restarts``). Each role's ``decide`` hook here says, with what only the path
knows, what a death means:

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
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from typing import Any

from evflow.errors import EvflowError, PeerLostError
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import scoreboard, statsboard
from evflow.processing.parallel.input import checkpoint
from evflow.processing.parallel.run.restarts import RestartPolicy, output_restart_refusal
from evflow.processing.parallel.split import SplitPath
from evflow.processing.parallel.worker.worker import EXIT_RECYCLE, worker_main
from evflow.processing.statistics import ModuleStatistics
from evflow.runtime.supervisor import (
    Decision,
    ManagedProcess,
    ProcessSpec,
    RestartBudget,
    Supervisor,
)
from evflow.wire.messages import MsgType

__all__ = ["ExitPolicy", "describe_exit"]


def describe_exit(code: int) -> str:
    """``exit code 3`` or ``signal 9 (SIGKILL)``."""
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class ExitPolicy:
    """The exit and restart policy of ``engine.Parent`` (the attributes are the parent's)."""

    split: SplitPath
    options: ProcessOptions
    session: str
    role_options: dict[str, Any]
    sup: Supervisor
    auth: Any
    board: scoreboard.Scoreboard
    stats_board: statsboard.StatsBoard
    backoff: RestartPolicy
    generation: dict[int, int]
    results: dict[str, tuple[dict[str, Any], list[Any]]]
    slot_stats: dict[str, list[ModuleStatistics]]
    timed_out: set[int]
    lost: list[str]
    error: EvflowError | None
    hard: bool
    aborting_at: float
    max_restarts: int
    restarts: int
    recycled: int
    restarts_cancelled: int
    output_restarts: int
    max_output_restarts: int
    input_restarts: int
    max_input_restarts: int

    budget: RestartBudget  # the workers' shared max_restarts
    pids: dict[int, str]  # (the parent's: live roles by pid)
    _alive: Callable[[str], bool]  # (the parent's: whether the input/output runs)
    _send: Callable[..., None]  # (the parent's: a message to a role on ctl)

    # --- the roles as supervised processes --------------------------------------------
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

    # --- deaths -----------------------------------------------------------------------
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

    # --- kills ------------------------------------------------------------------------
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

"""The supervisor: starts a set of processes, reaps them, restarts, relays signals, cleans up.

Every process is a child of one :class:`~evflow.runtime.zygote.Zygote` (a forked
function or an exec'd command such as ``evflow device ...``), so every death is noticed
at once through ``zygote.fileno()``, and every child dies with the supervisor.

- **Restart policy** per process: ``never`` or ``on-failure`` (a non-zero exit or a
  signal) with ``max_restarts`` and exponential backoff (``backoff_s * 2**n``, capped at
  ``backoff_max_s``). Past the limit the process is reported *failed* with a message
  naming it, its last exit and the limit. The clock is injectable (tests).
- **Orderly shutdown** (first SIGINT/SIGTERM, or :meth:`Supervisor.shutdown`): groups in
  ``stop_order`` (default: the order of :meth:`~Supervisor.add`), one group after the
  other. A device (``device_id`` set, bus on) is walked down FairMQ's sequence over the
  bus (RUNNING -> STOP -> RESET_TASK -> RESET_DEVICE -> END); a plain process gets
  SIGTERM. Whatever is still alive after ``grace_s`` gets SIGKILL. A second SIGINT
  SIGKILLs everything at once. The bus proxy (if any) stops last.
- **Decisions**: a spec with a ``decide`` hook (processes.py) says per death what
  happens: restart now, later (the supervisor holds the timer), with new arguments,
  taking one of a group's shared :class:`RestartBudget`, or end, or give up. A path run
  (processing/parallel/run/engine.py) keeps its policy there and leaves the mechanics here.
- **Events**: :meth:`~Supervisor.on_exit` callbacks and :meth:`~Supervisor.poll` return
  an :class:`ExitEvent` for each death, as soon as it happens.
- **Cleanup**: :meth:`~Supervisor.close` removes the session's ipc directory and its
  shared-memory segments.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from evflow.errors import ConfigurationError, EvflowError, PeerLostError
from evflow.runtime._supervisor_stop import StoppingMixin
from evflow.runtime.processes import (
    RESTART_POLICIES,
    Decision,
    ExitEvent,
    ManagedProcess,
    ProcessSpec,
    RestartBudget,
    describe_exit,
)
from evflow.runtime.zygote import Zygote
from evflow.transport.paths import remove_session_files

__all__ = [
    "BUS_PROCESS",
    "RESTART_POLICIES",
    "Decision",
    "ExitEvent",
    "ManagedProcess",
    "ProcessSpec",
    "RestartBudget",
    "Supervisor",
    "describe_exit",
]

log = logging.getLogger("evflow.supervisor")

#: the bus proxy's process name; it stops after every other process
BUS_PROCESS = "bus"


class Supervisor(StoppingMixin):
    """Per-host process manager. See the module docstring.

    Call :meth:`start` before creating any zmq context in this process (it forks the
    zygote); ``bus=True`` also starts a bus proxy process for the session (local ipc
    endpoints that ``evflow ctl`` finds; ``bus_addresses`` adds or replaces them).
    """

    def __init__(
        self,
        session: str | None = None,
        *,
        zygote: Zygote | None = None,
        bus: bool = False,
        bus_addresses: tuple[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session = session or f"s{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.zygote = zygote if zygote is not None else Zygote()
        self.clock = clock
        self.processes: dict[str, ManagedProcess] = {}
        self._by_pid: dict[int, ManagedProcess] = {}
        self._callbacks: list[Callable[[ExitEvent], None]] = []
        self._started = False
        self._stopping = False
        self._final = False  # stop_restarting(): every death from now on is final
        self._fast = False
        self._signals = 0
        self.signals: list[int] = []  # the signals received, in order
        self._stopping_requested = False
        self._want_bus = bus
        # the proxy's (XSUB, XPUB) channel addresses; ";" adds endpoints, e.g.
        # ("ipc://bus-in.ipc;tcp://*:5555", "ipc://bus-out.ipc;tcp://*:5556") for other hosts
        self._bus_addresses = bus_addresses
        self._context: Any = None
        self._controller: Any = None
        self.failed: list[ExitEvent] = []
        #: replace a zygote that died (its children died with it and are handled as
        #: any death: restarted by their policy). Off unless asked for: a caller that
        #: polls :meth:`fileno` must then register it again after a replacement
        self.replace_lost_zygote = False
        self.zygote_replacements = 0
        #: ``callback(new_zygote_pid)`` after a replacement, before anything is forked
        self.on_new_zygote: list[Callable[[int], None]] = []
        self._carried: list[tuple[int, int]] = []  # exits the lost zygote left

    def __repr__(self) -> str:
        alive = sum(p.alive for p in self.processes.values())
        return f"<Supervisor {self.session} processes={len(self.processes)} alive={alive}>"

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> Supervisor:
        """Fork the zygote (if not yet running), start the bus and every added process."""
        if self._started:
            return self
        if self.zygote.pid is None:
            self.zygote.start()
        self._started = True
        if self._want_bus:
            from evflow.runtime.bus import run_bus_proxy

            self.add(
                ProcessSpec(
                    BUS_PROCESS,
                    target=run_bus_proxy,
                    args=(self.session, *(self._bus_addresses or ())),
                    restart="on-failure",
                    max_restarts=5,
                    stop_order=1 << 30,
                    grace_s=2.0,
                )
            )
        for proc in sorted(self.processes.values(), key=lambda p: p.order):
            if proc.state == "new":
                self._launch(proc)
        return self

    @property
    def bus_endpoints(self) -> Any:
        """The session bus's endpoints (a ``BusEndpoints``), for ``--bus`` of devices."""
        from evflow.runtime.bus import BusEndpoints

        return BusEndpoints.for_session(self.session)

    def add(self, spec: ProcessSpec) -> ManagedProcess:
        """Register ``spec``; started at once if the supervisor runs."""
        if spec.name in self.processes:
            raise ConfigurationError(f"a process named {spec.name!r} is already supervised")
        proc = ManagedProcess(spec, order=len(self.processes))
        self.processes[spec.name] = proc
        if self._started and not self._stopping:
            self._launch(proc)
        return proc

    def add_many(self, specs: Sequence[ProcessSpec]) -> list[ManagedProcess]:
        """Register ``specs`` (functions only); when running, the zygote forks them in
        one request (:meth:`Zygote.spawn_many`). A failed fork fails its process only."""
        seen = set(self.processes)
        for spec in specs:
            if spec.target is None:
                raise ConfigurationError(f"add_many: process {spec.name!r} has no target")
            if spec.name in seen:
                raise ConfigurationError(f"a process named {spec.name!r} is already supervised")
            seen.add(spec.name)
        procs = []
        for spec in specs:
            proc = ManagedProcess(spec, order=len(self.processes))
            self.processes[spec.name] = proc
            procs.append(proc)
        if not self._started or self._stopping:
            return procs
        for proc in procs:
            if proc.spec.before_launch is not None:
                proc.spec.before_launch(proc)
        try:
            pids = self.zygote.spawn_many(self._items(procs))
        except PeerLostError:
            if not self._replace_zygote():
                raise
            pids = self.zygote.spawn_many(self._items(procs))  # (arguments made again)
        for proc, pid in zip(procs, pids, strict=True):
            if isinstance(pid, int):
                self._launched(proc, pid)
            else:
                self._fail(proc, -1, 1, f"{proc.name}: cannot start: {pid}")
        return procs

    @staticmethod
    def _items(procs: list[ManagedProcess]) -> list[tuple[Any, tuple[Any, ...], str]]:
        return [(p.spec.target, p.args, p.label) for p in procs if p.spec.target is not None]

    def add_function(
        self, name: str, target: Callable[..., int | None], *args: Any, **policy: Any
    ) -> ManagedProcess:
        """``add(ProcessSpec(name, target=target, args=args, **policy))``."""
        return self.add(ProcessSpec(name, target=target, args=args, **policy))

    def add_command(self, name: str, argv: Sequence[str], **policy: Any) -> ManagedProcess:
        """``add(ProcessSpec(name, argv=argv, **policy))``."""
        return self.add(ProcessSpec(name, argv=list(argv), **policy))

    def _launch(self, proc: ManagedProcess) -> None:
        try:
            self._launch_once(proc)
        except PeerLostError:  # the zygote died (under the request, or before it)
            if not self._replace_zygote():
                raise
            self._launch_once(proc)  # its arguments made again for the new zygote

    def _replace_zygote(self) -> bool:
        """Start a new zygote in place of the lost one; False if not allowed (or it
        still runs). Its children died with it (PDEATHSIG): their exits, reported as
        SIGKILL, are handled by the next :meth:`reap` like any other death."""
        old = self.zygote
        if not self.replace_lost_zygote or old.alive or self._stopping or self._final:
            return False
        self._carried.extend(old.stop(grace_s=0.0))
        self.zygote = Zygote().start(replacing=True)
        self.zygote_replacements += 1
        log.warning("zygote pid %s died; a new zygote (pid %s) forks the processes from now on",
                    old.pid, self.zygote.pid)  # fmt: skip
        for callback in self.on_new_zygote:
            callback(self.zygote.pid or 0)
        return True

    def _launch_once(self, proc: ManagedProcess) -> None:
        spec = proc.spec
        if spec.before_launch is not None:
            spec.before_launch(proc)
        if spec.target is not None:
            pid = self.zygote.spawn(spec.target, *proc.args, name=proc.label)
        else:
            assert spec.argv is not None
            pid = self.zygote.spawn_exec(spec.argv, env=spec.env, cwd=spec.cwd, name=spec.name)
        self._launched(proc, pid)

    def _launched(self, proc: ManagedProcess, pid: int) -> None:
        spec = proc.spec
        proc.pid, proc.state, proc.returncode = pid, "running", None
        proc.restart_at_s = None
        proc.started_at_s = self.clock()
        proc.pids.append(pid)
        self._by_pid[pid] = proc
        if spec.after_launch is not None:
            spec.after_launch(proc)

    # --- events --------------------------------------------------------------------
    def on_exit(self, callback: Callable[[ExitEvent], None]) -> None:
        """Call ``callback(event)`` for every death, from :meth:`poll` (same thread)."""
        self._callbacks.append(callback)

    def fileno(self) -> int:
        """Readable when a child died: put it in your zmq.Poller, then call :meth:`poll`."""
        return self.zygote.fileno()

    @property
    def live(self) -> Mapping[int, ManagedProcess]:
        """The running processes by pid (a read-only view, no copy: cheap to ask often)."""
        return MappingProxyType(self._by_pid)

    def next_restart_in_s(self) -> float | None:
        """Seconds until the next scheduled restart (by ``clock``), None if none."""
        due = [p.restart_at_s for p in self.processes.values() if p.restart_at_s is not None]
        return max(0.0, min(due) - self.clock()) if due else None

    def poll(self, timeout_s: float = 0.0) -> list[ExitEvent]:
        """Wait up to ``timeout_s`` for deaths; handle them and start due restarts."""
        wait_s = timeout_s
        restart_in = self.next_restart_in_s()
        if restart_in is not None:
            wait_s = min(wait_s, restart_in)
        if wait_s > 0:
            with selectors.DefaultSelector() as sel:
                sel.register(self.zygote.fileno(), selectors.EVENT_READ)
                sel.select(wait_s)
        events = self.reap()
        events += self.launch_due()
        for event in events:
            for callback in self._callbacks:
                callback(event)
        return events

    def reap(self) -> list[ExitEvent]:
        """Handle the deaths noticed so far (never blocks; no callbacks): a ``decide``
        hook's immediate restart is forked here, a delayed one by :meth:`launch_due`."""
        exits = self.zygote.exits()
        if not self.zygote.alive and self._started:
            # replaced before its children's deaths are decided: their restarts are
            # forked by the new zygote, with arguments that name it
            self._replace_zygote()
        exits = self._carried + exits + self.zygote.exits()
        self._carried = []
        return [self._handle_exit(pid, rc) for pid, rc in exits]

    def launch_due(self) -> list[ExitEvent]:
        """Fork the restarts whose backoff is over (no callbacks); failed ones as events."""
        events: list[ExitEvent] = []
        now = self.clock()
        for proc in sorted(self.processes.values(), key=lambda p: p.order):
            if proc.state == "backoff" and proc.restart_at_s is not None:
                if self._stopping:
                    proc.state, proc.restart_at_s = "stopped", None
                elif now >= proc.restart_at_s:
                    proc.restarts += 1
                    log.info(
                        "restarting %s (restart %d of %d)",
                        proc.name,
                        proc.restarts,
                        proc.spec.max_restarts,
                    )
                    proc.budgeted = False
                    try:
                        self._launch(proc)
                    except EvflowError as exc:
                        events.append(self._fail(proc, proc.pid or 0, -1, f"restart failed: {exc}"))
        return events

    def cancel_restarts(self) -> int:
        """Drop every restart still waiting for its backoff (e.g. the work is over);
        each gives its restart back to its budget. Returns how many were dropped."""
        n = 0
        for proc in self.processes.values():
            if proc.state == "backoff":
                proc.state, proc.restart_at_s = "stopped", None
                if proc.budgeted and proc.spec.budget is not None:
                    proc.spec.budget.used -= 1
                proc.budgeted = False
                n += 1
        return n

    def stop_restarting(self) -> int:
        """From now on a death is final (``stopped``, never restarted): the work is being
        stopped in order by someone else (a topology's controller walking its devices
        down), and a process that fails on its way out is to be reported, not started
        again. Drops the restarts waiting for their backoff; returns how many."""
        self._final = True
        return self.cancel_restarts()

    def waiting(self) -> list[ManagedProcess]:
        """Processes waiting for a delayed restart."""
        return [p for p in self.processes.values() if p.state == "backoff"]

    def _handle_exit(self, pid: int, returncode: int) -> ExitEvent:
        proc = self._by_pid.pop(pid, None)
        if proc is None:  # spawned on the shared zygote by someone else: pass it on
            what = f"unmanaged child pid {pid} {describe_exit(returncode)}"
            return ExitEvent("", pid, returncode, "unmanaged", 0, what, self.clock())
        proc.returncode = returncode
        spec = proc.spec
        what = f"process {proc.name!r} (pid {pid}) {describe_exit(returncode)}"
        now = self.clock()
        if self._stopping or self._final:
            proc.state = "stopped"
            return ExitEvent(proc.name, pid, returncode, "stopped", proc.restarts, what, now)
        if spec.decide is not None:
            return self._decided(proc, pid, returncode, what, now)
        if returncode == 0:
            proc.state = "done"
            return ExitEvent(proc.name, pid, 0, "done", proc.restarts, what, now)
        if spec.restart == "never":
            return self._fail(proc, pid, returncode, f"{what}; restart policy is 'never'")
        if returncode in spec.final_codes:
            return self._fail(proc, pid, returncode, f"{what}: a final error, not restarted")
        if proc.restarts >= spec.max_restarts:
            return self._fail(
                proc,
                pid,
                returncode,
                f"{what}; it was restarted {proc.restarts} time(s), the limit "
                f"(max_restarts={spec.max_restarts}); giving up",
            )
        delay = spec.backoff_for(proc.restarts)
        proc.state, proc.restart_at_s = "backoff", now + delay
        message = f"{what}; restarting in {delay:.3g} s"
        log.warning("%s", message)
        return ExitEvent(proc.name, pid, returncode, "restarting", proc.restarts, message, now)

    def _decided(
        self, proc: ManagedProcess, pid: int, returncode: int, what: str, now: float
    ) -> ExitEvent:
        """A death of a process with a ``decide`` hook: carry out what the hook says.

        An immediate restart is forked here, before the next death is looked at; a
        failing fork raises (the caller's run cannot go on without its process).
        """
        decision = proc.spec.decide(proc, returncode)  # type: ignore[misc]
        if decision.action == "end":
            proc.state = "done" if returncode == 0 else "ended"
            outcome = proc.state
            return ExitEvent(proc.name, pid, returncode, outcome, proc.restarts, what, now)
        if decision.action != "restart":
            return self._fail(proc, pid, returncode, decision.message or what)
        budget = proc.spec.budget
        if decision.counts and budget is not None:
            if budget.left <= 0:
                return self._fail(
                    proc, pid, returncode, f"{what}; the group's {budget.limit} restarts are spent"
                )
            budget.used += 1
        if decision.args is not None:
            proc.args = decision.args
        if decision.delay_s > 0.0:
            proc.state, proc.restart_at_s = "backoff", now + decision.delay_s
            proc.budgeted = decision.counts and budget is not None
            message = f"{what}; restarting in {decision.delay_s:.3g} s"
        else:
            proc.restarts += 1
            self._launch(proc)
            message = f"{what}; restarted (pid {proc.pid})"
        return ExitEvent(proc.name, pid, returncode, "restarting", proc.restarts, message, now)

    def _fail(self, proc: ManagedProcess, pid: int, returncode: int, message: str) -> ExitEvent:
        proc.state, proc.restart_at_s = "failed", None
        event = ExitEvent(
            proc.name, pid, returncode, "failed", proc.restarts, f"{message} (failed)", self.clock()
        )
        self.failed.append(event)
        log.error("%s", event.message)
        return event

    def kill(self, target: str | int, sig: int = signal.SIGKILL) -> bool:
        """Send ``sig`` to a process by name or pid (e.g. on a per-event timeout).

        Race-free: a child that was already reaped is not signalled (returns False).
        """
        if isinstance(target, str):
            proc = self.processes.get(target)
            if proc is None:
                raise ConfigurationError(f"no supervised process named {target!r}")
            if proc.pid is None or not proc.alive:
                return False
            target = proc.pid
        return self.zygote.kill(int(target), sig)

    @property
    def active(self) -> bool:
        """True while a process (other than the bus proxy) runs or waits for its restart."""
        return any(
            p.state in ("running", "backoff")
            for p in self.processes.values()
            if p.name != BUS_PROCESS
        )

    def close(self, cleanup: bool = True) -> None:
        """Stop what still runs (fast), the zygote, and remove the session's ipc and shm
        (``cleanup=False``: the caller calls :meth:`cleanup` once its sockets closed)."""
        if any(p.alive for p in self.processes.values()):
            self.shutdown(fast=True)
        if self._controller is not None:
            self._controller.close()
            self._context.term()
            self._controller = self._context = None
        if self.zygote.pid is not None:  # a lost one too: its sockets, its zombie
            self._stopping = True  # what the zygote's stop reaps is not restarted
            for pid, rc in self.zygote.stop(grace_s=0.5):
                self._handle_exit(pid, rc)
        if cleanup:
            self.cleanup()

    def cleanup(self) -> None:
        """Remove the session's ipc directory and shared-memory segments."""
        remove_session_files(self.session)

    def __enter__(self) -> Supervisor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

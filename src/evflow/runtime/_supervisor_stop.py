"""The supervisor's signals and shutdown (a mixin of runtime.supervisor.Supervisor).

First SIGINT/SIGTERM: :attr:`shutdown_requested`; a second: the shutdown goes fast.
:meth:`shutdown` stops the processes group by group in ``stop_order``: devices walked
down FairMQ's sequence over the bus, plain processes SIGTERM, SIGKILL after ``grace_s``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from evflow.runtime._devicestop import walk_down
from evflow.runtime.processes import ExitEvent, ManagedProcess
from evflow.runtime.zygote import Zygote

log = logging.getLogger("evflow.supervisor")


class StoppingMixin:
    """Signals, :meth:`run` and :meth:`shutdown` of the Supervisor (its attributes)."""

    processes: dict[str, ManagedProcess]
    zygote: Zygote
    signals: list[int]
    _signals: int
    _fast: bool
    _stopping: bool
    _stopping_requested: bool
    _want_bus: bool
    _context: Any
    _controller: Any
    failed: list[ExitEvent]

    if TYPE_CHECKING:  # a property of the Supervisor

        @property
        def active(self) -> bool: ...

    bus_endpoints: Any
    start: Callable[[], Any]
    poll: Callable[[float], list[ExitEvent]]
    close: Callable[[], None]

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)
        self._signals += 1
        if self._signals > 1:
            self._fast = True  # the second signal: no more waiting
        self._stopping_requested = True

    @property
    def shutdown_requested(self) -> bool:
        """True once SIGINT/SIGTERM arrived (with :meth:`install_signal_handlers`)."""
        return self._stopping_requested

    def install_signal_handlers(self, keep_ignored: bool = False) -> Callable[[], None]:
        """Handle SIGINT/SIGTERM: the first sets :attr:`shutdown_requested`, a second
        makes a running :meth:`shutdown` fast; :attr:`signals` lists them. Returns a
        function that restores the old handlers. :meth:`run` does this for you.

        ``keep_ignored``: a signal ignored now stays ignored (a run started in the
        background must not stop on the terminal's Ctrl-C), and outside the main thread
        nothing is installed.
        """
        sigs: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
        if keep_ignored:
            if threading.current_thread() is not threading.main_thread():
                return lambda: None
            sigs = tuple(s for s in sigs if signal.getsignal(s) is not signal.SIG_IGN)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in sigs}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore

    def run(self, install_signals: bool = True, poll_s: float = 0.1) -> int:
        """Supervise until every process ended; shut down on SIGINT/SIGTERM.

        Returns 0, or 1 if a process failed (its message was logged). Main thread only
        when ``install_signals``.
        """
        restore = self.install_signal_handlers() if install_signals else None
        try:
            self.start()
            while self.active and not self._stopping_requested:
                self.poll(poll_s)
            if self._stopping_requested:
                self.shutdown()
        finally:
            if restore is not None:
                restore()
            self.close()
        return 1 if self.failed else 0

    def shutdown(self, fast: bool = False) -> None:
        """Stop everything: group by group in ``stop_order`` (see the module docstring)."""
        self._stopping = True
        self._fast = self._fast or fast
        self.poll(0)
        groups: dict[int, list[ManagedProcess]] = {}
        for proc in self.processes.values():
            key = proc.spec.stop_order if proc.spec.stop_order is not None else proc.order
            groups.setdefault(key, []).append(proc)
        for key in sorted(groups):
            self._stop_group(groups[key])

    def _stop_group(self, group: list[ManagedProcess]) -> None:
        """SIGTERM plain processes, walk devices down over the bus, SIGKILL the rest."""
        alive = [p for p in group if p.alive]
        if not alive:
            return
        if not self._fast:
            devices = [p for p in alive if p.spec.device_id and self._want_bus]
            for proc in alive:
                if proc not in devices and proc.pid is not None:
                    log.info("stopping %s (pid %d): SIGTERM", proc.name, proc.pid)
                    self.zygote.kill(proc.pid, signal.SIGTERM)
            for proc in devices:  # one after the other, each within its own grace
                self._stop_device(proc, time.monotonic() + proc.spec.grace_s)
            deadline = time.monotonic() + max(p.spec.grace_s for p in alive)
            self._wait(alive, deadline)
            late = [p for p in devices if p.alive and p.pid is not None]
            for proc in late:  # did not finish over the bus: the runner's own SIGTERM path
                log.warning("device %s did not stop over the bus: SIGTERM", proc.name)
                self.zygote.kill(proc.pid, signal.SIGTERM)  # type: ignore[arg-type]
            if late:
                self._wait(late, time.monotonic() + 1.0)
        for proc in alive:
            if proc.alive and proc.pid is not None:
                how = log.info if self._fast else log.warning
                how("%s (pid %d) still alive: SIGKILL", proc.name, proc.pid)
                self.zygote.kill(proc.pid, signal.SIGKILL)
        self._wait(alive, time.monotonic() + 5.0, stop_on_fast=False)

    def _wait(
        self, procs: list[ManagedProcess], deadline_s: float, stop_on_fast: bool = True
    ) -> None:
        while any(p.alive for p in procs) and time.monotonic() < deadline_s:
            if stop_on_fast and self._fast:
                return
            self.poll(0.05)

    def _stop_device(self, proc: ManagedProcess, deadline_s: float) -> None:
        """Walk a device down FairMQ's shutdown sequence over the bus (see _devicestop)."""
        walk_down(
            self._bus_controller(),
            str(proc.spec.device_id),
            deadline_s,
            poll=self.poll,
            alive=lambda: proc.alive,
            fast=lambda: self._fast,
        )

    def _bus_controller(self) -> Any:
        if self._controller is None:
            import zmq

            from evflow.runtime.bus import BusController

            self._context = zmq.Context()
            self._controller = BusController(
                self._context, self.bus_endpoints, name=f"supervisor-{os.getpid()}"
            )
        return self._controller

"""Run a path over all events in this process (basf2's sequential mode).

initialize all modules; for every event from the source: begin_run/end_run at a change
of (experiment, run), then ``event`` on each module until one drops it; at the end
end_run and terminate. A module that raises stops the run with a ``ModuleError`` after
the writers are terminated, so everything written so far stays readable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any

from evflow.errors import ConfigurationError, EvflowError, ModuleError
from evflow.processing.chain import ModuleChain, output_files, user_traceback
from evflow.processing.console import ConsoleProgress, is_terminal
from evflow.processing.failures import groups_from
from evflow.processing.options import ProcessOptions
from evflow.processing.path import Path
from evflow.processing.quarantine import MAX_QUARANTINED, SequentialQuarantine
from evflow.processing.summary import RunSummary

_clock = time.perf_counter


def run_sequential(path: Path, options: ProcessOptions | None = None) -> RunSummary:
    """Process every event of ``path``'s source (up to ``options.max_events``)."""
    options = options if options is not None else ProcessOptions()
    source = path.source
    if source is None:
        first = path.modules[0].name if len(path) else "nothing"
        raise ConfigurationError(
            f"the path has no source: its first module is {first}; start it with a "
            f"Source such as RootInput, RecordInput or ToyGenerator"
        )
    chain = ModuleChain(path.modules, process="main")
    total = source.total()
    if options.max_events is not None:
        total = options.max_events if total is None else min(total, options.max_events)
    progress = ConsoleProgress(
        total,
        enabled=options.show_progress(is_terminal(sys.stderr)),
        interval_s=options.progress_interval_s,
    )
    read = written = 0
    start = time.monotonic()
    quarantine = None
    if options.allow_quarantine:  # a failing event is quarantined, the run goes on
        limit = int((options.extra or {}).get("max_quarantined", MAX_QUARANTINED))
        quarantine = SequentialQuarantine(chain, limit)
    with StopSignals() as stop:
        try:
            chain.initialize()
            progress.start()
            read, written = _event_loop(
                chain, source, options.max_events, progress, stop, quarantine
            )
            chain.end_run()
            progress.stop(read)
            chain.terminate()
            if quarantine is not None:
                quarantine.close()
        except BaseException:  # a second Ctrl-C too: close the writers, then stop
            progress.stop()
            chain.abort()
            if quarantine is not None:
                quarantine.abort()
            raise
    wall_s = time.monotonic() - start
    stats = chain.statistics()
    q = quarantine
    return RunSummary(
        events_read=read,
        events_written=written,
        events_dropped=sum(s.dropped for s in stats),
        events_quarantined=len(q.reasons) if q is not None else 0,
        wall_s=wall_s,
        workers=0,
        modules=tuple(stats),
        persistent=chain.persistent,
        outputs=tuple(output_files(chain.modules)) + (q.files if q is not None else ()),
        interrupted=bool(stop.signum),
        counters={"signal": stop.signum} if stop.signum else {},
        quarantined=tuple(q.reasons) if q is not None else (),
        failures=groups_from(q.log.as_list()) if q is not None else (),
        quarantine_files=q.files if q is not None else (),
        allow_quarantine=options.allow_quarantine,
    )


def _event_loop(
    chain: ModuleChain,
    source: Any,
    max_events: int | None,
    progress: ConsoleProgress,
    stop: StopSignals,
    quarantine: SequentialQuarantine | None = None,
) -> tuple[int, int]:
    """The hot loop: per event one source step, the modules, and a clock comparison."""
    read = written = 0
    events = source.events(0)
    limit = max_events if max_events is not None else -1
    current: tuple[int, int] | None = None
    next_due = progress.next_due
    monotonic = time.monotonic
    try:
        while read != limit:
            t0 = _clock()
            try:
                store = next(events)
            except StopIteration:
                break
            except EvflowError:
                raise
            except Exception as exc:
                raise ModuleError(source.name, "events", None, exc, user_traceback(exc)) from exc
            chain.add_source_time(_clock() - t0)
            read += 1
            meta = store.meta
            if current is None or (meta.experiment, meta.run) != current:
                current = (meta.experiment, meta.run)
                chain.switch_run(*current)
            try:
                if chain.event(store):
                    written += 1
            except ModuleError as exc:
                if quarantine is None or exc.hook != "event":
                    raise
                quarantine.put(store, exc)  # allow_quarantine: written flagged, go on
            if stop.signum:
                break  # SIGINT/SIGTERM: this event is done; end the run cleanly
            if next_due != float("inf"):
                now = monotonic()
                if now >= next_due:
                    progress.update(read, now)
                    next_due = progress.next_due
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()  # a generator source closes its files now, not at garbage collection
    return read, written


class StopSignals:
    """SIGINT/SIGTERM during a run: the first finishes the current event and ends the run
    cleanly (end_run, terminate: files closed); a second one stops at once (writers are
    still closed). Installed only in the main thread, and not over an ignored signal.
    """

    def __init__(self) -> None:
        self.signum = 0  # the first stop signal received, 0 for none
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            raise_for_signal(signum)
        self.signum = signum
        # say it at once: an event that hangs would otherwise look like an ignored Ctrl-C
        # (os.write: a signal handler must not re-enter a buffered stream)
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        with contextlib.suppress(OSError):
            os.write(
                2,
                f"evflow: stopping ({what}): the current event finishes, then the run "
                "ends and its files are closed (Ctrl-C again: stop now)\n".encode(),
            )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()


def raise_for_signal(signum: int) -> None:
    """End the program the way ``signum`` asks: SIGTERM exits 143, SIGINT is Ctrl-C (130)."""
    if signum == signal.SIGTERM:
        raise SystemExit(128 + signal.SIGTERM)
    raise KeyboardInterrupt

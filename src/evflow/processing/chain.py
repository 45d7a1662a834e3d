"""Run the hooks of a list of modules in one process, with statistics and clear errors.

The sequential processor runs a whole path through one ``ModuleChain``; a parallel
run gives each process (input, worker, output) a chain of its part of the path. User
exceptions become ``ModuleError`` (module, hook, event uid, user traceback); evflow's
own errors (e.g. ``OutputError`` from a writer) pass through unchanged.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from evflow.errors import EvflowError, ModuleError
from evflow.event import FLAG_DROPPED, DataStore, RunMeta
from evflow.processing.module import Module, Source
from evflow.processing.statistics import ModuleStatistics, StatisticsCollector
from evflow.processing.writer import Writer

log = logging.getLogger(__name__)

_clock = time.perf_counter  # monotonic, finest resolution: for durations only


class ModuleChain:
    """Modules of (a part of) a path, run in order in this process.

    A ``Source`` at position 0 takes part in the run hooks but not in ``event``: the
    processor reads from it and reports the time with ``add_source_time``.
    ``persistent`` is this process's run-level store; every event gets it as
    ``store.persistent``.
    """

    def __init__(
        self,
        modules: Sequence[Module],
        process: str = "main",
        persistent: dict[str, Any] | None = None,
    ) -> None:
        self.modules = list(modules)
        self.persistent: dict[str, Any] = persistent if persistent is not None else {}
        self.stats = StatisticsCollector([m.name for m in self.modules], process)
        first = 1 if self.modules and isinstance(self.modules[0], Source) else 0
        # bound methods looked up once: the per-event loop does no attribute lookups
        self._event_calls: list[tuple[int, Module, Callable[[DataStore], bool | None]]] = [
            (i, m, m.event) for i, m in enumerate(self.modules) if i >= first
        ]
        self._initialized: list[Module] = []
        self._terminated = False
        self.run: RunMeta | None = None

    # --- per event ----------------------------------------------------------------------
    def event(self, store: DataStore) -> bool:
        """Run ``store`` through the modules; False when a module dropped it."""
        store.persistent = self.persistent
        calls, times, dropped = self.stats.calls, self.stats.time_s, self.stats.dropped
        for i, module, call in self._event_calls:
            t0 = _clock()
            try:
                keep = call(store)
            except EvflowError:
                raise
            except Exception as exc:
                raise event_error(module, store, exc) from exc
            times[i] += _clock() - t0
            calls[i] += 1
            if keep is False:
                dropped[i] += 1
                store.meta.flags |= FLAG_DROPPED
                return False
        return True

    def event_batch(
        self,
        stores: Sequence[DataStore],
        kept: bytearray,
        start: int = 0,
        stop: int | None = None,
        cursor: tuple[Any, int] | None = None,
    ) -> list[tuple[int, ModuleError]]:
        """Run ``stores[start:stop]`` through the modules, one store after the other.

        The same calls in the same order as :meth:`event` on each store in turn, but
        a store on which a module raises fails alone: it comes back as ``(index,
        ModuleError)`` and the next store goes on. ``kept[i]`` is set to 1 for each
        store that no module dropped or failed on (left as it was otherwise). An
        ``EvflowError`` (evflow's own, not user code) stops the batch at once.

        ``cursor`` ``(words, at)``: ``words[at] = i + 1`` while store ``i`` is in the
        modules, ``0`` between stores (the worker's scoreboard slot: when the process
        dies, the parent knows the exact event).

        Statistics: ``calls`` and ``dropped`` as :meth:`event` counts them. Time: a
        chain of one module is timed once per batch (its time includes the loop's
        own ~0.1 µs per event and any store that failed); with several modules one
        clock reading per module and store, each module's time running from the end
        of the one before (so the first also carries the loop's overhead).
        """
        stop = len(stores) if stop is None else stop
        if start >= stop:
            return []
        words, at = cursor if cursor is not None else ([0], 0)
        if len(self._event_calls) != 1:
            return self._event_batch_many(stores, kept, start, stop, words, at)
        ((mi, module, call),) = self._event_calls
        persistent = self.persistent
        calls, times, dropped = self.stats.calls, self.stats.time_s, self.stats.dropped
        failures: list[tuple[int, ModuleError]] = []
        n_dropped = 0
        t0 = _clock()
        for i in range(start, stop):
            store = stores[i]
            store.persistent = persistent
            words[at] = i + 1
            try:
                keep = call(store)
            except EvflowError:
                words[at] = 0
                raise
            except Exception as exc:
                words[at] = 0
                failures.append((i, event_error(module, store, exc)))
                continue
            words[at] = 0
            if keep is False:
                n_dropped += 1
                store.meta.flags |= FLAG_DROPPED
            else:
                kept[i] = 1
        times[mi] += _clock() - t0
        calls[mi] += stop - start - len(failures)
        dropped[mi] += n_dropped
        return failures

    def _event_batch_many(
        self,
        stores: Sequence[DataStore],
        kept: bytearray,
        start: int,
        stop: int,
        words: Any,
        at: int,
    ) -> list[tuple[int, ModuleError]]:
        """:meth:`event_batch` for a chain of zero or several modules."""
        persistent = self.persistent
        calls, times, dropped = self.stats.calls, self.stats.time_s, self.stats.dropped
        event_calls = self._event_calls
        failures: list[tuple[int, ModuleError]] = []
        t = _clock()
        for i in range(start, stop):
            store = stores[i]
            store.persistent = persistent
            words[at] = i + 1
            for mi, module, call in event_calls:
                try:
                    keep = call(store)
                except EvflowError:
                    words[at] = 0
                    raise
                except Exception as exc:
                    failures.append((i, event_error(module, store, exc)))
                    t = _clock()
                    break
                now = _clock()
                times[mi] += now - t
                t = now
                calls[mi] += 1
                if keep is False:
                    dropped[mi] += 1
                    store.meta.flags |= FLAG_DROPPED
                    break
            else:
                kept[i] = 1
            words[at] = 0
        return failures

    def add_source_time(self, seconds: float) -> None:
        """Count one event produced by the source at position 0 in ``seconds``."""
        self.stats.calls[0] += 1
        self.stats.time_s[0] += seconds

    # --- run hooks ----------------------------------------------------------------------
    def initialize(self) -> None:
        for module in self.modules:
            self._hook(module, "initialize", module.initialize)
            self._initialized.append(module)

    def switch_run(self, experiment: int, run: int) -> None:
        """Call end_run/begin_run when (experiment, run) differs from the current run."""
        current = self.run
        if current is not None and current.experiment == experiment and current.run == run:
            return
        if current is not None:
            self.end_run()
        self.run = RunMeta(experiment, run)
        for module in self.modules:
            self._hook(module, "begin_run", module.begin_run, self.run)

    def end_run(self) -> None:
        """End the current run, if one is open."""
        run, self.run = self.run, None
        if run is None:
            return
        for module in self.modules:
            self._hook(module, "end_run", module.end_run, run)

    def terminate(self) -> None:
        """Terminate every module in path order (once)."""
        if self._terminated:
            return
        self._terminated = True
        for module in self._initialized:
            self._hook(module, "terminate", module.terminate)

    def abort(self) -> None:
        """After an error: terminate the writers so what they wrote stays readable.

        Other modules are left alone (their state is unknown). Errors from the writers
        are logged, never raised: they must not hide the error that stopped the run.
        """
        if self._terminated:
            return
        self._terminated = True
        for module in self._initialized:
            if not is_writer(module):
                continue
            try:
                module.terminate()
            except EvflowError as exc:
                # e.g. the full disk that stopped the run fails the close again: the
                # run's own error line says it; a traceback here would only bury it
                log.debug("writer %r failed to close after an error: %s", module.name, exc)
            except Exception as exc:
                log.warning(
                    "writer %r failed to close after an error: %s: %s",
                    module.name,
                    type(exc).__name__,
                    exc,
                )

    def statistics(self) -> list[ModuleStatistics]:
        return self.stats.snapshot()

    def writers(self) -> list[Module]:
        return [m for m in self.modules if is_writer(m)]

    @staticmethod
    def _hook(module: Module, hook: str, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except EvflowError:
            raise
        except Exception as exc:
            raise ModuleError(module.name, hook, None, exc, user_traceback(exc)) from exc


def is_writer(module: Module) -> bool:
    """Whether ``module`` writes output (a :class:`~evflow.processing.writer.Writer`, or
    one in shape)."""
    if isinstance(module, Writer):
        return True
    return all(callable(getattr(module, name, None)) for name in ("flush", "close", "write_raw"))


def output_files(modules: Iterable[Module]) -> list[str]:
    """The files the writers among ``modules`` write (their ``file`` parameter)."""
    files = []
    for module in modules:
        if is_writer(module):
            value = module.params.get("file") or getattr(module, "file", None)
            if value:
                files.append(str(value))
    return files


def event_error(module: Module, store: DataStore, exc: Exception) -> ModuleError:
    """The error for ``exc`` raised by ``module.event(store)``, caused by it."""
    error = ModuleError(module.name, "event", store.meta.uid, exc, user_traceback(exc))
    error.__cause__ = exc
    return error


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without the frames of this wrapper module."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))

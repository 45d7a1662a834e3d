"""The result of a run and how it is shown: counts, rate and the module table."""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass, field
from typing import IO, Any

from evflow.processing.console import is_terminal
from evflow.processing.failures import FailureGroup, report_failures
from evflow.processing.statistics import ModuleStatistics, merge_statistics, processes_of

#: more processes than this: the per-process columns of the module table are folded
#: (processes, fewest and most calls), or 1000 workers print a table 1000 columns wide
MAX_PROCESS_COLUMNS = 8


@dataclass(frozen=True, slots=True)
class RunSummary:
    """What ``evflow.process`` returns.

    ``events_read`` came out of the source, ``events_written`` reached the end of the
    path, ``events_dropped`` were dropped by a module, ``events_quarantined`` were
    written raw after too many failed attempts (parallel only). ``wall_s`` is the
    wall time of the event loop in seconds. ``modules`` holds one row per module and
    process (see ``ModuleStatistics.process``). ``persistent`` is the run-level store
    (``store.persistent``; merged over workers in a parallel run), e.g. histograms.
    ``counters`` carries extra figures by name (restarts, retries, ...).
    """

    events_read: int = 0
    events_written: int = 0
    events_dropped: int = 0
    events_quarantined: int = 0
    wall_s: float = 0.0
    workers: int = 0
    modules: tuple[ModuleStatistics, ...] = ()
    persistent: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, int | float] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    interrupted: bool = False
    quarantined: tuple[tuple[int, str], ...] = ()
    """(uid, reasons) of every quarantined event (parallel runs; reliability)."""
    failures: tuple[FailureGroup, ...] = ()
    """Module exceptions of a parallel run, one group per module and exception type
    (retried or quarantined); ``report_failures()`` shows them."""
    quarantine_files: tuple[str, ...] = ()
    """Record files the quarantined events went to beside a columnar (ROOT) output."""
    killed_workers: tuple[str, ...] = ()
    """Workers killed before they reported: their ``modules`` rows were read from
    shared memory and count up to their last finished batch."""
    allow_quarantine: bool = False
    """The run was told quarantined events are acceptable (``--allow-quarantine``)."""

    @property
    def events_failed(self) -> bool:
        """Events were quarantined and the run was not told to accept it: ``evflow run``
        exits with ``EXIT_EVENTS_FAILED``."""
        return bool(self.events_quarantined) and not self.allow_quarantine

    def report_failures(self, file: IO[str] | None = None) -> None:
        """One line per failing module (after its first traceback) on ``file`` (stderr)."""
        if self.failures or self.quarantined:
            report_failures(self.failures, self.quarantined, file or sys.stderr)

    @property
    def rate_hz(self) -> float:
        """Events read per second of wall time."""
        return self.events_read / self.wall_s if self.wall_s > 0 else 0.0

    def module_totals(self) -> list[ModuleStatistics]:
        """One row per module, summed over processes."""
        return merge_statistics(self.modules)

    def render(self, file: IO[str] | None = None, width: int | None = None) -> None:
        """Print the summary and the module statistics table (rich) to ``file``."""
        from rich.console import Console

        stream = file if file is not None else sys.stdout
        if width is None and not is_terminal(stream):
            width = (
                1000  # logs and pipes: never squeeze columns (tables are only as wide as needed)
            )
        console = Console(file=stream, width=width, highlight=False, markup=False)
        console.print(self._summary_line(), soft_wrap=True)
        if self.modules:
            console.print(self._table())

    def __str__(self) -> str:
        buf = io.StringIO()
        self.render(buf)
        return buf.getvalue()

    def _summary_line(self) -> str:
        mode = f"{self.workers} worker(s)" if self.workers else "sequential"
        parts = [
            f"{self.events_read} read",
            f"{self.events_written} written",
            f"{self.events_dropped} dropped",
        ]
        if self.events_quarantined:
            parts.append(f"{self.events_quarantined} quarantined")
        text = (
            f"evflow: {', '.join(parts)} events in {self.wall_s:.2f} s "
            f"({self.rate_hz:,.0f} events/s, {mode})"
        )
        if self.interrupted:
            text += " [interrupted]"
        for name, value in self.counters.items():
            text += f"\n  {name}: {value}"
        for uid, reason in self.quarantined[:20]:
            text += f"\n  quarantined uid {uid}: {reason}"
        if len(self.quarantined) > 20:
            text += f"\n  ... and {len(self.quarantined) - 20} more quarantined"
        for file in self.quarantine_files:
            text += f"\n  quarantined events written to {file}"
        return text

    def _table(self) -> Any:
        from rich.table import Table

        processes = processes_of(self.modules)
        per_process = 1 < len(processes) <= MAX_PROCESS_COLUMNS
        folded = len(processes) > MAX_PROCESS_COLUMNS
        notes = []
        if per_process:
            notes.append("per-process columns: calls")
        if folded:
            notes.append(
                f"{len(processes)} processes: per-process columns folded into the "
                "processes a module ran in and its fewest and most calls in one of them"
            )
        if self.killed_workers:
            killed = list(self.killed_workers)
            names = ", ".join(killed[:MAX_PROCESS_COLUMNS])
            if len(killed) > MAX_PROCESS_COLUMNS:
                names += f" and {len(killed) - MAX_PROCESS_COLUMNS} more"
            notes.append(
                f"killed before they reported: {names} (their calls count up to their "
                "last finished batch)"
            )
        table = Table(
            title="Module statistics",
            title_justify="left",
            caption="\n".join(notes) or None,
            caption_justify="left",
        )
        table.add_column("Module", no_wrap=True)
        table.add_column("Calls", justify="right", no_wrap=True)
        table.add_column("Dropped", justify="right", no_wrap=True)
        table.add_column("Time (s)", justify="right", no_wrap=True)
        table.add_column("Time/call (ms)", justify="right", no_wrap=True)
        table.add_column("Share", justify="right", no_wrap=True)
        extra_columns = 0
        if per_process:
            for proc in processes:
                table.add_column(proc, justify="right", no_wrap=True)
            extra_columns = len(processes)
        if folded:
            for title in ("Processes", "Min calls", "Max calls"):
                table.add_column(title, justify="right", no_wrap=True)
            extra_columns = 3
        totals = self.module_totals()
        grand_s = sum(row.time_s for row in totals) or 1.0
        by_key = {(row.module, row.process): row for row in self.modules}
        for row in totals:
            cells = [
                row.module,
                f"{row.calls:,}",
                f"{row.dropped:,}",
                f"{row.time_s:.3f}",
                f"{row.mean_ms:.4f}",
                f"{100 * row.time_s / grand_s:.1f}%",
            ]
            if per_process:
                for proc in processes:
                    one = by_key.get((row.module, proc))
                    cells.append(f"{one.calls:,}" if one else "")
            if folded:
                calls = [r.calls for r in self.modules if r.module == row.module]
                cells += [f"{len(calls):,}", f"{min(calls):,}", f"{max(calls):,}"]
            table.add_row(*cells)
        table.add_section()
        table.add_row(
            "Total",
            f"{self.events_read:,}",
            f"{self.events_dropped:,}",
            f"{sum(r.time_s for r in totals):.3f}",
            "",
            "",
            *([""] * extra_columns),
        )
        return table

"""A rich progress bar for the terminal: events, events/s and ETA when the total is known.

The processor calls ``update(done)`` whenever it likes; the bar redraws at most every
``interval_s`` seconds, so per-event cost is one clock read and a comparison at the
call site (the processor checks ``due(now)`` before calling ``update``).
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import IO, Any

__all__ = ["ConsoleProgress", "is_terminal"]


class ConsoleProgress:
    """Progress of one run on a terminal stream (stderr by default).

    ``enabled=False`` makes every method a no-op, so callers need no ``if``.
    """

    def __init__(
        self,
        total: int | None,
        enabled: bool,
        interval_s: float = 0.1,
        description: str = "events",
        file: IO[str] | None = None,
    ) -> None:
        self.total = total
        self.enabled = enabled
        self.interval_s = interval_s
        self.next_due = 0.0  # time.monotonic() of the next allowed redraw
        self._description = description
        self._file = file if file is not None else sys.stderr
        self._progress: Any = None
        self._task: Any = None

    def start(self) -> ConsoleProgress:
        if not self.enabled:
            self.next_due = float("inf")  # never due: callers skip update() entirely
            return self
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        console = Console(file=self._file, force_terminal=True)
        columns: list[Any] = [TextColumn("[bold]{task.description}")]
        if self.total is not None:
            columns.append(BarColumn())
        columns += [
            MofNCompleteColumn() if self.total is not None else TextColumn("{task.completed}"),
            TextColumn("{task.fields[rate]} events/s"),
            TimeElapsedColumn(),
        ]
        if self.total is not None:
            columns += [TextColumn("ETA"), TimeRemainingColumn()]
        # auto_refresh off: no extra thread, we redraw at most every interval_s
        self._progress = Progress(*columns, console=console, auto_refresh=False, transient=False)
        self._task = self._progress.add_task(self._description, total=self.total, rate="-")
        self._progress.start()
        self._start = time.monotonic()
        self.next_due = self._start + self.interval_s
        return self

    def due(self, now: float) -> bool:
        """True when ``update`` would redraw at monotonic time ``now``."""
        return now >= self.next_due

    def update(self, done: int, now: float | None = None) -> None:
        """Show ``done`` events processed so far (redraws at most every interval)."""
        if self._progress is None:
            return
        now = time.monotonic() if now is None else now
        self.next_due = now + self.interval_s
        elapsed = max(now - self._start, 1e-9)
        self._progress.update(self._task, completed=done, rate=f"{done / elapsed:,.0f}")
        self._progress.refresh()

    def stop(self, done: int | None = None) -> None:
        if self._progress is None:
            return
        if done is not None:
            self.update(done)
        self._progress.stop()
        self._progress = None

    def __enter__(self) -> ConsoleProgress:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal; False for replaced or closed streams."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False

"""What ``evflow up`` shows while a topology runs.

On a terminal: a live table (device, host, state, process, msg/s in and out), refreshed
twice a second, longest tables cut to the terminal's height with a count of the rest.
Otherwise (a pipe, a log file): one line each time the count of devices per state
changes, e.g. ``fan-in: RUNNING 5, EXITING 1``.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any

__all__ = ["LineView", "TableView", "make_view", "status_table"]


def _histogram(rows: list[dict[str, Any]]) -> str:
    counts = Counter(
        r["state"] if r["process"] in ("running", "starting") else r["process"] for r in rows
    )
    return ", ".join(f"{state} {n}" for state, n in sorted(counts.items()))


class LineView:
    """One line per change of the state histogram (for pipes and logs)."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self._last = ""

    def update(self, ctrl: Any) -> None:
        if ctrl.bus is None or not ctrl.bus.changed:
            return
        ctrl.bus.changed = False
        text = _histogram([r.row() for r in ctrl.records.values()])
        if text != self._last:
            self._last = text
            print(f"{ctrl.topology.name}: {text}", file=self.stream, flush=True)

    def close(self, ctrl: Any = None) -> None:
        pass


def status_table(status: dict[str, Any], max_rows: int = 0) -> Any:
    """A rich Table of a controller status (``evflow status`` and the live view)."""
    from rich.table import Table

    lost_hosts = {h["name"] for h in status.get("hosts", []) if h.get("lost")}
    table = Table(
        title=f"{status.get('topology')} ({status.get('session')}): {status.get('phase')}",
        title_justify="left",
    )
    for col in ("device", "host", "state", "process", "msg/s in", "msg/s out"):
        table.add_column(col, justify="right" if col.startswith("msg") else "left")
    rows = status.get("devices", [])
    shown = rows if not max_rows or len(rows) <= max_rows else rows[: max_rows - 1]
    for r in shown:
        host = r["host"] + (" (lost)" if r["host"] in lost_hosts else "")
        table.add_row(
            r["id"],
            host,
            r["state"],
            r["process"],
            f"{r['msg_in_hz']:.0f}",
            f"{r['msg_out_hz']:.0f}",
        )
    if len(shown) < len(rows):
        table.add_row(f"... {len(rows) - len(shown)} more", "", _histogram(rows[len(shown) :]))
    return table


class TableView:
    """A rich live table, refreshed at most twice a second."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console(stderr=False)
        self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self.live.start()
        self._next = 0.0

    def update(self, ctrl: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + 0.5
        rows = max(5, self.console.size.height - 8)
        self.live.update(status_table(ctrl.status(), rows), refresh=True)

    def close(self, ctrl: Any = None) -> None:
        if ctrl is not None:  # the final states, not those of the last refresh
            rows = max(5, self.console.size.height - 8)
            self.live.update(status_table(ctrl.status(), rows), refresh=True)
        self.live.stop()


def make_view(live: bool | None = None) -> Any:
    """A table on a terminal, lines otherwise (``live`` forces one or the other)."""
    use_table = sys.stdout.isatty() if live is None else live
    return TableView() if use_table else LineView()

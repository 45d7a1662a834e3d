"""What ``evflow up`` shows while a topology runs, and the summary at its end.

On a terminal: a live table (device, host, state, process, msg/s in and out), refreshed
twice a second, longest tables cut to the terminal's height with a count of the rest.
Otherwise (a pipe, a log file) nothing while it runs, or with ``-v`` one line each time
the count of devices per state changes, e.g. ``fan-in: RUNNING 5, EXITING 1``.
:func:`end_summary`: a few lines per device kind (messages, objects stored, restarts,
devices lost), from the summaries the devices sent as they ended.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any

__all__ = ["LineView", "TableView", "end_summary", "make_view", "status_table"]


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


def make_view(live: bool | None = None, lines: bool = True) -> Any:
    """A table on a terminal, lines otherwise (``live`` forces one or the other);
    ``lines=False``: no view at all where there is no terminal (None)."""
    use_table = sys.stdout.isatty() if live is None else live
    if use_table:
        return TableView()
    return LineView() if lines else None


def _kind(cls: str) -> str:
    """A device class as people name it: ``sink``, ``qc-merger``, ``ToyEvents``."""
    return cls.rsplit(":", 1)[-1]


def _count(summary: dict[str, Any], *keys: str) -> int | None:
    """``summary[k1][k2]...`` if it is an int (a device's own figures are untrusted)."""
    value: Any = summary
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value if type(value) is int else None


def end_summary(ctrl: Any, elapsed_s: float) -> list[str]:
    """The end of a topology in a few lines: one per device kind (``x N`` devices,
    messages in and out, what sinks received and repositories stored, restarts and
    devices lost, the last two only when there were any), then one verdict line."""
    kinds: dict[str, list[Any]] = {}
    # sources first, as the data flows (the stop order); then as the file names them
    for rec in sorted(ctrl.records.values(), key=lambda r: r.spec.stop_order):
        kinds.setdefault(_kind(rec.spec.cls), []).append(rec)
    width = max(len(k) + len(str(len(r))) for k, r in kinds.items()) + 3
    lines = []
    for kind, recs in kinds.items():
        head = f"{kind} x{len(recs)}"
        parts = []
        msg_in = [_count(r.summary, "messages_in") for r in recs]
        msg_out = [_count(r.summary, "messages_out") for r in recs]
        if any(n is not None for n in msg_in + msg_out):
            missing = sum(1 for n in msg_in if n is None)
            parts.append(
                f"messages in {sum(n or 0 for n in msg_in)}, out {sum(n or 0 for n in msg_out)}"
                + (f" ({missing} sent no figures)" if missing else "")
            )
        received = [_count(r.summary, "sink", "received") for r in recs]
        announced = [_count(r.summary, "sink", "announced") for r in recs]
        if any(n is not None for n in received):
            parts.append(
                f"received {sum(n or 0 for n in received)} of "
                f"{sum(n or 0 for n in announced)} announced"
            )
        stored = [_count(r.summary, "qc_repository", "stored") for r in recs]
        if any(n is not None for n in stored):
            dropped = sum(_count(r.summary, "qc_repository", "lost") or 0 for r in recs)
            parts.append(
                f"objects stored {sum(n or 0 for n in stored)}"
                + (f", not stored {dropped}" if dropped else "")
            )
        restarts = sum(r.restarts for r in recs)
        if restarts:
            parts.append(f"restarts {restarts}")
        lost = sum(1 for r in recs if r.lost)
        if lost:
            parts.append(f"lost {lost}")
        lines.append(f"  {head:<{width}}{'; '.join(parts) or 'no figures'}")
    lost_ids = [r.id for r in ctrl.records.values() if r.lost]
    restarts = sum(r.restarts for r in ctrl.records.values())
    verdict = (
        f"{len(lost_ids)} of {len(ctrl.records)} devices lost"
        if lost_ids
        else f"{len(ctrl.records)} devices ended cleanly"
    )
    again = f", {restarts} restart{'s' if restarts != 1 else ''}" if restarts else ""
    top = f"{ctrl.topology.name}: {verdict}{again} after {elapsed_s:.1f} s"
    return [top, *lines]

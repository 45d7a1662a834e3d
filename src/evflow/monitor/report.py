"""The static report of a run: ``DIR/index.html`` with PNG plots, viewable without a server.

From the collector's store: the workers' event rate over the run, events and CPU per
device, memory per device, and a table of every device (state, restarts, counters).
From a QC repository (optional): the latest version of every object, plotted with
matplotlib (1D as steps, 2D as a colour map), with its quality colour and flags.
"""

from __future__ import annotations

import html
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from evflow.errors import OutputError
from evflow.monitor.collector import MetricsStore
from evflow.monitor.web.views import device_row

QUALITY_COLOURS = {"Good": "#16a34a", "Medium": "#f59e0b", "Bad": "#dc2626", "Null": "#6b7280"}


def write_report(
    directory: str | Path,
    store: MetricsStore,
    *,
    repo: str | Path | None = None,
    title: str = "evflow run",
) -> Path:
    """Write the report; return the path of ``index.html``."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the report directory {out}: {exc}") from None
    now = store.wall()
    rows = [device_row(r, now) for r in store.nodes()]
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p>written {time.strftime('%Y-%m-%d %H:%M:%S')}; {len(rows)} devices</p>",
    ]
    parts += _metric_plots(out, store, rows)
    parts.append(_device_table(rows))
    if repo is not None:
        parts += _qc_section(out, Path(repo))
    page = out / "index.html"
    page.write_text(_PAGE.format(title=html.escape(title), body="\n".join(parts)))
    return page


def _metric_plots(out: Path, store: MetricsStore, rows: list[dict[str, Any]]) -> list[str]:
    import matplotlib.pyplot as plt

    parts = ["<h2>Run</h2>"]
    rates = store.rates()
    if rates:
        t0 = rates[0][0]
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.plot([t - t0 for t, _ in rates], [v for _, v in rates])
        ax.set_xlabel("time since the first metrics (s)")
        ax.set_ylabel("events/s (all workers)")
        _save(fig, out / "event_rate.png")
        parts.append('<img src="event_rate.png" alt="event rate">')
    if rows:
        names = [r["id"] for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3))
        axes[0].bar(names, [r["events_in"] for r in rows])
        axes[0].set_ylabel("events processed")
        axes[1].bar(names, [r["rss_mb"] for r in rows], color="tab:orange")
        axes[1].set_ylabel("RSS (MB)")
        for ax in axes:
            ax.tick_params(axis="x", rotation=60, labelsize=7)
        _save(fig, out / "devices.png")
        parts.append('<img src="devices.png" alt="events and memory per device">')
    return parts


def _device_table(rows: list[dict[str, Any]]) -> str:
    cols = ("id", "host", "role", "state", "restarts", "events_in", "events_out", "rss_mb")
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in cols) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _qc_section(out: Path, repo_path: Path) -> list[str]:
    from evflow.qc.repository import Repository

    parts = ["<h2>QC objects</h2>"]
    if not repo_path.exists():
        return [*parts, f"<p>no QC repository at {html.escape(str(repo_path))}</p>"]
    with Repository(repo_path, readonly=True) as repo:
        for path in repo.paths(""):
            stored = repo.latest(path)
            if stored is None:
                continue
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", path) + ".png"
            drawn = _plot_object(stored.obj, path, out / name)
            colour = QUALITY_COLOURS.get(stored.quality or "", "#cbd5e1")
            flags = "".join(f"<li>{html.escape(str(f))}</li>" for f in stored.flags)
            parts.append(
                f'<div class="qc"><h3><span class="q" style="background:{colour}">'
                f"{html.escape(stored.quality or 'not checked')}</span> {html.escape(path)}</h3>"
                f"<p>run {stored.run}, cycle {stored.cycle}, version {stored.id}</p>"
                f"<ul>{flags}</ul>"
                + (f'<img src="{name}" alt="{html.escape(path)}">' if drawn else "")
                + "</div>"
            )
    return parts


def _plot_object(obj: Any, title: str, file: Path) -> bool:
    import matplotlib.pyplot as plt

    from evflow.qc.checks import is_histogram

    fig, ax = plt.subplots(figsize=(5, 3.2))
    if is_histogram(obj) and len(obj.axes) == 1:
        ax.stairs(obj.values(), np.asarray(obj.axes[0].edges))
        ax.set_xlabel(obj.axes[0].label or obj.axes[0].name or "")
    elif is_histogram(obj) and len(obj.axes) == 2:
        x, y = (np.asarray(a.edges) for a in obj.axes)
        mesh = ax.pcolormesh(x, y, obj.values().T)
        fig.colorbar(mesh, ax=ax)
    elif isinstance(obj, np.ndarray) and obj.ndim == 1:
        ax.plot(obj)
    else:
        plt.close(fig)
        return False
    ax.set_title(title, fontsize=9)
    _save(fig, file)
    return True


def _save(fig: Any, file: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(file, dpi=80)
    plt.close(fig)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:16px}}
td,th{{padding:2px 8px;border-bottom:1px solid #ddd}}
.q{{color:#fff;padding:2px 8px;border-radius:4px}} img{{max-width:100%}}</style></head>
<body>
{body}
</body></html>
"""

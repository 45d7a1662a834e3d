"""What the dashboard pages show, as JSON-able dicts built from the collector's store.

Kept apart from the ASGI code so that the static report and tests use the same figures.
"""

from __future__ import annotations

import time
from typing import Any

from evflow.monitor.collector import MetricsStore, NodeRecord, _number

#: a device silent this long (s) is shown as stale
STALE_S = 5.0
#: states after which a device does no more work: its rates are 0, not its last ones
ENDED_STATES = frozenset({"EXITING", "ERROR"})


def device_row(rec: NodeRecord, now: float) -> dict[str, Any]:
    m = rec.metrics
    stale = now - rec.last_seen_s > STALE_S
    ended = rec.state in ENDED_STATES
    raw_rates = m.get("rates")
    # an ended or silent device does nothing now: its last published rates are history
    rates: dict[str, Any] = (
        raw_rates if isinstance(raw_rates, dict) and not (ended or stale) else {}
    )
    fill = None
    cap = _number(m.get("receive_buffer_capacity"))
    if cap > 0:
        fill = round(_number(m.get("receive_buffer_size")) / cap, 4)
    return {
        "id": rec.node_id,
        "host": rec.host,
        "role": rec.role(),
        "state": rec.state or "UNKNOWN",
        "pid": rec.pid,
        "process": str(m.get("process_name", ""))[:64],
        "restarts": rec.restarts,
        # seconds since the last restart (None: never), the page marks recent ones
        "restarted_ago_s": round(now - rec.restarted_s, 1) if rec.restarted_s else None,
        "events_in": rec.counter("events_in"),
        "events_out": rec.counter("events_out"),
        "msg_in_hz": _number(rates.get("messages_in_hz")),
        "msg_out_hz": _number(rates.get("messages_out_hz")),
        "events_in_hz": _number(rates.get("events_in_hz")),
        "queue_fill": fill,
        "queue_size": _number(m.get("receive_buffer_size")),
        "rss_mb": round(_number(m.get("VmRSS")) / 1024, 1),
        "cpu_percent": 0.0 if ended or stale else _number(m.get("cpu_percent")),
        "age_s": round(max(0.0, now - rec.last_seen_s), 1),
        "stale": stale,
        "ended": ended,
    }


def edges_of(rows: list[dict[str, Any]]) -> list[list[str]]:
    """A parallel run's graph: input -> every worker -> output (others have no edges)."""
    ids = {r["id"] for r in rows}
    workers = [r["id"] for r in rows if r["role"] == "worker"]
    edges = []
    if "input" in ids:
        edges += [["input", w] for w in workers]
    if "output" in ids:
        edges += [[w, "output"] for w in workers]
    return edges


def progress(rows: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any] | None:
    """Events done of a path run, its rate and ETA (None when nothing to show)."""
    out = next((r for r in rows if r["id"] == "output"), None)
    if out is None:
        return None
    done = out["events_in"]
    total = info.get("total")
    rate = out["events_in_hz"]
    eta = None
    if isinstance(total, int | float) and total > 0 and rate > 0:
        eta = round(max(0.0, (total - done) / rate), 1)
    return {"done": done, "total": total, "rate_hz": rate, "eta_s": eta}


def run_view(store: MetricsStore) -> dict[str, Any]:
    """Everything the run page shows, at once (what the SSE stream sends)."""
    now = store.wall()
    rows = [device_row(r, now) for r in store.nodes()]
    info = store.run_info() if store.run_info is not None else {}
    edges = info.get("edges") or edges_of(rows)
    rates = store.rates()[-120:]
    modules = store.module_times()[-120:]
    names = sorted({m for _, times in modules for m in times})
    # nothing heard for a while (the run ended, or stalled): the plots fall to 0 now
    # instead of holding the last value
    if rates and now - rates[-1][0] > STALE_S:
        rates.append((now, 0.0))
    if modules and now - modules[-1][0] > STALE_S:
        modules.append((now, dict.fromkeys(names, 0.0)))
    return {
        "time": time.time(),
        "title": info.get("title", "evflow"),
        "devices": rows,
        "edges": edges,
        "progress": progress(rows, info),
        "rate": {"t": [t for t, _ in rates], "events_hz": [v for _, v in rates]},
        # busy time per module, s per s summed over the workers (1 = one core)
        "modules": {
            "t": [t for t, _ in modules],
            "s": {m: [times.get(m, 0.0) for _, times in modules] for m in names},
        },
        "refused": store.bad + store.refused,
        "run": {k: v for k, v in info.items() if isinstance(v, int | float | str) or v is None},
    }

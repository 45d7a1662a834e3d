"""A real Prometheus (Debian's) scrapes a running ``evflow run -p 2 --dashboard``."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from _monitor_helpers import events_in, free_port, prometheus, query, slow_run

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

N_EVENTS = 600


def _value(url: str, promql: str) -> float | None:
    result = query(url, promql)
    return float(result[0]["value"][1]) if result else None


def test_prometheus_scrapes_a_parallel_run_and_counts_every_event(tmp_path: Path) -> None:
    port = free_port()
    report = tmp_path / "report"
    with (
        prometheus(tmp_path, port) as url,
        slow_run(
            tmp_path,
            n_events=N_EVENTS,
            work_ms=6.0,
            port=port,
            args=["--dashboard-linger", "12", "--prometheus", url, "--report", str(report)],
        ) as (proc, out),
    ):
        assert proc.stderr is not None
        # the run's roles are done (output closed) when the dashboard starts to linger
        line = proc.stderr.readline()
        assert line.startswith("evflow: run done; the dashboard stays up 12 s"), line
        written = events_in(out)
        assert written == N_EVENTS
        deadline = time.monotonic() + 10
        up = processed = None
        while time.monotonic() < deadline:
            up = _value(url, 'up{job="evflow"}')
            processed = _value(url, 'sum(evflow_events_processed_total{role="worker"})')
            if up == 1 and processed == written:
                break
            time.sleep(0.5)
        print(
            f"prometheus: up={up}, workers' events_processed_total={processed}, written={written}"
        )
        assert up == 1
        assert processed == written
        # every role is a series, named and labelled as documented
        devices = {r["metric"]["device"] for r in query(url, "evflow_events_processed_total")}
        assert {"input", "worker-0", "worker-1", "output"} <= devices
        assert _value(url, 'sum(evflow_events_out_total{device="output"})') == written
        # with --prometheus, the dashboard's history plot reads from it
        history = httpx.get(
            f"http://127.0.0.1:{port}/api/history",
            params={"device": "output", "key": "events_out", "minutes": "5"},
            timeout=10,
        ).json()
        assert history["source"] == "prometheus"
        assert history["query"] == 'evflow_events_out_total{device="output"}'
        assert history["v"] and history["v"][-1] == written
        assert proc.wait(timeout=40) == 0
    # the static report: the workers' final counts add up to the events written
    text = (report / "index.html").read_text()
    rows = re.findall(r"<tr><td>(worker-\d)</td>(?:<td>[^<]*</td>){4}<td>([\d.]+)</td>", text)
    assert len(rows) == 2 and sum(float(n) for _, n in rows) == written
    assert (report / "event_rate.png").read_bytes()[:4] == b"\x89PNG"

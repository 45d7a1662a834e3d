"""Worker churn: 200+ worker restarts during a run; /metrics stays bounded and flat."""

from __future__ import annotations

import statistics
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from _monitor_helpers import events_in, free_port, slow_run
from evflow.monitor.prometheus import parse_exposition, total

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

N_EVENTS = 3000
CHURN_STEERING = textwrap.dedent(
    """
    import os
    import evflow
    from evflow.io.generators import BusyWork, ToyGenerator
    from evflow.processing.faults import FaultInjector

    path = evflow.Path()
    path.add(ToyGenerator(n_events=int(os.environ["N_EVENTS"]), payload_bytes=256, seed=1))
    path.add(BusyWork(work_ms=float(os.environ["WORK_MS"])))
    # a worker exits on ~8 % of attempts: hundreds of restarts, nothing lost (at least
    # 240 for 3000 events: since batches shrink while workers die, few events are
    # attempted again, so the attempts are not many more than the events)
    path.add(FaultInjector(mode="exit", probability=0.08, seed=3))
    evflow.process(
        path,
        output=os.environ["OUT_FILE"],
        max_attempts=10,
        extra={"max_restarts": 100000, "restart_backoff_s": 0.0},
    )
    """
)


def test_two_hundred_worker_restarts_keep_scrapes_bounded_and_flat(tmp_path: Path) -> None:
    port = free_port()
    samples: list[tuple[float, float, int, float]] = []  # t, scrape s, devices, restarts
    stop = threading.Event()

    def scrape() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            t0 = time.monotonic()
            while not stop.is_set():
                try:
                    start = time.perf_counter()
                    text = c.get("/metrics").text
                    took = time.perf_counter() - start
                    restarts = c.get("/api/run").json()["run"].get("workers_restarted", 0)
                except httpx.HTTPError:
                    break  # the run ended
                got = parse_exposition(text)
                samples.append(
                    (
                        time.monotonic() - t0,
                        took,
                        int(total(got, "evflow_monitor_devices")),
                        restarts,
                    )
                )
                time.sleep(0.1)

    with slow_run(
        tmp_path,
        n_events=N_EVENTS,
        work_ms=0.5,
        port=port,
        args=["--dashboard-linger", "1"],
        steering_text=CHURN_STEERING,
    ) as (proc, out):
        scraper = threading.Thread(target=scrape)
        scraper.start()
        try:
            assert proc.wait(timeout=100) == 0
        finally:
            stop.set()
            scraper.join(15)
    assert events_in(out) == N_EVENTS  # exactly the events read, whatever the churn
    restarts = max(s[3] for s in samples)
    times_ms = [1000 * s[1] for s in samples]
    tenth = max(1, len(times_ms) // 10)
    first, last = statistics.median(times_ms[:tenth]), statistics.median(times_ms[-tenth:])
    print(
        f"\nchurn: {restarts} worker restarts, {len(samples)} scrapes; /metrics took "
        f"median {statistics.median(times_ms):.2f} ms (first tenth {first:.2f} ms, last tenth "
        f"{last:.2f} ms, max {max(times_ms):.2f} ms); devices at most {max(s[2] for s in samples)}"
    )
    assert restarts >= 200
    # bounded: the series follow worker slots (and input, output, parallel), not processes
    assert max(s[2] for s in samples) <= 5
    # flat: a generous bound on growth, never a timing absolute
    assert last <= 5 * first + 20

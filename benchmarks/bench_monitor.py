"""Monitoring: what the dashboard costs a run, scrape latency, update latency in a browser.

    python benchmarks/bench_monitor.py [--quick] [--only chain|scrape|browser]

- chain: the 1 kB chain (ToyGenerator -> no-op BusyWork, 2 workers), runs alternated
  without and with ``--dashboard`` (collector + web server + a scraper hitting
  /metrics every second + one SSE client), events/s side by side (goal: <= 2 % less);
- scrape: 256 synthetic devices publishing metrics once a second on a real bus; the
  time of ``GET /metrics`` over HTTP (median, p95) and its size;
- browser: a device's metric changes on the bus; the time until Chromium's run page has
  it (Date.now() in the page against time.time() here: same host, same clock), with the
  dashboard's default update interval (0.5 s) and a short one (0.1 s).
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import threading
import time
from typing import Any

import httpx
import zmq

import evflow
from evflow.io import BusyWork, ToyGenerator
from evflow.monitor import runhook
from evflow.monitor.collector import MetricsStore
from evflow.monitor.prometheus import exposition, make_registry
from evflow.monitor.web import start_dashboard
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel import run_parallel
from evflow.runtime.bus import BusClient, BusProxy

CHROMIUM = "/usr/bin/chromium"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- chain --------------------------------------------------------------------------------
def _chain_once(n: int, port: int | None) -> tuple[float, float]:
    """(events/s, CPU seconds this process spent per second of the run: the parent's
    loop, and with the dashboard its collector, web server and the two clients)."""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    rate, wall_s = _chain_run(n, port)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return rate, cpu_s / wall_s


def _chain_run(n: int, port: int | None) -> tuple[float, float]:
    path = evflow.Path([ToyGenerator(n_events=n, payload_bytes=1024), BusyWork(work_ms=0.0)])
    stop = threading.Event()
    threads: list[threading.Thread] = []
    if port is not None:
        runhook.request(runhook.RunMonitor(port=port))

        def scraper() -> None:  # what a Prometheus at 1 s and one open browser cost
            with httpx.Client(timeout=5) as c:
                while not stop.wait(1.0):
                    with contextlib.suppress(httpx.HTTPError):
                        c.get(f"http://127.0.0.1:{port}/metrics")

        def browser() -> None:
            while not stop.is_set():
                try:
                    with httpx.stream(
                        "GET", f"http://127.0.0.1:{port}/api/stream/run", timeout=5
                    ) as r:
                        for _ in r.iter_lines():
                            if stop.is_set():
                                return
                except httpx.HTTPError:
                    stop.wait(0.2)

        threads = [threading.Thread(target=f, daemon=True) for f in (scraper, browser)]
        for t in threads:
            t.start()
    try:
        summary = run_parallel(path, ProcessOptions(workers=2, quiet=True))
    finally:
        stop.set()
        runhook.release()
        for t in threads:
            t.join(6)
    return summary.events_written / summary.wall_s, summary.wall_s


def chain(quick: bool) -> None:
    n = 200_000 if quick else 1_000_000
    rounds = 2 if quick else 4
    plain: list[tuple[float, float]] = []
    dash: list[tuple[float, float]] = []
    _chain_once(20_000, _free_port())  # warm-up: imports, first forks
    for _ in range(rounds):
        plain.append(_chain_once(n, None))
        dash.append(_chain_once(n, _free_port()))
    print(f"\n1 kB chain, {n} events, 2 workers, {rounds} alternated pairs")
    for name, runs in (("without", plain), ("with   ", dash)):
        print(
            f"  {name} --dashboard: "
            + ", ".join(f"{r:,.0f}" for r, _ in runs)
            + " events/s; parent CPU "
            + ", ".join(f"{1000 * c:.0f}" for _, c in runs)
            + " ms per s of run"
        )
    ratios = [d[0] / p[0] for p, d in zip(plain, dash, strict=True)]
    extra_ms = 1000 * (
        statistics.median(c for _, c in dash) - statistics.median(c for _, c in plain)
    )
    print(
        f"  median {statistics.median(r for r, _ in plain):,.0f} vs "
        f"{statistics.median(r for r, _ in dash):,.0f} events/s; with/without per pair: "
        f"{', '.join(f'{r:.3f}' for r in ratios)}; the dashboard's CPU: {extra_ms:.1f} ms/s "
        f"= {extra_ms / 20:.2f} % of the 2 cores"
    )


# --- scrape -------------------------------------------------------------------------------
def _publishers(ctx: zmq.Context[Any], proxy: BusProxy, n: int, stop: threading.Event) -> None:
    clients = [BusClient(ctx, f"device-{i}", proxy.endpoints) for i in range(n)]
    try:
        k = 0
        while not stop.is_set():
            for c in clients:
                c.metrics.events_in = k
                c.metrics.extra["merged_objects"] = k
                c.publish_metrics()
            k += 1
            stop.wait(1.0)
    finally:
        for c in clients:
            c.close()


def scrape(quick: bool, n_devices: int = 256) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    proxy = BusProxy(ctx, f"bench-monitor-{time.monotonic_ns() % 10**6}")
    proxy.start_thread()
    stop = threading.Event()
    pub = threading.Thread(target=_publishers, args=(ctx, proxy, n_devices, stop))
    store = MetricsStore()
    try:
        with start_dashboard([proxy.endpoints], "auto", store=store) as dash:
            pub.start()
            deadline = time.monotonic() + 30
            while len(store.nodes()) < n_devices and time.monotonic() < deadline:
                time.sleep(0.1)
            times = []
            size = 0
            with httpx.Client(timeout=10) as c:
                for _ in range(30 if quick else 100):
                    t0 = time.perf_counter()
                    body = c.get(f"http://127.0.0.1:{dash.port}/metrics").content
                    times.append(1000 * (time.perf_counter() - t0))
                    size = len(body)
                    time.sleep(0.05)
            times.sort()
            n_samples = sum(1 for line in body.splitlines() if not line.startswith(b"#"))
            t0 = time.perf_counter()
            for _ in range(10):
                exposition(make_registry(store))
            direct_ms = 100 * (time.perf_counter() - t0)
            print(
                f"\n/metrics with {len(store.nodes())} devices over HTTP: median "
                f"{statistics.median(times):.1f} ms, p95 {times[int(0.95 * len(times)) - 1]:.1f}"
                " ms;"
                f" {size / 1024:.0f} kB, {n_samples} samples; exposition alone {direct_ms:.1f} ms"
            )
    finally:
        stop.set()
        if pub.is_alive():
            pub.join(10)
        proxy.close()
        ctx.term()


# --- browser ------------------------------------------------------------------------------
def browser(quick: bool) -> None:
    from playwright.sync_api import sync_playwright

    ctx: zmq.Context[Any] = zmq.Context()
    proxy = BusProxy(ctx, f"bench-monitor-b-{time.monotonic_ns() % 10**6}")
    proxy.start_thread()
    client = BusClient(ctx, "worker-0", proxy.endpoints)
    try:
        with sync_playwright() as pw:
            chrome = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
            for interval_s in (0.5, 0.1):
                with start_dashboard(
                    [proxy.endpoints], "auto", store=MetricsStore(), interval_s=interval_s
                ) as dash:
                    page = chrome.new_page()
                    page.goto(dash.url)
                    client.publish_metrics()
                    page.wait_for_function("window.evRun && window.evRun.updates > 0")
                    page.evaluate(
                        "window.evRun.seen = {}; window.evRun.onUpdate = (d) => {"
                        " const w = d.devices.find(x => x.id === 'worker-0');"
                        " if (w && !(w.events_in in window.evRun.seen))"
                        " window.evRun.seen[w.events_in] = Date.now(); }; true"
                    )
                    lat = []
                    for k in range(1, (10 if quick else 30) + 1):
                        client.metrics.events_in = k
                        t0 = time.time()
                        client.publish_metrics()
                        page.wait_for_function(f"{k} in window.evRun.seen", timeout=10_000)
                        seen_ms = page.evaluate(f"window.evRun.seen[{k}]")
                        lat.append(seen_ms - 1000 * t0)
                        time.sleep(0.137 * (k % 5))  # spread over the update phase
                    page.close()
                lat.sort()
                print(
                    f"\nmetric change -> Chromium's run page (update interval {interval_s} s): "
                    f"median {statistics.median(lat):.0f} ms, min {lat[0]:.0f}, max {lat[-1]:.0f}"
                )
            chrome.close()
    finally:
        client.close()
        proxy.close()
        ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("chain", "scrape", "browser"))
    args = ap.parse_args()
    print(time.strftime("bench_monitor %Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    if args.only in (None, "scrape"):
        scrape(args.quick)
    if args.only in (None, "browser"):
        browser(args.quick)
    if args.only in (None, "chain"):
        chain(args.quick)


if __name__ == "__main__":
    main()

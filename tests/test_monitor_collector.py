"""The metrics collector and its Prometheus exposition: real bus, real publishers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from evflow.monitor.collector import BusCollector, MetricsStore
from evflow.monitor.prometheus import exposition, make_registry, parse_exposition, total
from evflow.runtime.bus import BusClient, BusProxy
from evflow.wire.messages import MsgType


def _metrics(node: str, pid: int, events: int, **more: Any) -> dict[str, Any]:
    return {
        "from": node,
        "metrics": {
            "node_id": node,
            "node_state": "RUNNING",
            "pid": pid,
            "events_in": events,
            "events_out": events,
            "cpu": 0.5,
            "VmRSS": 1000,
            "receive_buffer_size": 3,
            "receive_buffer_capacity": 12,
            "rates": {"events_in_hz": 10.0},
            "role": node.split("-")[0],
            **more,
        },
    }


def _scrape(store: MetricsStore) -> dict[Any, float]:
    return parse_exposition(exposition(make_registry(store)).decode())


def test_names_labels_and_units() -> None:
    store = MetricsStore(host="h2")
    store.ingest(MsgType.METRICS, _metrics("worker-3", 100, 7, ledger=5, merged_objects=4))
    text = exposition(make_registry(store)).decode()
    assert 'evflow_events_processed_total{device="worker-3",host="h2",role="worker"} 7.0' in text
    assert 'evflow_rss_bytes{device="worker-3",host="h2",role="worker"} 1.024e+06' in text
    assert "evflow_cpu_seconds_total" in text
    samples = _scrape(store)
    assert total(samples, "evflow_queue_fill_ratio", queue="receive") == pytest.approx(0.25)
    assert total(samples, "evflow_ledger_events") == 5
    # a figure without a name of its own (a merger's) is still exported, by name
    assert total(samples, "evflow_device_figure", name="merged_objects") == 4
    assert total(samples, "evflow_device_state", state="RUNNING") == 1


def test_restart_keeps_counters_monotonic_and_counts_restarts() -> None:
    store = MetricsStore(host="h")
    store.ingest(MsgType.METRICS, _metrics("worker-0", 100, 50))
    store.ingest(MsgType.METRICS, _metrics("worker-0", 101, 5))  # the replacement
    store.ingest(MsgType.METRICS, _metrics("worker-0", 101, 8))
    samples = _scrape(store)
    assert total(samples, "evflow_events_processed_total") == 58
    assert total(samples, "evflow_restarts_total", device="worker-0") == 1
    assert total(samples, "evflow_monitor_devices") == 1  # no new series per process


def test_untrusted_headers_are_refused_and_counted() -> None:
    store = MetricsStore(host="h", max_nodes=3)
    for bad in (None, [], {"from": 5}, {"from": "x" * 500}, {"from": "a", "metrics": "no"}):
        store.ingest(MsgType.METRICS, bad)
    assert store.bad == 5
    for i in range(10):
        store.ingest(MsgType.METRICS, _metrics(f"dev-{i}", i + 1, 1, cpu=float("nan")))
    assert len(store.nodes()) == 3 and store.refused == 7
    samples = _scrape(store)
    assert total(samples, "evflow_monitor_refused_messages_total") == 12


def test_silent_devices_expire() -> None:
    now = [1000.0]
    store = MetricsStore(host="h", expire_s=60.0, wall=lambda: now[0])
    store.ingest(MsgType.METRICS, _metrics("gone-1", 1, 1))
    now[0] += 30
    store.ingest(MsgType.METRICS, _metrics("alive-1", 2, 1))
    now[0] += 40
    assert [r.node_id for r in store.nodes()] == ["alive-1"]


@pytest.fixture
def proxy() -> Iterator[BusProxy]:
    ctx: zmq.Context[Any] = zmq.Context()
    p = BusProxy(ctx, "mon-collector")
    p.start_thread()
    try:
        yield p
    finally:
        p.close()
        ctx.term()


def test_collector_hears_publishers_on_a_real_bus(proxy: BusProxy) -> None:
    store = MetricsStore(host="here")
    collector = BusCollector(store, [proxy.endpoints]).start()
    ctx: zmq.Context[Any] = zmq.Context()
    clients = [BusClient(ctx, f"worker-{i}", proxy.endpoints) for i in range(3)]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for i, c in enumerate(clients):
                c.metrics.events_in = 10 * (i + 1)
                c.publish_metrics()
            time.sleep(0.05)
            samples = _scrape(store)
            if total(samples, "evflow_events_processed_total", role="worker") == 60:
                break
        assert total(samples, "evflow_events_processed_total", role="worker") == 60
        clients[0].publish_state(new="ERROR")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and store.nodes()[0].state != "ERROR":
            time.sleep(0.02)
        assert {r.node_id: r.state for r in store.nodes()}["worker-0"] == "ERROR"
        # garbage on the bus never reaches the store as a device
        assert all(r.node_id.startswith("worker-") for r in store.nodes())
    finally:
        for c in clients:
            c.close()
        ctx.term()
        collector.stop()


def test_module_times_are_counters_across_restarts() -> None:
    now = [1000.0]
    store = MetricsStore(host="h", wall=lambda: now[0])
    store.ingest(MsgType.METRICS, _metrics("worker-0", 1, 5, module_time_s={"Busy": 2.0}))
    now[0] += 1.5
    store.ingest(MsgType.METRICS, _metrics("worker-0", 2, 1, module_time_s={"Busy": 0.5}))
    samples = _scrape(store)
    assert total(samples, "evflow_module_seconds_total", module="Busy") == 2.5
    assert not any(n == "evflow_device_figure" and "Busy" in str(lab) for n, lab in samples)


def test_a_superscript_digit_in_an_id_sorts_and_scrapes() -> None:
    # '²'.isdigit() is true but int('²') raises: the ids sort as names
    store = MetricsStore(host="h")
    assert store.ingest(MsgType.METRICS, _metrics("w-²", 1, 1))
    store.ingest(MsgType.METRICS, _metrics("w-10", 2, 1))
    store.ingest(MsgType.METRICS, _metrics("w-9", 3, 1))
    assert [r.node_id for r in store.nodes()] == ["w-9", "w-10", "w-²"]
    assert total(_scrape(store), "evflow_events_processed_total") == 3


@pytest.mark.parametrize(
    "metrics",
    [
        {7: 1, "pid": 5},
        {"pid": 5, "extra": {1: 2}},
        {"pid": 5, "extra": "x"},
        {"pid": 5, "rates": {b"x": 1.0}},
        {"pid": 5, "channels": {3: {"messages_in": 1}}},
        {"pid": 5, "module_time_s": {None: 1.0}},
        {"pid": 5, "module_time_s": [1.0]},
        {f"k{i}": i for i in range(2000)},
    ],
)
def test_metrics_with_keys_that_are_no_names_are_refused_and_counted(
    metrics: dict[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    store = MetricsStore(host="h")
    assert not store.ingest(MsgType.METRICS, {"from": "dev-1", "metrics": metrics})
    assert store.bad == 1 and store.nodes() == []
    assert sum("monitor collector" in r.message for r in caplog.records) == 1
    assert total(_scrape(store), "evflow_monitor_refused_messages_total") == 1


def test_ids_that_are_not_printable_are_refused() -> None:
    store = MetricsStore(host="h")
    for node in ("a\nb", "\x00", "dev\x1b[31m"):
        assert not store.ingest(MsgType.METRICS, _metrics(node, 1, 1))
    assert store.bad == 3 and store.nodes() == []


def test_the_collector_thread_survives_hostile_metrics_on_a_real_bus(proxy: BusProxy) -> None:
    store = MetricsStore(host="here")
    collector = BusCollector(store, [proxy.endpoints]).start()
    ctx: zmq.Context[Any] = zmq.Context()
    client = BusClient(ctx, "worker-0", proxy.endpoints)
    try:
        deadline = time.monotonic() + 30
        good = _metrics("worker-0", 1, 42)
        while time.monotonic() < deadline and not store.nodes():
            client.publish(MsgType.METRICS, {"from": "worker-0", "metrics": {5: "x"}})
            client.publish(MsgType.METRICS, {"from": "w-²", "metrics": {"extra": {1: 2}}})
            client.publish(MsgType.METRICS, good)
            time.sleep(0.05)
        assert [r.node_id for r in store.nodes()] == ["worker-0"]
        assert store.bad >= 2
        assert collector._thread is not None and collector._thread.is_alive()
        assert total(_scrape(store), "evflow_events_processed_total") == 42
    finally:
        client.close()
        ctx.term()
        collector.stop()


def _worker(node: str, pid: int, stamp: float, busy_s: float) -> dict[str, Any]:
    return _metrics(node, pid, 1, response_timestamp=stamp, module_time_s={"Busy": busy_s})


def test_module_busy_time_uses_the_publishers_clock_not_the_arrival_time() -> None:
    """Two workers, each 90 % busy in one module, publish once a second; a starved
    collector takes 6 s of their snapshots within 1.2 s. Busy time summed over the
    workers is at most 2 (s per s) at every point, by its definition."""
    now = [1000.0]
    store = MetricsStore(host="h", wall=lambda: now[0])
    for k in range(7):  # publisher time 0, 1, ..., 6 s; module seconds 0.9 per second
        for w, pid in (("worker-0", 10), ("worker-1", 11)):
            store.ingest(MsgType.METRICS, _worker(w, pid, 500.0 + k, 0.9 * k))
        now[0] += 0.2  # all of it arrives within 1.4 s
    points = [m["Busy"] for _, m in store.module_times()]
    assert points and all(0.0 <= v <= 2.0 for v in points), points
    assert points[-1] == pytest.approx(1.8)
    from evflow.monitor.web.views import run_view

    shown = run_view(store)["modules"]["s"]["Busy"]
    assert all(0.0 <= v <= 2.0 for v in shown), shown


def test_module_busy_time_starts_again_with_a_restarted_worker() -> None:
    now = [1000.0]
    store = MetricsStore(host="h", wall=lambda: now[0])
    store.ingest(MsgType.METRICS, _worker("worker-0", 10, 500.0, 40.0))
    now[0] += 1.0
    store.ingest(MsgType.METRICS, _worker("worker-0", 10, 501.0, 40.5))
    now[0] += 1.0
    store.ingest(MsgType.METRICS, _worker("worker-0", 11, 502.0, 0.2))  # the replacement
    now[0] += 1.0
    store.ingest(MsgType.METRICS, _worker("worker-0", 11, 503.0, 0.9))
    assert [m for _, m in store.module_times()] == [
        {"Busy": 0.5},
        {"Busy": pytest.approx(0.7)},
    ]

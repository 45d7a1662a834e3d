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
        deadline = time.monotonic() + 10
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
        deadline = time.monotonic() + 5
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


def test_module_times_are_counters_across_restarts_and_a_history() -> None:
    now = [1000.0]
    store = MetricsStore(host="h", wall=lambda: now[0])
    store.ingest(MsgType.METRICS, _metrics("worker-0", 1, 5, module_time_s={"Busy": 2.0}))
    now[0] += 1.5
    store.ingest(MsgType.METRICS, _metrics("worker-0", 2, 1, module_time_s={"Busy": 0.5}))
    samples = _scrape(store)
    assert total(samples, "evflow_module_seconds_total", module="Busy") == 2.5
    assert not any(n == "evflow_device_figure" and "Busy" in str(lab) for n, lab in samples)
    assert [m for _, m in store.module_times()] == [{"Busy": 2.0}, {"Busy": 2.5}]

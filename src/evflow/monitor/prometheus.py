"""The collector's store in the Prometheus text format (prometheus-client custom collector).

No multiprocess files: :class:`StoreCollector` builds the families from
:class:`~evflow.monitor.collector.MetricsStore` at scrape time, so a scrape costs
O(nodes) however many processes were restarted. Every series has the labels
``device`` (the node id, e.g. ``worker_3``'s bus id ``worker-3``), ``host`` and
``role``; names carry units and counters end in ``_total`` (the client appends it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from evflow.monitor.collector import MODULE_PREFIX, MetricsStore, NodeRecord, _number

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("device", "host", "role")

#: counter name (without _total) -> (snapshot key, help, scale)
_COUNTERS: dict[str, tuple[str, str, float]] = {
    "evflow_events_processed": ("events_in", "Events the device took in and finished", 1.0),
    "evflow_events_out": ("events_out", "Events the device passed on (kept, sent, written)", 1.0),
    "evflow_messages_in": ("messages_in", "Messages received", 1.0),
    "evflow_messages_out": ("messages_out", "Messages sent", 1.0),
    "evflow_bytes_in": ("bytes_in", "Bytes received", 1.0),
    "evflow_bytes_out": ("bytes_out", "Bytes sent", 1.0),
    "evflow_cpu_seconds": ("cpu", "User+system CPU seconds", 1.0),
    "evflow_quarantined_events": ("quarantined", "Events written raw after max_attempts", 1.0),
    "evflow_dropped_events": ("dropped", "Events dropped (duplicates, stale)", 1.0),
    "evflow_duplicate_events": ("duplicates", "Late duplicates the output dropped", 1.0),
    "evflow_bad_messages": ("bad_messages", "Malformed messages refused", 1.0),
    "evflow_retries": ("retries", "Events sent again after a worker was lost", 1.0),
    "evflow_timeouts": ("timeouts", "Per-event timeouts", 1.0),
}
#: gauge name -> (snapshot key, help, scale)
_GAUGES: dict[str, tuple[str, str, float]] = {
    "evflow_rss_bytes": ("VmRSS", "Resident set size", 1024.0),
    "evflow_cpu_usage_ratio": (
        "cpu_percent",
        "CPU use, last interval (1 = a core)",
        0.01,
    ),
    "evflow_receive_queue_messages": ("receive_buffer_size", "Receive queue depth", 1.0),
    "evflow_receive_queue_capacity_messages": (
        "receive_buffer_capacity",
        "Receive high-water mark",
        1.0,
    ),
    "evflow_send_queue_messages": ("send_buffer_size", "Send queue depth", 1.0),
    "evflow_send_queue_capacity_messages": ("send_buffer_capacity", "Send high-water mark", 1.0),
    "evflow_ledger_events": ("ledger", "Events in the input's ledger (not yet confirmed)", 1.0),
    "evflow_credits_in_flight_events": ("in_flight", "Events sent to workers, not returned", 1.0),
    "evflow_resend_queue_events": ("resend_queue", "Events waiting to be sent again", 1.0),
    "evflow_written_unconfirmed_events": (
        "written_not_confirmed",
        "Events written, confirmation to the input pending",
        1.0,
    ),
}
_KNOWN = {k for k, _, _ in _COUNTERS.values()} | {k for k, _, _ in _GAUGES.values()}
_SKIP = _KNOWN | {"pid", "request_timestamp", "response_timestamp", "first_event_at"}
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")
#: other numeric figures a device publishes (merger, event builder...) at most this many
MAX_OTHER = 64


def _labels(rec: NodeRecord) -> list[str]:
    return [rec.node_id, rec.host, rec.role()]


class StoreCollector(Collector):
    """prometheus-client collector over a :class:`MetricsStore`."""

    def __init__(self, store: MetricsStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        nodes = self.store.nodes()
        now = self.store.wall()
        for name, (key, text, scale) in _COUNTERS.items():
            fam = CounterMetricFamily(name, text, labels=LABELS)
            for rec in nodes:
                if key in rec.metrics or key in rec.offsets:
                    fam.add_metric(_labels(rec), rec.counter(key) * scale)
            yield fam
        restarts = CounterMetricFamily(
            "evflow_restarts", "Processes that replaced this device (pid changes)", labels=LABELS
        )
        for rec in nodes:
            restarts.add_metric(_labels(rec), rec.restarts)
        yield restarts
        for name, (key, text, scale) in _GAUGES.items():
            gauge = GaugeMetricFamily(name, text, labels=LABELS)
            for rec in nodes:
                if key in rec.metrics:
                    gauge.add_metric(_labels(rec), _number(rec.metrics[key]) * scale)
            yield gauge
        yield from self._fill(nodes)
        yield from self._states(nodes, now)
        yield from self._channels(nodes)
        yield from self._modules(nodes)
        yield from self._others(nodes)
        own = GaugeMetricFamily("evflow_monitor_devices", "Devices the collector knows")
        own.add_metric([], len(nodes))
        yield own
        bad = CounterMetricFamily("evflow_monitor_refused_messages", "Bus messages refused")
        bad.add_metric([], self.store.bad + self.store.refused)
        yield bad

    def _fill(self, nodes: list[NodeRecord]) -> Iterator[Metric]:
        fill = GaugeMetricFamily(
            "evflow_queue_fill_ratio",
            "Queue depth over its high-water mark",
            labels=[*LABELS, "queue"],
        )
        for rec in nodes:
            for queue in ("receive", "send"):
                cap = _number(rec.metrics.get(f"{queue}_buffer_capacity"))
                if cap > 0:
                    size = _number(rec.metrics.get(f"{queue}_buffer_size"))
                    fill.add_metric([*_labels(rec), queue], size / cap)
        yield fill

    def _states(self, nodes: list[NodeRecord], now: float) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "evflow_device_state",
            "1 for the device's current state (FairMQ state names)",
            labels=[*LABELS, "state"],
        )
        seen = GaugeMetricFamily(
            "evflow_device_last_seen_timestamp_seconds",
            "Wall clock of the device's last bus message",
            labels=LABELS,
        )
        for rec in nodes:
            state.add_metric([*_labels(rec), rec.state or "UNKNOWN"], 1)
            seen.add_metric(_labels(rec), rec.last_seen_s)
        yield state
        yield seen

    def _channels(self, nodes: list[NodeRecord]) -> Iterator[Metric]:
        labels = [*LABELS, "channel"]
        fams = {
            key: CounterMetricFamily(f"evflow_channel_{key}", f"Per-channel {key}", labels=labels)
            for key in ("messages_in", "messages_out", "bytes_in", "bytes_out")
        }
        for rec in nodes:
            channels = rec.metrics.get("channels")
            if not isinstance(channels, dict):
                continue
            for label, ch in list(channels.items())[:MAX_OTHER]:
                if not isinstance(ch, dict):
                    continue
                for key, fam in fams.items():
                    fam.add_metric([*_labels(rec), str(label)[:64]], _number(ch.get(key)))
        yield from fams.values()

    def _modules(self, nodes: list[NodeRecord]) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "evflow_module_seconds",
            "Wall time spent in each module's event() (monotonic across restarts)",
            labels=[*LABELS, "module"],
        )
        for rec in nodes:
            for key in sorted(rec.metrics.keys() | rec.offsets.keys()):
                if key.startswith(MODULE_PREFIX):
                    fam.add_metric([*_labels(rec), key[len(MODULE_PREFIX) :]], rec.counter(key))
        yield fam

    def _others(self, nodes: list[NodeRecord]) -> Iterator[Metric]:
        """Numeric figures without a name of their own (merger, event builder, ...)."""
        fam = GaugeMetricFamily(
            "evflow_device_figure",
            "Other numeric figures a device publishes, by name",
            labels=[*LABELS, "name"],
        )
        for rec in nodes:
            n = 0
            for key, value in rec.metrics.items():
                if key in _SKIP or isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                if key.startswith(MODULE_PREFIX):
                    continue
                fam.add_metric([*_labels(rec), _NAME_RE.sub("_", str(key))[:64]], _number(value))
                n += 1
                if n >= MAX_OTHER:
                    break
        yield fam


def make_registry(store: MetricsStore) -> CollectorRegistry:
    """A registry of its own (no default process collectors): just the store."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format of everything in ``registry``."""
    return generate_latest(registry)


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a text exposition: {(name, sorted labels): value} (for tests, reports)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(samples: dict[tuple[str, Any], float], metric: str, /, **labels: str) -> float:
    """Sum of ``metric`` over the samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == metric and want <= set(lab))

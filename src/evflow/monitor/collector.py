"""The metrics collector: what every node published on the control bus, kept in memory.

One :class:`MetricsStore` holds, per node (device id), the latest metrics snapshot and
state, a short history of a few figures, and counter bookkeeping across restarts. A
:class:`BusCollector` thread feeds it from one or more buses (SUB on METRICS and STATE).
The Prometheus exposition (:mod:`evflow.monitor.prometheus`), the web dashboard and the
static report all read the store; nothing here writes files, so a scrape costs the same
however many processes came and went.

**Bounded by construction.** The label set is the set of node ids, not of processes: a
worker's replacements publish under the id of the slot they replace (``worker-3``), so
restarts add no series. A restart is seen when a node's ``pid`` changes: ``restarts``
goes up and the dead process's last counters are carried into an offset, so every
``*_total`` stays monotonic across incarnations. Nodes silent for ``expire_s`` (default
10 minutes) are dropped, and at most ``max_nodes`` nodes are kept (further ids are
refused and counted in ``refused``), so a misbehaving publisher cannot grow memory.

Everything arriving on the bus is untrusted: a header that is not a map, an id that is
not a short printable string, metrics (or their ``extra``, ``rates``, ``channels`` and
``module_time_s`` maps) that are not maps with string keys, or more than MAX_KEYS
figures, refuse the whole message: counted in ``bad`` and logged once per kind.

**Module busy time.** A worker publishes the wall seconds each module spent in
``event()`` since it started (``module_time_s``). The dashboard's module plot shows
them as seconds per second (1 = a core busy): the difference between two snapshots of
the same process over the difference of *their* timestamps (``response_timestamp``,
the publisher's clock), never over the collector's arrival times, which a starved
collector thread or a congested bus bunches up (several seconds of work arriving
within one second read as 3 or 7 busy cores of 2 workers).
"""

from __future__ import annotations

import collections
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq

from evflow.runtime.busclient import BusEndpoints, open_bus_sockets
from evflow.wire.messages import BadMessageCounter, MsgType

log = logging.getLogger("evflow.monitor")

#: counters that survive restarts (offset by the dead process's last value)
COUNTERS = (
    "events_in",
    "events_out",
    "messages_in",
    "messages_out",
    "bytes_in",
    "bytes_out",
    "cpu",
    "quarantined",
    "dropped",
    "duplicates",
    "bad_messages",
    "retries",
    "timeouts",
)
#: figures kept in each node's history (one sample per metrics message)
#: prefix of the flattened per-module wall times (``module_time_s`` maps of the roles)
MODULE_PREFIX = "module_time_s:"
MAX_MODULES = 64
HISTORY_KEYS = ("events_in", "events_out", "events_in_hz", "events_out_hz", "cpu_percent", "rss_b")
_EVENTS_IN_HZ = HISTORY_KEYS.index("events_in_hz")
MAX_ID_CHARS = 128
#: the most figures one metrics message may carry (a role publishes about 50)
MAX_KEYS = 1024
#: nested maps whose keys the store and the exposition read as names
_NAMED_MAPS = ("extra", "rates", "channels", "module_time_s")
#: a node silent this long is not counted in the summed rates any more (s)
RATE_FRESH_S = 5.0


@dataclass
class NodeRecord:
    """One node (device id) as the collector knows it."""

    node_id: str
    host: str
    state: str = ""
    pid: int = 0
    restarts: int = 0
    restarted_s: float = 0.0  # wall clock of the last restart seen (0: never)
    first_seen_s: float = 0.0
    last_seen_s: float = 0.0  # wall clock of the last message
    metrics: dict[str, Any] = field(default_factory=dict)
    offsets: dict[str, float] = field(default_factory=dict)
    #: the last module_time_s snapshot: (publisher's wall s, pid, {module: seconds})
    module_mark: tuple[float, int, dict[str, float]] | None = None
    #: each module's busy time (s per s) between the last two snapshots of its process
    module_busy: dict[str, float] = field(default_factory=dict)
    #: (wall s, figures in the order of HISTORY_KEYS): tuples, not dicts, to stay small
    history: collections.deque[tuple[float, tuple[float, ...]]] = field(
        default_factory=lambda: collections.deque(maxlen=300)
    )

    def counter(self, key: str) -> float:
        """``key`` summed over every incarnation of this node (monotonic)."""
        return _number(self.metrics.get(key)) + self.offsets.get(key, 0.0)

    def role(self) -> str:
        role = self.metrics.get("role")
        if isinstance(role, str) and role:
            return role[:32]
        return self.node_id.split("-", 1)[0]


class MetricsStore:
    """Thread-safe store of what the bus delivered (see the module docstring)."""

    def __init__(
        self,
        *,
        host: str | None = None,
        history_len: int = 300,
        expire_s: float = 600.0,
        max_nodes: int = 4096,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.host = host or socket.gethostname()
        self.history_len = history_len
        self.expire_s = expire_s
        self.max_nodes = max_nodes
        self.wall = wall
        self._nodes: dict[str, NodeRecord] = {}
        self._lock = threading.Lock()
        self.refusals = BadMessageCounter("monitor collector", log)
        self.bad = 0
        self.refused = 0
        self.messages = 0
        self.version = 0  # bumped on every change: the web layer's cheap "anything new?"
        #: set by the owner of a run: {"total": events or None, "done_role": "output", ...}
        self.run_info: Callable[[], dict[str, Any]] | None = None
        #: (wall s, summed events_in_hz of the workers) per second, for the rate plot
        self.rate_history: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=history_len
        )
        #: (wall s, {module: wall seconds summed over the workers}) per second
        self.module_history: collections.deque[tuple[float, dict[str, float]]] = collections.deque(
            maxlen=history_len
        )

    # --- input ----------------------------------------------------------------------
    def refuse(self, kind: str, detail: str) -> bool:
        """Count a refused message (logged once per kind); returns False."""
        self.bad += 1
        self.refusals.record(kind, detail)
        return False

    def ingest(self, kind: MsgType, header: Any) -> bool:
        """One METRICS or STATE message's header; False (and counted) when refused."""
        if not isinstance(header, dict):
            return self.refuse("bad-header", f"{kind.name} header is not a map")
        node_id = header.get("from")
        if (
            type(node_id) is not str
            or not 0 < len(node_id) <= MAX_ID_CHARS
            or not node_id.isprintable()
        ):
            return self.refuse("bad-sender", f"{kind.name} from {_short(node_id)}")
        metrics = header.get("metrics")
        if kind is MsgType.METRICS:
            why = _bad_metrics(metrics)
            if why:
                return self.refuse("bad-metrics", f"METRICS of {node_id!r}: {why}")
        now = self.wall()
        with self._lock:
            rec = self._nodes.get(node_id)
            if rec is None:
                self._expire(now)
                if len(self._nodes) >= self.max_nodes:
                    self.refused += 1
                    return False
                rec = NodeRecord(node_id, self.host, first_seen_s=now)
                rec.history = collections.deque(maxlen=self.history_len)
                self._nodes[node_id] = rec
            rec.last_seen_s = now
            self.messages += 1
            self.version += 1
            if kind is MsgType.STATE:
                state = header.get("state")
                if isinstance(state, str):
                    rec.state = state[:32]
                return True
            assert isinstance(metrics, dict)
            self._update(rec, metrics, now)
            return True

    def _update(self, rec: NodeRecord, metrics: dict[str, Any], now: float) -> None:
        pid = metrics.get("pid")
        if isinstance(pid, int) and pid != rec.pid:
            if rec.pid:  # a new process under the same id: a restart
                rec.restarts += 1
                rec.restarted_s = now
                module_keys = [k for k in rec.metrics if k.startswith(MODULE_PREFIX)]
                for key in (*COUNTERS, *module_keys):
                    rec.offsets[key] = rec.offsets.get(key, 0.0) + _number(rec.metrics.get(key))
            rec.pid = pid
        host = metrics.get("host")
        if isinstance(host, str) and host:
            rec.host = host[:64]
        state = metrics.get("node_state")
        if isinstance(state, str) and state:
            rec.state = state[:32]
        flat = dict(metrics)
        extra = metrics.get("extra")
        if isinstance(extra, dict):  # ProcessMetrics.extra: the owner's own figures
            for k, v in extra.items():
                flat.setdefault(k, v)
        modules = metrics.get("module_time_s")
        if isinstance(modules, dict):
            times = {str(n)[:64]: _number(s) for n, s in list(modules.items())[:MAX_MODULES]}
            for name, seconds in times.items():
                flat[MODULE_PREFIX + name] = seconds
            del flat["module_time_s"]
            self._busy(rec, metrics, times, now)
        rec.metrics = flat
        raw_rates = metrics.get("rates")
        rates: dict[str, Any] = raw_rates if isinstance(raw_rates, dict) else {}
        sample = (  # in the order of HISTORY_KEYS
            rec.counter("events_in"),
            rec.counter("events_out"),
            _number(rates.get("events_in_hz")),
            _number(rates.get("events_out_hz")),
            _number(metrics.get("cpu_percent")),
            _number(metrics.get("VmRSS")) * 1024,
        )
        rec.history.append((now, sample))
        self._note_rate(now)

    @staticmethod
    def _busy(
        rec: NodeRecord, metrics: dict[str, Any], times: dict[str, float], now: float
    ) -> None:
        """Each module's seconds per second since the last snapshot of the same process,
        over the publisher's own clock (see the module docstring)."""
        stamp = _number(metrics.get("response_timestamp")) or now
        mark = rec.module_mark
        if mark is not None and mark[1] == rec.pid and stamp > mark[0]:
            span = stamp - mark[0]
            # one process runs its modules one at a time: more than 1 is a clock step
            rec.module_busy = {
                name: min(1.0, max(0.0, (seconds - mark[2].get(name, 0.0)) / span))
                for name, seconds in times.items()
            }
        elif mark is None or mark[1] != rec.pid:
            rec.module_busy = {}  # a new process: its rate from its second snapshot on
        rec.module_mark = (stamp, rec.pid, times)

    def _note_rate(self, now: float) -> None:
        """At most one point a second: the workers' summed event rate and module busy
        time (of workers heard within RATE_FRESH_S)."""
        if self.rate_history and now - self.rate_history[-1][0] < 1.0:
            return
        total = 0.0
        modules: dict[str, float] = {}
        for rec in self._nodes.values():
            if rec.role() != "worker" or now - rec.last_seen_s >= RATE_FRESH_S:
                continue
            if rec.history:
                total += rec.history[-1][1][_EVENTS_IN_HZ]
            for name, busy in rec.module_busy.items():
                modules[name] = modules.get(name, 0.0) + busy
        self.rate_history.append((now, total))
        if modules:
            self.module_history.append((now, modules))

    def _expire(self, now: float) -> None:
        gone = [n for n, r in self._nodes.items() if now - r.last_seen_s > self.expire_s]
        for n in gone:
            del self._nodes[n]

    # --- output ---------------------------------------------------------------------
    def nodes(self, with_history: bool = False) -> list[NodeRecord]:
        """A consistent copy of every node (sorted by role, then id); the histories are
        copied only when asked (a scrape does not need them)."""
        with self._lock:
            self._expire(self.wall())
            out = []
            for rec in self._nodes.values():
                copy = NodeRecord(
                    rec.node_id,
                    rec.host,
                    rec.state,
                    rec.pid,
                    rec.restarts,
                    rec.restarted_s,
                    rec.first_seen_s,
                    rec.last_seen_s,
                    dict(rec.metrics),
                    dict(rec.offsets),
                )
                if with_history:
                    copy.history = collections.deque(rec.history, maxlen=rec.history.maxlen)
                out.append(copy)
        out.sort(key=lambda r: (_role_rank(r.role()), _natural(r.node_id)))
        return out

    def history(self, node_id: str, key: str) -> list[tuple[float, float]]:
        """``(wall s, value)`` of one of HISTORY_KEYS for ``node_id`` (oldest first)."""
        i = HISTORY_KEYS.index(key)
        with self._lock:
            rec = self._nodes.get(node_id)
            if rec is None:
                return []
            return [(t, s[i]) for t, s in rec.history]

    def rates(self) -> list[tuple[float, float]]:
        with self._lock:
            return list(self.rate_history)

    def module_times(self) -> list[tuple[float, dict[str, float]]]:
        """Per second: each module's busy time (s per s) summed over the workers."""
        with self._lock:
            return list(self.module_history)

    def forget(self) -> None:
        with self._lock:
            self._nodes.clear()
            self.rate_history.clear()
            self.module_history.clear()


class BusCollector:
    """A thread that subscribes to METRICS and STATE on each bus and fills ``store``."""

    def __init__(self, store: MetricsStore, endpoints: Iterable[BusEndpoints | str]) -> None:
        self.store = store
        self.endpoints = [
            e if isinstance(e, BusEndpoints) else BusEndpoints.parse(e) for e in endpoints
        ]
        self.decoder = BadMessageCounter("monitor collector")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> BusCollector:
        self._thread = threading.Thread(target=self._run, name="evflow-collector", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        subs = []
        try:
            poller = zmq.Poller()
            for ep in self.endpoints:
                pub, sub = open_bus_sockets(ctx, ep, "monitor", (MsgType.METRICS, MsgType.STATE))
                pub.close(0)  # the collector only listens
                subs.append(sub)
                poller.register(sub.socket, zmq.POLLIN)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            for s in subs:
                s.close(0)
            ctx.term()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    self._drain(sock)
        finally:
            for s in subs:
                s.close(0)
            ctx.term()

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        for _ in range(10_000):  # bounded: the stop flag is looked at again soon
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.decoder.decode(frames)
            if msg is None:
                self.store.bad += 1
                continue
            if msg.type in (MsgType.METRICS, MsgType.STATE):
                try:
                    self.store.ingest(msg.type, msg.header)
                except Exception as exc:  # a value no check foresaw: never the thread
                    self.store.refuse("unchecked-value", f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return 0.0


_ROLE_RANK = {"parallel": 0, "bus": 1, "input": 2, "worker": 3, "output": 4}


def _role_rank(role: str) -> int:
    return _ROLE_RANK.get(role, 5)


def _natural(name: str) -> tuple[Any, ...]:
    """``worker-10`` after ``worker-9`` (ASCII digits only: ``'²'.isdigit()`` is true)."""
    head, _, tail = name.rpartition("-")
    if tail.isascii() and tail.isdigit():
        return (head, int(tail), "")
    return (name, -1, name)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad_metrics(metrics: Any) -> str:
    """Why a metrics map is refused ("" when it is fine): see the module docstring."""
    if type(metrics) is not dict:
        return f"metrics is {_short(metrics)}, not a map"
    if len(metrics) > MAX_KEYS:
        return f"{len(metrics)} figures (at most {MAX_KEYS})"
    for key in metrics:
        if type(key) is not str:
            return f"a figure named {_short(key)} (names are strings)"
    for name in _NAMED_MAPS:
        inner = metrics.get(name)
        if inner is None:
            continue
        if type(inner) is not dict or len(inner) > MAX_KEYS:
            return f"{name} is {_short(inner)}, not a map"
        for key in inner:
            if type(key) is not str:
                return f"{name} has a key {_short(key)} (names are strings)"
    return ""

"""Per-process metrics: cheap counters, rates, CPU and memory, as one JSON-able snapshot.

Counting is a plain attribute increment (``m.events_in += 1``); everything costly (psutil,
rates, socket probes) happens only in :meth:`ProcessMetrics.snapshot`, which the bus
client calls about once a second or when asked by ``get-metrics``.

The snapshot has the fields of the ALICE QC prototype's monitoring replies::

    command, node_id, node_state, pid, request_timestamp, response_timestamp,
    receive_buffer_size, receive_buffer_capacity, receive_buffer_overloaded,
    send_buffer_size, send_buffer_capacity, send_buffer_overloaded,
    VmRSS (kB, like /proc/<pid>/status), cpu_clock (the process's CPU clock: user +
    system seconds, what the prototype's ``time.clock()`` read), cpu (the same),
    cpu_percent, rates {messages_in_hz, messages_out_hz, bytes_in_per_s,
    bytes_out_per_s, events_in_hz, events_out_hz}

plus the raw counters. ``command`` is what the snapshot answers: ``get-metrics``, or
``metrics`` for the periodic publication. Timestamps are wall-clock seconds since the
epoch (``time.time``, comparable across hosts); rates use the monotonic clock.

Buffers: ZeroMQ does not expose its queue depths, so a size is what the owner holds
itself and reports with :meth:`set_queue` (the input: events at the workers, sent and
not finished, against the credit windows it keeps; the output: events written and not
yet confirmed, against the count that forces a CONFIRM), added to the channels' (0:
what sits in a socket's queue is not visible). A capacity is the reported one plus the
channels' high-water marks. ``*_overloaded`` is True when the size reached the
capacity, and ``send_buffer_overloaded`` also when a sending channel's socket cannot
take a message now (HWM reached, ``ZMQ_EVENTS``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil  # type: ignore[import-untyped]
import zmq

#: socket types whose send blocks (instead of dropping) at the high-water mark
BLOCKING_SENDERS = frozenset({"push", "dealer", "pair", "req"})

_RATE_KEYS = (
    ("messages_in", "messages_in_hz"),
    ("messages_out", "messages_out_hz"),
    ("bytes_in", "bytes_in_per_s"),
    ("bytes_out", "bytes_out_per_s"),
    ("events_in", "events_in_hz"),
    ("events_out", "events_out_hz"),
)


class ProcessMetrics:
    """Counters of one process (node). Increment the attributes directly; they are ints.

    ``channels`` (objects with ``messages_in/out``, ``bytes_in/out``, ``type``, ``config``
    and ``socket``, i.e. :class:`evflow.transport.channel.Channel`) are summed into the
    message and byte counters at snapshot time, so the data path pays nothing extra.
    ``clock`` (monotonic seconds) and ``wall`` (epoch seconds) are injectable for tests.
    """

    __slots__ = (
        "_cpu_mark",
        "_last",
        "_pid",
        "_proc",
        "_rates",
        "bytes_in",
        "bytes_out",
        "channels",
        "clock",
        "events_in",
        "events_out",
        "extra",
        "messages_in",
        "messages_out",
        "node_id",
        "queues",
        "wall",
    )

    def __init__(
        self,
        node_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.node_id = node_id
        self.clock = clock
        self.wall = wall
        self.messages_in = 0
        self.messages_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.events_in = 0
        self.events_out = 0
        #: other counters or gauges the owner wants published (name -> number)
        self.extra: dict[str, int | float] = {}
        self.channels: list[Any] = []
        #: "receive"/"send" -> (size, capacity) as reported by the owner
        self.queues: dict[str, tuple[int, int]] = {}
        self._proc: psutil.Process | None = None
        self._pid = 0
        self._last: tuple[float, dict[str, int]] | None = None
        self._rates: dict[str, float] = {}
        self._cpu_mark: tuple[float, float] | None = None

    def __repr__(self) -> str:
        return (
            f"<ProcessMetrics {self.node_id!r} msgs in/out={self.messages_in}/"
            f"{self.messages_out} events in/out={self.events_in}/{self.events_out}>"
        )

    def set_queue(self, which: str, size: int, capacity: int = 0) -> None:
        """Report the depth of the ``"receive"`` or ``"send"`` queue (messages or events)."""
        if which not in ("receive", "send"):
            raise ValueError(f"queue must be 'receive' or 'send', got {which!r}")
        self.queues[which] = (int(size), int(capacity))

    def add_channels(self, channels: Iterable[Any]) -> None:
        """Count these channels' traffic in the snapshot (``Channel`` objects)."""
        self.channels.extend(channels)

    def counters(self) -> dict[str, int]:
        """Own counters plus the traffic of the attached channels."""
        out = {
            "messages_in": self.messages_in,
            "messages_out": self.messages_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "events_in": self.events_in,
            "events_out": self.events_out,
        }
        for ch in self.channels:
            out["messages_in"] += ch.messages_in
            out["messages_out"] += ch.messages_out
            out["bytes_in"] += ch.bytes_in
            out["bytes_out"] += ch.bytes_out
        return out

    def update_rates(self, now_s: float | None = None) -> dict[str, float]:
        """Recompute rates over the interval since the previous call (per second)."""
        now_s = self.clock() if now_s is None else now_s
        counts = self.counters()
        if self._last is not None:
            then_s, before = self._last
            dt = now_s - then_s
            if dt > 0:
                self._rates = {
                    rate: round((counts[key] - before[key]) / dt, 3) for key, rate in _RATE_KEYS
                }
        else:
            self._rates = {rate: 0.0 for _, rate in _RATE_KEYS}
        self._last = (now_s, counts)
        return dict(self._rates)

    def _process(self) -> psutil.Process:
        pid = os.getpid()
        if self._proc is None or self._pid != pid:  # a fork must not report its parent
            self._proc, self._pid = psutil.Process(pid), pid
            self._cpu_mark = None
        return self._proc

    def _buffers(self) -> dict[str, Any]:
        recv_size, recv_cap = self.queues.get("receive", (0, 0))
        send_size, send_cap = self.queues.get("send", (0, 0))
        send_blocked = False
        for ch in self.channels:
            if getattr(ch, "closed", False):
                continue
            config = getattr(ch, "config", None)
            if config is not None:
                if ch.type in ("pull", "sub", "xsub", "router", "dealer", "pair", "rep", "req"):
                    recv_cap += int(config.rcvBufSize)
                if ch.type in BLOCKING_SENDERS or ch.type in ("pub", "xpub", "router"):
                    send_cap += int(config.sndBufSize)
            if ch.type in BLOCKING_SENDERS:
                with contextlib.suppress(zmq.ZMQError):  # closed meanwhile
                    send_blocked |= not (ch.socket.getsockopt(zmq.EVENTS) & zmq.POLLOUT)
        return {
            "receive_buffer_size": recv_size,
            "receive_buffer_capacity": recv_cap,
            "receive_buffer_overloaded": bool(recv_cap and recv_size >= recv_cap),
            "send_buffer_size": send_size,
            "send_buffer_capacity": send_cap,
            "send_buffer_overloaded": bool(send_blocked or (send_cap and send_size >= send_cap)),
        }

    def snapshot(
        self,
        node_state: str = "",
        request_timestamp: float | None = None,
        extra: dict[str, Any] | None = None,
        command: str = "get-metrics",
    ) -> dict[str, Any]:
        """All fields as a JSON-able dict (see the module docstring)."""
        proc = self._process()
        try:
            with proc.oneshot():
                cpu_times = proc.cpu_times()
                rss = proc.memory_info().rss
        except psutil.Error:
            cpu_times, rss = None, 0
        cpu_s = (cpu_times.user + cpu_times.system) if cpu_times is not None else 0.0
        now_s = self.clock()
        cpu_percent = 0.0
        if self._cpu_mark is not None and now_s > self._cpu_mark[0]:
            cpu_percent = 100.0 * (cpu_s - self._cpu_mark[1]) / (now_s - self._cpu_mark[0])
        self._cpu_mark = (now_s, cpu_s)
        if self._last is None:
            self.update_rates(now_s)
        wall = self.wall()
        snap: dict[str, Any] = {
            "command": command,
            "node_id": self.node_id,
            "node_state": node_state,
            "pid": os.getpid(),
            "request_timestamp": wall if request_timestamp is None else request_timestamp,
            "response_timestamp": wall,
            **self._buffers(),
            "VmRSS": rss // 1024,
            "cpu_clock": round(cpu_s, 3),
            "cpu": round(cpu_s, 3),
            "cpu_percent": round(cpu_percent, 1),
            "rates": dict(self._rates),
            **self.counters(),
        }
        if self.extra:
            snap["extra"] = dict(self.extra)
        if extra:
            snap.update(extra)
        return snap

"""Counters of a device's channels: the metrics snapshot and FairMQ-style rate logging."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from evflow.transport.channel import Channel
from evflow.wire.messages import BadMessageCounter

log = logging.getLogger("evflow.device")


def channel_metrics(
    channels: Iterable[Channel], bad_messages: Mapping[str, BadMessageCounter]
) -> dict[str, Any]:
    """Totals and per-channel counters (messages, bytes, high-water marks), bad messages."""
    per_channel: dict[str, dict[str, Any]] = {}
    totals = {"messages_in": 0, "messages_out": 0, "bytes_in": 0, "bytes_out": 0}
    for ch in channels:
        st = ch.statistics()
        per_channel[ch.label] = {
            "type": st.type,
            "messages_in": st.messages_in,
            "messages_out": st.messages_out,
            "bytes_in": st.bytes_in,
            "bytes_out": st.bytes_out,
            "rcv_hwm": ch.config.rcvBufSize,
            "snd_hwm": ch.config.sndBufSize,
        }
        if ch.batch_us or ch.batches_in:  # ZeroMQ messages that carried several
            per_channel[ch.label]["batch_us"] = ch.batch_us
            per_channel[ch.label]["batches_out"] = ch.batches_out
            per_channel[ch.label]["batches_in"] = ch.batches_in
        shm = getattr(ch, "shm_metrics", None)
        if shm is not None:  # transport=shm: bytes above include the region's
            per_channel[ch.label]["shm"] = shm()
        totals["messages_in"] += st.messages_in
        totals["messages_out"] += st.messages_out
        totals["bytes_in"] += st.bytes_in
        totals["bytes_out"] += st.bytes_out
    kinds: dict[str, int] = {}
    for counter in bad_messages.values():
        for kind, n in counter.counts.items():
            kinds[kind] = kinds.get(kind, 0) + n
    return {
        **totals,
        "channels": per_channel,
        "bad_messages": sum(kinds.values()),
        "bad_message_kinds": kinds,
    }


class RateLogger:
    """Logs msg/s and MB/s of each channel every ``rateLogging`` seconds (0 = never)."""

    def __init__(self, device_id: str) -> None:
        self.device_id = device_id
        self._marks: dict[str, tuple[float, int, int, int, int]] = {}

    def reset(self) -> None:
        self._marks.clear()

    def log(self, channels: Iterable[Channel], now_s: float) -> None:
        for ch in channels:
            every_s = ch.config.rateLogging
            if not every_s or ch.closed:
                continue
            counts = (ch.messages_in, ch.bytes_in, ch.messages_out, ch.bytes_out)
            mark = self._marks.get(ch.label)
            if mark is not None:
                dt = now_s - mark[0]
                if dt < every_s:
                    continue
                d = [c - m for c, m in zip(counts, mark[1:], strict=True)]
                if any(d):
                    log.info(
                        "%s %s: in %.0f msg/s %.3f MB/s, out %.0f msg/s %.3f MB/s",
                        self.device_id, ch.label,
                        d[0] / dt, d[1] / dt / 1e6, d[2] / dt, d[3] / dt / 1e6,
                    )  # fmt: skip
            self._marks[ch.label] = (now_s, *counts)

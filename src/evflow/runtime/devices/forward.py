"""Forwarding devices: ``splitter`` (1 -> n round robin), ``merger`` (n -> 1), ``proxy``.

Each forwards every message from ``data-in`` to ``data-out`` except END, which it
acknowledges upstream at once (the data before it is already here). When the last
expected END arrived, it sends END with its own counts on every output and waits for
their ACKs before it stops. Either side may be raw (FairMQ's wire): raw input is
forwarded as data; only data goes out on a raw output.
"""

from __future__ import annotations

import logging
from typing import Any

from evflow.params import Param
from evflow.runtime.device import Device, Origin
from evflow.runtime.devices._stream import EndTracker, acknowledge, send_end, wait_for_acks
from evflow.runtime.framing import outgoing
from evflow.transport.channel import Channel
from evflow.wire.messages import Message, MsgType

log = logging.getLogger("evflow.device")


class _Forwarder(EndTracker, Device):
    in_channel = Param(str, "data-in", "input channel")
    out_channel = Param(str, "data-out", "output channel (sub-channels for the splitter)")
    inputs = Param(int, 0, "END messages to wait for (0 = one per input sub-channel)")
    ack_timeout_s = Param(float, 10.0, "how long to wait for downstream ACKs (s)")

    def init_task(self) -> None:
        self._outs: list[Channel] = self.channel_list(self.out_channel)
        self.sent = [0] * len(self._outs)
        self.received = 0
        self.ends = 0
        self.not_forwarded = 0
        self._next = 0
        self._needed = self.inputs or len(self.channel_list(self.in_channel))
        self._needed -= len(self.lost_peers)
        self.on_data(self.in_channel, self._handle)

    def _pick(self) -> int:
        return 0

    def _handle(self, msg: Message, origin: Origin) -> bool:
        if msg.type is MsgType.END:
            if self._track_end(msg):
                self.ends += 1
            acknowledge(self, msg, origin, count=self.received)
            return self.ends < self._needed
        if msg.type is MsgType.ACK:
            return True
        i = self._pick()
        frames = outgoing(self._outs[i], msg.type, msg.header, msg.payload)
        if frames is None:  # a raw output carries only data
            self.not_forwarded += 1
            return True
        self._outs[i].send(frames)
        self.sent[i] += 1
        self.received += 1
        return True

    def post_run(self) -> None:
        for i in range(len(self._outs)):
            send_end(self, self.out_channel, i, self.sent[i])
        acked = wait_for_acks(self, self.out_channel, len(self._outs), self.ack_timeout_s)
        log.info(
            "%s: forwarded %d messages %s, %d of %d END acknowledged",
            self.id,
            self.received,
            self.sent,
            acked,
            len(self._outs),
        )

    def summary(self) -> dict[str, Any]:
        out = self.metrics()
        out["forwarded"] = {
            "received": getattr(self, "received", 0),
            "sent": getattr(self, "sent", []),
            "ends": getattr(self, "ends", 0),
            "lost_peers": sorted(self.lost_peers),
            "not_forwarded": getattr(self, "not_forwarded", 0),
        }
        return out


class Splitter(_Forwarder):
    description = "1 -> n: round robin over the data-out sub-channels"

    def _pick(self) -> int:
        i = self._next
        self._next = (i + 1) % len(self._outs)
        return i


class Merger(_Forwarder):
    description = "n -> 1: everything from data-in (sub-channels or peers) to data-out"


class Proxy(_Forwarder):
    description = "1 -> 1 forwarder from data-in to data-out (zmq balances over its peers)"

"""Forwarding devices: ``splitter`` (1 -> n round robin), ``merger`` (n -> 1), ``proxy``.

Each forwards every data (EVENTS) message from ``data-in`` to ``data-out``, round robin
over its sub-channels when it has several (a topology channel with ``peers = "all"``
has one per peer, so that each peer's END carries its own count); END it
acknowledges upstream at once (the data before it is already here). When the last
expected END arrived, it sends END with its own counts on every output and waits for
their ACKs before it stops. Either side may be raw (FairMQ's wire): raw input is
forwarded as data; only data goes out on a raw output. Any other message type on
the input (a stranger's HELLO, READY, ...) is refused and counted, never forwarded.
"""

from __future__ import annotations

import logging
from typing import Any

from evflow.errors import IncompleteStreamError
from evflow.params import Param
from evflow.runtime.device import Device, Origin
from evflow.runtime.devices.stream import (
    EndTracker,
    acknowledge,
    count_mismatch,
    end_and_wait,
)
from evflow.runtime.framing import outgoing
from evflow.runtime.loops import send_when_ready
from evflow.transport.channel import DEFAULT_BATCH_US, Channel
from evflow.wire.messages import Message, MsgType

log = logging.getLogger("evflow.device")


class _Forwarder(EndTracker, Device):
    default_batch_us = DEFAULT_BATCH_US
    in_channel = Param(str, "data-in", "input channel")
    out_channel = Param(str, "data-out", "output channel (sub-channels for the splitter)")
    inputs = Param(int, 0, "END messages to wait for (0 = one per input sub-channel)")
    senders = Param(str, "", "ids whose END counts, comma-separated (empty: any sender)")
    ack_timeout_s = Param(
        float, 10.0, "how long to wait for a downstream ACK once its receiver left (s)"
    )
    refused_timeout_s = Param(
        float,
        10.0,
        "with --max-iterations: after a refused message, end in ERROR when nothing more "
        "arrives for this long (refused messages never count; 0 = wait)",
    )

    def init_task(self) -> None:
        self._outs: list[Channel] = self.channel_list(self.out_channel)
        # [received, sent on sub-channel 0, 1, ...]: a restarted process goes on from them
        record = self._open_record(1 + len(self._outs))
        self.received = record.counts[0]
        self.sent = [record.counts[1 + i] for i in range(len(self._outs))]
        self.ends = self._ends_taken()
        self.not_forwarded = 0
        self._next = 0
        self._needed = self.inputs or len(self.channel_list(self.in_channel))
        self._needed -= len(self.lost_peers)
        self._raw_in = any(ch.raw for ch in self.channel_list(self.in_channel))
        self.on_data(self.in_channel, self._handle)

    def _pick(self) -> int:
        """Round robin over the output sub-channels (one, or one per peer of a channel
        with ``peers = "all"``: each peer's END then carries what went to it)."""
        i = self._next
        self._next = (i + 1) % len(self._outs)
        return i

    def _handle(self, msg: Message, origin: Origin) -> bool:
        if msg.type is MsgType.END:
            counts = self._track_end(msg, origin)
            if counts is None:
                return True
            if counts:
                self.ends += 1
            acknowledge(self, msg, origin, count=self.received)
            return self.ends < self._needed
        if msg.type is MsgType.ACK:
            return True
        if msg.type is not MsgType.EVENTS:
            # only data travels on: a stranger's HELLO or READY passed on would be
            # counted as data and fail every count check downstream
            self.bad_messages[origin.channel.label].record(
                "not-data", f"{msg.type.name} on a data channel, not forwarded"
            )
            return True
        i = self._pick()
        self.received += 1
        self.record.counts[0] = self.received
        frames = outgoing(self._outs[i], msg.type, msg.header, msg.payload)
        if frames is None:  # a raw output carries only data
            self.not_forwarded += 1
            return True
        # counted before it goes: a kill in between shows as a message missing downstream
        self.sent[i] += 1
        self.record.counts[1 + i] = self.sent[i]
        if not send_when_ready(self, self._outs[i], frames):
            self.sent[i] -= 1
            self.record.counts[1 + i] = self.sent[i]
            log.warning("%s: stopped while %s had no peer: 1 message not forwarded", self.id,
                        self._outs[i].label)  # fmt: skip
            return False
        return True

    def post_run(self) -> None:
        _ends, acked = end_and_wait(self, self.out_channel, self.sent, self.ack_timeout_s)
        log.info(
            "%s: forwarded %d messages %s, %d of %d END acknowledged",
            self.id,
            self.received,
            self.sent,
            acked,
            len(self._outs),
        )
        self.check_unended("forwarder")
        # what went out must be what the inputs announced: a message lost here (read,
        # then the process killed before it went out) is named here, not downstream
        if self.lost_peers or self._raw_in or self.ends < self._needed:
            return
        out = sum(self.sent) + self.not_forwarded
        if out != self.announced_total:
            raise IncompleteStreamError(
                count_mismatch("forwarder", self.id, out, self.announced_total, self.record)
            )

    def summary(self) -> dict[str, Any]:
        out = self.metrics()
        out["forwarded"] = {
            "received": getattr(self, "received", 0),
            "sent": getattr(self, "sent", []),
            "ends": getattr(self, "ends", 0),
            "not_forwarded": getattr(self, "not_forwarded", 0),
            "lost_peers": sorted(self.lost_peers),
        }
        return out


class Splitter(_Forwarder):
    description = "1 -> n: round robin over the data-out sub-channels"


class Merger(_Forwarder):
    description = "n -> 1: everything from data-in (sub-channels or peers) to data-out"


class Proxy(_Forwarder):
    description = "1 -> 1 forwarder from data-in to data-out (zmq balances over its peers)"

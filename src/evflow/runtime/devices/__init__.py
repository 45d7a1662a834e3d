"""Built-in devices, runnable with ``evflow device NAME``, and the public API for
writing your own.

All carry wire-protocol messages (EVENTS with the data as payload) and end a stream
with an END message that carries the count, acknowledged by the receiver (ACK) before
the sender closes: end of stream is a message, never a closed socket.

Your own devices (see docs/topology.md, "Your own source and sink devices")::

    from evflow import DataStore, EventMeta, Param
    from evflow.runtime.devices import SinkDevice, SourceDevice

    class Numbers(SourceDevice):
        n = Param(int, 1000, "events to send")

        def events(self):
            for i in self.share(self.n):      # this instance's part when copies > 1
                store = DataStore(EventMeta(uid=i, event=i))
                store["x"] = float(i)
                yield store

    class Sum(SinkDevice):
        def event(self, store):
            self.total = getattr(self, "total", 0.0) + store["x"]

The base classes send, wait for room at the receiver, end the stream with END (the
counts) and its ACK, and check the counts at the receiving end. For other streams:
``Device`` with ``send_when_ready`` (a send that waits for room, not past a stop),
``end_and_wait`` (the sender's end: END on every sub-channel, then the ACKs, waited for
while the receivers stay connected), its halves ``send_end`` / ``wait_for_acks``, and
``acknowledge`` (the receiver's answer to END).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from evflow.runtime.device import Device, Origin
    from evflow.runtime.devices._streamrecord import StreamRecord
    from evflow.runtime.devices.eventsink import SinkDevice, decode_events
    from evflow.runtime.devices.source import SourceDevice, instance_index
    from evflow.runtime.devices.stream import (
        acknowledge,
        end_and_wait,
        send_end,
        wait_for_acks,
    )
    from evflow.runtime.loops import send_when_ready
    from evflow.wire.messages import Message, MsgType

#: the public names, imported on first use: loading the registry below (every
#: ``evflow device`` start) must not pull in sockets and the codec (numpy)
_LAZY = {
    "send_when_ready": "evflow.runtime.loops",
    "Device": "evflow.runtime.device",
    "Origin": "evflow.runtime.device",
    "acknowledge": "evflow.runtime.devices.stream",
    "end_and_wait": "evflow.runtime.devices.stream",
    "send_end": "evflow.runtime.devices.stream",
    "wait_for_acks": "evflow.runtime.devices.stream",
    "StreamRecord": "evflow.runtime.devices._streamrecord",
    "SinkDevice": "evflow.runtime.devices.eventsink",
    "decode_events": "evflow.runtime.devices.eventsink",
    "SourceDevice": "evflow.runtime.devices.source",
    "instance_index": "evflow.runtime.devices.source",
    "Message": "evflow.wire.messages",
    "MsgType": "evflow.wire.messages",
}

#: name -> "module:Class", imported on demand
BUILTIN_DEVICES: dict[str, str] = {
    "sampler": "evflow.runtime.devices.sampler:Sampler",
    "sink": "evflow.runtime.devices.sink:Sink",
    "event-sink": "evflow.runtime.devices.eventsink:SinkDevice",
    "file-source": "evflow.io.file_source:FileSource",
    "splitter": "evflow.runtime.devices.forward:Splitter",
    "merger": "evflow.runtime.devices.forward:Merger",
    "proxy": "evflow.runtime.devices.forward:Proxy",
    "qc-merger": "evflow.qc.merger:QcMerger",
    "qc-producer": "evflow.qc.producer_device:QcProducer",
    "eventbuilder": "evflow.hlt.builder_device:EventBuilderDevice",
    "replay": "evflow.hlt.replay_device:ReplayDevice",
    "qc-repository": "evflow.qc.repository_device:QcRepositoryDevice",
}

__all__ = [
    "BUILTIN_DEVICES",
    "Device",
    "Message",
    "MsgType",
    "Origin",
    "SinkDevice",
    "SourceDevice",
    "StreamRecord",
    "acknowledge",
    "decode_events",
    "end_and_wait",
    "instance_index",
    "send_end",
    "send_when_ready",
    "wait_for_acks",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Writing your own devices for a topology (``evflow up``): the public names.

A source yields events; the base class sends them, waits for room at the receiver,
and ends the stream with END (the counts) and its ACK::

    from evflow.devices import DataStore, EventMeta, Param, SourceDevice

    class Numbers(SourceDevice):
        n = Param(int, 1000, "events to send")

        def events(self):
            for i in self.share(self.n):      # this instance's part when copies > 1
                store = DataStore(EventMeta(uid=i, event=i))
                store["x"] = float(i)
                yield store

A sink gets every event; the base class answers END and checks the counts::

    from evflow.devices import SinkDevice

    class Sum(SinkDevice):
        def event(self, store):
            self.total = getattr(self, "total", 0.0) + store["x"]

For other streams: ``Device`` with ``send_when_ready`` (a send that waits for room but
not past a stop), ``send_end`` / ``wait_for_acks`` (the sender's end) and
``acknowledge`` (the receiver's answer to END). See docs/topology.md, "Your own source
and sink devices".
"""

from __future__ import annotations

from evflow.params import Param
from evflow.processing.datastore import DataStore, EventMeta
from evflow.runtime._loops import send_when_ready
from evflow.runtime.device import Device, Origin
from evflow.runtime.devices._stream import acknowledge, send_end, wait_for_acks
from evflow.runtime.devices.eventsink import SinkDevice, decode_events
from evflow.runtime.devices.source import SourceDevice, instance_index
from evflow.wire.codec import encode_batch, encode_event
from evflow.wire.messages import Message, MsgType

__all__ = [
    "DataStore",
    "Device",
    "EventMeta",
    "Message",
    "MsgType",
    "Origin",
    "Param",
    "SinkDevice",
    "SourceDevice",
    "acknowledge",
    "decode_events",
    "encode_batch",
    "encode_event",
    "instance_index",
    "send_end",
    "send_when_ready",
    "wait_for_acks",
]

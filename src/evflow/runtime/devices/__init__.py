"""Built-in devices, runnable with ``evflow device NAME``.

All carry wire-protocol messages (EVENTS with the data as payload) and end a stream
with an END message that carries the count, acknowledged by the receiver (ACK) before
the sender closes: end of stream is a message, never a closed socket. Base classes
for your own (``SourceDevice``, ``SinkDevice``) are public in :mod:`evflow.devices`.
"""

from __future__ import annotations

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

__all__ = ["BUILTIN_DEVICES"]

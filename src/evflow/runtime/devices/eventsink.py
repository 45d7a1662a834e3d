"""``SinkDevice``: the base of devices that take a stream of events until END.

A subclass writes ``event(store)``, called for every event that arrives on
``channel_name`` (EVENTS messages of the safe codec: single events or batches, as a
``SourceDevice``, a path's roles or a forwarder send them); the base class does the
rest of the stream protocol:

- it waits for one END per input (``inputs``; 0: one per sub-channel, which a topology
  file sets to the number of connected peers) and answers each with ACK;
- it checks the counts: the EVENTS messages received against the ``count`` the ENDs
  announced and, when every END names them (a ``SourceDevice``'s do), the events
  against their ``events``. A difference ends the device in ERROR: loss is never silent;
- undecodable messages are counted and dropped (logged once); nothing on the socket can
  crash the device or reach ``event()`` unchecked.

Registered as the built-in ``event-sink``: used as it is, it counts events.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from evflow.errors import CodecError, PeerLostError
from evflow.params import Param
from evflow.runtime.device import Device, Origin
from evflow.runtime.devices.stream import EndTracker, acknowledge
from evflow.wire.codec import decode_batch, decode_event
from evflow.wire.messages import Message, MsgType

__all__ = ["SinkDevice", "decode_events"]

log = logging.getLogger("evflow.device")


def decode_events(frames: Sequence[Any]) -> list[Any]:
    """The events of one EVENTS payload (one event or a batch); CodecError if neither."""
    try:
        return [decode_event(frames)]
    except CodecError as exc:
        if "batch" not in str(exc):
            raise
        return decode_batch(frames)


def _count(value: Any) -> int | None:
    """A count from an END header (untrusted): a non-negative int, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
        return value
    return None


class SinkDevice(EndTracker, Device):
    """Override :meth:`event`; see the module docstring for what the base class does.

    ``init_task`` and ``post_run`` belong to the base class (call ``super()`` when
    overriding them); the other hooks are free for yours.
    """

    description = "takes events until END from every input; checks the counts END announced"

    channel_name = Param(str, "data", "input channel")
    inputs = Param(int, 0, "END messages to wait for (0 = one per sub-channel)")
    senders = Param(str, "", "ids whose END counts, comma-separated (empty: any sender)")

    def event(self, store: Any) -> None:
        """One event that arrived, a ``DataStore`` (override; the default only counts it)."""

    def init_task(self) -> None:
        # [messages, events, events announced]: kept across a restart (stream_dir set)
        record = self._open_record(3)
        self.messages, self.events_in, self.events_announced = record.counts[:3]
        self.ends = self._ends_taken()  # ENDs a killed predecessor already took
        self.ends_without_events = 0
        self.bad_events = 0
        self.bad_ends = 0
        self.other = 0
        self._needed = self.inputs or len(self.channel_list(self.channel_name))
        self._needed -= len(self.lost_peers)
        self.on_data(self.channel_name, self._handle)

    def _handle(self, msg: Message, origin: Origin) -> bool:
        if msg.type is MsgType.EVENTS:
            try:
                stores = decode_events(list(msg.payload))
            except CodecError as exc:
                self.bad_events += 1
                if self.bad_events == 1:
                    log.error("%s: undecodable events dropped (%s); more are only counted",
                              self.id, exc)  # fmt: skip
                return True
            self.messages += 1
            for store in stores:
                self.event(store)
            self.events_in += len(stores)
            self.record.counts[0], self.record.counts[1] = self.messages, self.events_in
            return True
        if msg.type is MsgType.END:
            return self._end(msg, origin)
        self.other += 1
        return True

    def _end(self, msg: Message, origin: Origin) -> bool:
        counts = self._track_end(msg, origin)  # None: forged or unknown sender, dropped
        if counts is None:
            return True
        if counts:  # the first END of this sender: its counts are the ones to check
            if _count(msg.header.get("count")) is None:
                self.bad_ends += 1
                if self.bad_ends == 1:
                    log.error("%s: END without a valid count from %r; its counts are not "
                              "checked", self.id, msg.header.get("from"))  # fmt: skip
            events = _count(msg.header.get("events"))
            if events is None:
                self.ends_without_events += 1
            else:
                self.events_announced += events
                self.record.counts[2] = self.events_announced
            self.ends += 1
        acknowledge(self, msg, origin, count=self.messages)
        return self.ends < self._needed

    def post_run(self) -> None:
        log.info("%s: %d events in %d messages (announced: %d messages), %d of %d END",
                 self.id, self.events_in, self.messages, self.announced, self.ends,
                 self._needed)  # fmt: skip
        self.check_unended("sink")
        if self.lost_peers:
            log.warning("%s: counts not checked: peer(s) %s were lost before their END",
                        self.id, ", ".join(sorted(self.lost_peers)))  # fmt: skip
            return
        if self.ends < self._needed or self.bad_ends:
            return  # stopped early, or a count we could not read: nothing to compare
        if self.messages != self.announced:
            raise PeerLostError(
                f"sink {self.id!r}: received {self.messages} messages but the senders "
                f"announced {self.announced}"
            )
        if not self.ends_without_events and self.events_in != self.events_announced:
            raise PeerLostError(
                f"sink {self.id!r}: received {self.events_in} events but the senders "
                f"announced {self.events_announced}"
            )

    def summary(self) -> dict[str, Any]:
        out = self.metrics()
        out["sink"] = {
            "received": getattr(self, "messages", 0),
            "announced": getattr(self, "announced", 0),
            "ends": getattr(self, "ends", 0),
            "events": getattr(self, "events_in", 0),
            "events_announced": getattr(self, "events_announced", 0),
            "bad_events": getattr(self, "bad_events", 0),
            "lost_peers": sorted(self.lost_peers),
        }
        return out

"""``SourceDevice``: the base of devices that send a stream of events, then END.

A subclass writes one generator, ``events()``, that yields ``DataStore`` objects; the
base class does the rest of the stream protocol:

- events go out in EVENTS messages of ``batch`` events (``encode_batch``; one event:
  ``encode_event``), the safe codec that paths and ``qc-producer`` devices decode,
  round robin over the sub-channels of ``channel_name``;
- a send waits while no peer can take it (none connected yet, or its queue at the
  high-water mark: the receiver's pace is the flow control) but not past a stop;
- at the end, or when the device is stopped for good, END goes on every sub-channel
  with ``count`` (EVENTS messages sent on it), ``events`` (events in them) and ``from``
  (our id), and the device waits for each ACK while its receiver stays connected
  (``ack_timeout_s`` counts from a receiver's disconnection: see ``end_and_wait``);
- ``copies`` instances can share one stream: ``share()`` says which part is ours.

A STOP from ``evflow ctl`` pauses the stream (the message being sent is kept and goes
first at the next RUN); END then goes only when the device leaves for good. One stream
per device process: after its END, a new RUN sends nothing. After an error in
``events()`` no END goes (the device ends in ERROR; its consumers are told it was lost).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

from evflow.errors import ConfigurationError
from evflow.params import Param
from evflow.runtime.device import Device
from evflow.runtime.devices.stream import end_and_wait
from evflow.runtime.framing import outgoing
from evflow.runtime.loops import send_when_ready
from evflow.runtime.states import State
from evflow.wire.codec import encode_batch, encode_event
from evflow.wire.messages import MsgType

__all__ = ["SourceDevice", "instance_index"]

log = logging.getLogger("evflow.device")

_INDEX = re.compile(r"_(\d+)$")


def instance_index(device_id: str) -> int:
    """The instance number of a topology device id (``reader_3`` -> 3; ``reader`` -> 0)."""
    match = _INDEX.search(device_id)
    return int(match.group(1)) if match else 0


class SourceDevice(Device):
    """Override :meth:`events`; see the module docstring for what the base class does.

    ``conditional_run``, ``post_run`` and ``reset_task`` belong to the base class (call
    ``super()`` when overriding them); ``init_task`` and ``reset`` are free for yours.
    """

    description = "sends the events of events(), then END with the counts"

    channel_name = Param(str, "data", "output channel")
    batch = Param(int, 100, "events per EVENTS message")
    copies = Param(int, 1, "instances sharing the stream (instance NAME_k takes part k)")
    ack_timeout_s = Param(
        float, 30.0, "how long to wait for an END acknowledgement once its receiver left (s)"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stream: dict[str, Any] | None = None

    def events(self) -> Iterable[Any]:
        """The events to send, in order: ``DataStore`` objects (``evflow.DataStore``; not
        imported here, the runtime sits below the event model). A generator: its
        ``finally`` closes files."""
        raise NotImplementedError(f"{type(self).__name__} must define events()")

    def share(self, total: int) -> range:
        """Our contiguous part of ``total`` items when ``copies`` instances share them."""
        k, n = self.copy_index, self.copies
        return range(total * k // n, total * (k + 1) // n)

    # --- the stream (framework-owned) ---------------------------------------------------
    @property
    def copy_index(self) -> int:
        """Which of the ``copies`` instances this one is (from the id's ``_k`` suffix)."""
        k = instance_index(self.id)
        if self.copies < 1 or k >= self.copies:
            raise ConfigurationError(
                f"device {self.id!r} is copy {k} but copies = {self.copies}; "
                "set copies to the number of instances"
            )
        return k

    def conditional_run(self) -> bool:
        state = self._stream_state()
        if state["ended"]:
            return False  # one stream per process: its END went already
        if state["pending"] is None:
            chunk = list(itertools.islice(state["iter"], self.batch))
            if not chunk:
                state["exhausted"] = True
                return False
            payload = encode_event(chunk[0]) if len(chunk) == 1 else encode_batch(chunk)
            state["pending"] = (payload, len(chunk))
        payload, n = state["pending"]
        i = state["next"]
        ch = self.channel(self.channel_name, i)
        frames = outgoing(ch, MsgType.EVENTS, None, payload)
        if frames is not None and not send_when_ready(self, ch, frames):
            return False  # stopped while no peer took it: kept for the next RUN
        state["pending"] = None
        state["next"] = (i + 1) % len(state["messages"])
        state["messages"][i] += 1
        state["events"][i] += n
        return True

    def _stream_state(self, start: bool = True) -> dict[str, Any]:
        """The stream's counters; ``start``: with the iterator over ``events()`` (a
        device told to leave before it ever ran ends its stream without one)."""
        state = self._stream
        if state is None:
            if self.batch < 1:
                raise ConfigurationError(
                    f"device {self.id!r}: batch must be >= 1, got {self.batch}"
                )
            subs = len(self.channel_list(self.channel_name))
            state = {
                "iter": None, "pending": None, "next": 0, "exhausted": False,
                "ended": False, "messages": [0] * subs, "events": [0] * subs, "acked": 0,
            }  # fmt: skip
            self._stream = state
        if start and state["iter"] is None and not state["ended"]:
            state["iter"] = iter(self.events())
        return state

    def post_run(self) -> None:
        # the loop ended by itself (events exhausted, max_iterations) or the device is
        # leaving: the stream ends; a STOP from outside only pauses it. After an error
        # no END: the consumers must not take a cut stream for a whole one
        if self.state is State.ERROR:
            return
        if not self._loop_stop or self.shutdown_requested:
            self.end_stream()

    def reset_task(self) -> None:
        self.end_stream()  # stopped, then told to leave: END was not sent yet

    def end_stream(self) -> None:
        """Send END (once) on every sub-channel and wait for the ACKs; close events()."""
        state = self._stream_state(start=False)
        if state["ended"]:
            return
        state["ended"] = True
        it: Iterator[Any] | None = state["iter"]
        close = getattr(it, "close", None)
        if close is not None:
            close()  # the generator's finally: files closed now, not at exit
        headers = [{"events": n} for n in state["events"]]
        sent, state["acked"] = end_and_wait(
            self, self.channel_name, state["messages"], self.ack_timeout_s, headers=headers
        )
        log.info("%s: sent %d events in %d messages, %d of %d END acknowledged", self.id,
                 self.events_sent, sum(state["messages"]), state["acked"], sent)  # fmt: skip

    @property
    def events_sent(self) -> int:
        state = self._stream
        return sum(state["events"]) if state else 0

    def summary(self) -> dict[str, Any]:
        out = self.metrics()
        state = self._stream or {}
        out["source"] = {
            "events": self.events_sent,
            "messages": sum(state.get("messages", [])),
            "acked": state.get("acked", 0),
            "exhausted": state.get("exhausted", False),
        }
        return out

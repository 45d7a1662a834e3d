"""``sink``: counts and measures EVENTS messages; checks the counts announced by END.

With ``read_payload`` (the default) it reads every byte of every payload frame (an
xor of its 64-bit words, ``checksum`` in the summary), so that ``gb_per_s`` is bytes
received *and read* per second, comparable with figures of a consumer that uses the
data (FairMQ's shmem figure is "payload written and read"). With ``--read-payload
false`` nothing is read (on a shm channel the bytes are then never touched) and the
rate is reported as ``received_gb_per_s``: what arrived, not what was read.

The sink stops after one END per input (``inputs``, default one per sub-channel of its
data channel). If every END arrived and the counts differ, post_run raises so the
device ends in ERROR: data loss is never silent.

Its figures (``elapsed_s``, ``msg_per_s``, ``gb_per_s``, ``cpu_s``) run from the first
data message to the end of the stream: the END that closed it, or, where none does (a
raw channel, FairMQ's wire, which has no END; a stop before the END), the last data
message on a raw channel (CPU: to the stop), else the stop. A raw stream ends by
``--max-iterations`` or a STOP, and its end report is the same either way.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from evflow.errors import IncompleteStreamError
from evflow.params import Param
from evflow.runtime.device import Device, Origin
from evflow.runtime.devices.stream import EndTracker, acknowledge, count_mismatch
from evflow.wire.messages import Message, MsgType

log = logging.getLogger("evflow.device")


class Sink(EndTracker, Device):
    description = "counts and measures messages; checks the counts announced by END"

    channel_name = Param(str, "data", "input channel")
    inputs = Param(int, 0, "END messages to wait for (0 = one per sub-channel)")
    senders = Param(str, "", "ids whose END counts, comma-separated (empty: any sender)")
    read_payload = Param(bool, True, "read every payload byte (gb_per_s: bytes read per s)")
    refused_timeout_s = Param(
        float,
        10.0,
        "with --max-iterations: after a refused message, end in ERROR when nothing more "
        "arrives for this long (refused messages never count; 0 = wait)",
    )

    def init_task(self) -> None:
        record = self._open_record(1)  # [messages received]
        self.received = record.counts[0]
        self.payload_bytes = 0
        self.ends = self._ends_taken()
        self.other = 0
        self.checksum = 0
        self._t_first = 0.0
        self._t_last = 0.0
        self._cpu_first = 0.0
        self._cpu_last = 0.0
        self._needed = self.inputs or len(self.channel_list(self.channel_name))
        self._needed -= len(self.lost_peers)
        self._raw = any(ch.raw for ch in self.channel_list(self.channel_name))
        self._read = bool(self.read_payload)  # (a parameter read is a descriptor call)
        # shm: payloads counted in place, the region's chunk released with the message
        self.on_data(self.channel_name, self._handle, views=True, batch=self._handle_batch)

    def _handle_batch(self, msgs: list[Message], origin: Origin) -> bool:
        """A batch: its data counted in one loop, anything else one by one."""
        if self._read:
            return all(self._handle(msg, origin) for msg in msgs)  # (stops at a False)
        events = MsgType.EVENTS
        n = nbytes = 0
        for msg in msgs:
            if msg.type is events:
                n += 1
                for frame in msg.payload:
                    nbytes += len(frame)
                continue
            if n:
                self._count_data(n, nbytes)
                n = nbytes = 0
            if not self._handle(msg, origin):
                return False  # (nothing is counted after the last END)
        if n:
            self._count_data(n, nbytes)
        return True

    def _count_data(self, n: int, nbytes: int) -> None:
        if not self.received:
            self._t_first = time.monotonic()
            self._cpu_first = time.process_time()
        self.received += n
        self.record.counts[0] = self.received  # a SIGKILL loses no count
        self.payload_bytes += nbytes

    def _handle(self, msg: Message, origin: Origin) -> bool:
        if msg.type is MsgType.EVENTS:
            self._count_data(1, sum(map(len, msg.payload)))
            if self._read:
                for frame in msg.payload:
                    self.checksum ^= read_all(frame)
            if origin.channel.raw:  # no END will come: this one may be the last
                self._t_last = time.monotonic()
            return True
        if msg.type is MsgType.END:
            counts = self._track_end(msg, origin)
            if counts is None:
                return True
            self._t_last = time.monotonic()
            self._cpu_last = time.process_time()
            if counts:
                self.ends += 1
            acknowledge(self, msg, origin, count=self.received)
            return self.ends < self._needed
        self.other += 1
        return True

    def post_run(self) -> None:
        if self._t_first and not self._cpu_last:  # no END closed the stream
            self._cpu_last = time.process_time()
            if not self._t_last:
                self._t_last = time.monotonic()
        fig = self._figures()
        gb_per_s = fig["payload_bytes"] / fig["elapsed_s"] / 1e9 if fig["elapsed_s"] else 0.0
        rate = (
            f"in {fig['elapsed_s']:.3f} s ({fig['msg_per_s']:.0f} msg/s, {gb_per_s:.3g} GB/s, "
            f"CPU {fig['cpu_s']:.3f} s)"
        )
        if self._raw:
            log.info("%s: received %d messages, %d B %s; raw framing, no END: %s", self.id,
                     self.received, self.payload_bytes, rate, self._ended_by())  # fmt: skip
        else:
            log.info(
                "%s: received %d of %d announced messages, %d B %s, %d of %d END",
                self.id,
                self.received,
                self.announced,
                self.payload_bytes,
                rate,
                self.ends,
                self._needed,
            )
        self.check_unended("sink")
        if self.lost_peers:
            log.warning(
                "%s: counts not checked: peer(s) %s were lost before their END",
                self.id,
                ", ".join(sorted(self.lost_peers)),
            )
        elif self.ends >= self._needed and self.received != self.announced:
            raise IncompleteStreamError(
                count_mismatch("sink", self.id, self.received, self.announced, self.record)
            )

    def _ended_by(self) -> str:
        if self.max_iterations and self.iterations >= self.max_iterations:
            return f"ended after --max-iterations {self.max_iterations}"
        if self.error is not None:
            return "ended by an error"
        return "ended by a stop"

    def _figures(self) -> dict[str, Any]:
        received = getattr(self, "received", 0)
        elapsed = max(getattr(self, "_t_last", 0.0) - getattr(self, "_t_first", 0.0), 0.0)
        return {
            "received": received,
            "payload_bytes": getattr(self, "payload_bytes", 0),
            "elapsed_s": elapsed,
            "cpu_s": max(getattr(self, "_cpu_last", 0.0) - getattr(self, "_cpu_first", 0.0), 0.0),
            "msg_per_s": received / elapsed if elapsed else 0.0,
        }

    def summary(self) -> dict[str, Any]:
        out = self.metrics()
        fig = self._figures()
        elapsed, nbytes = fig["elapsed_s"], fig["payload_bytes"]
        out["sink"] = {
            "received": fig["received"],
            "announced": getattr(self, "announced", 0),
            "ends": getattr(self, "ends", 0),
            "lost_peers": sorted(self.lost_peers),
            "other": getattr(self, "other", 0),
            "payload_bytes": nbytes,
            "elapsed_s": elapsed,
            "cpu_s": fig["cpu_s"],
            "msg_per_s": fig["msg_per_s"],
            "payload_read": self.read_payload,
            "checksum": getattr(self, "checksum", 0),
        }
        rate = "gb_per_s" if self.read_payload else "received_gb_per_s"
        out["sink"][rate] = nbytes / elapsed / 1e9 if elapsed else 0.0
        return out


def read_all(frame: object) -> int:
    """Every byte of ``frame`` read: the xor of its 64-bit words (and its last bytes)."""
    try:  # bytes, memoryview, zmq.Frame, a contiguous array: its bytes without a copy
        data = np.frombuffer(frame, np.uint8)  # type: ignore[call-overload]
    except (TypeError, ValueError):  # an array that is not one contiguous buffer
        data = np.ascontiguousarray(frame).reshape(-1).view(np.uint8)
    n = len(data) - len(data) % 8
    out = int(np.bitwise_xor.reduce(data[:n].view(np.uint64))) if n else 0
    for b in data[n:].tolist():
        out ^= b
    return out

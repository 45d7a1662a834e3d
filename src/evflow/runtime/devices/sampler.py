"""``sampler``: sends messages of ``msg_size`` bytes (N = ``--max-iterations``, at
``--rate`` Hz when set), then END with the count, and waits for its ACK.

``--batch B``: each iteration sends B messages; on a ``transport=shm`` channel in one
ZeroMQ message (``send_many``), elsewhere one after the other.

With several sub-channels (a topology channel with ``peers = "all"`` has one per peer)
the iterations go round robin over them, and each gets END with its own count."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import zmq

from evflow.params import Param
from evflow.runtime.device import Device
from evflow.runtime.devices._streamrecord import StreamRecord
from evflow.runtime.devices.stream import end_and_wait
from evflow.runtime.framing import outgoing
from evflow.runtime.loops import send_when_ready
from evflow.transport.channel import COPY_THRESHOLD_BYTES, DEFAULT_BATCH_US
from evflow.transport.shm_channel import ShmChannel
from evflow.wire.messages import MsgType

log = logging.getLogger("evflow.device")

_NOBLOCK = int(zmq.NOBLOCK)


class Sampler(Device):
    description = "sends N messages of S bytes at rate R, then END with the count"
    default_batch_us = DEFAULT_BATCH_US

    msg_size = Param(int, 1000, "payload bytes per message")
    channel_name = Param(str, "data", "output channel")
    ack_timeout_s = Param(
        float, 10.0, "how long to wait for the END acknowledgement once its receiver left (s)"
    )
    zero_copy = Param(
        bool, False, "write each message into a new buffer from channel.new_message (shm: in place)"
    )
    batch = Param(int, 1, "messages per iteration (shm: in one ZeroMQ message, send_many)")

    _record: StreamRecord

    def init_task(self) -> None:
        if self.msg_size < 0:
            raise ValueError(f"msg_size must be >= 0, got {self.msg_size}")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        # random bytes: nothing on the way can compress them. A large payload is one
        # zmq.Frame sent again and again: libzmq shares its buffer by reference count,
        # so there is neither a copy nor pyzmq's per-send zero-copy bookkeeping
        payload: Any = os.urandom(self.msg_size)
        if self.msg_size >= COPY_THRESHOLD_BYTES:
            payload = zmq.Frame(payload)
        self._outs = self.channel_list(self.channel_name)
        # raw framing: the payload alone, as a FairMQ sampler sends it
        self._frames = []
        for ch in self._outs:
            frames = outgoing(ch, MsgType.EVENTS, None, (payload,))
            assert frames is not None  # (EVENTS with a payload always has frames)
            self._frames.append(frames)
        self._payload = memoryview(payload)
        # [messages sent on sub-channel 0, 1, ...]: a restarted sampler goes on from its
        # dead process's counts
        directory = getattr(self, "stream_dir", None)
        if hasattr(self, "_record"):  # a new task of this process, not a restart
            self._record.reset()
        else:
            self._record = StreamRecord(
                Path(directory) if directory else None, self.id, len(self._outs)
            )
        self._sent = [self._record.counts[i] for i in range(len(self._outs))]
        self._next = sum(self._sent) // self.batch % len(self._outs)
        self._total = self.max_iterations * self.batch
        self._sent_total = sum(self._sent)
        # read once: a parameter read per message is a descriptor call per message
        self._per_run = int(self.batch)
        self._zero_copy = bool(self.zero_copy)
        self._as_batch = [self._per_run > 1 and isinstance(ch, ShmChannel) for ch in self._outs]
        self._plain = self._per_run == 1 and not self._zero_copy
        self._n_outs = len(self._outs)
        # unpaced, a batching channel gets a batch's worth of messages per iteration
        # (one loop turn for many messages); paced, one message per period as asked
        self._burst = [
            min(max(ch.batch_bytes // max(self.msg_size, 1), 1), 1024) - 1
            if ch.batch_us and not self.rate_hz and len(self._outs) == 1
            else 0
            for ch in self._outs
        ]
        self.acked = 0

    @property
    def sent(self) -> int:
        """Messages sent (on all sub-channels)."""
        return getattr(self, "_sent_total", 0)

    def pre_run(self) -> None:
        self._t0 = time.monotonic()
        self._cpu0 = time.process_time()

    def _send_burst(self, out: Any, frames: list[Any], most: int) -> int:
        """Send up to ``most`` more copies of ``frames`` while ``out`` takes them at once
        (a batching channel holds them); how many went."""
        most = min(most, self._total - self._sent_total - 1) if self._total else most
        if most <= 0:
            return 0
        try:
            out.send_many([frames] * most, _NOBLOCK)  # held all at once, or none
        except zmq.Again:
            return 0
        return most

    def _message(self, i: int) -> list[Any]:
        if not self._zero_copy:
            return self._frames[i]
        # a new buffer per message, filled in place, sent without a copy
        out = self._outs[i]
        msg = out.new_message(self.msg_size, wait_s=self.ack_timeout_s)
        msg.data[:] = self._payload
        frames = outgoing(out, MsgType.EVENTS, None, (msg,))
        assert frames is not None
        return frames

    def _count(self, i: int, n: int) -> None:
        self._sent[i] += n
        self._sent_total += n
        self._record.counts[i] = self._sent[i]

    def conditional_run(self) -> bool:
        if self._total and self._sent_total >= self._total:
            return False  # a restart after its dead process had sent them all
        i = self._next
        out = self._outs[i]
        if self._plain:  # one prepared message per iteration: the common case, inline
            frames = self._frames[i]
            n = 1
            try:
                out.send(frames, _NOBLOCK)
            except zmq.Again:  # (no room: wait for it, not past a stop)
                if not send_when_ready(self, out, frames):
                    return False
            else:
                if self._burst[i]:  # a batching channel takes a burst in one call
                    n += self._send_burst(out, frames, self._burst[i])
            self._count(i, n)
            self.iterations += n - 1  # (one iteration per message, as without bursts)
            if self._n_outs > 1:
                self._next = (i + 1) % self._n_outs
            return True
        # waits for a peer, but not past a stop request (a sink that never came)
        if self._as_batch[i]:
            batch = [self._message(i) for _ in range(self._per_run)]
            if not send_when_ready(self, out, batch, many=True):
                return False
            self._count(i, len(batch))
        else:
            for _ in range(self._per_run):
                if not send_when_ready(self, out, self._message(i)):
                    return False
                self._count(i, 1)
        self._next = (i + 1) % len(self._outs)
        return True

    def post_run(self) -> None:
        self.elapsed_s = time.monotonic() - self._t0
        self.cpu_s = time.process_time() - self._cpu0  # all threads, libzmq's I/O thread too
        _, self.acked = end_and_wait(self, self.channel_name, self._sent, self.ack_timeout_s)
        log.info(
            "%s: sent %d messages of %d B in %.3f s",
            self.id,
            self.sent,
            self.msg_size,
            self.elapsed_s,
        )

    def summary(self) -> dict[str, Any]:
        out = self.metrics()
        out["sampler"] = {
            "sent": getattr(self, "sent", 0),
            "acked": getattr(self, "acked", 0),
            "msg_size": self.msg_size,
            "elapsed_s": getattr(self, "elapsed_s", 0.0),
            "cpu_s": getattr(self, "cpu_s", 0.0),
        }
        return out

"""The RUNNING loops of a :class:`~evflow.runtime.device.Device`.

One of them runs while a device is RUNNING: ``conditional_loop`` (the device overrides
``conditional_run``), ``data_loop`` (``on_data`` handlers: poll, drain, decode and
dispatch messages, answering REP requests the handler left unanswered) or ``idle_loop``.
Each keeps the device's timers going (``_tick``) and ends when the device's loop-stop
flag is set, when a hook or handler returns False, or after ``max_iterations``. They are
the device's own code, moved here to keep the state-machine driver short, and so read
its private flags.

Channels that batch (``Channel.batch_us``) hold small data messages back; the loops
flush them (``flush_channels``) before they block or sleep, and when they end, so a
message waits for company only while the device is busy.

Refused messages (malformed, or FairMQ's bare frames on a channel without
``framing=raw``) are counted as bad messages and never count towards
``max_iterations``. So that a count they can never reach does not leave a device
waiting for ever, ``data_loop`` with ``max_iterations`` ends in ERROR (one line, an
:class:`~evflow.errors.IncompleteStreamError`) once the last message that arrived was
refused and nothing more arrived for the device's ``refused_timeout_s`` (a parameter
of the built-in sink and forwarders; ``REFUSED_TIMEOUT_S`` for other devices; 0 waits
for ever). A STOP (or SIGINT) ends it any time, as always.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from evflow.errors import IncompleteStreamError
from evflow.runtime.framing import decoder, looks_raw, raw_hint
from evflow.transport.channel import Channel
from evflow.wire.messages import (
    BadMessageCounter,
    Message,
    MsgType,
    decode_fast,
    encode_message,
)

#: zmq.NOBLOCK as a plain int (pyzmq's flag enums cost a conversion per use)
_NOBLOCK = int(zmq.NOBLOCK)
#: how long the loops block before looking at flags and timers (ms)
POLL_INTERVAL_MS = 100
#: ... and while a batch is held that its peer could not take yet (ms)
HELD_RETRY_MS = 5
#: messages taken from one socket before the others get a turn
DRAIN_BATCH = 256
#: with max_iterations: how long a device whose last message was refused waits for
#: another one before it gives up on its count (s; the built-in devices' parameter
#: ``refused_timeout_s`` overrides it)
REFUSED_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a message came from: the channel and, on ROUTER channels, the peer identity."""

    channel: Channel
    peer: bytes | None = None


Handler = Callable[[Message, Origin], "bool | None"]
#: takes the messages of one received batch at once (``Device.on_data(batch=...)``)
BatchHandler = Callable[[list[Message], Origin], "bool | None"]


class Device(Protocol):
    """What the loops use of a :class:`~evflow.runtime.device.Device` (a Protocol, so
    that this module does not import the device module that imports it)."""

    _handlers: dict[str, Handler]
    _batch_handlers: dict[str, BatchHandler]
    _views: set[str]
    _loop_stop: bool
    iterations: int
    max_iterations: int
    rate_hz: float
    bad_messages: dict[str, BadMessageCounter]

    def channel_list(self, name: str) -> list[Channel]: ...
    def all_channels(self) -> list[Channel]: ...
    def flush_channels(self) -> bool: ...
    def conditional_run(self) -> bool: ...
    def _tick(self, now_s: float | None = None) -> None: ...


def conditional_loop(dev: Device) -> None:
    """Call ``conditional_run`` until it returns False, at ``rate_hz`` when set."""
    period_s = 1.0 / dev.rate_hz if dev.rate_hz else 0.0
    limit = dev.max_iterations
    next_s = time.monotonic()
    run = dev.conditional_run
    batching = any(ch.batch_us for ch in dev.all_channels())
    while not dev._loop_stop:
        if not run():
            break
        dev.iterations += 1
        if limit and dev.iterations >= limit:
            break
        if period_s:
            next_s += period_s
            if batching:
                dev.flush_channels()
            _sleep_until(dev, next_s)
        else:
            dev._tick()
    if batching:
        dev.flush_channels()


def send_when_ready(
    dev: Device,
    ch: Channel,
    frames: Sequence[Any],
    timeout_s: float | None = None,
    *,
    many: bool = False,
) -> bool:
    """Send one message on ``ch``, waiting while no peer can take it (none connected
    yet, or its queue is at the high-water mark) with the timers going; False, and
    nothing sent, when a stop is requested (``timeout_s`` None) or after ``timeout_s``.

    ``many``: ``frames`` is a list of messages, sent with ``ch.send_many`` (which must
    be all or none: a shm channel).

    A blocking send to a peer that never came would otherwise never return, and the
    device would ignore every stop request (a SIGINT only sets a flag).
    """
    send = ch.send_many if many else ch.send
    try:
        send(frames, _NOBLOCK)  # the common case: one call, no poll
        return True
    except zmq.Again:
        pass  # (libzmq takes a multipart message whole or not at all)
    deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if deadline_s is None:
            if dev._loop_stop:
                return False
            wait_ms = POLL_INTERVAL_MS
        else:
            wait_ms = min(POLL_INTERVAL_MS, int((deadline_s - time.monotonic()) * 1000))
            if wait_ms <= 0:
                return False
        dev._tick()
        if ch.socket.poll(wait_ms, zmq.POLLOUT):
            try:
                send(frames, _NOBLOCK)
                return True
            except zmq.Again:
                continue  # another sender took the room first


def _sleep_until(dev: Device, deadline_s: float) -> None:
    while not dev._loop_stop:
        now = time.monotonic()
        if now >= deadline_s:
            return
        dev._tick(now)
        time.sleep(min(deadline_s - now, POLL_INTERVAL_MS / 1000))


def idle_loop(dev: Device) -> None:
    """No hook and no handler: keep the timers going until asked to stop."""
    while not dev._loop_stop:
        dev._tick()
        time.sleep(POLL_INTERVAL_MS / 1000)


def data_loop(dev: Device) -> None:
    """Poll the channels that have ``on_data`` handlers and hand each message over."""
    poller = zmq.Poller()
    targets: dict[Any, tuple[Channel, Handler, BadMessageCounter, Origin, bool]] = {}
    limit = dev.max_iterations
    batched: dict[Any, BatchHandler] = {}  # sockets whose batches go to a batch handler
    for name, handler in dev._handlers.items():
        views = name in dev._views
        for ch in dev.channel_list(name):
            poller.register(ch.socket, zmq.POLLIN)
            targets[ch.socket] = (ch, handler, dev.bad_messages[ch.label], Origin(ch), views)
            on_batch = dev._batch_handlers.get(name)
            # (raw frames are data whatever they look like: never the fast decode)
            if on_batch and not limit and not ch.raw and ch.type in ("pull", "pair", "sub"):
                batched[ch.socket] = on_batch
    # raw channels: FairMQ's bare frames are the data; the others warn once about them
    decoders = {sock: decoder(t[0], t[2]) for sock, t in targets.items()}
    # refused messages never count towards the limit: give up after a quiet spell
    quiet_s = float(getattr(dev, "refused_timeout_s", REFUSED_TIMEOUT_S)) if limit else 0.0
    # a shm channel keeps the rest of a batch (send_many) after a recv: the socket has
    # nothing more to say about those messages, so they are looked for here
    sockets = list(targets)
    batching = any(ch.batch_us for ch in dev.all_channels())
    try:
        _drain(dev, poller, targets, decoders, batched, sockets, limit, quiet_s, batching)
    finally:
        if batching:
            dev.flush_channels()


def _drain(
    dev: Device,
    poller: zmq.Poller,
    targets: dict[Any, tuple[Channel, Handler, BadMessageCounter, Origin, bool]],
    decoders: dict[Any, Any],
    batched: dict[Any, BatchHandler],
    sockets: list[Any],
    limit: int,
    quiet_s: float,
    batching: bool,
) -> None:
    noblock = _NOBLOCK
    refused_at = 0.0  # when the last message arrived, if it was refused (else 0)
    refused_raw: Channel | None = None  # where it arrived, if it looked raw (FairMQ)
    while not dev._loop_stop:
        dev._tick()
        if refused_at and quiet_s > 0 and time.monotonic() - refused_at >= quiet_s:
            refused = sum(t[2].total for t in targets.values())
            raise IncompleteStreamError(
                f"{refused} message(s) refused and nothing more arrived for {quiet_s:g} s: "
                f"--max-iterations {limit} cannot be reached ({dev.iterations} counted; "
                "refused messages never count)"
                + (f"; {raw_hint(refused_raw)}" if refused_raw is not None else "")
            )
        waiting = [s for s in sockets if targets[s][0].pending]
        if waiting:
            ready = [s for s, _ in poller.poll(0)]
        elif batching and any(ch.held for ch in dev.all_channels()):
            # about to wait: what is held goes first, unless more input is here already
            ready = [s for s, _ in poller.poll(0)]
            if not ready:
                wait_ms = POLL_INTERVAL_MS if dev.flush_channels() else HELD_RETRY_MS
                ready = [s for s, _ in poller.poll(wait_ms)]
        else:
            ready = [s for s, _ in poller.poll(POLL_INTERVAL_MS)]
        ready += [s for s in waiting if s not in ready]
        for sock in ready:
            ch, handler, bad, origin, views = targets[sock]
            router, rep = ch.type == "router", ch.type == "rep"
            decode = decoders[sock]
            on_batch = batched.get(sock)
            if on_batch is not None:
                for _ in range(DRAIN_BATCH):
                    try:
                        got = ch.recv_many(noblock, views=views)
                    except zmq.Again:
                        break
                    # (refused ones are counted by the decoder; without max_iterations
                    # there is no count for them to stall)
                    msgs = []
                    for frames in got:
                        msg = decode_fast(frames) or decode(frames)
                        if msg is not None:
                            msgs.append(msg)
                    if not msgs:
                        continue
                    dev.iterations += len(msgs)
                    if on_batch(msgs, origin) is False:
                        dev._loop_stop = True
                        break
                if dev._loop_stop:
                    break
                continue
            for _ in range(DRAIN_BATCH):
                try:
                    frames = ch.recv(noblock, views=True) if views else ch.recv(noblock)
                except zmq.Again:
                    break
                if router:
                    if len(frames) < 2:
                        bad.record("short", "routed message without identity")
                        refused_at, refused_raw = time.monotonic(), None
                        continue
                    origin = Origin(ch, frames[0])
                    frames = frames[1:]
                msg = decode(frames)
                if msg is None:
                    if rep:  # REP must answer before it can receive again
                        ch.send(encode_message(MsgType.REPLY, {"error": "bad message"}))
                    refused_at = time.monotonic()
                    refused_raw = ch if looks_raw(frames) else None
                    continue
                refused_at = 0.0
                dev.iterations += 1
                if rep:
                    sent_before = ch.messages_out
                    result = handler(msg, origin)
                    if ch.messages_out == sent_before:
                        ch.send(encode_message(MsgType.ACK))  # the handler did not answer
                else:
                    result = handler(msg, origin)
                if result is False or (limit and dev.iterations >= limit):
                    dev._loop_stop = True
                    break
            if dev._loop_stop:
                break

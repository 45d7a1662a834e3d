"""The builder's inputs over ZeroMQ: senders (DEALER) -> one receiver (ROUTER), with credits.

Protocol, per sender: ``HELLO {"protocol", "source"}`` -> the receiver answers
``READY {"credit": c}``; each fragment batch (:mod:`evflow.hlt.fragments`) uses one
credit; the receiver gives a credit back (``READY {"credit": n}``) for each batch the
builder has taken entirely. A batch the builder could only partly take (memory limit)
stays with the receiver, and its credit with it, until room is made: that is the
back-pressure, and it reaches only the sources that run ahead. ``END {"count",
"from", "source"}`` ends a stream; the receiver answers ``ACK`` and the builder infers
that the events still missing this source will not get it.

The first credits go out once every expected source has said HELLO (or ``start_wait_s``
after the first HELLO): senders that start a little apart would otherwise make the
first events look incomplete (the early ones would time out waiting for the late).

A peer that ignores its credits gets at most ``overrun_limit`` batches queued; more
are dropped and counted (``overrun``), so nothing grows without bound.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from evflow.errors import PeerLostError, ProtocolError
from evflow.hlt.eventbuilder import EventBuilder
from evflow.hlt.fragments import FragmentBatch, decode_fragments, encode_fragments
from evflow.transport.channel import Channel, open_channel, parse_channel_config
from evflow.wire.messages import (
    PROTOCOL_VERSION,
    BadMessageCounter,
    MsgType,
    decode_message,
    encode_message,
)

__all__ = ["FragmentReceiver", "FragmentSender"]

log = logging.getLogger("evflow.hlt")


@dataclass
class _Peer:
    source: int
    identity: bytes
    pending: deque[FragmentBatch] = field(default_factory=deque)
    owed: int = 0  # credits to give back
    batches: int = 0
    ended: bool = False
    end_count: int | None = None


class FragmentReceiver:
    """The builder end: a ROUTER channel feeding an :class:`EventBuilder`.

    Call :meth:`pump` from a loop; it reads what is there (at most ``timeout_ms``
    waiting), feeds the builder, returns credits and runs the builder's time-outs.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        builder: EventBuilder,
        address: str,
        *,
        session: str = "default",
        credit: int = 16,
        overrun_limit: int = 64,
        rcv_hwm: int = 10_000,
        start_wait_s: float = 10.0,
        bad: BadMessageCounter | None = None,
        channel: Channel | None = None,
    ) -> None:
        self.builder = builder
        if channel is None:
            (cfg,) = parse_channel_config(
                f"name=fragments,type=router,method=bind,address={address},rcvBufSize={rcv_hwm}"
            )
            channel = open_channel(context, cfg, session)
            self._own = True
        else:
            self._own = False
        self.channel = channel
        self.credit = credit
        self.overrun_limit = overrun_limit
        self.start_wait_s = start_wait_s
        self._first_hello: float | None = None
        self.started = False
        self.bad = bad or BadMessageCounter("event builder/fragments", log)
        self.peers: dict[bytes, _Peer] = {}
        self.by_source: dict[int, _Peer] = {}
        self.overrun = 0
        self.refused = 0  # batches from a peer without HELLO, or naming another source
        self.poll_interval_s = 0.01  # time-outs and inference: O(ring) numpy work
        self._next_poll = 0.0

    @property
    def endpoints(self) -> list[str]:
        return self.channel.endpoints

    def all_ended(self) -> bool:
        srcs = self.builder.sources
        return all(s in self.by_source and self.by_source[s].ended for s in srcs)

    def pending(self) -> int:
        return sum(len(p.pending) for p in self.peers.values())

    def pump(self, timeout_ms: int = 5, max_messages: int = 4096) -> int:
        """Read and build for at most ``timeout_ms``; return the messages read."""
        ch = self.channel
        got = 0
        if ch.poll(timeout_ms):
            while got < max_messages and ch.readable():
                try:
                    frames = ch.recv(zmq.NOBLOCK)
                except zmq.Again:  # (a shm channel may have dropped a bad marker)
                    break
                got += 1
                self._handle(frames)
        self._retry()
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + self.poll_interval_s
            self.builder.poll()  # on the builder's own clock
        self._give_credits()
        return got

    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self.bad.record("short", "routed message without identity")
            return
        identity = bytes(frames[0])
        msg = self.bad.decode(frames[1:])
        if msg is None:
            return
        peer = self.peers.get(identity)
        if msg.type is MsgType.EVENTS:
            if peer is None:
                self.refused += 1
                return
            try:
                batch = decode_fragments(msg)
            except ProtocolError as exc:
                self.bad.record("fragments", str(exc))
                peer.owed += 1
                return
            if batch.source != peer.source:
                self.refused += 1
                peer.owed += 1
                return
            peer.batches += 1
            if peer.pending:
                if len(peer.pending) >= self.overrun_limit:
                    self.overrun += 1
                    return
                peer.pending.append(batch)
                return
            self._feed(peer, batch)
        elif msg.type is MsgType.HELLO:
            source = msg.header.get("source")
            if msg.header.get("protocol") != PROTOCOL_VERSION or type(source) is not int:
                self.bad.record("hello", f"bad HELLO {msg.header!r}")
                return
            if source not in self.builder._index:
                log.warning("event builder: HELLO from unknown source %s refused", source)
                self.refused += 1
                return
            peer = _Peer(source, identity)
            old = self.by_source.get(source)
            if old is not None:  # a restarted sender: its old peer is gone
                self.peers.pop(old.identity, None)
            self.peers[identity] = peer
            self.by_source[source] = peer
            peer.owed = self.credit
            if self._first_hello is None:
                self._first_hello = time.monotonic()
        elif msg.type is MsgType.END:
            if peer is None:
                self.refused += 1
                return
            peer.ended = True
            count = msg.header.get("count")
            peer.end_count = count if type(count) is int else None
            if not peer.pending:
                self.builder.end_source(peer.source)
            ch = self.channel
            ch.send([identity, *encode_message(MsgType.ACK, {"to": msg.header.get("from", "")})])
        else:
            self.bad.record("unexpected", f"unexpected {msg.type.name} on the fragment input")

    def _feed(self, peer: _Peer, batch: FragmentBatch) -> bool:
        n = self.builder.add(batch)
        if n < len(batch):
            peer.pending.appendleft(batch.tail(n))
            return False
        peer.owed += 1
        return True

    def _retry(self) -> None:
        for peer in self.peers.values():
            while peer.pending:
                batch = peer.pending.popleft()
                if not self._feed(peer, batch):
                    break
            if peer.ended and not peer.pending:
                self.builder.end_source(peer.source)

    def _give_credits(self) -> None:
        if not self.started:
            if self._first_hello is None:
                return
            waited = time.monotonic() - self._first_hello
            if len(self.by_source) < len(self.builder.sources) and waited < self.start_wait_s:
                return
            self.started = True
        send = self.channel.send
        # credits go back in chunks of half the window: the sender still holds at
        # least the other half, so it never waits, and we send far fewer READYs
        least = max(1, self.credit // 2)
        for peer in self.peers.values():
            if peer.owed >= least and not peer.ended:
                send([peer.identity, *encode_message(MsgType.READY, {"credit": peer.owed})])
                peer.owed = 0

    def metrics(self) -> dict[str, Any]:
        out = self.builder.metrics()
        out.update(
            overrun=self.overrun,
            refused=self.refused,
            bad_messages=self.bad.total,
            pending_batches=self.pending(),
            senders=len(self.peers),
        )
        return out

    def close(self, linger_ms: int | None = 0) -> None:
        if self._own:
            self.channel.close(linger_ms)


class FragmentSender:
    """One source's end: a DEALER that sends fragment batches within its credits."""

    def __init__(
        self,
        context: zmq.Context[Any],
        address: str,
        source: int,
        *,
        session: str = "default",
        name: str = "",
    ) -> None:
        (cfg,) = parse_channel_config(
            f"name=fragments-{source},type=dealer,method=connect,address={address}"
        )
        self.channel = open_channel(context, cfg, session)
        self.source = source
        self.name = name or f"source-{source}"
        self.credit = 0
        self.sent = 0
        self.channel.send(
            encode_message(MsgType.HELLO, {"protocol": PROTOCOL_VERSION, "source": source})
        )

    def _read(self, timeout_ms: int) -> None:
        ch = self.channel
        if not ch.poll(timeout_ms):
            return
        while True:
            try:
                frames = ch.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_message(frames)
            except ProtocolError:
                continue  # a bad answer is ignored; the credit it meant comes again or not
            if msg.type is MsgType.READY:
                credit = msg.header.get("credit")
                if type(credit) is int and credit > 0:
                    self.credit += credit

    def wait_credit(self, deadline_s: float, stop: Callable[[], bool] | None = None) -> bool:
        """Wait until a credit is there (or the deadline passes); True if there is one.

        Credits are read from the socket only when none is left (READYs wait there
        meanwhile): a send with credit costs no poll."""
        while self.credit <= 0:
            left_ms = int((deadline_s - time.monotonic()) * 1000)
            if stop is not None and stop():
                return False
            self._read(min(max(left_ms, 0), 50))
            if left_ms <= 0:
                return self.credit > 0
        return True

    def send_batch(self, ids: Any, fragments: Any, timeout_s: float = 30.0) -> None:
        """Send one batch (see :func:`encode_fragments`), waiting for a credit first."""
        if not self.wait_credit(time.monotonic() + timeout_s):
            raise PeerLostError(
                f"{self.name}: no credit from the event builder within {timeout_s:.0f} s"
            )
        self.channel.send(encode_fragments(self.source, ids, fragments))
        self.credit -= 1
        self.sent += 1

    def send_end(self) -> None:
        """Send END with the count of batches sent (then :meth:`wait_ack`)."""
        self.channel.send(
            encode_message(
                MsgType.END, {"count": self.sent, "from": self.name, "source": self.source}
            )
        )

    def wait_ack(self, deadline_s: float, waiting: Callable[[], object] | None = None) -> bool:
        """Wait for the ACK of our END until ``deadline_s``; False if it did not come."""
        ch = self.channel
        while True:
            if waiting is not None:
                waiting()
            left_ms = int((deadline_s - time.monotonic()) * 1000)
            if left_ms <= 0:
                return False
            if not ch.poll(min(left_ms, 10 if waiting else 100)):
                continue
            frames = ch.recv()
            if frames and frames[0] == bytes([MsgType.ACK]):
                return True

    def end(self, timeout_s: float = 10.0, waiting: Callable[[], object] | None = None) -> bool:
        """Send END with the count and wait for the ACK; False if it did not come.

        ``waiting`` is called while waiting (a test that runs both ends in one thread).
        """
        self.send_end()
        return self.wait_ack(time.monotonic() + timeout_s, waiting)

    def close(self, linger_ms: int | None = 0) -> None:
        self.channel.close(linger_ms)

"""The builder's inputs over ZeroMQ: senders (DEALER) -> one receiver (ROUTER), with credits.

Protocol, per sender: ``HELLO {"protocol", "source"}`` -> the receiver answers
``READY {"credit": 0, "epoch", "done"}`` at once and ``READY {"credit": c, ...}`` when
it starts; each fragment batch (:mod:`evflow.hlt.fragments`) uses one credit; the
receiver gives a credit back (``READY {"credit": n, ...}``) for each batch the
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

Restarts (a builder SIGKILLed and started again, ``restart = "on-failure"``):

- every READY and ACK names the receiver's ``epoch`` (a token of this receiver and of
  this sender's HELLO) and ``done``: every event id below it has left construction
  (built and taken, or refused). A sender keeps each batch it sent until ``done``
  passes its ids (or its END is acknowledged);
- a sender that heard nothing from the builder for ``HELLO_RESEND_S`` while it waits
  (for a credit, or for its ACK) says HELLO again; the same receiver answers with
  the same epoch (nothing else changes), a new one (a restarted builder) with another:
  the sender then drops its old credits, sends again every batch it kept, then its
  END if it had sent one. The new process knows (``resume``) what its predecessor
  built and refuses those fragments as late, so no event is built twice;
- with ``ack_when_built`` (the device) END is acknowledged only once every id the
  stream sent is ``done``, and the ENDs acknowledged are handed to ``on_end`` (the
  device keeps them): a restarted builder does not wait for streams that ended.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from evflow.errors import PeerLostError, ProtocolError
from evflow.hlt.eventbuilder import EventBuilder
from evflow.hlt.fragments import FragmentBatch, decode_fragments, encode_fragments
from evflow.transport.channel import Channel, parse_channel_config
from evflow.transport.opening import open_channel
from evflow.wire.messages import (
    PROTOCOL_VERSION,
    BadMessageCounter,
    MsgType,
    decode_message,
    encode_message,
)

__all__ = ["HELLO_RESEND_S", "FragmentReceiver", "FragmentSender", "wait_acked"]

log = logging.getLogger("evflow.hlt")

#: a sender waiting for the builder (a credit, its ACK) that heard nothing from it this
#: long says HELLO again: a restarted builder knows nobody, and answers with a new epoch
HELLO_RESEND_S = 1.0
#: batches a sender keeps for a restarted builder at most (the builder's ``done``
#: normally keeps it to the events in construction); older ones are let go, counted
MAX_RETAINED = 1 << 16
#: longest epoch a sender takes from a READY or ACK (a receiver's is 12 + a few chars)
MAX_EPOCH_LEN = 64
_MAX_ID = (1 << 63) - 1


@dataclass
class _Peer:
    source: int
    identity: bytes
    epoch: str
    pending: deque[FragmentBatch] = field(default_factory=deque)
    owed: int = 0  # credits to give back
    batches: int = 0
    ended: bool = False
    end_count: int | None = None
    end_from: str = ""  # who to name in the ACK
    acked: bool = False
    last_id: int = -1  # the highest event id it sent (unordered sources only)


class FragmentReceiver:
    """The builder end: a ROUTER channel feeding an :class:`EventBuilder`.

    Call :meth:`pump` from a loop; it reads what is there (at most ``timeout_ms``
    waiting), feeds the builder, returns credits and runs the builder's time-outs.

    ``ack_when_built``: END is acknowledged once every event id its stream sent has
    left construction (see the module docstring), not at once; ``on_end(source,
    count)`` is called just before an ACK goes (first time per stream), ``resume``
    sets up a restarted receiver from what its predecessor kept.
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
        ack_when_built: bool = False,
        on_end: Callable[[int, int], None] | None = None,
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
        self.ack_when_built = ack_when_built
        self.on_end = on_end
        self._first_hello: float | None = None
        self.started = False
        self.bad = bad or BadMessageCounter("event builder/fragments", log)
        self.peers: dict[bytes, _Peer] = {}
        self.by_source: dict[int, _Peer] = {}
        #: sources whose END a dead predecessor acknowledged (see resume), and those of
        #: them whose sender said HELLO to us since (and got its ACK again)
        self.ended_before: set[int] = set()
        self.reacked: set[int] = set()
        self.resumed = False
        self.overrun = 0
        self.refused = 0  # batches from a peer without HELLO, or naming another source
        self.poll_interval_s = 0.01  # time-outs and inference: O(ring) numpy work
        self._next_poll = 0.0
        self._token = secrets.token_hex(6)  # this receiver's part of every epoch
        self._ordered = builder.config.ordered
        self._hellos = 0  # peers made: the other part

    @property
    def endpoints(self) -> list[str]:
        return self.channel.endpoints

    def resume(self, ended: Iterable[int], base: int, built: Any) -> None:
        """Go on from a dead predecessor: the streams ``ended`` were acknowledged (no
        END comes again), events below ``base`` and ``built`` left (see
        :meth:`EventBuilder.resume`). Before the first :meth:`pump`."""
        self.resumed = True
        self.builder.resume(base, built)
        for source in ended:
            if source in self.builder._index:
                self.ended_before.add(source)
                self.builder.end_source(source)

    def all_ended(self) -> bool:
        srcs = self.builder.sources
        by = self.by_source
        return all(s in self.ended_before or (s in by and by[s].ended) for s in srcs)

    def unanswered(self) -> set[int]:
        """Sources whose END our dead predecessor took but whose sender we have not
        heard: it may still wait for the ACK (the kill may have come before it went)."""
        return self.ended_before - self.reacked

    def pending(self) -> int:
        return sum(len(p.pending) for p in self.peers.values())

    def done_below(self) -> int:
        """Every event id below this has left construction and been taken from the
        builder (built, or refused): nothing below it is still to come out of here."""
        b = self.builder
        if b.base is None:
            return b._resume_base or 0
        low = b.top if not b.n_open else b.base
        for batch in b._out:  # built, not taken yet (ascending ids)
            if len(batch.ids):
                low = min(low, int(batch.ids[0]))
        for peer in self.peers.values():
            for pend in peer.pending:  # received, not in construction yet
                if len(pend.ids):
                    low = min(low, int(pend.ids.min()))
        return max(low, 0)

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
        if self.ack_when_built:
            self._ack_built()
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
            if not self._ordered and len(batch.ids):  # (ordered: the builder knows it)
                peer.last_id = max(peer.last_id, int(batch.ids.max()))
            if peer.pending:
                if len(peer.pending) >= self.overrun_limit:
                    self.overrun += 1
                    return
                peer.pending.append(batch)
                return
            self._feed(peer, batch)
        elif msg.type is MsgType.HELLO:
            self._hello(identity, peer, msg.header)
        elif msg.type is MsgType.END:
            if peer is None:
                self.refused += 1
                return
            if peer.ended:  # sent again: its ACK may be due already
                if peer.acked:
                    self._send_ack(peer)
                return
            peer.ended = True
            count = msg.header.get("count")
            peer.end_count = count if type(count) is int else None
            sender = msg.header.get("from", "")
            peer.end_from = sender if isinstance(sender, str) else ""
            if not peer.pending:
                self.builder.end_source(peer.source)
            if not self.ack_when_built:
                self._ack(peer)
        else:
            self.bad.record("unexpected", f"unexpected {msg.type.name} on the fragment input")

    def _hello(self, identity: bytes, peer: _Peer | None, header: dict[str, Any]) -> None:
        source = header.get("source")
        if header.get("protocol") != PROTOCOL_VERSION or type(source) is not int:
            self.bad.record("hello", f"bad HELLO {header!r}")
            return
        if source not in self.builder._index:
            log.warning("event builder: HELLO from unknown source %s refused", source)
            self.refused += 1
            return
        if peer is not None:  # said again (it waited): the same epoch, nothing changes
            if peer.source != source:
                self.bad.record("hello", f"HELLO for source {source} from source {peer.source}")
                return
        else:
            self._hellos += 1
            peer = _Peer(source, identity, f"{self._token}.{self._hellos}")
            old = self.by_source.get(source)
            if old is not None:  # a restarted sender: its old peer is gone
                self.peers.pop(old.identity, None)
            self.peers[identity] = peer
            self.by_source[source] = peer
            peer.owed = self.credit
            if self._first_hello is None:
                self._first_hello = time.monotonic()
        # at once, without credit: the sender learns whom it talks to (credits follow
        # when the builder starts)
        header = {"credit": 0, "epoch": peer.epoch, "done": self.done_below()}
        self.channel.send([identity, *encode_message(MsgType.READY, header)])
        if source in self.ended_before:
            # our predecessor took its END and built all of it, but died before its
            # ACK went (or reached the sender): answered here
            self.reacked.add(source)
            self._send_ack(peer)

    def _ack(self, peer: _Peer) -> None:
        if not peer.acked and self.on_end is not None:
            self.on_end(peer.source, peer.end_count or 0)  # kept before it is answered
        peer.acked = True
        self._send_ack(peer)

    def _send_ack(self, peer: _Peer) -> None:
        header = {"to": peer.end_from, "epoch": peer.epoch, "done": self.done_below()}
        self.channel.send([peer.identity, *encode_message(MsgType.ACK, header)])

    def _ack_built(self) -> None:
        """ACK the ENDs whose streams have left construction entirely."""
        done: int | None = None
        for peer in self.peers.values():
            if peer.ended and not peer.acked and not peer.pending:
                if done is None:
                    done = self.done_below()
                if self._last_id(peer) < done:
                    self._ack(peer)

    def _last_id(self, peer: _Peer) -> int:
        """The highest event id ``peer``'s source sent (ordered: as the builder saw it,
        ids refused as far left out)."""
        if not self._ordered:
            return peer.last_id
        b = self.builder
        return int(b._last[b._index[peer.source]])

    def ack_ended(self) -> None:
        """ACK every END not acknowledged yet (the builder has sent on everything)."""
        for peer in self.peers.values():
            if peer.ended and not peer.acked:
                self._ack(peer)

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
            heard = len(self.ended_before | set(self.by_source))
            if heard < len(self.builder.sources) and waited < self.start_wait_s:
                return
            self.started = True
        send = self.channel.send
        # credits go back in chunks of half the window: the sender still holds at
        # least the other half, so it never waits, and we send far fewer READYs
        least = max(1, self.credit // 2)
        done: int | None = None
        for peer in self.peers.values():
            if peer.owed >= least and not peer.ended:
                if done is None:
                    done = self.done_below()
                header = {"credit": peer.owed, "epoch": peer.epoch, "done": done}
                send([peer.identity, *encode_message(MsgType.READY, header)])
                peer.owed = 0

    def metrics(self) -> dict[str, Any]:
        out = self.builder.metrics()
        out.update(
            overrun=self.overrun,
            refused=self.refused,
            bad_messages=self.bad.total,
            pending_batches=self.pending(),
            senders=len(self.peers),
            resumed=self.resumed,
        )
        return out

    def close(self, linger_ms: int | None = 0) -> None:
        if self._own:
            self.channel.close(linger_ms)


class FragmentSender:
    """One source's end: a DEALER that sends fragment batches within its credits.

    It keeps what it sent until the builder says it is built (``done``), and sends it
    again to a restarted builder (module docstring). The buffers given to
    :meth:`send_batch` must therefore stay as they are until then."""

    def __init__(
        self,
        context: zmq.Context[Any],
        address: str,
        source: int,
        *,
        session: str = "default",
        name: str = "",
        ordered: bool = True,
    ) -> None:
        (cfg,) = parse_channel_config(
            f"name=fragments-{source},type=dealer,method=connect,address={address}"
        )
        self.channel = open_channel(context, cfg, session)
        self.source = source
        self.name = name or f"source-{source}"
        #: ids ascend (within and across batches, as the builder's ``ordered``): a
        #: batch's last id is its highest (a scan of every id costs a few us)
        self.ordered = ordered
        self.credit = 0
        self.sent = 0
        self.epoch: str | None = None  # whom we talk to (None: nobody answered yet)
        self.done = 0  # the builder's: every id below it is built
        self.builder_restarts = 0  # new epochs after the first
        self.resent = 0  # batches sent again to a restarted builder
        self.let_go = 0  # batches beyond MAX_RETAINED, not kept
        self.acked = False
        self.restarted_at = 0.0  # when a restarted builder was last noticed
        self._kept: deque[tuple[int, list[Any]]] = deque()  # (highest id, frames)
        self._resend: deque[tuple[int, list[Any]]] = deque()
        self._ending = False
        self._end_to: str | None = ""  # the epoch our END last went to ("": none)
        self._heard = self._hello_at = time.monotonic()
        #: a HELLO not answered yet: nothing goes until the answer says to whom (a
        #: restarted builder must have what the dead one had not built first)
        self._asked = False
        self._next_service = 0.0
        self._hello()

    @property
    def kept(self) -> int:
        """Batches kept for a restarted builder."""
        return len(self._kept)

    def _hello(self) -> None:
        self.channel.send(
            encode_message(MsgType.HELLO, {"protocol": PROTOCOL_VERSION, "source": self.source})
        )
        self._hello_at = time.monotonic()
        self._asked = True

    def _read(self, timeout_ms: int) -> None:
        ch = self.channel
        if not (ch.readable() or (timeout_ms > 0 and ch.poll(timeout_ms))):
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
                self._heard = time.monotonic()
                self._asked = False
                self._builder(msg.header)
                credit = msg.header.get("credit")
                if type(credit) is int and credit > 0:
                    self.credit += credit
            elif msg.type is MsgType.ACK:
                self._heard = time.monotonic()
                self._asked = False
                self._builder(msg.header)
                if self._ending:
                    self.acked = True
                    self._kept.clear()
                    self._resend.clear()

    def _builder(self, header: dict[str, Any]) -> None:
        """The epoch and ``done`` of a READY or ACK: a new epoch is a builder that does
        not have what we sent (a restarted one): our credits were the dead one's, and
        what it had not built goes again."""
        done = header.get("done")
        if type(done) is int and 0 <= done <= _MAX_ID and done > self.done:
            self.done = done
        if self._kept and self._kept[0][0] < self.done:
            for kept in (self._kept, self._resend):
                while kept and kept[0][0] < self.done:
                    kept.popleft()
        epoch = header.get("epoch")
        if isinstance(epoch, str) and 0 < len(epoch) <= MAX_EPOCH_LEN and epoch != self.epoch:
            if self.epoch is not None:
                self.builder_restarts += 1
                self.restarted_at = time.monotonic()
                self.credit = 0
                self._resend = deque(self._kept)
                log.warning(
                    "%s: stream %d: a new event builder process: sending again the %d "
                    "batches the old one had not built",
                    self.name,
                    self.source,
                    len(self._resend),
                )
            self.epoch = epoch

    def service(self, timeout_ms: int = 0) -> None:
        """Read what the builder said (waiting at most ``timeout_ms``), say HELLO
        again if it has been silent for ``HELLO_RESEND_S``, send again what a restarted
        builder must have, and then our END if it is due there."""
        self._read(timeout_ms)
        now = time.monotonic()
        if not self.acked and now - max(self._heard, self._hello_at) >= HELLO_RESEND_S:
            self._hello()
        if self._asked:
            return
        while self._resend and self.credit > 0:
            _, frames = self._resend.popleft()
            self.channel.send(frames)
            self.credit -= 1
            self.resent += 1
        if self._ending and not self.acked and not self._resend and self._end_to != self.epoch:
            self._send_end()

    @property
    def ready(self) -> bool:
        """A batch may go now: a credit, nothing to send again first, no HELLO
        waiting for its answer."""
        return self.credit > 0 and not self._resend and not self._asked

    def wait_credit(self, deadline_s: float, stop: Callable[[], bool] | None = None) -> bool:
        """Wait until a credit is there (or the deadline passes); True if there is one.

        Credits are read from the socket only when none is left (READYs wait there
        meanwhile), or every 0.1 s: a send with credit costs no poll."""
        if self.ready:
            now = time.monotonic()
            if now < self._next_service:
                return True
            self._next_service = now + 0.1
            self.service()
        while not self.ready:
            left_ms = int((deadline_s - time.monotonic()) * 1000)
            if stop is not None and stop():
                return False
            self.service(min(max(left_ms, 0), 50))
            if left_ms <= 0:
                return self.ready
        return True

    def send_batch(self, ids: Any, fragments: Any, timeout_s: float = 30.0) -> None:
        """Send one batch (see :func:`encode_fragments`), waiting for a credit first."""
        if not self.wait_credit(time.monotonic() + timeout_s):
            raise PeerLostError(
                f"{self.name}: no credit from the event builder within {timeout_s:.0f} s"
            )
        frames = encode_fragments(self.source, ids, fragments)
        self.channel.send(frames)
        self.credit -= 1
        self.sent += 1
        top = _highest(ids, self.ordered)
        if top >= self.done:
            if len(self._kept) >= MAX_RETAINED:
                self._kept.popleft()
                if not self.let_go:
                    log.warning(
                        "%s: stream %d: %d batches sent and not built yet: the oldest are "
                        "no longer kept for a restarted builder",
                        self.name,
                        self.source,
                        MAX_RETAINED,
                    )
                self.let_go += 1
            self._kept.append((top, frames))

    def _send_end(self) -> None:
        self.channel.send(
            encode_message(
                MsgType.END, {"count": self.sent, "from": self.name, "source": self.source}
            )
        )
        self._end_to = self.epoch

    def send_end(self) -> None:
        """Send END with the count of batches sent (then :meth:`wait_ack`); to a
        restarted builder it goes again after what that one must have."""
        self._ending = True
        if not self._resend and not self._asked:
            self._send_end()

    def wait_ack(self, deadline_s: float, waiting: Callable[[], object] | None = None) -> bool:
        """Wait for the ACK of our END until ``deadline_s`` (later by as much if a
        restarted builder was met meanwhile); False if it did not come."""
        return not wait_acked([self], deadline_s - time.monotonic(), waiting)

    def end(self, timeout_s: float = 10.0, waiting: Callable[[], object] | None = None) -> bool:
        """Send END with the count and wait for the ACK; False if it did not come.

        ``waiting`` is called while waiting (a test that runs both ends in one thread).
        """
        self.send_end()
        return self.wait_ack(time.monotonic() + timeout_s, waiting)

    def close(self, linger_ms: int | None = 0) -> None:
        self.channel.close(linger_ms)


def _highest(ids: Any, ordered: bool) -> int:
    """The highest event id of a batch (``ids`` as for :func:`encode_fragments`);
    ``ordered``: the last."""
    if type(ids) is bytes:
        if ordered:
            return min(int.from_bytes(ids[-8:], "little"), _MAX_ID) if ids else -1
        arr = np.frombuffer(ids, "<u8")
    else:
        arr = np.asarray(ids)
    if not len(arr):
        return -1
    return min(int(arr[-1] if ordered else arr.max()), _MAX_ID)


def wait_acked(
    senders: Sequence[FragmentSender],
    timeout_s: float,
    waiting: Callable[[], object] | None = None,
) -> list[FragmentSender]:
    """Serve ``senders`` (their END sent) until each has its ACK, or ``timeout_s``
    passed: counted again from the moment a restarted builder is met, so that a
    builder restarted while the streams end gets the full time. Returns the senders
    still without an ACK."""
    start = time.monotonic()
    poller = zmq.Poller()
    for s in senders:
        poller.register(s.channel.socket, zmq.POLLIN)
    while True:
        for s in senders:
            if not s.acked:
                s.service()
        left = [s for s in senders if not s.acked]
        if not left:
            return []
        restarted = max(s.restarted_at for s in senders)
        deadline = max(start, restarted) + timeout_s
        now = time.monotonic()
        if now >= deadline:
            return left
        if waiting is not None:
            waiting()
        poller.poll(min(int((deadline - now) * 1000) + 1, 10 if waiting else 50))

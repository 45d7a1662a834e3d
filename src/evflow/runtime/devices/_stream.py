"""End of stream between devices: END with a count, answered by ACK.

Acknowledgements travel back on the data channel itself when its socket type can
answer (pair, dealer, router), otherwise on a channel named ``<data channel>-ack``
(e.g. a sink's ``data-ack`` push socket connected to the sampler's ``data-ack`` pull
socket). ACKs carry ``to`` (the END sender's id) so that a shared ack socket can be
fanned in, or a pub/sub ack channel fanned out.

A raw channel (``framing = "raw"``, FairMQ's wire) has no END and no ACK: the stream
ends by count (``--max-iterations`` on the receiver) or by STOP, as in FairMQ.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from evflow.runtime.device import BIDIRECTIONAL, Device, Origin
from evflow.transport.channel import Channel
from evflow.wire.messages import Message, MsgType, encode_message

log = logging.getLogger("evflow.device")

ACK_SUFFIX = "-ack"


def send_end(dev: Device, name: str, index: int, count: int, **extra: Any) -> None:
    """Send END with ``count`` (messages sent on this sub-channel) and our id (nothing
    on a raw channel: the receiver counts)."""
    if dev.channel(name, index).raw:
        log.info("%s: %d messages on raw channel %s[%d] (no END on raw framing)",
                 dev.id, count, name, index)  # fmt: skip
        return
    dev.send(name, MsgType.END, {"count": count, "from": dev.id, **extra}, index=index)


def ack_sources(dev: Device, name: str) -> list[Channel]:
    """The channels on which ACKs for END sent on ``name`` arrive (may be empty)."""
    subs = dev.channel_list(name)
    if subs and subs[0].type in BIDIRECTIONAL:
        return subs
    if dev.channels.get(name + ACK_SUFFIX):
        return dev.channel_list(name + ACK_SUFFIX)
    return []


def wait_for_acks(dev: Device, name: str, expected: int, timeout_s: float) -> int:
    """Wait until ``expected`` ACKs addressed to us arrived; return how many did
    (0 at once on a raw channel, which has no ACK)."""
    if dev.channel(name).raw:
        return 0
    sources = ack_sources(dev, name)
    if not sources:
        log.warning(
            "%s: END on %r is not acknowledged (socket type %s cannot answer and there is no "
            "%r channel); the last messages may be lost if the peer is slow",
            dev.id,
            name,
            dev.channel(name).type,
            name + ACK_SUFFIX,
        )
        return 0
    poller = zmq.Poller()
    for ch in sources:
        poller.register(ch.socket, zmq.POLLIN)
    by_socket = {ch.socket: ch for ch in sources}
    got = 0
    deadline = time.monotonic() + timeout_s
    while got < expected:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            log.error(
                "%s: only %d of %d END acknowledgements on %r within %.1f s",
                dev.id,
                got,
                expected,
                name,
                timeout_s,
            )
            break
        for sock, _ in poller.poll(min(left_ms, 100)):
            ch = by_socket[sock]
            frames = ch.recv()
            if ch.type == "router":
                frames = frames[1:]
            msg = dev.bad_messages[ch.label].decode(frames)
            if msg is None or msg.type is not MsgType.ACK:
                continue
            if msg.header.get("to", dev.id) == dev.id:
                got += 1
    return got


def acknowledge(dev: Device, msg: Message, origin: Origin, **extra: Any) -> bool:
    """Answer an END with ACK on the way it can travel back; False if there is none."""
    if origin.channel.raw:
        return False
    header = {"to": msg.header.get("from", ""), "from": dev.id, **extra}
    frames = encode_message(MsgType.ACK, header)
    ch = origin.channel
    if ch.type in BIDIRECTIONAL:
        ch.send([origin.peer, *frames] if ch.type == "router" else frames)
        return True
    acks = dev.channels.get(ch.name + ACK_SUFFIX)
    if acks:
        acks[min(ch.index, len(acks) - 1)].send(frames)
        return True
    log.debug(
        "%s: cannot acknowledge END on %s (no %r channel)", dev.id, ch.label, ch.name + ACK_SUFFIX
    )
    return False


class EndTracker:
    """Mixin for receivers that wait for one END per input (sink, forwarders).

    ``peer_lost(peer_id)`` (the topology controller calls it over the bus when an
    expendable peer died) stops waiting for that peer's END; the counts can then no
    longer be checked against what the senders announced, and the summary says so.
    """

    _needed: int
    ends: int

    def _track_end(self, msg: Message) -> bool:
        """Note an END; False if it comes from a peer already given up as lost (its END
        was no longer waited for, so it must not stand in for another peer's)."""
        sender = str(msg.header.get("from"))
        self.__dict__.setdefault("ends_from", set()).add(sender)
        return sender not in self.lost_peers

    @property
    def lost_peers(self) -> set[str]:
        lost: set[str] = self.__dict__.setdefault("_lost_peers", set())
        return lost

    def peer_lost(self, peer_id: str) -> None:
        """Stop waiting for ``peer_id``'s END; end the loop if no other END is due."""
        dev: Any = self
        if peer_id in self.__dict__.get("ends_from", ()) or peer_id in self.lost_peers:
            return
        self.lost_peers.add(peer_id)
        log.warning("%s: peer %s was lost; not waiting for its END", dev.id, peer_id)
        if hasattr(self, "_needed"):
            self._needed -= 1
            if self.ends >= self._needed:
                dev._loop_stop = True

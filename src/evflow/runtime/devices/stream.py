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

import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from evflow.errors import IncompleteStreamError
from evflow.runtime.device import BIDIRECTIONAL, Device, Origin
from evflow.runtime.devices._streamrecord import StreamRecord
from evflow.runtime.loops import send_when_ready
from evflow.transport.channel import Channel
from evflow.transport.curve import CONNECTION_EVENTS
from evflow.wire.messages import Message, MsgType, encode_message

log = logging.getLogger("evflow.device")

ACK_SUFFIX = "-ack"
#: after a stop request, how long END may wait for room at a peer that stopped taking
#: messages (a live one makes room in milliseconds; one that left never does)
#: how long END may wait for a peer to take it when the caller names no time
END_SEND_TIMEOUT_S = 10.0
STOPPED_END_WAIT_S = 2.0
#: an END not acknowledged this long is sent again (its receiver may have been
#: restarted meanwhile; receivers count one END per sender)
END_RESEND_S = 1.0
#: the longest END waits for its acknowledgement from a receiver that stays connected
#: (one that never answers is hung)
MAX_ACK_WAIT_S = 600.0


def send_end(
    dev: Device,
    name: str,
    index: int,
    count: int,
    timeout_s: float = END_SEND_TIMEOUT_S,
    **extra: Any,
) -> bool:
    """Send END with ``count`` (messages sent on this sub-channel) and our id; False
    (logged) when no peer took it within ``timeout_s``. With nothing sent (``count``
    0) it goes only if a peer is there now: a device stopped before its peer ever
    came must not wait for it; after a stop request it waits ``STOPPED_END_WAIT_S`` at
    most (a peer that vanished, or a connect that never reached anyone). Nothing goes
    on a raw channel (FairMQ framing has no END: the receiver counts); False then."""
    ch = dev.channel(name, index)
    if ch.raw:
        log.info("%s: %d messages on raw channel %s (no END on raw framing)",
                 dev.id, count, ch.label)  # fmt: skip
        return False
    if count == 0:
        timeout_s = 0.0
    elif dev.shutdown_requested:
        timeout_s = min(timeout_s, STOPPED_END_WAIT_S)
    frames = encode_message(MsgType.END, {"count": count, "from": dev.id, **extra})
    if send_when_ready(dev, ch, frames, timeout_s):
        return True
    why = "no peer is connected" if count == 0 else f"no peer took it within {timeout_s:g} s"
    log.warning("%s: END on %s not sent: %s", dev.id, ch.label, why)
    return False


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


_UP_EVENTS = frozenset({zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED})


class PeerWatch:
    """Whether the peer of a sub-channel is still there, from its socket's monitor events.

    Started when the END goes: until an event says otherwise its peer is taken to be
    there (it was, for the data before the END). A connecting socket's peer is gone
    from a disconnection or a failed (re)connect until it connects again; a binding
    socket's when the last connection it saw accepted, or an earlier one, closed.
    Inproc and raw channels give no events: their peer always counts as there.

    libzmq keeps one monitor per socket: a CURVE channel's is its refusal watcher's,
    so the events come from that (``monitor`` is None and ``read`` is called each
    turn); another channel gets a monitor socket of its own to poll."""

    def __init__(self, ch: Channel) -> None:
        self._channel = ch
        methods = [ep.method or ch.config.method for ep in ch.config.endpoints]
        self._bound = {url for url, m in zip(ch.endpoints, methods, strict=False) if m == "bind"}
        self._up: dict[str, bool] = dict.fromkeys(ch.endpoints, True)
        self._accepted: set[int] = set()
        self._events: deque[tuple[int, int, str]] = deque()
        self._security = ch.security
        self.monitor: zmq.Socket[Any] | None = None
        if self._security is not None:
            self._security.listen(self._take)
        else:
            self.monitor = ch.socket.get_monitor_socket(CONNECTION_EVENTS)

    @property
    def connected(self) -> bool:
        return bool(self._accepted) or any(self._up.values()) or not self._up

    def _key(self, endpoint: str) -> str:
        if endpoint not in self._up and len(self._up) == 1:
            return next(iter(self._up))  # (the one endpoint, spelled another way)
        return endpoint

    def _take(self, kind: int, value: int, endpoint: str) -> None:
        self._events.append((kind, value, endpoint))  # (deque: safe from another thread)

    def read(self) -> None:
        """Take the events that arrived (call when ``monitor`` is readable, or each turn
        without one)."""
        while self.monitor is not None and self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            self._take(event["event"], event["value"], event["endpoint"].decode(errors="replace"))
        while self._events:
            kind, fd, endpoint = self._events.popleft()
            key = self._key(endpoint)
            if key in self._bound:  # a connection to our bound address, by its fd
                if kind == zmq.EVENT_ACCEPTED:
                    self._accepted.add(fd)
                elif kind == zmq.EVENT_DISCONNECTED:
                    self._accepted.discard(fd)
                    self._up[key] = False  # (connections from before we watched: gone too)
            elif kind in _UP_EVENTS:
                self._up[key] = True
            elif kind != zmq.EVENT_ACCEPTED:
                self._up[key] = False

    def close(self) -> None:
        if self._security is not None:
            self._security.unlisten(self._take)  # (its monitor stays: the refusal log's)
            return
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._channel.socket.disable_monitor()
            self.monitor.close(0)


def end_and_wait(
    dev: Device,
    name: str,
    counts: Sequence[int],
    timeout_s: float,
    *,
    headers: Sequence[dict[str, Any]] | None = None,
    max_wait_s: float = MAX_ACK_WAIT_S,
    **extra: Any,
) -> tuple[int, int]:
    """END on every sub-channel ``i`` of ``name`` with ``counts[i]`` (0 past the end of
    ``counts``: every peer gets its END), ``headers[i]`` and ``extra`` in its header;
    then wait for the ACKs. Returns (ENDs sent, ENDs acknowledged).

    A receiver answers END when it reads it, behind everything queued before it: under
    load that is long after the END left, and no failure. So the wait lasts as long as
    the receiver stays connected (:class:`PeerWatch`); ``timeout_s`` counts from its
    disconnection (it died, or left without answering), and then the END is given up
    with one ERROR line. ``max_wait_s`` bounds the whole wait (a connected receiver that
    never answers: hung), and after a stop request the ACKs get ``timeout_s`` more
    (then a warning). An END not acknowledged is sent again every END_RESEND_S: one
    that reached a receiver killed before it answered is announced again to its
    restarted process (receivers count one END per sender)."""
    subs = dev.channel_list(name)
    counts = [*counts[: len(subs)], *[0] * (len(subs) - len(counts))]
    fields = [{**extra, **(headers[i] if headers else {})} for i in range(len(subs))]
    sent = [send_end(dev, name, i, counts[i], timeout_s, **fields[i]) for i in range(len(subs))]
    ends = [{"count": counts[i], "from": dev.id, **fields[i]} for i in range(len(subs))]
    if not any(sent) or subs[0].raw:
        return sum(sent), 0
    sources = ack_sources(dev, name)
    if not sources:
        wait_for_acks(dev, name, sum(sent), timeout_s)  # logs why none can come
        return sum(sent), 0
    watches = {i: PeerWatch(subs[i]) for i in range(len(subs)) if sent[i]}
    try:
        return sum(sent), _await_acks(dev, name, sources, watches, ends, timeout_s, max_wait_s)
    finally:
        for watch in watches.values():
            watch.close()


def _await_acks(
    dev: Device,
    name: str,
    sources: list[Channel],
    watches: dict[int, PeerWatch],
    ends: list[dict[str, Any]],
    timeout_s: float,
    max_wait_s: float,
) -> int:
    """The wait of :func:`end_and_wait`; returns the ACKs that arrived. With ACKs on the
    data sockets each END has its own: one whose receiver is gone ``timeout_s`` is given
    up alone. With an ack channel (ACKs by receiver id) the wait ends when fewer
    receivers are connected than ACKs are due, for ``timeout_s``."""
    subs = dev.channel_list(name)
    expected = len(watches)
    per_channel = sources is subs  # ACKs on the data sockets: one per sub-channel
    by_socket = {ch.socket: i for i, ch in enumerate(sources)}
    by_monitor = {w.monitor: w for w in watches.values() if w.monitor is not None}
    unpolled = [w for w in watches.values() if w.monitor is None]
    acked: set[Any] = set()  # sub-channel indices, or (ack channel) receiver ids
    given_up: dict[int, str] = {}  # sub-channel -> why
    gone_since: dict[int, float] = {}  # sub-channel (-1: the ack channel's receivers)
    poller = zmq.Poller()
    for sock in [*by_socket, *by_monitor]:
        poller.register(sock, zmq.POLLIN)
    started = time.monotonic()
    resend_at = started + END_RESEND_S
    stopped_at: float | None = None
    hung = ""
    while len(acked) + len(given_up) < expected:
        now = time.monotonic()
        waiting = [i for i in watches if i not in acked and i not in given_up]
        if not per_channel:
            waiting = list(watches) if len(acked) < expected else []
        for unpolled_watch in unpolled:
            unpolled_watch.read()
        if now >= resend_at:
            resend_at = now + END_RESEND_S
            for i in waiting:
                with contextlib.suppress(zmq.Again):
                    subs[i].send(encode_message(MsgType.END, ends[i]), zmq.NOBLOCK)
        # who is gone: each waiting receiver, or (ack channel) fewer than the ACKs due
        if per_channel:
            gone = [i for i in waiting if not watches[i].connected]
        else:
            live = sum(1 for w in watches.values() if w.connected)
            gone = [-1] if live < expected - len(acked) else []
        for i in [i for i in gone_since if i not in gone]:
            del gone_since[i]
        for i in gone:
            since = gone_since.setdefault(i, now)
            if now - since >= timeout_s:
                who = "its receivers" if i == -1 else f"the receiver on {subs[i].label}"
                for k in watches if i == -1 else [i]:
                    given_up[k] = f"{who} left {now - since:.1f} s ago"
        if len(acked) + len(given_up) >= expected:
            break
        if dev.shutdown_requested and stopped_at is None:
            stopped_at = now  # (a stop still gives the ACKs timeout_s to come)
        if stopped_at is not None and now - stopped_at >= timeout_s:
            log.warning("%s: only %d of %d END acknowledgements on %r %.1f s after the "
                        "stop request", dev.id, len(acked), expected, name,
                        now - stopped_at)  # fmt: skip
            return min(len(acked), expected)
        if now - started >= max_wait_s:
            hung = f"none within {max_wait_s:.0f} s from a connected receiver (hung?)"
            break
        dev._tick()
        for sock, _ in poller.poll(100):
            watch = by_monitor.get(sock)
            if watch is not None:
                watch.read()
                continue
            ch = sources[by_socket[sock]]
            frames = ch.recv()
            if ch.type == "router":
                frames = frames[1:]
            msg = dev.bad_messages[ch.label].decode(frames)
            if msg is None or msg.type is not MsgType.ACK:
                continue
            if msg.header.get("to", dev.id) != dev.id:
                continue
            if per_channel and by_socket[sock] in watches:
                acked.add(by_socket[sock])
                given_up.pop(by_socket[sock], None)  # (back, and answered after all)
            elif not per_channel:
                acked.add(str(msg.header.get("from")))
    got = min(len(acked), expected)
    if got < expected:
        why = "; ".join(dict.fromkeys([*given_up.values(), *filter(None, [hung])]))
        log.error("%s: only %d of %d END acknowledgements on %r: %s",
                  dev.id, got, expected, name, why)  # fmt: skip
    return got


class EndTracker:
    """Mixin for receivers that wait for one END per input (sink, forwarders).

    An END counts once per sender, and only from a sender the topology named
    (``senders``, when the device has that parameter set) or, without that list, from
    any sender that names itself; anything else is counted as a bad message and
    dropped (a forged or repeated END must not end the stream early). Repeats of a
    counted END are acknowledged again (their sender may have missed the first ACK).

    ``peer_lost(peer_id)`` (the topology controller calls it over the bus when an
    expendable peer died) stops waiting for that peer's END; the counts can then no
    longer be checked against what the senders announced, and the summary says so.

    The ENDs taken are kept in a :class:`StreamRecord` (``stream_dir`` set by the
    topology for a device that may be restarted): a restarted receiver does not wait
    for ENDs its dead process already took.
    """

    _needed: int
    ends: int
    record: StreamRecord

    def _open_record(self, slots: int) -> StreamRecord:
        dev: Any = self
        if hasattr(self, "record"):  # a new task of this process, not a restart
            self.record.reset()
            return self.record
        directory = getattr(dev, "stream_dir", None)
        self.record = StreamRecord(Path(directory) if directory else None, dev.id, slots)
        return self.record

    def _known_senders(self) -> set[str]:
        raw = getattr(self, "senders", "")
        return {s.strip() for s in raw.split(",") if s.strip()} if isinstance(raw, str) else set()

    def _ends_taken(self) -> int:
        """ENDs already taken (by a dead predecessor) that count now."""
        return sum(1 for s in self.record.ends if s.partition("#")[0] not in self.lost_peers)

    def _track_end(self, msg: Message, origin: Origin) -> bool | None:
        """Note an END: True if it counts (a new sender's), False if it is a repeat or
        comes from a peer already given up as lost (acknowledge it, count nothing), None
        if it must be dropped unanswered (no sender, an unknown one)."""
        dev: Any = self
        sender = msg.header.get("from")
        known = self._known_senders()
        if not isinstance(sender, str) or not sender or (known and sender not in known):
            dev.bad_messages[origin.channel.label].record(
                "end", f"END from {sender!r}, not a sender of this channel"
            )
            return None
        # one END per sender and sub-channel (a sender may feed several of ours)
        index = origin.channel.index
        key = sender if not index else f"{sender}#{index}"
        if key in self.record.ends:
            return False
        count = msg.header.get("count")
        self.record.add_end(key, count if type(count) is int and count >= 0 else 0)
        return sender not in self.lost_peers

    @property
    def ends_from(self) -> set[str]:
        ends = self.record.ends if hasattr(self, "record") else {}
        return {key.partition("#")[0] for key in ends}

    @property
    def announced_total(self) -> int:
        return sum(self.record.ends.values())

    @property
    def announced(self) -> int:
        """Messages the counted ENDs announced (0 before the task opened its record)."""
        return self.announced_total if hasattr(self, "record") else 0

    def pre_run(self) -> None:
        if self.ends >= self._needed:  # a restart: its dead process took every END
            dev: Any = self
            dev._loop_stop = True

    @property
    def unended(self) -> set[str]:
        """Senders that exited without their END reaching this device (see peer_ended)."""
        out: set[str] = self.__dict__.setdefault("_unended", set())
        return out

    def peer_ended(self, peer_id: str) -> None:
        """``peer_id`` exited cleanly (the controller tells a restarted receiver, every few
        seconds). If its END is still unknown at the second notice, it never comes (the
        sender gave up on its ACK while we were dead): stop waiting for it; the counts
        then cannot hold (``check_unended`` raises)."""
        dev: Any = self
        if peer_id in self.ends_from or peer_id in self.lost_peers or peer_id in self.unended:
            return
        seen: set[str] = self.__dict__.setdefault("_ended_seen", set())
        if peer_id not in seen:
            seen.add(peer_id)
            return
        self.unended.add(peer_id)
        log.error("%s: %s ended, but its END never reached this device", dev.id, peer_id)
        self._one_end_less()

    def _one_end_less(self) -> None:
        """One END fewer to wait for: end the loop if every other one came."""
        if hasattr(self, "_needed"):
            self._needed -= 1
            if self.ends >= self._needed:
                dev: Any = self
                dev._loop_stop = True

    def check_unended(self, kind: str) -> None:
        dev: Any = self
        if self.unended:
            raise IncompleteStreamError(
                f"{kind} {dev.id!r}: the END of {', '.join(sorted(self.unended))} never "
                "arrived (sent while this device was being restarted, and not acknowledged "
                "in time); its count cannot be checked"
            )

    @property
    def lost_peers(self) -> set[str]:
        lost: set[str] = self.__dict__.setdefault("_lost_peers", set())
        return lost

    def peer_lost(self, peer_id: str) -> None:
        """Stop waiting for ``peer_id``'s END; end the loop if no other END is due."""
        dev: Any = self
        if peer_id in self.ends_from or peer_id in self.lost_peers:
            return
        self.lost_peers.add(peer_id)
        log.warning("%s: peer %s was lost; not waiting for its END", dev.id, peer_id)
        self._one_end_less()


def count_mismatch(kind: str, dev_id: str, got: int, announced: int, record: StreamRecord) -> str:
    """The one line of a count that does not hold (names the device and the difference)."""
    if got < announced:
        what = f"{announced - got} of {announced} announced messages missing"
    else:
        what = f"{got - announced} messages more than the {announced} announced"
    why = (
        " (its process was restarted: they died with the killed process)"
        if record.restarted and got < announced
        else ""
    )
    return f"{kind} {dev_id!r}: {what}{why}; received {got}"

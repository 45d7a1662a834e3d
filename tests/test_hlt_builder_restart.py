"""A restarted event builder gets its streams back (issue 21, "topologies as reliable as
path runs"): the fragment senders say HELLO again when the builder falls silent, learn
from its answer (a new ``epoch``) that it is a new process, and send again what the
dead one had not built; the new one knows what its predecessor built (``resume``) and
refuses those fragments as late, so every event comes out exactly once. Before, the
senders said HELLO once: a new builder granted them no credit and they waited for ever.

In one process and one thread (the builders are pumped from the senders' waits), over
an ipc path that the "restarted" builder binds again after the first one was closed
without a word, as a SIGKILLed process leaves it. ``tests/test_topology_builder_restart.py``
does the same with real processes under ``evflow up``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from evflow.hlt.eventbuilder import BuilderConfig, BuildState, EventBuilder
from evflow.hlt.links import FragmentReceiver, FragmentSender, wait_acked
from evflow.wire.messages import PROTOCOL_VERSION, MsgType, decode_message, encode_message

SOURCES = [0, 1, 2]
#: generous: the senders' HELLO comes again after 1 s of silence, the machine is shared
DEADLINE_S = 30.0


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


class Side:
    """One builder process: its receiver, and what it "sent on" (ids, states)."""

    def __init__(self, ctx: zmq.Context[Any], address: str, **kw: Any) -> None:
        self.builder = EventBuilder(BuilderConfig(sources=SOURCES, timeout_s=5.0))
        self.recv = FragmentReceiver(ctx, self.builder, address, ack_when_built=True, **kw)
        self.ids: list[int] = []
        self.states: list[int] = []
        self.done = 0  # what a device keeps as its restart point after sending on

    def pump(self) -> None:
        self.recv.pump(5)
        for batch in self.builder.take_built():
            self.ids += batch.ids.tolist()
            self.states += batch.states.tolist()
        self.done = self.recv.done_below()


def fragments(source: int, ids: range) -> list[bytes]:
    return [f"{source}:{i}".encode() for i in ids]


def send(
    senders: list[FragmentSender], ids: range, pump: Callable[[], None], only: Any = None
) -> None:
    """Each sender (or those of ``only``) sends ``ids``; while one waits for a credit
    the builder is pumped and every sender served, as the replay device does."""
    deadline = time.monotonic() + DEADLINE_S
    for s in senders:
        if only is not None and s.source not in only:
            continue
        while not s.wait_credit(time.monotonic() + 0.02):
            assert time.monotonic() < deadline, f"source {s.source}: no credit"
            pump()
            for other in senders:
                other.service()
        s.send_batch(list(ids), fragments(s.source, ids))


def test_senders_say_hello_again_and_a_restarted_builder_builds_every_event_once(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path / 'frags.ipc'}"
    first = Side(ctx, address)
    senders = [FragmentSender(ctx, address, s, name="replay") for s in SOURCES]
    second: Side | None = None
    try:
        for start in range(0, 200, 10):
            send(senders, range(start, start + 10), first.pump)
        # two streams ahead: events 200..209 are in construction when the builder dies
        send(senders, range(200, 210), first.pump, only={0, 1})
        deadline = time.monotonic() + DEADLINE_S
        while first.builder.n_open < 10 or len(first.ids) < 200:
            assert time.monotonic() < deadline, first.recv.metrics()
            first.pump()
        assert first.ids == list(range(200))
        # (the senders keep what they sent until a READY's ``done`` passes it: here
        # the last READYs went before the builder had passed on what they gave back)
        first.recv.close()  # killed: no END, no goodbye; its file gone, as a new bind does
        second = Side(ctx, address)
        # its restart point as a device may have kept it a little before the kill
        # (behind what it sent on): the events 150..199 come again, and are refused
        assert first.done == 200
        second.recv.resume([], 150, np.array(first.ids))
        # stream 2 goes on as if nothing happened (its old credits): to nobody first
        send(senders, range(200, 210), second.pump, only={2})
        for start in range(210, 300, 10):
            send(senders, range(start, start + 10), second.pump)
        for s in senders:
            s.send_end()
        left = wait_acked(senders, DEADLINE_S, second.pump)
        assert not left, [(s.source, s.kept, s.builder_restarts) for s in left]
    finally:
        for s in senders:
            s.close()
        first.recv.close()
        if second is not None:
            second.recv.close()
    assert second is not None
    built = Counter(first.ids + second.ids)
    assert sorted(built) == list(range(300)), "every event built"
    assert set(built.values()) == {1}, "none twice"
    assert set(first.states + second.states) == {BuildState.COMPLETE}
    assert [s.builder_restarts for s in senders] == [1, 1, 1]
    assert sum(s.resent for s in senders) >= 2  # 200..209 of streams 0 and 1 (and 2's)
    m = second.recv.metrics()
    assert m["resumed"] is True
    assert m["late"] > 0, "what the dead builder had built came again: refused as late"


def test_an_end_is_acknowledged_only_once_its_whole_stream_is_built(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    taken: list[tuple[int, int]] = []
    side = Side(ctx, f"ipc://{tmp_path / 'frags.ipc'}", on_end=lambda s, n: taken.append((s, n)))
    senders = [FragmentSender(ctx, side.recv.endpoints[0], s) for s in SOURCES]
    try:
        send(senders, range(10), side.pump, only={0, 1})
        senders[0].send_end()
        deadline = time.monotonic() + DEADLINE_S
        while not side.recv.by_source[0].ended:
            assert time.monotonic() < deadline
            side.pump()
        for _ in range(20):  # its events wait for source 2: no ACK yet, nothing kept
            side.pump()
            senders[0].service()
        assert not senders[0].acked and taken == []
        assert senders[0].kept == 1  # (sent again, were the builder restarted now)
        send(senders, range(10), side.pump, only={2})
        assert not wait_acked(senders[:1], DEADLINE_S, side.pump)
        assert taken == [(0, 1)] and senders[0].kept == 0
        assert side.ids == list(range(10))
    finally:
        for s in senders:
            s.close()
        side.recv.close()


def test_a_restarted_builder_answers_an_end_its_predecessor_took_and_waits_for_no_other(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """The dead process took the END of streams 0 and 1 (kept before any ACK went) and
    died: stream 0's sender still waits for its ACK; stream 1's got it and left."""
    address = f"ipc://{tmp_path / 'frags.ipc'}"
    first = Side(ctx, address)
    sender = FragmentSender(ctx, address, 0, name="replay")
    second: Side | None = None
    try:
        deadline = time.monotonic() + DEADLINE_S
        while sender.epoch is None:
            assert time.monotonic() < deadline
            first.pump()
            sender.service()
        sender.send_end()  # taken by the dead one (as its record says), never answered
        first.recv.close()
        second = Side(ctx, address)
        second.recv.resume([0, 1], 0, np.array([], np.int64))
        assert not second.recv.all_ended() and second.recv.unanswered() == {0, 1}
        assert not wait_acked([sender], DEADLINE_S, second.pump)
        assert second.recv.unanswered() == {1}  # (the device waits for it a while)
        assert sender.builder_restarts == 1
    finally:
        sender.close()
        first.recv.close()
        if second is not None:
            second.recv.close()


def test_hostile_hellos_and_answers_change_nothing(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    """A known peer's HELLO for another source is refused and counted; a sender takes
    no epoch, credit or ``done`` of the wrong type or size from an answer, and an ACK
    before its END ends nothing."""
    side = Side(ctx, f"ipc://{tmp_path / 'frags.ipc'}")
    peer = ctx.socket(zmq.DEALER)
    peer.connect(side.recv.endpoints[0])
    fake = ctx.socket(zmq.ROUTER)
    fake_addr = f"ipc://{tmp_path / 'fake.ipc'}"
    fake.bind(fake_addr)
    sender = FragmentSender(ctx, fake_addr, 0)
    try:
        peer.send_multipart(
            encode_message(MsgType.HELLO, {"protocol": PROTOCOL_VERSION, "source": 1})
        )
        peer.send_multipart(
            encode_message(MsgType.HELLO, {"protocol": PROTOCOL_VERSION, "source": 2})
        )
        deadline = time.monotonic() + DEADLINE_S
        while side.recv.bad.total < 1:
            assert time.monotonic() < deadline, side.recv.metrics()
            side.pump()
        assert sorted(side.recv.by_source) == [1]  # source 2 not taken over
        assert peer.poll(int(DEADLINE_S * 1000))
        answer = decode_message(peer.recv_multipart())
        assert answer.type is MsgType.READY and answer.header["credit"] == 0

        assert fake.poll(int(DEADLINE_S * 1000))
        who, *hello = fake.recv_multipart()
        assert decode_message(hello).type is MsgType.HELLO
        for header in (
            {"credit": 1, "epoch": 5, "done": "x"},
            {"credit": 1, "epoch": "e" * 65, "done": -1},
            {"credit": 1, "epoch": "", "done": 2**63},
        ):
            fake.send_multipart([who, *encode_message(MsgType.READY, header)])
        fake.send_multipart([who, *encode_message(MsgType.ACK, {"to": "x"})])
        while sender.credit < 3:
            assert time.monotonic() < deadline
            sender.service(10)
        assert (sender.epoch, sender.done, sender.acked) == (None, 0, False)
    finally:
        sender.close()
        peer.close(0)
        fake.close(0)
        side.recv.close()

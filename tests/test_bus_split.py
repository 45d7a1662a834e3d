"""The bus proxy with ipc and tcp endpoints: two sockets per side (the tcp one may be
CURVE), one bus: every message reaches subscribers on both, and a subscriber leaving
one side does not cut off a subscriber of the same topic on the other."""

from __future__ import annotations

import time
from typing import Any

import zmq

from _wait import wait_until
from evflow.runtime.bus import BusProxy
from evflow.wire.messages import MsgType, decode_message, encode_message


def _sub(context: zmq.Context[Any], url: str) -> zmq.Socket[Any]:
    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, bytes([MsgType.METRICS]))
    sock.connect(url)
    return sock


def _heard(pub: zmq.Socket[Any], sub: zmq.Socket[Any], timeout_s: float = 3.0) -> bool:
    """Publish until ``sub`` hears one (subscriptions take a moment to travel)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.send_multipart(encode_message(MsgType.METRICS, {"from": "t", "metrics": {}}))
        if sub.poll(50):
            frames = sub.recv_multipart()
            return decode_message(frames).type is MsgType.METRICS
    return False


def test_ipc_and_tcp_sides_are_one_bus() -> None:
    context: zmq.Context[Any] = zmq.Context()
    proxy = BusProxy(
        context,
        "splitbus",
        publish_address="ipc://bus-in.ipc;tcp://127.0.0.1:0",
        subscribe_address="ipc://bus-out.ipc;tcp://127.0.0.1:0",
    )
    proxy.start_thread()
    socks: list[zmq.Socket[Any]] = []
    try:
        ins = list(proxy._xsub.endpoints) + list(proxy._xsubs[1].endpoints)
        outs = list(proxy._xpub.endpoints) + list(proxy._xpubs[1].endpoints)
        assert [e.split(":")[0] for e in ins] == ["ipc", "tcp"]
        pub_tcp = context.socket(zmq.PUB)
        pub_tcp.connect(ins[1])
        pub_ipc = context.socket(zmq.PUB)
        pub_ipc.connect(ins[0])
        sub_ipc, sub_tcp = _sub(context, outs[0]), _sub(context, outs[1])
        socks += [pub_tcp, pub_ipc, sub_ipc, sub_tcp]
        assert _heard(pub_tcp, sub_ipc)  # a remote node's message reaches a local client
        assert _heard(pub_ipc, sub_tcp)  # and the controller's reaches the remote nodes
        # the tcp subscriber leaves: its unsubscribe must not cut off the ipc one
        sub_tcp.close(linger=0)
        socks.remove(sub_tcp)
        # the proxy has taken the unsubscribe: its tcp side (1) holds the topic no more
        topic = bytes([MsgType.METRICS])
        wait_until(lambda: 1 not in proxy._topics.get(topic, set()), 30, "the unsubscribe")
        while sub_ipc.poll(50):
            sub_ipc.recv_multipart()
        assert _heard(pub_tcp, sub_ipc)
    finally:
        for sock in socks:
            sock.close(linger=0)
        proxy.close()
        context.term()

"""Built-in devices as real processes: exact counts over ipc and tcp, splitter, merger,
and random bytes sent to every receiving socket type of a running device."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from _proc import finish, read_stats, start_device
from _wait import wait_until
from evflow.errors import TimeoutError_
from evflow.runtime.bus import BusController, BusProxy
from evflow.wire.messages import MsgType, decode_message, encode_message


def cc(**keys: Any) -> tuple[str, str]:
    return ("--channel-config", ",".join(f"{k}={v}" for k, v in keys.items()))


def start_sink(dev_id: str, *channels: str, stats: Path | None = None) -> subprocess.Popen[str]:
    extra = ("--stats-file", str(stats)) if stats is not None else ()
    return start_device("sink", "--id", dev_id, *extra, *channels)


def start_sampler(
    dev_id: str, n: int, msg_size: int, *channels: str, stats: Path | None = None
) -> subprocess.Popen[str]:
    """A sampler sending ``n`` messages of ``msg_size`` bytes."""
    extra = ("--stats-file", str(stats)) if stats is not None else ()
    return start_device(
        "sampler", "--id", dev_id, "--max-iterations", str(n), "--msg-size", str(msg_size),
        *extra, *channels,
    )  # fmt: skip


def finish_all(procs: list[subprocess.Popen[str]]) -> None:
    """Wait for every process; all must exit 0 (the assertion shows their stderr tails)."""
    results = [finish(p, 90) for p in procs]
    assert [r[0] for r in results] == [0] * len(procs), [r[2][-800:] for r in results]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_sampler_to_sink_delivers_exactly_n_messages(
    transport: str, tmp_path: Path, _runtime_dir: Path
) -> None:
    n = 100_000
    if transport == "ipc":
        data_b, data_c = "ipc://data", "ipc://data"
        ack_b, ack_c = "ipc://ack", "ipc://ack"
    else:
        p1, p2 = free_port(), free_port()
        data_b, data_c = f"tcp://127.0.0.1:{p1}", f"tcp://127.0.0.1:{p1}"
        ack_b, ack_c = f"tcp://127.0.0.1:{p2}", f"tcp://127.0.0.1:{p2}"
    sink = start_sink(
        "sink",
        *cc(name="data", type="pull", method="bind", address=data_b),
        *cc(name="data-ack", type="push", method="bind", address=ack_b),
        stats=tmp_path / "sink.json",
    )
    sampler = start_sampler(
        "sampler",
        n,
        64,
        *cc(name="data", type="push", method="connect", address=data_c),
        *cc(name="data-ack", type="pull", method="connect", address=ack_c),
        stats=tmp_path / "sampler.json",
    )
    code_s, _, err_s = finish(sampler, 90)
    code_k, _, err_k = finish(sink, 90)
    assert (code_s, code_k) == (0, 0), err_s + err_k
    got = read_stats(tmp_path / "sink.json")["sink"]
    assert got["received"] == n and got["announced"] == n and got["ends"] == 1
    assert got["payload_bytes"] == 64 * n
    sent = read_stats(tmp_path / "sampler.json")["sampler"]
    assert sent["sent"] == n and sent["acked"] == 1


def test_sink_detects_a_count_mismatch(tmp_path: Path) -> None:
    sink = start_sink("sink", *cc(name="data", type="pull", method="bind", address="ipc://mm"))
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{os.environ['EVFLOW_RUNTIME_DIR']}/default/mm")
    for _ in range(3):
        push.send_multipart(encode_message(MsgType.EVENTS, None, (b"x",)))
    push.send_multipart(encode_message(MsgType.END, {"count": 5, "from": "t"}))
    code, _, err = finish(sink, 30)
    push.close(0)
    ctx.term()
    assert code == 1
    assert "sink 'sink': 2 of 5 announced messages missing; received 3" in err


def test_splitter_round_robins_and_keeps_every_message(tmp_path: Path) -> None:
    n, outs = 30_000, 3
    procs = [
        start_sampler(
            "sampler",
            n,
            100,
            *cc(name="data", type="push", method="bind", address="ipc://in"),
            *cc(name="data-ack", type="pull", method="bind", address="ipc://in-ack"),
        )
    ]
    split_args = [
        *cc(name="data-in", type="pull", method="connect", address="ipc://in"),
        *cc(name="data-in-ack", type="push", method="connect", address="ipc://in-ack"),
        *cc(name="data-out-ack", type="pull", method="bind", address="ipc://out-ack"),
    ]
    for i in range(outs):
        split_args += cc(name="data-out", type="push", method="bind", address=f"ipc://out{i}")
        procs.append(
            start_sink(
                f"sink{i}",
                *cc(name="data", type="pull", method="connect", address=f"ipc://out{i}"),
                *cc(name="data-ack", type="push", method="connect", address="ipc://out-ack"),
                stats=tmp_path / f"sink{i}.json",
            )
        )
    procs.append(
        start_device(
            "splitter", "--id", "split", "--stats-file", str(tmp_path / "split.json"), *split_args
        )
    )
    finish_all(procs)
    counts = [read_stats(tmp_path / f"sink{i}.json")["sink"]["received"] for i in range(outs)]
    assert sum(counts) == n
    assert counts == [n // outs] * outs  # round robin: equal shares
    assert read_stats(tmp_path / "split.json")["forwarded"]["sent"] == counts


def test_merger_keeps_every_message_from_every_input(tmp_path: Path) -> None:
    n, ins = 20_000, 3
    procs = [
        start_sampler(
            f"s{i}",
            n,
            10,
            *cc(name="data", type="dealer", method="connect", address="ipc://merge-in"),
        )
        for i in range(ins)
    ]
    procs.append(
        start_device(
            "merger",
            "--id",
            "merger",
            "--inputs",
            str(ins),
            *cc(name="data-in", type="router", method="bind", address="ipc://merge-in"),
            *cc(name="data-out", type="pair", method="connect", address="ipc://merge-out"),
        )
    )
    procs.append(
        start_sink(
            "sink",
            *cc(name="data", type="pair", method="bind", address="ipc://merge-out"),
            stats=tmp_path / "sink.json",
        )
    )
    finish_all(procs)
    got = read_stats(tmp_path / "sink.json")["sink"]
    assert got["received"] == got["announced"] == n * ins


PEERS = {
    "pull": zmq.PUSH,
    # XPUB: a PUB that hears the subscription, so the test sends once it has arrived
    # (a PUB drops what it sends before that)
    "sub": zmq.XPUB,
    "xsub": zmq.XPUB,
    "pair": zmq.PAIR,
    "router": zmq.DEALER,
    "dealer": zmq.DEALER,
    "rep": zmq.REQ,
}


def _garbage(rng: random.Random) -> list[bytes]:
    kind = rng.randrange(5)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 200))]
    if kind == 1:
        return [bytes([rng.randrange(256)]), rng.randbytes(rng.randrange(0, 50))]
    if kind == 2:
        return [b"\x03", b"\xc1", b"payload"]  # EVENTS with a malformed header
    if kind == 3:
        return [b"\x03", b"\x93\x01\x02\x03"]  # header is a list, not a map
    return [rng.randbytes(rng.randrange(0, 20)) for _ in range(rng.randrange(1, 6))]


def test_random_bytes_on_every_socket_type_are_counted_not_fatal(
    tmp_path: Path, _runtime_dir: Path
) -> None:
    args: list[str] = []
    for kind in PEERS:
        args += cc(name="data", type=kind, method="bind", address=f"ipc://g-{kind}")
    stats = tmp_path / "sink.json"
    sink = start_sink("sink", *args, stats=stats)
    base = _runtime_dir / "default"
    deadline = time.monotonic() + 60
    while not all((base / f"g-{k}").exists() for k in PEERS):
        assert time.monotonic() < deadline and sink.poll() is None
        time.sleep(0.05)
    ctx: zmq.Context[Any] = zmq.Context()
    rng = random.Random(42)
    peers = {}
    for kind, peer_type in PEERS.items():
        s = ctx.socket(peer_type)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{base}/g-{kind}")
        peers[kind] = s
    for kind, s in peers.items():
        if PEERS[kind] == zmq.XPUB:
            assert s.poll(60_000), f"the sink's {kind} channel never subscribed"
            assert s.recv()[:1] == b"\x01"  # a subscription
    sent_bad = 0
    for kind, s in peers.items():
        for _ in range(40):
            s.send_multipart(_garbage(rng))
            sent_bad += 1
            if kind == "rep":
                assert s.poll(30_000), "REP channel stopped answering"
                s.recv_multipart()
        s.send_multipart(encode_message(MsgType.EVENTS, None, (b"ok",)))
        if kind == "rep":
            assert s.poll(30_000)
            s.recv_multipart()
        # a window, not a synchronisation: a sink killed by this kind's garbage is named
        # here; the exit code and the exact counts at the end catch it whenever it dies
        time.sleep(0.05)
        assert sink.poll() is None, f"sink died after garbage on {kind}"
    for kind, s in peers.items():
        s.send_multipart(encode_message(MsgType.END, {"count": 1, "from": "test"}))
        if kind in ("pair", "dealer", "router", "rep"):
            assert s.poll(30_000), f"no ACK on {kind}"
            assert decode_message(s.recv_multipart()).type is MsgType.ACK
    code, _, err = finish(sink, 30)
    for s in peers.values():
        s.close(0)
    ctx.term()
    assert code == 0, err[-2000:]
    got = read_stats(stats)
    assert got["sink"]["received"] == len(PEERS) == got["sink"]["announced"]
    assert got["bad_messages"] == sent_bad
    assert set(got["bad_message_kinds"]) <= {"short", "bad-type", "unknown-type", "bad-header"}


def test_proxy_chain_keeps_every_message(tmp_path: Path) -> None:
    n = 20_000
    procs = [
        start_sampler(
            "src", n, 200,
            *cc(name="data", type="push", method="connect", address="ipc://p-in"),
            *cc(name="data-ack", type="pull", method="bind", address="ipc://p-in-ack"),
        ),
        start_device(
            "proxy", "--id", "proxy",
            *cc(name="data-in", type="pull", method="bind", address="ipc://p-in"),
            *cc(name="data-in-ack", type="push", method="connect", address="ipc://p-in-ack"),
            *cc(name="data-out", type="dealer", method="bind", address="ipc://p-out"),
        ),
        start_sink(
            "dst",
            *cc(name="data", type="dealer", method="connect", address="ipc://p-out"),
            stats=tmp_path / "sink.json",
        ),
    ]  # fmt: skip
    finish_all(procs)
    got = read_stats(tmp_path / "sink.json")["sink"]
    assert got["received"] == got["announced"] == n


def _messages_out(controller: BusController, node: str) -> int:
    """What ``node`` sent so far (its get-metrics over the bus); 0 while it does not answer."""
    try:
        (reply,) = controller.request("get-metrics", node, timeout_s=2.0)
    except TimeoutError_:
        return 0
    return int(reply["data"]["messages_out"])


def test_sigint_to_a_running_sampler_still_ends_the_stream_exactly(tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    proxy = BusProxy(ctx, "default")  # the sampler on a bus: the test sees it sending
    proxy.start_thread()
    controller = BusController(ctx, proxy.endpoints)
    try:
        _sigint_a_running_sampler(tmp_path, controller, str(proxy.endpoints))
    finally:
        controller.close()
        proxy.close()
        ctx.term()


def _sigint_a_running_sampler(tmp_path: Path, controller: BusController, bus: str) -> None:
    sink = start_sink(
        "sink",
        *cc(name="data", type="pull", method="bind", address="ipc://i-data"),
        *cc(name="data-ack", type="push", method="bind", address="ipc://i-ack"),
        stats=tmp_path / "sink.json",
    )
    sampler = start_device(
        "sampler", "--id", "sampler", "--rate", "2000", "--msg-size", "100",
        "--stats-file", str(tmp_path / "sampler.json"), "--bus", bus,
        *cc(name="data", type="push", method="connect", address="ipc://i-data"),
        *cc(name="data-ack", type="pull", method="connect", address="ipc://i-ack"),
    )  # fmt: skip
    # endless sampler (no --max-iterations): the SIGINT comes while it is sending
    wait_until(
        lambda: _messages_out(controller, "sampler") > 100, 90, "the sampler sending", proc=sampler
    )
    sampler.send_signal(2)
    code_s, _, err_s = finish(sampler, 30)
    code_k, _, err_k = finish(sink, 30)
    assert (code_s, code_k) == (0, 0), err_s + err_k
    sent = read_stats(tmp_path / "sampler.json")["sampler"]
    got = read_stats(tmp_path / "sink.json")["sink"]
    assert sent["sent"] > 100 and sent["acked"] == 1
    assert got["received"] == got["announced"] == sent["sent"]


def test_a_sampler_whose_peer_never_comes_leaves_no_session_directory() -> None:
    # its connect made the session directory; no peer ever bound there, so it held no
    # ipc file of ours, and the empty directory stayed after Ctrl-C
    session = Path(os.environ["EVFLOW_RUNTIME_DIR"]) / "lonely"
    sampler = start_device(
        "sampler", "--id", "sampler", "--session", "lonely", "--ack-timeout-s", "0.5",
        *cc(name="data", type="push", method="connect", address="ipc://nobody-binds"),
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not session.is_dir() and sampler.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert session.is_dir(), "the sampler never connected"
    sampler.send_signal(2)
    code, _, err = finish(sampler, 30)
    assert code == 0, err
    assert not session.exists()

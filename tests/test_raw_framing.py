"""framing = "raw": evflow devices and plain ZeroMQ peers playing FairMQ devices (one
plain frame per message part, no evflow header) exchange data with exact counts.

FairMQ is not installed here: its zeromq transport puts nothing on the wire but the
message parts as plain frames (ZMTP 3.1, NULL security), which is what a pyzmq PUSH or
PULL socket does. ``fairmq_bsampler`` and ``fairmq_sink`` below also count
``--max-iterations`` the way FairMQ 1.10's BenchmarkSampler and Sink do: after the
transfer (send or receive, then ``if (n >= max) break; ++n``), so N moves N + 1 messages.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from _proc import finish, read_stats, start_device, wait_for_stderr
from evflow.runtime.framing import decoder, outgoing
from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message

DOC = Path(__file__).parents[1] / "docs" / "farm.md"
Reap = Callable[[subprocess.Popen[str]], subprocess.Popen[str]]


def cc(**keys: Any) -> tuple[str, str]:
    return ("--channel-config", ",".join(f"{k}={v}" for k, v in keys.items()))


@pytest.fixture
def ctx() -> Any:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def reap() -> Iterator[Reap]:
    """``reap(start_device(...))``: killed and waited for after a test that failed
    before it finished (the conftest would kill it too, with warnings about pipes)."""
    started: list[subprocess.Popen[str]] = []

    def add(proc: subprocess.Popen[str]) -> subprocess.Popen[str]:
        started.append(proc)
        return proc

    yield add
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _bound(ctx: zmq.Context[Any], kind: int) -> tuple[zmq.Socket[Any], str]:
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.rcvtimeo = 20_000
    sock.sndtimeo = 20_000  # (a device that never came fails the test, never hangs it)
    sock.bind("tcp://127.0.0.1:0")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def test_raw_channel_frames_are_the_payload(ctx: zmq.Context[Any]) -> None:
    cfg = parse_channel_config("name=data,type=pull,method=bind,address=tcp://127.0.0.1:0,"
                               "framing=raw")[0]  # fmt: skip
    ch = open_channel(ctx, cfg, "s")
    try:
        assert outgoing(ch, MsgType.EVENTS, {"x": 1}, [b"a", b"b"]) == [b"a", b"b"]
        assert outgoing(ch, MsgType.END, {"count": 3}) is None  # no raw form
        msg = decoder(ch, BadMessageCounter())([b"\x07garbage"])
        assert msg is not None and msg.type is MsgType.EVENTS and msg.payload == [b"\x07garbage"]
    finally:
        ch.close()
    with pytest.raises(Exception, match="bad framing 'fairmq'"):
        parse_channel_config("name=d,type=pull,method=bind,address=tcp://*:0,framing=fairmq")


def test_fairmq_style_sender_to_evflow_sink(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    """Like ``fairmq-bsampler --msg-size 1000`` (and multipart 2-part messages) -> sink."""
    n = 5000
    push, address = _bound(ctx, zmq.PUSH)
    sink = start_device(
        "sink", "--id", "sink", "--max-iterations", str(2 * n),
        "--stats-file", str(tmp_path / "sink.json"),
        *cc(name="data", type="pull", method="connect", address=address, framing="raw"),
    )  # fmt: skip
    payload = os.urandom(1000)
    for i in range(n):
        push.send(payload)
        push.send_multipart([b"head%d" % i, payload])  # one message, two parts
    code, _, err = finish(sink, 60)
    push.close()
    assert code == 0, err[-800:]
    stats = read_stats(tmp_path / "sink.json")["sink"]
    assert stats["received"] == 2 * n
    assert stats["payload_bytes"] == n * 1000 + sum(len(b"head%d" % i) + 1000 for i in range(n))
    assert stats["other"] == 0


def test_evflow_sampler_to_fairmq_style_receiver(ctx: zmq.Context[Any]) -> None:
    """Like ``fairmq-sink --max-iterations N``: each message is the bare payload."""
    n = 3000
    pull, address = _bound(ctx, zmq.PULL)
    sampler = start_device(
        "sampler", "--id", "sampler", "--max-iterations", str(n), "--msg-size", "100000",
        *cc(name="data", type="push", method="connect", address=address, framing="raw",
            linger=-1),
    )  # fmt: skip
    sizes = []
    for _ in range(n):
        frames = pull.recv_multipart(copy=False)
        sizes.append([len(f) for f in frames])
    code, _, err = finish(sampler, 60)
    assert code == 0, err[-800:]
    assert sizes == [[100000]] * n  # one plain frame each, no type byte, no header
    assert not pull.poll(200)  # and nothing else: no END on raw
    pull.close()


def test_proxy_bridges_fairmq_data_into_an_evflow_stream_with_exact_counts(
    ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """raw in (a FairMQ sampler) -> proxy -> evflow sink: the proxy stops after its
    count and ends the evflow side with END, which the sink checks against what came."""
    n = 4000
    push, raw_address = _bound(ctx, zmq.PUSH)
    sink = start_device(
        "sink", "--id", "sink", "--stats-file", str(tmp_path / "sink.json"),
        *cc(name="data", type="pair", method="bind", address="ipc://bridge"),
    )  # fmt: skip
    proxy = start_device(
        "proxy", "--id", "proxy", "--max-iterations", str(n),
        *cc(name="data-in", type="pull", method="connect", address=raw_address, framing="raw"),
        *cc(name="data-out", type="pair", method="connect", address="ipc://bridge"),
    )  # fmt: skip
    for i in range(n):
        push.send(b"event %d" % i)
    codes = [finish(p, 60) for p in (proxy, sink)]
    push.close()
    assert [c[0] for c in codes] == [0, 0], [c[2][-800:] for c in codes]
    stats = read_stats(tmp_path / "sink.json")["sink"]
    assert stats["received"] == stats["announced"] == n
    assert stats["payload_bytes"] == sum(len(b"event %d" % i) for i in range(n))


def test_proxy_sends_an_evflow_stream_out_raw(ctx: zmq.Context[Any]) -> None:
    """evflow sampler (END/ACK) -> proxy -> raw out to a FairMQ-style receiver."""
    n = 2000
    pull, raw_address = _bound(ctx, zmq.PULL)
    proxy = start_device(
        "proxy", "--id", "proxy",
        *cc(name="data-in", type="pair", method="bind", address="ipc://src"),
        *cc(name="data-out", type="push", method="connect", address=raw_address,
            framing="raw", linger=-1),
    )  # fmt: skip
    sampler = start_device(
        "sampler", "--id", "sampler", "--max-iterations", str(n), "--msg-size", "64",
        *cc(name="data", type="pair", method="connect", address="ipc://src"),
    )  # fmt: skip
    got = [pull.recv_multipart() for _ in range(n)]
    codes = [finish(p, 60) for p in (sampler, proxy)]
    assert [c[0] for c in codes] == [0, 0], [c[2][-800:] for c in codes]
    assert all(len(m) == 1 and len(m[0]) == 64 for m in got)
    assert not pull.poll(200)  # END stayed on the evflow side
    pull.close()


def test_channel_configs_in_the_docs_parse() -> None:
    """The FairMQ and evflow command lines in docs/farm.md use keys evflow accepts."""
    doc = (Path(__file__).parents[1] / "docs" / "farm.md").read_text()
    assert "fairmq-bsampler" in doc and "framing=raw" in doc
    configs = re.findall(r"--channel-config\s+'?([^\s']+)", doc)
    assert len(configs) >= 4
    for text in configs:
        parse_channel_config(text)


# --- FairMQ 1.10's counting, on the wire as its zeromq transport sends ----------------
def fairmq_bsampler(sock: zmq.Socket[Any], max_iterations: int, payload: bytes) -> int:
    """``fairmq-bsampler --max-iterations M``'s Run loop; returns the messages sent."""
    sent = iterations = 0
    while True:
        sock.send(payload)
        sent += 1
        if max_iterations > 0 and iterations >= max_iterations:
            return sent
        iterations += 1


def fairmq_sink(sock: zmq.Socket[Any], max_iterations: int) -> int:
    """``fairmq-sink --max-iterations M``'s Run loop; returns the messages received
    (an AssertionError when one more is awaited in vain: the real one waits for ever)."""
    received = iterations = 0
    while True:
        try:
            sock.recv_multipart()
        except zmq.Again:
            raise AssertionError(
                f"fairmq-sink --max-iterations {max_iterations} still waiting after "
                f"{received} messages"
            ) from None
        received += 1
        if max_iterations > 0 and iterations >= max_iterations:
            return received
        iterations += 1


def _assert_end_figures(stats: dict[str, Any]) -> None:
    """The sink's end report has figures, and they agree with each other."""
    assert stats["received"] > 0 and stats["payload_bytes"] > 0
    assert stats["elapsed_s"] > 0, stats
    assert stats["cpu_s"] > 0, stats
    assert stats["msg_per_s"] == pytest.approx(stats["received"] / stats["elapsed_s"])
    assert stats["gb_per_s"] == pytest.approx(stats["payload_bytes"] / stats["elapsed_s"] / 1e9)


def test_raw_sink_ended_by_its_count_reports_time_rates_and_cpu(
    ctx: zmq.Context[Any], tmp_path: Path, reap: Reap
) -> None:
    """A raw stream has no END (where the figures used to be taken): the count ends it."""
    n = 2000
    push, address = _bound(ctx, zmq.PUSH)
    sink = reap(start_device(
        "sink", "--id", "sink", "--max-iterations", str(n),
        "--stats-file", str(tmp_path / "sink.json"),
        *cc(name="data", type="pull", method="connect", address=address, framing="raw"),
    ))  # fmt: skip
    payload = os.urandom(1000)
    for _ in range(n):
        push.send(payload)
    code, _, err = finish(sink, 60)
    push.close()
    assert code == 0, err[-800:]
    stats = read_stats(tmp_path / "sink.json")["sink"]
    assert stats["received"] == n and stats["payload_bytes"] == n * 1000
    _assert_end_figures(stats)
    line = next(x for x in err.splitlines() if f"sink: received {n} messages" in x)
    assert "msg/s" in line and "GB/s" in line and "CPU" in line, line
    assert f"ended after --max-iterations {n}" in line, line


def test_raw_sink_stopped_by_sigint_reports_the_same(
    ctx: zmq.Context[Any], tmp_path: Path, reap: Reap
) -> None:
    """Without --max-iterations a STOP (here SIGINT) ends a raw stream, with the same
    end report: figures from the first to the last message."""
    n = 50
    push, address = _bound(ctx, zmq.PUSH)
    sink = reap(start_device(
        "sink", "--id", "sink", "--stats-file", str(tmp_path / "sink.json"),
        *cc(name="data", type="pull", method="connect", address=address, framing="raw"),
    ))  # fmt: skip
    payload = os.urandom(1000)
    log = ""
    # messages until the sink's rate log shows them arriving (a burst before its first
    # rate mark may never show: keep them coming)
    deadline = time.monotonic() + 60
    while "sink data[0]: in " not in log:
        assert time.monotonic() < deadline, log[-2000:]
        for i in range(n):
            push.send_multipart([b"part %d" % i, payload])
        log += _read_stderr(sink, 0.2)
    sink.send_signal(signal.SIGINT)
    code, _, err = finish(sink, 60)
    push.close()
    assert code == 0, (log + err)[-800:]
    stats = read_stats(tmp_path / "sink.json")["sink"]
    _assert_end_figures(stats)
    line = next(x for x in (log + err).splitlines() if "sink: received" in x)
    assert "msg/s" in line and "ended by a stop" in line, line


def _read_stderr(proc: subprocess.Popen[str], wait_s: float) -> str:
    """What the process logged within ``wait_s`` (not given back by ``finish``)."""
    assert proc.stderr is not None
    if not select.select([proc.stderr.fileno()], [], [], wait_s)[0]:
        return ""
    return os.read(proc.stderr.fileno(), 65536).decode()


def _raw_hints(err: str) -> list[str]:
    return [x for x in err.splitlines() if "looks like a raw (FairMQ) stream" in x]


def test_fairmq_frames_on_an_evflow_channel_warn_once_and_are_never_data(
    ctx: zmq.Context[Any], tmp_path: Path, reap: Reap
) -> None:
    """fairmq-bsampler's frames (one part, or several) on a channel without
    framing=raw: one WARNING naming the channel and the fix, every one refused and
    counted, and the evflow stream on the same channel goes on unharmed."""
    push, address = _bound(ctx, zmq.PUSH)
    sink = reap(start_device(
        "sink", "--id", "sink", "--stats-file", str(tmp_path / "sink.json"),
        *cc(name="data", type="pull", method="connect", address=address),
    ))  # fmt: skip
    payload = os.urandom(1000)
    for i in range(50):
        push.send(payload)  # --msg-size 1000
        push.send_multipart([payload, b"part %d" % i])  # --multipart true --num-parts 2
    push.send_multipart(encode_message(MsgType.EVENTS, None, (b"data",)))
    push.send_multipart(encode_message(MsgType.END, {"count": 1, "from": "sampler"}))
    code, _, err = finish(sink, 60)
    push.close()
    assert code == 0, err[-800:]
    stats = read_stats(tmp_path / "sink.json")
    assert stats["sink"]["received"] == stats["sink"]["announced"] == 1
    assert stats["sink"]["other"] == 0
    assert stats["bad_messages"] == 100
    (hint,) = _raw_hints(err)
    assert "[WARNING]" in hint and "sink/data[0]" in hint, hint
    assert "channel 'data' needs framing=raw" in hint, hint
    assert "dropped bad message" not in err  # the one line says it all


def test_refused_messages_never_count_and_a_counted_sink_gives_up_with_one_error(
    ctx: zmq.Context[Any], tmp_path: Path, reap: Reap
) -> None:
    """``evflow device sink --max-iterations N`` fed by fairmq-bsampler without
    framing=raw: its count can never be reached. Once nothing more arrives for
    ``--refused-timeout-s`` it ends in ERROR with one line (and its end report)."""
    n = 100
    push, address = _bound(ctx, zmq.PUSH)
    sink = reap(start_device(
        "sink", "--id", "sink", "--max-iterations", str(n), "--refused-timeout-s", "1",
        "--stats-file", str(tmp_path / "sink.json"),
        *cc(name="data", type="pull", method="connect", address=address),
    ))  # fmt: skip
    sent = fairmq_bsampler(push, n - 1, os.urandom(1000))
    code, _, err = finish(sink, 60)
    push.close()
    assert code == 1, err[-800:]
    errors = [x for x in err.splitlines() if "[ERROR]" in x]
    assert len(errors) == 1, err[-2000:]
    assert f"--max-iterations {n} cannot be reached (0 counted" in errors[0], errors
    assert "channel 'data' needs framing=raw" in errors[0], errors
    assert len([x for x in _raw_hints(err) if "[WARNING]" in x]) == 1
    stats = read_stats(tmp_path / "sink.json")
    assert stats["sink"]["received"] == 0 and stats["iterations"] == 0
    assert 0 < stats["bad_messages"] <= sent


def test_a_stop_ends_a_sink_waiting_on_refused_messages_with_its_report(
    ctx: zmq.Context[Any], tmp_path: Path, reap: Reap
) -> None:
    """``--refused-timeout-s 0`` waits for ever; a SIGINT then ends it cleanly."""
    push, address = _bound(ctx, zmq.PUSH)
    sink = reap(start_device(
        "sink", "--id", "sink", "--max-iterations", "10", "--refused-timeout-s", "0",
        "--stats-file", str(tmp_path / "sink.json"),
        *cc(name="data", type="pull", method="connect", address=address),
    ))  # fmt: skip
    fairmq_bsampler(push, 9, b"x" * 100)
    log = wait_for_stderr(sink, "needs framing=raw")
    sink.send_signal(signal.SIGINT)
    code, _, err = finish(sink, 60)
    push.close()
    assert code == 0, (log + err)[-800:]
    assert "[ERROR]" not in log + err
    stats = read_stats(tmp_path / "sink.json")
    assert stats["sink"]["received"] == 0 and stats["bad_messages"] > 0


# --- docs/farm.md's FairMQ command lines, as written ---------------------------------
def _doc_commands() -> list[list[list[str]]]:
    """The FairMQ section's code blocks, each a list of argv (continuations joined)."""
    text = DOC.read_text()
    section = text.split("## FairMQ on the wire", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    return [[shlex.split(c) for c in b.replace("\\\n", " ").splitlines() if c] for b in blocks]


def _option(argv: list[str], name: str) -> int:
    return int(argv[argv.index(name) + 1])


def _evflow_argv(argv: list[str], address: str, **replace: str) -> tuple[str, list[str]]:
    """``evflow device CLASS ...`` of the docs for ``start_device``: our address, and
    the options in ``replace`` (``msg_size="1000"``) changed."""
    assert argv[:2] == ["evflow", "device"], argv
    out = [re.sub(r"address=[^,]+", f"address={address}", a) for a in argv[3:]]
    for key, value in replace.items():
        out[out.index("--" + key.replace("_", "-")) + 1] = value
    return argv[2], out


def test_doc_fairmq_counts_match_evflow_counts() -> None:
    """FairMQ counts --max-iterations after the transfer: M on its side is M + 1 messages,
    the N of the evflow device across; the docs say so in words."""
    blocks = _doc_commands()
    pairs: list[tuple[list[str], list[str]]] = []
    for block in blocks:
        fmq = [a for a in block if a[0].startswith("fairmq-")]
        evf = [a for a in block if a[0] == "evflow"]
        if fmq and evf:
            pairs.append((fmq[0], evf[0]))
    assert {f[0] for f, _ in pairs} == {"fairmq-bsampler", "fairmq-sink"}, blocks
    for fairmq, evflow in pairs:
        assert _option(fairmq, "--max-iterations") + 1 == _option(evflow, "--max-iterations")
    assert "count `--max-iterations` after the transfer" in " ".join(DOC.read_text().split())


def test_doc_fairmq_sampler_to_evflow_sink_as_written(
    ctx: zmq.Context[Any], tmp_path: Path, reap: Reap
) -> None:
    """The docs' first example, their counts as written (smaller messages): everything
    fairmq-bsampler sends is what the evflow sink takes, and it ends by its count."""
    fairmq, evflow = next(
        (b[0], b[1]) for b in _doc_commands() if b and b[0][0] == "fairmq-bsampler"
    )
    push, address = _bound(ctx, zmq.PUSH)
    cls, argv = _evflow_argv(evflow, address)
    sink = reap(start_device(cls, *argv, "--stats-file", str(tmp_path / "sink.json")))
    sent = fairmq_bsampler(push, _option(fairmq, "--max-iterations"), os.urandom(1000))
    code, _, err = finish(sink, 120)
    assert code == 0, err[-800:]
    assert read_stats(tmp_path / "sink.json")["sink"]["received"] == sent
    push.close()


def test_doc_evflow_sampler_to_fairmq_sink_as_written(ctx: zmq.Context[Any], reap: Reap) -> None:
    """The docs' second example: fairmq-sink ends after exactly what the evflow
    sampler sends (with the sampler's count it would wait for one more for ever)."""
    fairmq, evflow = next((b[0], b[1]) for b in _doc_commands() if b and b[0][0] == "fairmq-sink")
    pull, address = _bound(ctx, zmq.PULL)
    pull.rcvtimeo = 10_000
    cls, argv = _evflow_argv(evflow, address, msg_size="1000")
    sampler = reap(start_device(cls, *argv))
    try:
        received = fairmq_sink(pull, _option(fairmq, "--max-iterations"))
    finally:
        code, _, err = finish(sampler, 120)
    assert code == 0, err[-800:]
    assert received == _option(evflow, "--max-iterations")
    assert not pull.poll(200)  # and nothing was left for a next one
    pull.close()

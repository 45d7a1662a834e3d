"""How a sender waits for the ACK of its END (``end_and_wait``, issue 21).

A receiver answers END when it reads it, behind everything queued before it: on a
loaded machine long after the END left. So a sender waits as long as its receiver stays
connected, and its ``ack_timeout_s`` counts from the receiver's disconnection. Before,
samplers, forwarders and sources counted it from the END and logged a spurious ``ERROR
... only 0 of 1 END acknowledgements`` on a correct run (only ``ToyEvents`` had the
connection-aware wait, in a copy of its own).

The receiver here is a hand-made peer that answers late: only after the sender has sent
its END three times (END goes again every second while unacknowledged), i.e. well past
the sender's ``ack_timeout_s`` of 1 s. No wall-clock bound is asserted: outcomes only.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from _proc import finish, read_stats, start_device
from evflow.runtime.device import Device
from evflow.runtime.devices.stream import end_and_wait
from evflow.transport.channel import ChannelConfig
from evflow.transport.coalesce import messages_of
from evflow.wire.messages import MsgType, decode_message, encode_message

#: END copies a late receiver waits for before it answers (or leaves): the first END
#: and two resends, END_RESEND_S (1 s) apart: past the senders' 1 s ack_timeout_s
LATE = 3
#: generous bound for anything to happen (a loaded 2-core machine)
WAIT_S = 120.0

SENDERS = {
    "sampler": ("sampler", "--max-iterations", "30", "--msg-size", "10"),
    "toy": ("evflow.qc.toy:ToyEvents", "--n-events", "300", "--batch", "10"),
    "source": ("_file_devices:Squares", "--n", "300", "--batch", "10"),
}


class Peer:
    """A receiver on ``address``: router (ACK on the data socket) or pull with a push
    ``-ack`` socket. It counts data and ENDs and answers when told."""

    def __init__(self, ctx: zmq.Context[Any], address: str, wiring: str) -> None:
        self.wiring = wiring
        self.files = [Path(address[len("ipc://") :]), Path(address[len("ipc://") :] + "-ack")]
        self.data = ctx.socket(zmq.ROUTER if wiring == "dealer" else zmq.PULL)
        self.data.bind(address)
        self.ack: zmq.Socket[Any] | None = None
        if wiring == "push":
            self.ack = ctx.socket(zmq.PUSH)
            self.ack.bind(address + "-ack")
        self.messages = 0
        self.ends = 0
        self._last: tuple[bytes | None, str] | None = None

    def serve(self, proc: subprocess.Popen[str], ends: int) -> None:
        """Take messages until ``ends`` ENDs arrived, the sender exited, or WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while self.ends < ends and proc.poll() is None and time.monotonic() < deadline:
            if not self.data.poll(100):
                continue
            frames = self.data.recv_multipart()
            ident = frames.pop(0) if self.wiring == "dealer" else None
            for message in messages_of(frames):  # (the sampler batches on push)
                msg = decode_message(message)
                if msg.type is MsgType.EVENTS:
                    self.messages += 1
                elif msg.type is MsgType.END:
                    self.ends += 1
                    self._last = (ident, str(msg.header["from"]))

    def answer(self) -> None:
        assert self._last is not None
        ident, sender = self._last
        frames = encode_message(MsgType.ACK, {"to": sender, "from": "peer"})
        if self.ack is not None:
            self.ack.send_multipart(frames)
        else:
            assert ident is not None
            self.data.send_multipart([ident, *frames])

    def close(self) -> None:
        self.data.close(0)
        if self.ack is not None:
            self.ack.close(0)
        for path in self.files:  # (libzmq leaves a closed socket's ipc file)
            path.unlink(missing_ok=True)


def start_sender(kind: str, address: str, wiring: str, tmp_path: Path) -> subprocess.Popen[str]:
    cls, *args = SENDERS[kind]
    channels = [f"name=data,type={wiring},method=connect,address={address}"]
    if wiring == "push":
        channels.append(f"name=data-ack,type=pull,method=connect,address={address}-ack")
    return start_device(
        cls, "--id", kind, "--ack-timeout-s", "1", "--stats-file", str(tmp_path / "s.json"),
        *[x for ch in channels for x in ("--channel-config", ch)], *args,
    )  # fmt: skip


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "[ERROR]" in line]


CASES = [("sampler", "dealer"), ("sampler", "push"), ("toy", "dealer"), ("source", "dealer")]


@pytest.mark.parametrize(("kind", "wiring"), CASES)
def test_a_late_ack_from_a_connected_receiver_is_no_error(
    tmp_path: Path, _runtime_dir: Path, kind: str, wiring: str
) -> None:
    address = f"ipc://{_runtime_dir}/late"
    ctx: zmq.Context[Any] = zmq.Context()
    peer = Peer(ctx, address, wiring)
    proc = start_sender(kind, address, wiring, tmp_path)
    try:
        peer.serve(proc, LATE)
        still_waiting = proc.poll() is None
        if still_waiting:
            peer.answer()
        code, _, err = finish(proc, WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        peer.close()
        ctx.term()
    assert still_waiting and peer.ends >= LATE, f"the sender did not wait:\n{err[-2000:]}"
    assert code == 0, err[-2000:]
    assert errors(err) == [], err[-2000:]
    summary = read_stats(tmp_path / "s.json")
    if kind in ("sampler", "source"):
        assert summary[kind]["acked"] == 1, summary


@pytest.mark.parametrize(("kind", "wiring"), [("sampler", "dealer"), ("toy", "dealer")])
def test_a_receiver_that_leaves_without_an_ack_ends_the_wait_with_one_line(
    tmp_path: Path, _runtime_dir: Path, kind: str, wiring: str
) -> None:
    """Connected and silent past the timeout (the sender waits), then gone (killed): the
    sender gives up ``ack_timeout_s`` after the disconnection, with one ERROR line."""
    address = f"ipc://{_runtime_dir}/gone"
    ctx: zmq.Context[Any] = zmq.Context()
    peer = Peer(ctx, address, wiring)
    proc = start_sender(kind, address, wiring, tmp_path)
    try:
        peer.serve(proc, LATE)
        still_waiting = proc.poll() is None
        peer.close()  # (as a killed process: its connection closes, nothing answers)
        code, _, err = finish(proc, WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        ctx.term()
    assert still_waiting and peer.ends >= LATE, f"the sender did not wait:\n{err[-2000:]}"
    assert code == 0, err[-2000:]
    said = errors(err)
    assert len(said) == 1, err[-2000:]
    assert "only 0 of 1 END acknowledgements on 'data'" in said[0], said
    assert "left" in said[0], said


def test_a_restarted_receiver_gets_the_end_again(tmp_path: Path, _runtime_dir: Path) -> None:
    """The receiver took the END and was killed before it answered; its restarted
    process, on the same address, gets the END again and answers: no error."""
    address = f"ipc://{_runtime_dir}/again"
    ctx: zmq.Context[Any] = zmq.Context()
    first = Peer(ctx, address, "dealer")
    proc = start_sender("sampler", address, "dealer", tmp_path)
    second: Peer | None = None
    try:
        first.serve(proc, 1)
        first.close()
        second = Peer(ctx, address, "dealer")
        second.serve(proc, 1)
        if second.ends:
            second.answer()
        code, _, err = finish(proc, WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if second is not None:
            second.close()
        ctx.term()
    assert first.ends == 1 and second.ends == 1, err[-2000:]
    assert code == 0 and errors(err) == [], err[-2000:]
    assert read_stats(tmp_path / "s.json")["sampler"]["acked"] == 1


# --- the ends of the wait, in process: the cap and a stop request -----------------------


@pytest.fixture
def pair(_runtime_dir: Path) -> Any:
    """A sender device with a dealer ``data`` channel connected to a silent router."""
    ctx: zmq.Context[Any] = zmq.Context()
    address = f"ipc://{_runtime_dir}/silent"
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    cfg = ChannelConfig(name="data", type="dealer", method="connect", address=address)
    dev = Device("snd", [cfg], context=ctx)
    dev._open(binding=False)
    yield dev, router
    dev.close_channels()
    router.close(0)
    ctx.term()
    Path(address[len("ipc://") :]).unlink(missing_ok=True)


def test_a_connected_receiver_that_never_answers_ends_at_the_cap(
    pair: Any, caplog: pytest.LogCaptureFixture
) -> None:
    dev, _router = pair
    with caplog.at_level(logging.WARNING, logger="evflow.device"):
        assert end_and_wait(dev, "data", [5], 60.0, max_wait_s=1.5) == (1, 0)
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert "hung" in said[0].getMessage()


def test_a_stop_request_ends_the_wait_with_a_warning(
    pair: Any, caplog: pytest.LogCaptureFixture
) -> None:
    dev, _router = pair
    dev.shutdown_requested = True
    with caplog.at_level(logging.WARNING, logger="evflow.device"):
        assert end_and_wait(dev, "data", [5], 0.5) == (1, 0)
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert "stop request" in said[0].getMessage()

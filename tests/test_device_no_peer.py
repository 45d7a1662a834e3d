"""A device whose peer never came (or went away) still stops on the first SIGINT.

Real ``evflow device`` processes and real signals: a sampler with no sink used to log
"orderly shutdown" and then block for ever in a send no peer would take.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from _proc import finish, start_device, wait_for_stderr
from _wait import wait_until
from evflow.errors import TimeoutError_
from evflow.runtime.bus import BusController, BusProxy

# a stop takes about 3 s (the loops look at their flags every 100 ms, END waits at most
# 2 s for a peer that stopped taking messages, a close lingers 0.5 s); a device blocked
# for ever in a send is what this bound catches, whatever the machine's load
STOP_BOUND_S = 60.0


def cc(**keys: Any) -> tuple[str, str]:
    return ("--channel-config", ",".join(f"{k}={v}" for k, v in keys.items()))


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """One SIGINT; (exit code, rest of the log). Fails past the bound."""
    proc.send_signal(signal.SIGINT)
    code, _, err = finish(proc, STOP_BOUND_S)
    return code, err


@pytest.fixture
def bus() -> Iterator[tuple[BusController, str]]:
    """A bus proxy of the default session, for the devices given ``--bus``: the test
    sees their counters (get-metrics), also while they wait in a send."""
    ctx: zmq.Context[Any] = zmq.Context()
    proxy = BusProxy(ctx, "default")
    proxy.start_thread()
    controller = BusController(ctx, proxy.endpoints)
    try:
        yield controller, str(proxy.endpoints)
    finally:
        controller.close()
        proxy.close()
        ctx.term()


def counter(controller: BusController, node: str, name: str) -> int:
    """``node``'s counter ``name`` (get-metrics); -1 while it does not answer."""
    try:
        (reply,) = controller.request("get-metrics", node, timeout_s=2.0)
    except TimeoutError_:
        return -1
    return int(reply["data"][name])


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_sampler_whose_sink_never_came_stops_on_the_first_sigint(tmp_path: Path) -> None:
    stats = tmp_path / "sampler.json"
    sampler = start_device(
        "sampler", "--id", "lonely", "--stats-file", str(stats),
        *cc(name="data", type="push", method="bind", address="ipc://never-read"),
    )  # fmt: skip
    wait_for_stderr(sampler, "lonely: RUNNING")
    # not a synchronisation: the assertions hold whenever the SIGINT comes; the pause
    # lets it find the sampler blocked in its send, on the peer that is not there
    time.sleep(0.3)
    code, err = stop(sampler)
    assert code == 0, err
    assert "EXITING" in err and "END on data[0] not sent: no peer is connected" in err
    assert json.loads(stats.read_text())["sampler"]["sent"] == 0


def test_a_sampler_connecting_to_nobody_over_tcp_stops_on_the_first_sigint(
    bus: tuple[BusController, str],
) -> None:
    # a tcp connect queues messages for a peer that may come: up to the high-water
    # mark, then the send blocks as with no peer at all
    controller, endpoints = bus
    sampler = start_device(
        "sampler", "--id", "tcp-lonely", "--msg-size", "10", "--bus", endpoints,
        *cc(name="data", type="push", method="connect", address=f"tcp://127.0.0.1:{unused_port()}",
            sndBufSize=50, batchUs=0),  # (batches: 50 in the queue would be 51200 messages)
    )  # fmt: skip
    wait_for_stderr(sampler, "tcp-lonely: RUNNING")
    # the queue is full (its high-water mark): the sampler waits in its send
    wait_until(
        lambda: counter(controller, "tcp-lonely", "messages_out") >= 50,
        60,
        "a full queue",
        proc=sampler,
    )
    code, err = stop(sampler)
    assert code == 0, err
    assert "EXITING" in err and "END on data[0] not sent" in err


def test_a_proxy_whose_output_never_came_stops_and_so_does_its_sampler(
    tmp_path: Path, bus: tuple[BusController, str]
) -> None:
    controller, endpoints = bus
    proxy = start_device(
        "proxy", "--id", "stuck-proxy", "--bus", endpoints,
        *cc(name="data-in", type="pull", method="bind", address="ipc://np-in"),
        *cc(name="data-out", type="push", method="bind", address="ipc://np-out"),
    )  # fmt: skip
    wait_for_stderr(proxy, "stuck-proxy: RUNNING")
    sampler = start_device(
        "sampler", "--id", "feeder", "--msg-size", "10", "--stats-file", str(tmp_path / "s.json"),
        *cc(name="data", type="push", method="connect", address="ipc://np-in", sndBufSize=20),
    )  # fmt: skip
    try:
        wait_for_stderr(sampler, "feeder: RUNNING")
        # the proxy holds a message for nobody (its counters show it took one)
        wait_until(
            lambda: counter(controller, "stuck-proxy", "messages_in") >= 1,
            60,
            "the proxy taking a message",
            proc=proxy,
        )
        code, err = stop(proxy)
        assert code == 0, err
        assert "1 message not forwarded" in err and "EXITING" in err
        # the feeder's peer went away: its first SIGINT ends it too, END unsent
        code, err = stop(sampler)
        assert code == 0, err
        assert "EXITING" in err
        assert json.loads((tmp_path / "s.json").read_text())["sampler"]["sent"] > 0
    finally:
        for p in (proxy, sampler):
            if p.poll() is None:
                p.kill()
                p.communicate()

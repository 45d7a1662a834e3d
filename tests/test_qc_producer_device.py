"""``evflow device qc-producer``: a QcTask on the events of a channel, as its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from evflow.errors import ConfigurationError
from evflow.event import DataStore
from evflow.qc.merger import QcMerger
from evflow.qc.producer_device import load_task_class
from evflow.qc.publication import PublishedObject
from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel
from evflow.wire.codec import encode_batch, encode_event
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from test_qc_layers import RUN, assert_equal_objects, event, reference  # noqa: E402

SESSION = "qcprod"


def test_producer_device_publishes_the_events_it_receives() -> None:
    pubs: list[PublishedObject] = []
    merger = QcMerger(
        "qc-merger",
        parse_channel_config("name=qc-in,type=router,method=bind,address=ipc://qcm"),
        session=SESSION, cycle_s=0.1, inputs=1, run_number=RUN, on_publish=[pubs.append],
    )  # fmt: skip
    thread = threading.Thread(target=merger.run)
    thread.start()
    context: zmq.Context[Any] = zmq.Context()
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    argv = [
        sys.executable, "-m", "evflow", "device", "qc-producer", "--id", "prod-a",
        "--task", "evflow.qc.toy:ToyQc", "--task-params", '{"name": "det"}',
        "--merger", "ipc://qcm", "--cycle-s", "0.05", "--run-number", str(RUN),
        "--session", SESSION, "--severity", "warn",
        "--channel-config", "name=data-in,type=pull,method=bind,address=ipc://qcp-in",
        "--channel-config", "name=data-in-ack,type=push,method=bind,address=ipc://qcp-ack",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    (out_cfg,) = parse_channel_config("name=out,type=push,method=connect,address=ipc://qcp-in")
    (ack_cfg,) = parse_channel_config("name=ack,type=pull,method=connect,address=ipc://qcp-ack")
    out, acks = open_channel(context, out_cfg, SESSION), open_channel(context, ack_cfg, SESSION)
    try:
        n = 1200
        for start in range(0, n, 100):
            batch = encode_batch(event(i) for i in range(start, start + 100))
            out.send(encode_message(MsgType.EVENTS, None, batch))
        out.send(encode_message(MsgType.EVENTS, None, [b"\xc1not an event"]))
        out.send(encode_message(MsgType.END, {"count": 13, "from": "test"}))
        assert acks.poll(30_000), "no ACK of END from the producer device"
        ack = BadMessageCounter().decode(acks.recv())
        assert ack is not None and ack.type is MsgType.ACK and ack.header["count"] == n
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        assert "undecodable events dropped" in stderr
        thread.join(30)
        assert not thread.is_alive()
    finally:
        out.close(0)
        acks.close(0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        merger.request_shutdown()
        thread.join(10)
        context.term()
    final = {p.name: p for p in pubs if p.metadata["final"]}
    assert_equal_objects(final, reference(list(range(n))))
    assert final["h1"].completeness["ended"] == ["prod-a"]


def bad_event(i: int, kind: str) -> DataStore:
    """Event i without the field ToyQc reads first (KeyError), or with a text in it
    (ValueError): its fill raises before it fills anything."""
    store = event(i)
    if kind == "missing":
        del store["x"]
    else:
        store["x"] = "not a number"
    return store


def test_a_task_that_raises_on_some_events_is_counted_and_the_producer_goes_on(
    tmp_path: Path,
) -> None:
    """Decodable events the task cannot fill (a field missing, a text where it wants a
    number): each left out and counted per kind, the first of each kind logged with its
    traceback, a summary line per kind at the end; every other event is merged."""
    pubs: list[PublishedObject] = []
    merger = QcMerger(
        "qc-merger",
        parse_channel_config("name=qc-in,type=router,method=bind,address=ipc://qcm"),
        session=SESSION, cycle_s=0.1, inputs=1, run_number=RUN, on_publish=[pubs.append],
    )  # fmt: skip
    thread = threading.Thread(target=merger.run)
    thread.start()
    context: zmq.Context[Any] = zmq.Context()
    stats = tmp_path / "stats.json"
    argv = [
        sys.executable, "-m", "evflow", "device", "qc-producer", "--id", "prod-a",
        "--task", "evflow.qc.toy:ToyQc", "--task-params", '{"name": "det"}',
        "--merger", "ipc://qcm", "--cycle-s", "0.05", "--run-number", str(RUN),
        "--session", SESSION, "--severity", "warn", "--stats-file", str(stats),
        "--channel-config", "name=data-in,type=pull,method=bind,address=ipc://qcp-in",
        "--channel-config", "name=data-in-ack,type=push,method=bind,address=ipc://qcp-ack",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    (out_cfg,) = parse_channel_config("name=out,type=push,method=connect,address=ipc://qcp-in")
    (ack_cfg,) = parse_channel_config("name=ack,type=pull,method=connect,address=ipc://qcp-ack")
    out, acks = open_channel(context, out_cfg, SESSION), open_channel(context, ack_cfg, SESSION)
    n, bad = 1000, {"missing": [7, 300, 301, 999], "text": [12, 500]}
    kind_of = {i: kind for kind, uids in bad.items() for i in uids}
    good = [i for i in range(n) if i not in kind_of]
    try:
        for start in range(0, n, 100):
            stores = [bad_event(i, kind_of[i]) if i in kind_of else event(i)
                      for i in range(start, start + 100)]  # fmt: skip
            out.send(encode_message(MsgType.EVENTS, None, encode_batch(stores)))
        out.send(encode_message(MsgType.EVENTS, None, encode_event(bad_event(n, "missing"))))
        out.send(encode_message(MsgType.END, {"count": 11, "from": "test"}))
        assert acks.poll(30_000), "no ACK of END from the producer device"
        ack = BadMessageCounter().decode(acks.recv())
        assert ack is not None and ack.type is MsgType.ACK and ack.header["count"] == n + 1
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        thread.join(30)
        assert not thread.is_alive()
    finally:
        out.close(0)
        acks.close(0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        merger.request_shutdown()
        thread.join(10)
        context.term()
    # one traceback per kind, then one line per kind at the end
    assert stderr.count("Traceback (most recent call last)") == 2, stderr
    assert "QC task 'det' raised KeyError on event uid=7" in stderr
    assert "QC task 'det' raised ValueError on event uid=12" in stderr
    assert "in fill" in stderr  # the user's frame is in the traceback
    assert ("QC task 'det' failed on 7 of 1001 events: KeyError on 5 (uids 7, 300, 301, "
            "999, 1000): \"event uid=7 has no object 'x'") in stderr  # fmt: skip
    assert "failed on 7 of 1001 events: ValueError on 2 (uids 12, 500)" in stderr
    qc = json.loads(stats.read_text())["qc"]
    assert qc["task_errors"] == 7 and qc["task_error_kinds"] == {"KeyError": 5, "ValueError": 2}
    assert qc["events_in"] == n + 1 and qc["events"] == len(good)
    final = {p.name: p for p in pubs if p.metadata["final"]}
    assert_equal_objects(final, reference(good))
    assert final["h1"].event_count == len(good)


def test_task_class_errors_name_the_problem() -> None:
    with pytest.raises(ConfigurationError, match="module:Class"):
        load_task_class("nocolon")
    with pytest.raises(ConfigurationError, match="cannot be loaded"):
        load_task_class("no_such_module_xyz:Task")
    with pytest.raises(ConfigurationError, match="not a subclass"):
        load_task_class("evflow.qc.merger:QcMerger")

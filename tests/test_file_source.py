"""The ``file-source`` device and the public source/sink API (``evflow.runtime.devices``).

Real topologies through ``evflow up``: a ROOT file (uproot-HZZ.root) read in chunks
feeds QC producers whose merged histograms equal a sequential fill bin by bin, and an
``event-sink`` whose count equals the file's entries; a record file and a source
written as a user would (public names only) feed a user's sink that sees every event
exactly once. A missing file, a missing tree, a foreign file: one error line before
anything starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

import evflow
import evflow.runtime.devices as public
from _proc import finish, read_stats, start_device, wait_for_line
from evflow.demo.muonqc import MUON_BRANCHES, MuonQc
from evflow.io.file_source import FileSource, resolve_input_file
from evflow.io.records import RecordWriter
from evflow.io.root import RootInput
from evflow.qc.repository import Repository
from evflow.runtime.devices import BUILTIN_DEVICES
from evflow.wire.codec import encode_batch, encode_event, pack_frames
from evflow.wire.messages import MsgType, encode_message

HERE = Path(__file__).parent
EXAMPLE = HERE.parent / "examples" / "topologies" / "file_qc.toml"
HZZ = resolve_input_file("uproot-HZZ.root")
HZZ_ENTRIES = 2421


def up(
    topology: Path, cwd: Path, *args: str, timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "evflow", "up", "--quiet", str(topology), *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=env,
    )  # fmt: skip


def stats(stats_dir: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in stats_dir.glob("*.json")}


def sources_to_sink(source: str, params: str, sink: str = "event-sink", copies: int = 1,
                    sink_params: str = "{}") -> str:  # fmt: skip
    """A topology: ``copies`` instances of ``source`` -> one ``sink``."""
    return (
        f'name = "fs"\n[devices.source]\nclass = "{source}"\ninstances = {copies}\n'
        f"params = {params}\n"
        'channels = [{ name = "data", type = "dealer", connect = "sink.data" }]\n'
        f'[devices.sink]\nclass = "{sink}"\nparams = {sink_params}\n'
        'channels = [{ name = "data", type = "router", bind = true }]\n'
    )


def test_the_devices_are_built_in_and_the_api_is_public() -> None:
    assert BUILTIN_DEVICES["file-source"] == "evflow.io.file_source:FileSource"
    assert BUILTIN_DEVICES["event-sink"] == "evflow.runtime.devices.eventsink:SinkDevice"
    for name in public.__all__:
        assert not name.startswith("_") and hasattr(public, name), name
    assert issubclass(FileSource, public.SourceDevice)
    wanted = {"SourceDevice", "SinkDevice", "send_end", "wait_for_acks", "acknowledge",
              "send_when_ready"}  # fmt: skip
    assert wanted <= set(public.__all__)


def test_example_file_qc_stores_the_sequential_fill_bin_by_bin(tmp_path: Path) -> None:
    """2 file sources (halves of uproot-HZZ.root) -> 2 producers -> merger -> repository:
    the final objects equal MuonQc filled with every entry in order."""
    proc = up(EXAMPLE, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = MuonQc(name="muon")
    ref.initialize()
    for store in RootInput(file=HZZ, branches=list(MUON_BRANCHES), step_size=500).events(0):
        ref.event(store)
    assert int(ref.objects["n_mu"].sum(flow=True)) == HZZ_ENTRIES
    with Repository(tmp_path / "file-qc.sqlite", readonly=True) as repo:
        assert sorted(repo.paths()) == sorted(f"qc/muon/{n}" for n in ref.objects)
        for name, want in ref.objects.items():
            got = repo.latest(f"qc/muon/{name}", run=1)
            assert got is not None and got.metadata["final"], name
            assert np.array_equal(got.obj.view(flow=True), want.view(flow=True)), name
            assert got.event_count == HZZ_ENTRIES
            assert got.completeness["ended"] == ["producer_0", "producer_1"]


def test_root_file_in_chunks_to_an_event_sink_counts_every_entry(tmp_path: Path) -> None:
    """3 sources share the file (step_size 300, 64 events a message): the sink counts
    2421 events, messages = the sum the ENDs announced."""
    topo = tmp_path / "t.toml"
    params = ('{ file = "uproot-HZZ.root", branches = "NMuon", step_size = 300, batch = 64, '
              "copies = 3 }")  # fmt: skip
    topo.write_text(sources_to_sink("file-source", params, copies=3))
    proc = up(topo, tmp_path, "--stats-dir", str(tmp_path / "stats"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = stats(tmp_path / "stats")
    sink = found["sink"]["sink"]
    assert sink["events"] == sink["events_announced"] == HZZ_ENTRIES
    assert sink["received"] == sink["announced"] and sink["ends"] == 3
    parts = [found[f"source_{k}"]["source"] for k in range(3)]
    assert [p["entries"] for p in parts] == [807, 807, 807]
    assert [p["first"] for p in parts] == [0, 807, 1614]
    assert all(p["acked"] == 1 and p["exhausted"] for p in parts)


def test_record_file_to_a_users_sink_every_event_once(tmp_path: Path) -> None:
    n = 1000
    file = tmp_path / "in.evr"
    with RecordWriter(str(file)) as w:
        for i in range(n):
            store = evflow.DataStore(evflow.EventMeta(uid=i, event=i))
            store["x"] = 3 * i
            w.write_record(uid=i, flags=0, payload=pack_frames(encode_event(store)))
    topo = tmp_path / "t.toml"
    topo.write_text(sources_to_sink("file-source", f'{{ file = "{file}", batch = 7, copies = 2 }}',
                                    sink="_file_devices:SumSink", copies=2))  # fmt: skip
    proc = up(topo, tmp_path, "--stats-dir", str(tmp_path / "stats"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = stats(tmp_path / "stats")["sink"]
    assert found["sum"] == {"total": 3 * n * (n - 1) // 2, "uids": n, "distinct": n,
                            "min": 0, "max": n - 1}  # fmt: skip
    assert found["sink"]["events"] == found["sink"]["events_announced"] == n


def test_a_users_source_and_sink_with_the_public_api(tmp_path: Path) -> None:
    n = 5000
    topo = tmp_path / "t.toml"
    topo.write_text(sources_to_sink("_file_devices:Squares", f"{{ n = {n}, copies = 2 }}",
                                    sink="_file_devices:SumSink", copies=2))  # fmt: skip
    proc = up(topo, tmp_path, "--stats-dir", str(tmp_path / "stats"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = stats(tmp_path / "stats")
    assert found["sink"]["sum"]["total"] == sum(i * i for i in range(n))
    assert found["sink"]["sum"]["distinct"] == n
    assert found["sink"]["sink"]["ends"] == 2
    assert sum(found[f"source_{k}"]["source"]["events"] for k in range(2)) == n


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ('{ file = "nope.root" }', "ROOT input file 'nope.root' does not exist"),
        (f'{{ file = "{HZZ}", tree = "evts" }}', "has no tree 'evts' (trees in it: events)"),
        (f'{{ file = "{HZZ}", branches = "NMuon,Muon_Pt" }}', "has no branch 'Muon_Pt'"),
        ('{ file = "BROKEN.root" }', "is not a readable ROOT file"),
        ('{ file = "BROKEN.evr" }', "is not an evflow record file"),
        ('{ file = "missing.evr" }', "does not exist"),
    ],
)
def test_a_bad_input_is_one_error_line_before_anything_starts(
    tmp_path: Path, params: str, message: str
) -> None:
    (tmp_path / "BROKEN.root").write_bytes(b"not a ROOT file at all" * 100)
    (tmp_path / "BROKEN.evr").write_bytes(b"garbage" * 100)
    topo = tmp_path / "t.toml"
    topo.write_text(sources_to_sink("file-source", params))
    proc = up(topo, tmp_path, timeout_s=60)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"evflow: error: {topo}: device 'source': "), lines[0]
    assert message in lines[0]


def _push_to_event_sink(
    tmp_path: Path, messages: list[list[bytes]]
) -> tuple[int, str, dict[str, Any]]:
    """Run ``evflow device event-sink`` on a pull socket, push ``messages``; its exit
    code, stderr and summary."""
    stats_file = tmp_path / "sink.json"
    channel = "name=data,type=pull,method=bind,address=ipc://es"
    sink = start_device("event-sink", "--id", "sink", "--stats-file", str(stats_file),
                        "--channel-config", channel)  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{os.environ['EVFLOW_RUNTIME_DIR']}/default/es")
    for frames in messages:
        push.send_multipart(frames)
    code, _, err = finish(sink, 30)
    push.close(0)
    ctx.term()
    return code, err, read_stats(stats_file)["sink"]


def _events(*uids: int) -> list[Any]:
    stores = []
    for i in uids:
        store = evflow.DataStore(evflow.EventMeta(uid=i, event=i))
        store["x"] = np.arange(i, dtype=np.float32)
        stores.append(store)
    return encode_message(MsgType.EVENTS, None, encode_batch(stores))


def test_event_sink_refuses_what_does_not_decode_and_never_passes_it_on(tmp_path: Path) -> None:
    garbage = [b"\x03", b"\x80", b"\x93\x01\x02"]  # EVENTS whose payload is no event
    code, err, sink = _push_to_event_sink(tmp_path, [
        _events(0, 1, 2), garbage, _events(3),
        encode_message(MsgType.END, {"count": 3, "events": 4, "from": "t"}),
    ])  # fmt: skip
    # 2 good messages of the 3 the sender counted: loss is never silent
    assert code == 1
    assert "received 2 messages but the senders announced 3" in err
    assert sink["events"] == 4 and sink["bad_events"] == 1
    assert err.count("undecodable events dropped") == 1


def test_event_sink_checks_the_events_an_end_announces(tmp_path: Path) -> None:
    code, err, _ = _push_to_event_sink(tmp_path, [
        _events(0, 1), _events(2),
        encode_message(MsgType.END, {"count": 2, "events": 5, "from": "t"}),
    ])  # fmt: skip
    assert code == 1
    assert "received 3 events but the senders announced 5" in err


def test_event_sink_takes_an_end_with_a_bad_count_without_crashing(tmp_path: Path) -> None:
    code, err, sink = _push_to_event_sink(tmp_path, [
        _events(0), encode_message(MsgType.END, {"count": "many", "events": -1, "from": "pusher"}),
    ])  # fmt: skip
    assert code == 0, err[-2000:]
    assert sink["events"] == 1 and sink["ends"] == 1
    assert "END without a valid count" in err


def test_a_stop_pauses_a_source_and_run_goes_on_with_one_end(tmp_path: Path) -> None:
    """STOP while the source runs: no END; RUN again: the stream goes on where it
    stopped and ends once, with every event (a sink stops at the first END)."""
    n = 300
    sink_stats, source_stats = tmp_path / "sink.json", tmp_path / "source.json"
    channel = "name=data,type=router,method=bind,address=ipc://p"
    sink = start_device("event-sink", "--id", "sink", "--stats-file", str(sink_stats),
                        "--channel-config", channel)  # fmt: skip
    source = start_device(
        "_file_devices:TalkingSquares", "--id", "source", "--n", str(n), "--batch", "1",
        "--rate", "100", "--control", "interactive", "--stats-file", str(source_stats),
        "--channel-config", "name=data,type=dealer,method=connect,address=ipc://p",
        stdin=subprocess.PIPE,
    )  # fmt: skip
    assert source.stdin is not None

    def say(keys: str) -> None:
        assert source.stdin is not None
        source.stdin.write(keys)
        source.stdin.flush()

    say("i\nk\nb\nx\nj\nr\n")
    wait_for_line(source, "AT 10")
    say("s\n")
    paused = [int(x[5:]) for x in wait_for_line(source, "POST_RUN") if x.startswith("SENT ")]
    assert len(paused) == 1 and 10 <= paused[0] < n
    say("r\n")
    ended = [int(x[5:]) for x in wait_for_line(source, "POST_RUN") if x.startswith("SENT ")]
    assert ended == [n]
    say("q\n")
    code, _, err = finish(source, 30)
    assert code == 0, err[-2000:]
    code, _, err = finish(sink, 30)
    assert code == 0, err[-2000:]
    got = read_stats(sink_stats)["sink"]
    assert got["events"] == got["events_announced"] == n and got["ends"] == 1
    assert read_stats(source_stats)["source"]["acked"] == 1

"""Decode bombs: a QC message that declares more bins than it carries is refused.

A few hundred bytes of histogram description can declare 10^13 cells; boost-histogram
allocates them before it looks at the bins that came along. The codec checks the
declared sizes against ``HistogramLimits`` first and raises ``CodecError``; a merger
and a repository device count such a message and go on.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import boost_histogram as bh
import hist
import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evflow.errors import CodecError
from evflow.processing.parallel.deltas import DeltaEncoder, DeltaMerger
from evflow.processing.parallel.histlimits import HistogramLimits, current_limits
from evflow.processing.parallel.persist import decode_persistent, encode_persistent
from evflow.qc.layers import build_layers, launch_layers
from evflow.qc.objects import decode_object, encode_object
from evflow.qc.repository import Repository
from evflow.runtime.supervisor import Supervisor
from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel
from evflow.transport.paths import session_dir
from evflow.wire.messages import MsgType, encode_message

sys.path.insert(0, str(Path(__file__).parent))
from test_qc_layers import RUN, reference, run_producer
from test_qc_merger_device import ctl_metrics
from test_qc_repository_device import CHECKS, repository_argv, wait_for

BIG = 3_000_000


def regular(bins: int) -> dict[str, Any]:
    return {"type": "regular", "lower": 0.0, "upper": 1.0, "bins": bins,
            "underflow": True, "overflow": True, "circular": False}  # fmt: skip


def bomb_uhi(n_axes: int = 3, bins: int = BIG, storage: str = "double") -> dict[str, Any]:
    """A histogram description of ``n_axes`` x ``bins`` cells and no bins at all."""
    return {"uhi_schema": 1, "axes": [regular(bins)] * n_axes, "storage": {"type": storage}}


def bomb_object(n_axes: int = 3) -> bytes:
    """What the chaos campaign sent: a QC object of ~300 bytes, 3 axes of 3 x 10^6 bins."""
    head = msgpack.packb({"v": 1, "items": [["o", "bh", bomb_uhi(n_axes)]]})
    return msgpack.packb({"qv": 1, "h": head, "f": []})


def bomb_delta_frames(kind: str) -> list[bytes]:
    """A histogram delta whose spec (``h``: beside a small bin frame; ``x``: a whole
    histogram) declares the bomb's axes."""
    spec = msgpack.packb([msgpack.packb({"v": 1, "items": [["t", "bh", bomb_uhi(2)]]})])
    item = ["h1", "h", spec, 1] if kind == "h" else ["h1", "x", spec]
    head = msgpack.packb({"v": 1, "items": [item]})
    return [head, bytes(64)] if kind == "h" else [head]


def test_the_campaigns_bomb_is_a_codec_error_naming_the_limit() -> None:
    data = bomb_object()
    assert len(data) < 400
    expected = (
        r"histogram of 3000002 x 3000002 x 3000002 cells \(flow bins included\) refused: "
        r"at most 10000000 cells \(EVFLOW_MAX_HIST_CELLS raises the limit\)"
    )
    with pytest.raises(CodecError, match=expected):
        decode_object(data)
    # two axes: 9 x 10^12 cells, which boost-histogram tried to allocate (bad_alloc)
    with pytest.raises(CodecError, match="refused"):
        decode_object(bomb_object(2))


@pytest.mark.parametrize("kind", ["h", "x"])
def test_bombs_in_a_delta_spec_are_codec_errors(kind: str) -> None:
    # a QC merger's limits; the parallel engine's (no cap) still wants the bins
    with pytest.raises(CodecError, match="refused"):
        DeltaMerger(current_limits()).decode(bomb_delta_frames(kind))
    with pytest.raises(CodecError, match="without its bins"):
        DeltaMerger().decode(bomb_delta_frames(kind))


def test_a_small_description_without_its_bins_is_refused() -> None:
    # within the cell limit, but no bins: 10^6 cells each from a few bytes would add up
    for storage in ("double", "weighted", "mean"):
        head = msgpack.packb({"v": 1, "items": [["o", "bh", bomb_uhi(1, 1000, storage)]]})
        with pytest.raises(CodecError, match="without its bins"):
            decode_object(msgpack.packb({"qv": 1, "h": head, "f": []}))
    # bins fewer than the axes declare: refused before the histogram is built
    values = np.zeros(10)
    _, frames, _ = encode_persistent({"v": values})
    uhi = bomb_uhi(1, 900_000)
    uhi["storage"]["values"] = {"__nd__": 0, "dtype": "<f8", "shape": [10]}
    head = msgpack.packb({"v": 1, "items": [["o", "bh", uhi]]})
    with pytest.raises(CodecError, match=r"bins 'values' of shape \(10,\), its axes make "
                                         r"\(900002,\)"):  # fmt: skip
        decode_persistent(head, frames)


def test_many_whole_histograms_in_one_delta_share_one_allowance() -> None:
    # each asks for 48 MB of zeros (under the 64 MB allowance of one); 40 of them would
    # be 2 GB from a message of a few kB
    spec = msgpack.packb([
        msgpack.packb({"v": 1, "items": [["t", "bh", {
            "uhi_schema": 1, "axes": [regular(6_000_000 - 2)],
            "storage": {"type": "double", "values": {"__nd__": 0, "dtype": "<f8",
                                                     "shape": [6_000_000]}}}]]}),
        48_000_000,
    ])  # fmt: skip
    head = msgpack.packb({"v": 1, "items": [[f"h{i}", "x", spec] for i in range(40)]})
    with pytest.raises(CodecError, match="zero bytes"):
        DeltaMerger().decode([head])


def test_limits_are_parameters_and_the_defaults_hold_real_histograms() -> None:
    h = hist.Hist.new.Reg(100, 0, 1).Reg(100, 0, 1).Weight()
    h.fill(np.random.default_rng(1).random(50), np.random.default_rng(2).random(50))
    head, frames, _ = encode_persistent({"h": h})
    assert decode_persistent(head, frames)["h"] == h
    with pytest.raises(
        CodecError, match=r"102 x 102 cells \(flow bins included\) refused: at most 10000 "
    ):
        decode_persistent(head, frames, HistogramLimits(max_cells=10_000))
    with pytest.raises(CodecError, match="2 axes refused"):
        decode_persistent(head, frames, HistogramLimits(max_axes=1))
    # the parallel engine's own objects: no cap (the bins came with them)
    big = hist.Hist.new.Reg(20_000, 0, 1).Double()
    head, frames, _ = encode_persistent({"h": big})
    assert decode_persistent(head, frames)["h"] == big
    with pytest.raises(CodecError, match="20002 cells"):
        decode_object(encode_object(big), HistogramLimits(max_cells=20_000))
    two = encode_persistent({"a": 1, "b": 2})
    with pytest.raises(CodecError, match="2 items"):
        decode_persistent(two[0], two[1], HistogramLimits(max_objects=1))


def _every_axis_kind() -> list[Any]:
    x = np.random.default_rng(3).random(100)
    out: list[Any] = [
        bh.Histogram(bh.axis.Regular(10, 1, 100, transform=bh.axis.transform.log)),
        bh.Histogram(bh.axis.Integer(-3, 4), bh.axis.Boolean()),
        bh.Histogram(bh.axis.IntCategory([1, 5], growth=True), bh.axis.StrCategory(["a"])),
        bh.Histogram(bh.axis.Variable([0, 0.1, 1], underflow=False), storage=bh.storage.Mean()),
        bh.Histogram(
            bh.axis.Regular(4, 0, 1, underflow=False, overflow=False),
            storage=bh.storage.WeightedMean(),
        ),
        bh.Histogram(bh.axis.Regular(5, 0, 1, growth=True), storage=bh.storage.Int64()),
        bh.Histogram(
            *(bh.axis.Regular(2, 0, 1, underflow=False, overflow=False) for _ in range(16))
        ),
    ]
    out += [
        bh.Histogram(bh.axis.Regular(4, 0, 1, circular=True), bh.axis.Integer(0, 3, circular=True)),
        bh.Histogram(bh.axis.Variable([0, 1, 2], circular=True), storage=bh.storage.Weight()),
        hist.Hist.new.Reg(5, 0, 1, name="pt", label="p_T").StrCat([], growth=True).Double(),
        bh.Histogram(),  # no axis: one cell
    ]
    out[-2].fill([0.5, 0.7], ["a", "b"])
    out[0].fill(x * 100)
    out[3].fill(x, sample=x)
    out[4].fill(x, sample=x, weight=x + 1)  # (empty, its variance comes back NaN)
    return out


@pytest.mark.parametrize(
    "h",
    _every_axis_kind(),
    ids=[
        "log",
        "int-bool",
        "cat",
        "var-mean",
        "wmean",
        "growth",
        "16d",
        "circular",
        "var-circular",
        "named-growing-cat",
        "no-axis",
    ],
)
def test_every_axis_and_storage_kind_still_round_trips(h: Any) -> None:
    same(decode_object(encode_object(h)), h)
    # and as a delta of the parallel engine (its spec travels without bins)
    frames = DeltaEncoder().snapshot({"h": h})
    if frames is not None:
        merger = DeltaMerger(current_limits())
        merger.merge(frames)
        same(merger.merged["h"], h)


def same(got: Any, want: Any) -> None:
    """Equal axes and storage, bins equal up to rounding (a WeightedMean's variance is
    recomputed from its UHI form: the last bits differ, limits or not)."""
    assert got.axes == want.axes and got.storage_type is want.storage_type
    a, b = got.view(flow=True), want.view(flow=True)
    for field in a.dtype.names or (None,):
        x, y = (a, b) if field is None else (a[field], b[field])
        assert np.allclose(x, y, equal_nan=True), field


def test_the_limits_come_from_the_environment() -> None:
    code = (
        "from evflow.qc.objects import decode_object, encode_object\n"
        "import hist\n"
        "h = hist.Hist.new.Reg(2000, 0, 1).Double()\n"
        "try:\n"
        "    decode_object(encode_object(h))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {**os.environ, "EVFLOW_MAX_HIST_CELLS": "1000"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("CodecError histogram of 2002 cells (flow bins included)")
    env["EVFLOW_MAX_HIST_CELLS"] = "lots"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert "EVFLOW_MAX_HIST_CELLS='lots' is not an integer" in out.stdout
    # a device that decodes says so when it starts, in one line
    argv = [sys.executable, "-m", "evflow", "device", "qc-merger", "--id", "m", "--session",
            "bad", "--severity", "error", "--channel-config",
            "name=qc-in,type=router,method=bind,address=ipc://m-in"]  # fmt: skip
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == (
        "evflow: error: device 'm': ConfigurationError: EVFLOW_MAX_HIST_CELLS='lots' is not "
        "an integer"
    )


# --- random headers: nothing but CodecError ------------------------------------------
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
    st.binary(max_size=16),
)  # fmt: skip
_sizes = st.one_of(st.integers(-3, 40), st.sampled_from([BIG, 2**31, 2**63, -(2**40)]))
_AXIS_TYPES = ["regular", "variable", "category_int", "category_str", "boolean", "other"]
_writer_info = st.fixed_dictionaries(
    {},
    optional={
        "orig_type": st.just("Integer"),
        "growth": st.booleans(),
        "transform": st.sampled_from(["log", "sqrt", "pow", "x"]),
        "bins": _sizes,
        "lower": st.floats(),
        "upper": st.floats(),
        "power": st.floats(),
    },
)
_axis = st.fixed_dictionaries(
    {"type": st.sampled_from(_AXIS_TYPES)},
    optional={
        "bins": _sizes,
        "lower": st.one_of(_sizes, st.floats()),
        "upper": st.one_of(_sizes, st.floats()),
        "underflow": st.booleans(),
        "overflow": st.booleans(),
        "circular": st.booleans(),
        "flow": st.booleans(),
        "edges": st.lists(st.floats(), max_size=6),
        "categories": st.lists(_sizes, max_size=4),
        "writer_info": st.fixed_dictionaries({"boost-histogram": _writer_info}),
    },
)
_array_ref = st.fixed_dictionaries(
    {"__nd__": st.one_of(st.integers(-2, 3), _scalars),
     "dtype": st.sampled_from(["<f8", "<i8", "O", "V0", "|V16", "<U9999999999", "x", "<f4"]),
     "shape": st.one_of(st.lists(_sizes, max_size=4), _scalars)},
)  # fmt: skip
_storage = st.fixed_dictionaries(
    {"type": st.sampled_from(["double", "int", "weighted", "mean", "weighted_mean", "z"])},
    optional={k: st.one_of(_array_ref, st.lists(st.floats(), max_size=4), _scalars)
              for k in ("values", "variances", "counts", "sum_of_weights",
                        "sum_of_weights_squared")},
)  # fmt: skip
_uhi = st.fixed_dictionaries(
    {"axes": st.one_of(st.lists(_axis, max_size=5), _scalars), "storage": st.one_of(_storage,
                                                                                   _scalars)},
    optional={"uhi_schema": st.integers(0, 2), "metadata": st.dictionaries(st.text(max_size=4),
                                                                           _scalars, max_size=2)},
)  # fmt: skip
_frames = st.lists(st.binary(max_size=96), max_size=3)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(uhi=_uhi, kind=st.sampled_from(["bh", "hist", "nd", "num", "?"]), frames=_frames)
def test_random_histogram_headers_raise_nothing_but_codec_error(
    uhi: dict[str, Any], kind: str, frames: list[bytes]
) -> None:
    head = msgpack.packb({"v": 1, "items": [["o", kind, uhi]]})
    data = msgpack.packb({"qv": 1, "h": head, "f": frames})
    with contextlib.suppress(CodecError):
        decode_object(data)
    # the same description as a delta spec (its bins may be zero frames sent as lengths)
    spec = msgpack.packb([msgpack.packb({"v": 1, "items": [["t", kind, uhi]]}),
                          *[len(f) for f in frames]])  # fmt: skip
    for item, extra in ((["h", "h", spec, 1], frames[:1] or [b""]), (["x", "x", spec], [])):
        for merger in (DeltaMerger(), DeltaMerger(current_limits())):
            with contextlib.suppress(CodecError):
                merger.decode([msgpack.packb({"v": 1, "items": [item]}), *extra])


# --- real devices ----------------------------------------------------------------------
def test_bombs_sent_to_a_merger_and_a_repository_are_counted_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    """Producers -> qc-merger -> qc-repository (real processes), bombs on both sockets:
    each refused and counted, neither device restarts, the stored objects are exact.
    (Two axes of 3 x 10^6 bins: 9 x 10^12 cells, a ``std::bad_alloc`` that killed both
    devices; three overflow boost-histogram's size computation instead.)"""
    n_events, p = 2000, 2
    repo_path, checks = tmp_path / "qc.sqlite", tmp_path / "checks.toml"
    checks.write_text(CHECKS)
    address = "ipc://qc-repo-in"
    context: zmq.Context[Any] = zmq.Context()
    sup = Supervisor(bus=True).start()
    sockets = []
    try:
        sup.add_command("qc-repository", repository_argv(sup, repo_path, checks, address),
                        device_id="qc-repository")  # fmt: skip
        wait_for(sup, (session_dir(sup.session) / "qc-repo-in").exists, 30,
                 "the repository device to bind")  # fmt: skip
        # the repository first: a publication whose object is the bomb
        (cfg,) = parse_channel_config(f"name=junk,type=push,method=connect,address={address}")
        to_repo = open_channel(context, cfg, sup.session)
        sockets.append(to_repo)
        header = {"qc": 1, "src": "m", "path": "qc/x/y", "task": "x", "name": "y", "run": RUN,
                  "cycle": 1, "seq": 1, "events": 1, "completeness": {}, "created": 1.0,
                  "metadata": {}}  # fmt: skip
        to_repo.send(encode_message(MsgType.RESULT, header, [bomb_object(2)]))
        wait_for(sup, lambda: ctl_metrics(sup, "qc-repository")["qc_repository"]["dropped"]
                 .get("garbage") == 1, 30, "the repository to count the bomb")  # fmt: skip

        producers = [f"prod-{j}" for j in range(p)]
        specs, routes = build_layers(producers, [1])
        (top,) = launch_layers(sup, specs, out_address=address, state_dir=tmp_path,
                               exec_devices=True, cycle_s=0.1, run_number=RUN)  # fmt: skip
        wait_for(sup, (session_dir(sup.session) / top).exists, 30, "the merger to bind")
        (cfg,) = parse_channel_config(
            f"name=junk,type=dealer,method=connect,address={routes['prod-0']}"
        )
        to_merger = open_channel(context, cfg, sup.session)
        sockets.append(to_merger)
        delta = {"qc": 1, "task": "det", "run": RUN, "cycle": 1, "seq": 1, "events": 1,
                 "mode": "delta"}  # fmt: skip
        objects = msgpack.packb([["h1", bomb_object(2)]])
        to_merger.send(encode_message(MsgType.EVENTS, {**delta, "src": "bomb-o"}, [objects]))
        for kind in ("h", "x"):
            frames = [msgpack.packb([]), *bomb_delta_frames(kind)]
            to_merger.send(encode_message(MsgType.EVENTS, {**delta, "src": f"bomb-{kind}"},
                                          frames))  # fmt: skip
        publication = {**header, "src": "bomb-pub", "path": "qc/det/h1", "task": "det"}
        to_merger.send(encode_message(MsgType.RESULT, publication, [bomb_object(2)]))
        wait_for(sup, lambda: ctl_metrics(sup, top)["qc"]["dropped"].get("garbage") == 4, 30,
                 "the merger to count the four bombs")  # fmt: skip
        for j, src in enumerate(producers):
            sup.add_function(src, run_producer, j, p, n_events, routes[src], sup.session)
        wait_for(sup, lambda: sup.processes[top].state == "done", 90, "the merger's end")
        merger = sup.processes[top]
        assert merger.returncode == 0 and merger.restarts == 0
        wait_for(sup, lambda: ctl_metrics(sup, "qc-repository")["qc_repository"]["ends"] == 1,
                 30, "the merger's END at the repository")  # fmt: skip
        metrics = ctl_metrics(sup, "qc-repository")
        assert metrics["node_state"] == "RUNNING"
        assert metrics["qc_repository"]["dropped"] == {"garbage": 1}
        assert sup.processes["qc-repository"].restarts == 0
    finally:
        for sock in sockets:
            sock.close(0)
        sup.shutdown()
        sup.close()
        context.term()
    # the merger's own count (its stats at exit), and what the repository holds
    ref = reference(list(range(n_events)))
    with Repository(repo_path, readonly=True) as repo:
        for name in ("h1", "h2", "h3", "hn"):
            got = repo.latest(f"qc/det/{name}")
            assert got is not None and got.event_count == n_events
            assert np.array_equal(got.obj.view(flow=True), ref[name].view(flow=True)), name
        latest = repo.latest("qc/det/count")
        assert latest is not None and latest.obj == n_events
        # the bombs' made-up sources sent nothing that was merged
        assert set(latest.completeness["missing"]) <= {"bomb-o", "bomb-h", "bomb-x"}
        assert repo.paths() == [f"qc/det/{n}" for n in
                                ["count", "h1", "h2", "h3", "hn", "rows", "sums"]]  # fmt: skip

"""``[qc.NAME]`` in a topology file: merger layers expanded into devices and channels.

Resolution only (no processes): a 500-producer spec with ``mergers_per_layer = [10, 1]``
gives the mergers, their inputs, hosts and channels; bad tables give one error naming
the file and the fix. With real processes: the shipped example through ``evflow up``
stores at the top exactly the sequential fill of the same events, bin by bin.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from evflow.errors import ConfigurationError
from evflow.qc.repository import Repository
from evflow.qc.toy import ToyQc, toy_event
from evflow.topology.loader import load_topology, parse_topology
from evflow.topology.resolve import ResolvedTopology, resolve

EXAMPLE = Path(__file__).parent.parent / "examples" / "topologies" / "qc_layers.toml"
HOSTS = {f"h{i}": {"address": f"10.9.0.{i}"} for i in range(1, 6)}


def spec_500(qc: dict[str, Any], hosts: dict[str, Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "devices": {
            "producer": {
                "class": "qc-producer",
                "instances": 500,
                "params": {"task": "evflow.qc.toy:ToyQc"},
                "channels": [{"name": "data-in", "type": "router", "bind": True}],
            },
            "repository": {
                "class": "qc-repository",
                "params": {"repo": "qc.sqlite"},
                "channels": [{"name": "qc-in", "type": "router", "bind": True}],
            },
        },
        "qc": {"det": qc},
    }
    if hosts is not None:
        data["hosts"] = hosts
    return data


def resolved(data: dict[str, Any]) -> ResolvedTopology:
    return resolve(parse_topology(data, source="t.toml"))


def test_500_producers_in_10_then_1_mergers_resolve_to_devices_and_channels() -> None:
    topo = resolved(
        spec_500(
            {
                "producers": "producer",
                "mergers_per_layer": [10, 1],
                "repository": "repository",
                "params": {"cycle_s": 2.0, "run_number": 5, "window_cycles": 3, "reset_every": 4},
            },
            HOSTS,
        )
    )
    devs = topo.devices
    lower = [f"det-merger-0-{i}" for i in range(10)]
    top = "det-merger-1-0"
    assert sorted(d for d in devs if "merger" in d) == sorted([*lower, top])
    for i, mid in enumerate(lower):
        m = devs[mid]
        block = [f"producer_{k}" for k in range(50 * i, 50 * (i + 1))]
        assert m.cls == "qc-merger"
        assert m.params["expected"] == ",".join(block) and m.params["inputs"] == 50
        assert m.params["cycle_s"] == 2.0 and m.params["run_number"] == 5
        assert "window_cycles" not in m.params and "reset_every" not in m.params
        (qc_in, qc_out) = m.channels
        assert qc_in.name == "qc-in" and qc_in.type == "router" and qc_in.bind
        assert qc_out.connect == [(f"{top}.qc-in", m.host == devs[top].host)]
        assert sorted(topo.consumers[p] for p in block) == [[(mid, "qc-in")]] * 50
    # producers round robin over 5 hosts: every block spans them all, so the mergers
    # are spread over the hosts (two each); the top goes on the first host
    assert sorted(devs[m].host for m in lower) == sorted([f"h{i}" for i in range(1, 6)] * 2)
    assert devs[top].host == "h1"
    t = devs[top]
    assert t.params["expected"] == ",".join(lower) and t.params["inputs"] == 10
    assert t.params["window_cycles"] == 3 and t.params["reset_every"] == 4
    assert [c.connect for c in t.channels if c.name == "qc-out"] == [[("repository.qc-in", True)]]
    assert devs["repository"].params["inputs"] == 1
    # producer k -> merger k // 50, on ipc when on the merger's host, tcp otherwise
    for k in (0, 49, 50, 499):
        p = devs[f"producer_{k}"]
        (out,) = [c for c in p.channels if c.name == "qc-out"]
        mid = f"det-merger-0-{k // 50}"
        assert out.type == "dealer" and out.connect == [(f"{mid}.qc-in", p.host == devs[mid].host)]
    # a merger with peers on its host and elsewhere binds both ipc and tcp
    m0 = devs["det-merger-0-0"]
    assert m0.channels[0].bind == f"ipc://;tcp://10.9.0.{m0.host[1:]}:0"
    # stop order: producers, then the first layer, the top, the repository
    assert devs["producer_0"].stop_order < m0.stop_order < t.stop_order
    assert t.stop_order < devs["repository"].stop_order


def test_reduction_and_explicit_hosts() -> None:
    topo = resolved(
        spec_500({"producers": "producer", "reduction": 50, "hosts": [["h2", "h3"], ["h5"]]}, HOSTS)
    )
    mergers = {d.id: d for d in topo.devices.values() if d.cls == "qc-merger"}
    assert len(mergers) == 11
    assert [mergers[f"det-merger-0-{i}"].host for i in range(4)] == ["h2", "h3", "h2", "h3"]
    assert mergers["det-merger-1-0"].host == "h5"
    assert not [c for c in mergers["det-merger-1-0"].channels if c.name == "qc-out"]


def test_one_merger_and_default_localhost() -> None:
    topo = resolved(spec_500({"producers": "producer", "mergers_per_layer": [1]}))
    m = topo.devices["det-merger"]
    assert m.host == "localhost" and m.params["inputs"] == 500
    assert m.channels[0].bind == "ipc://"


def test_producers_in_a_collection_feed_the_merger_of_their_block() -> None:
    data = {
        "devices": {
            "source": {
                "class": "evflow.qc.toy:ToyEvents",
                "params": {"copies": 6},
                "channels": [{"name": "data", "type": "dealer", "connect": "producer.data-in"}],
            },
            "producer": {
                "class": "qc-producer",
                "channels": [{"name": "data-in", "type": "router", "bind": True}],
            },
        },
        "collections": {"chain": {"devices": ["source", "producer"], "hosts": "every"}},
        "hosts": {f"h{i}": {"address": f"10.9.0.{i}"} for i in range(1, 7)},
        "qc": {"det": {"producers": "producer", "reduction": 3}},
    }
    topo = resolved(data)
    devs = topo.devices
    assert devs["det-merger-0-0"].params["expected"] == "producer_0,producer_1,producer_2"
    assert devs["det-merger-0-1"].params["expected"] == "producer_3,producer_4,producer_5"
    # each block is on three hosts, one producer each: the first host of the block
    assert (devs["det-merger-0-0"].host, devs["det-merger-0-1"].host) == ("h1", "h4")
    assert devs["det-merger-1-0"].host == "h1"
    for k in range(6):
        assert devs[f"source_{k}"].host == devs[f"producer_{k}"].host == f"h{k + 1}"
        (out,) = [c for c in devs[f"producer_{k}"].channels if c.name == "qc-out"]
        assert [key for key, _ in out.connect] == [f"det-merger-0-{k // 3}.qc-in"]


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        (
            {"producers": "producer", "reduction": 0},
            "t.toml: [qc.det]: QC layers: reduction must be >= 2, got 0 (500 producers: give",
        ),
        (
            {"producers": "producer", "mergers_per_layer": [10, 2]},
            "must end with 1 (one top merger) (500 producers: give mergers_per_layer as a list "
            "that shrinks layer by layer and ends with 1",
        ),
        (
            {"producers": "producer", "mergers_per_layer": [10, 20, 1]},
            "20 mergers cannot take 10 inputs",
        ),
        (
            {"producers": "prod", "reduction": 4},
            "t.toml: [qc.det]: producers = 'prod' names no device; give the name of the device",
        ),
        ({"producers": "producer"}, "give mergers_per_layer (e.g. [10, 1]) or reduction"),
        (
            {"producers": "producer", "reduction": 4, "repository": "repo"},
            "repository = 'repo' names no device",
        ),
        (
            {"producers": "producer", "reduction": 50, "params": {"inputs": 3}},
            "params sets 'inputs', which the layers set for each merger; remove it",
        ),
        (
            {"producers": "producer", "reduction": 50, "params": {"cycle": 3}},
            "device 'det-merger-0-0': class 'qc-merger' has no parameter 'cycle'",
        ),
        (
            {"producers": "producer", "reduction": 50, "hosts": [["h1"]]},
            "hosts must be one list of host names per layer (2 layers)",
        ),
        (
            {"producers": "producer", "reduction": 50, "restart": "on-failure"},
            "restart = on-failure needs state_dir",
        ),
        ({"producers": "producer", "reduction": 4, "layers": 2}, "unknown key 'layers'"),
        (
            {"producers": "repository", "reduction": 4},
            "producers = 'repository' is a device of class 'qc-repository', not a QC producer",
        ),
    ],
)
def test_bad_qc_tables_are_one_error_naming_file_and_fix(qc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_topology(spec_500(qc), source="t.toml")
    assert message in str(info.value)
    assert str(info.value).startswith("t.toml")


def test_a_qc_name_that_cannot_prefix_device_names_is_refused() -> None:
    data = spec_500({"producers": "producer", "reduction": 50})
    data["qc"] = {"9det": data["qc"]["det"]}
    with pytest.raises(ConfigurationError, match=r"t.toml: \[qc.9det\]: the name must start"):
        parse_topology(data, source="t.toml")


def test_the_example_resolves_to_two_layers_and_a_repository() -> None:
    topo = resolve(load_topology(EXAMPLE))
    mergers = sorted(d.id for d in topo.devices.values() if d.cls == "qc-merger")
    assert mergers == ["toy-merger-0-0", "toy-merger-0-1", "toy-merger-1-0"]
    assert topo.devices["toy-merger-0-1"].params["expected"] == ",".join(
        f"producer_{k}" for k in range(4, 8)
    )


def assert_sequential_fill(
    repo_path: Path, n_events: int, run: int, producers: list[str], lower: list[str], top: str
) -> None:
    """The final objects in the repository equal ToyQc filled with every event in order,
    and the top's completeness names every producer (through ``lower``) as ended."""
    ref = ToyQc(name="toy")
    ref.initialize()
    for i in range(n_events):
        ref.event(toy_event(i, run))
    with Repository(repo_path, readonly=True) as repo:
        assert sorted(repo.paths()) == sorted(f"qc/toy/{n}" for n in ref.objects)
        got = {}
        for name in ref.objects:
            stored = repo.latest(f"qc/toy/{name}", run=run)
            assert stored is not None and stored.metadata["final"], name
            got[name] = stored
    for name in ("h1", "h2", "h3", "hn"):
        assert got[name].obj == ref.objects[name], name
        assert np.array_equal(got[name].obj.view(flow=True), ref.objects[name].view(flow=True)), (
            name
        )
    assert got["count"].obj == n_events == ref.objects["count"]
    assert np.array_equal(got["sums"].obj, ref.objects["sums"])
    rows, want = got["rows"].obj.sorted_by("i"), ref.objects["rows"].sorted_by("i")
    assert np.array_equal(rows["i"], want["i"]) and np.array_equal(rows["x"], want["x"])
    done = got["h1"].completeness  # in producers, through the layers
    assert done["expected"] == producers and done["ended"] == producers
    assert done["missing"] == [] and sum(done["events_by_source"].values()) == n_events
    assert done["mergers"]["ended"] == lower
    assert got["h1"].event_count == n_events and got["h1"].metadata["merger"] == top


@pytest.mark.timeout(210)  # the run's own bound (180 s) first: it says more
def test_example_through_evflow_up_stores_the_sequential_fill(tmp_path: Path) -> None:
    """8 sources -> 8 producers -> 2 mergers -> 1 -> repository, real processes: the
    final objects in the repository equal ToyQc filled with all 40000 events in order."""
    proc = subprocess.run(
        [sys.executable, "-m", "evflow", "up", "--quiet", str(EXAMPLE)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    producers = [f"producer_{k}" for k in range(8)]
    assert_sequential_fill(
        tmp_path / "qc-layers.sqlite", 40_000, 7, producers,
        ["toy-merger-0-0", "toy-merger-0-1"], "toy-merger-1-0",
    )  # fmt: skip

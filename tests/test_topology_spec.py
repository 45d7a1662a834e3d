"""Topology files: what they resolve to, and one clear error for each kind of mistake."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from evflow.errors import ConfigurationError
from evflow.topology.loader import load_topology, parse_topology
from evflow.topology.node import Exchange
from evflow.topology.resolve import resolve
from evflow.transport.channel_config import SOCKET_OPTIONS
from evflow.transport.hosts import load_hosts

EXAMPLES = Path(__file__).parent.parent / "examples" / "topologies"

FAN_IN = """
[devices.sampler]
class = "sampler"
instances = 4
channels = [{ name = "data", type = "dealer", connect = "merger.data-in" }]
[devices.merger]
class = "merger"
channels = [
  { name = "data-in", type = "router", bind = true },
  { name = "data-out", type = "dealer", connect = "sink.data" },
]
[devices.sink]
class = "sink"
channels = [{ name = "data", type = "router", bind = true }]
"""


def parse(text: str, **kw: object) -> object:
    return parse_topology(tomllib.loads(text), source="t.toml", **kw)  # type: ignore[arg-type]


def hosts(*names: str) -> dict[str, object]:
    table = {n: {"address": f"10.0.0.{i + 1}"} for i, n in enumerate(names)}
    from evflow.transport.hosts import parse_hosts

    return parse_hosts(table, source="hosts.toml")  # type: ignore[return-value]


def test_defaults_put_every_device_on_localhost_with_ipc() -> None:
    topo = resolve(parse(FAN_IN))  # type: ignore[arg-type]
    assert sorted(topo.devices) == [
        "merger",
        "sampler_0",
        "sampler_1",
        "sampler_2",
        "sampler_3",
        "sink",
    ]
    assert {d.host for d in topo.devices.values()} == {"localhost"}
    merger = topo.devices["merger"]
    assert merger.channels[0].bind == "ipc://"
    assert merger.params["inputs"] == 4  # one END per sampler
    assert topo.devices["sink"].params["inputs"] == 1
    assert topo.devices["sampler_2"].channels[0].connect == [("merger.data-in", True)]
    # sources stop first, the sink last
    assert [topo.devices[i].stop_order for i in ("sampler_0", "merger", "sink")] == [0, 1, 2]


def test_placement_round_robin_every_host_and_tcp_across_hosts() -> None:
    text = FAN_IN.replace("instances = 4", 'hosts = "every"').replace(
        '[devices.sink]\nclass = "sink"', '[devices.sink]\nclass = "sink"\nhosts = ["h3"]'
    )
    text = text.replace(
        '[devices.merger]\nclass = "merger"', '[devices.merger]\nclass = "merger"\nhosts = ["h2"]'
    )
    topo = resolve(parse(text, hosts=hosts("h1", "h2", "h3")))  # type: ignore[arg-type]
    assert [topo.devices[f"sampler_{i}"].host for i in range(3)] == ["h1", "h2", "h3"]
    merger = topo.devices["merger"]
    assert merger.host == "h2"
    assert merger.channels[0].bind == "ipc://;tcp://10.0.0.2:0"  # sampler_1 is local
    assert topo.devices["sink"].channels[0].bind == "tcp://10.0.0.3:0"
    assert topo.devices["sampler_0"].channels[0].connect == [("merger.data-in", False)]
    assert topo.devices["sampler_1"].channels[0].connect == [("merger.data-in", True)]


def test_two_layer_fan_in_spreads_peers_and_counts_inputs() -> None:
    topo = resolve(load_topology(EXAMPLES / "two_layer.toml"))
    targets = [topo.devices[f"sampler_{i}"].channels[0].connect[0][0] for i in range(8)]
    assert targets == ["merger1_0.data-in", "merger1_1.data-in"] * 4
    assert topo.devices["merger1_0"].params["inputs"] == 4
    assert topo.devices["merger2"].params["inputs"] == 2


def test_collection_copies_share_a_host_and_connect_inside_the_copy() -> None:
    text = """
[devices.reco]
class = "proxy"
channels = [
  { name = "data-in", type = "pull", bind = true },
  { name = "data-out", type = "push", connect = "qc.data" },
]
[devices.qc]
class = "sink"
channels = [{ name = "data", type = "pull", bind = true }]
[collections.proc]
devices = ["reco", "qc"]
hosts = "every"
n_min = 2
"""
    topo = resolve(parse(text, hosts=hosts("a", "b", "c")))  # type: ignore[arg-type]
    for k, host in enumerate("abc"):
        assert topo.devices[f"reco_{k}"].host == topo.devices[f"qc_{k}"].host == host
        assert topo.devices[f"reco_{k}"].channels[1].connect == [(f"qc_{k}.data", True)]
    (group,) = [g for g in topo.groups if "proc" in g.name]
    assert group.n_min == 2 and group.copies == [
        ["reco_0", "qc_0"],
        ["reco_1", "qc_1"],
        ["reco_2", "qc_2"],
    ]


def test_three_hosts_example_places_on_h1_h2_h3(tmp_path: Path) -> None:
    hosts_file = tmp_path / "hosts.toml"
    hosts_file.write_text(
        "[hosts]\n"
        + "".join(
            f'h{i} = {{ address = "10.201.0.{i}", ssh = "root@10.201.0.{i}" }}\n' for i in (1, 2, 3)
        )
    )
    topo = resolve(load_topology(EXAMPLES / "three_hosts.toml", load_hosts(hosts_file)))
    placed = {d.id: d.host for d in topo.devices.values()}
    assert placed == {
        "sampler_0": "h1",
        "sampler_1": "h2",
        "sampler_2": "h3",
        "merger": "h2",
        "sink": "h3",
    }
    assert topo.spans_hosts


BAD = [
    (
        "unknown class",
        FAN_IN.replace('class = "merger"', 'class = "mergr"'),
        ["device 'merger'", "mergr", "module:Class"],
    ),
    (
        "unknown parameter",
        FAN_IN.replace("instances = 4", "instances = 4\nparams = { msg_sise = 10 }"),
        ["device 'sampler'", "msg_sise", "msg_size"],
    ),
    (
        "parameter of the wrong type",
        FAN_IN.replace("instances = 4", 'instances = 4\nparams = { msg_size = "big" }'),
        ["device 'sampler'", "msg_size", "int"],
    ),
    (
        "peer device does not exist",
        FAN_IN.replace('connect = "sink.data"', 'connect = "snk.data"'),
        ["device 'merger'", "channel 'data-out'", "no device 'snk'"],
    ),
    (
        "peer channel does not exist",
        FAN_IN.replace('connect = "sink.data"', 'connect = "sink.input"'),
        ["device 'merger'", "has no channel 'input'", "its channels: data"],
    ),
    (
        "cycle of connects with no bind",
        FAN_IN.replace(
            '{ name = "data", type = "router", bind = true }',
            '{ name = "data", type = "router", connect = "merger.data-out" }',
        ),
        ["cycle of connects", "merger.data-out -> sink.data -> merger.data-out", "bind = true"],
    ),
    (
        "instances = 0 with n_min > 0",
        FAN_IN.replace("instances = 4", "instances = 0\nn_min = 1"),
        ["device 'sampler'", "n_min = 1", "set instances >= 1"],
    ),
    (
        "unknown host",
        FAN_IN.replace('class = "sink"', 'class = "sink"\nhosts = ["h9"]'),
        ["device 'sink'", "unknown host 'h9'", "--hosts"],
    ),
    (
        "unknown key",
        FAN_IN.replace('class = "sink"', 'class = "sink"\ninstance = 2'),
        ["device 'sink'", "unknown key 'instance'", "instances"],
    ),
    (
        "bad socket type",
        FAN_IN.replace('type = "router", bind', 'type = "ruoter", bind'),
        ["channel 'data", "ruoter", "router"],
    ),
    (
        "bind and connect at once",
        FAN_IN.replace(
            '{ name = "data", type = "router", bind = true }',
            '{ name = "data", type = "router", bind = true, connect = "merger.data-in" }',
        ),
        ["device 'sink'", "exactly one of bind"],
    ),
]


@pytest.mark.parametrize(("case", "text", "wanted"), BAD, ids=[b[0] for b in BAD])
def test_bad_topology_gives_one_clear_error(case: str, text: str, wanted: list[str]) -> None:
    with pytest.raises(ConfigurationError) as info:
        resolve(parse(text))  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("t.toml: "), message
    assert "\n" not in message
    for part in wanted:
        assert part in message, (part, message)


def test_every_fairmq_socket_option_reaches_the_channel_the_device_opens() -> None:
    wanted = {key: 7 + i for i, key in enumerate(SOCKET_OPTIONS)}
    given = ", ".join(f"{key} = {value}" for key, value in wanted.items())
    text = FAN_IN.replace(
        '{ name = "data", type = "router", bind = true }',
        f'{{ name = "data", type = "router", bind = true, {given} }}',
    )
    sink = resolve(parse(text)).devices["sink"]  # type: ignore[arg-type]
    (cfg,) = Exchange(None, sink, 1.0).bind_configs()  # type: ignore[arg-type]
    assert {key: getattr(cfg, key) for key in SOCKET_OPTIONS} == wanted
    with pytest.raises(ConfigurationError, match=r"channel 'data-in'.*bad linger -2"):
        parse(FAN_IN.replace("bind = true }", "bind = true, linger = -2 }"))


def test_bad_files_name_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[devices.sink\nclass = 1")
    with pytest.raises(ConfigurationError, match=r"broken\.toml: not valid TOML"):
        load_topology(broken)
    with pytest.raises(ConfigurationError, match="does not exist"):
        load_topology(tmp_path / "missing.toml")
    empty = tmp_path / "empty.toml"
    empty.write_text('name = "x"\n')
    with pytest.raises(ConfigurationError, match=r"empty\.toml: no devices"):
        load_topology(empty)


def test_cli_reports_a_bad_topology_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(FAN_IN.replace('connect = "sink.data"', 'connect = "snk.data"'))
    proc = subprocess.run(
        [sys.executable, "-m", "evflow", "up", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("evflow: error: ") and "bad.toml" in lines[0] and "'snk'" in lines[0]

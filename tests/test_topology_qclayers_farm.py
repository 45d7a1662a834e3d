"""``[qc.NAME]`` merger layers over ssh on three hosts (network namespaces running sshd).

6 toy sources and 6 producers (a collection, round robin over h1..h3) -> 3 mergers ->
1 -> a repository: each merger placed by the spec on its host (tcp between hosts),
and the merged objects at the top equal the sequential fill, bin by bin.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from farm_hosts import NamespaceFarm
from test_topology_farm import assert_clean, evflow, make_keys
from test_topology_qclayers import assert_sequential_fill
from test_topology_up import stats

pytestmark = [pytest.mark.netns]

TOPOLOGY = """
name = "qc-farm"

[devices.source]
class = "evflow.qc.toy:ToyEvents"
params = {{ n_events = 12000, copies = 6, run_number = 3 }}
channels = [{{ name = "data", type = "dealer", connect = "producer.data-in" }}]

[devices.producer]
class = "qc-producer"
channels = [{{ name = "data-in", type = "router", bind = true }}]

[devices.producer.params]
task = "evflow.qc.toy:ToyQc"
task_params = '{{"name": "toy"}}'
cycle_s = 0.2
run_number = 3

[collections.chain]
devices = ["source", "producer"]
instances = 6

[qc.toy]
producers = "producer"
mergers_per_layer = [3, 1]
repository = "repository"
params = {{ cycle_s = 0.3, run_number = 3 }}

[devices.repository]
class = "qc-repository"
hosts = ["h3"]
params = {{ repo = "{repo}" }}
channels = [{{ name = "qc-in", type = "router", bind = true }}]
"""


@pytest.mark.timeout(210)  # the run's own bound (180 s) first: it says more
def test_qc_layers_over_ssh_on_three_hosts(farm: NamespaceFarm, tmp_path: Path) -> None:
    hosts = farm.write_hosts_file(tmp_path / "hosts.toml")
    keys = make_keys(farm, tmp_path / "keys")
    topo = tmp_path / "qc_farm.toml"
    topo.write_text(TOPOLOGY.format(repo=tmp_path / "qc.sqlite"))
    out = tmp_path / "stats"
    proc = evflow(
        farm, "up", str(topo), "--hosts", str(hosts), "--launcher", "ssh", "--keys", str(keys),
        "--quiet", "--stats-dir", str(out), timeout_s=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    placed = {k: v["host"] for k, v in stats(out).items()}
    # producer_k on h(k mod 3 + 1); blocks {0,1} {2,3} {4,5}: each merger on a host of
    # its block, spread over the three; the top on the first host
    assert [placed[f"producer_{k}"] for k in range(6)] == ["h1", "h2", "h3"] * 2
    lower = [f"toy-merger-0-{i}" for i in range(3)]
    assert [placed[m] for m in lower] == ["h1", "h3", "h2"]
    assert placed["toy-merger-1-0"] == "h1" and placed["repository"] == "h3"
    assert_sequential_fill(
        tmp_path / "qc.sqlite", 12_000, 3, [f"producer_{k}" for k in range(6)], lower,
        "toy-merger-1-0",
    )  # fmt: skip
    assert_clean(farm)

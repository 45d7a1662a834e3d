"""``evflow demo --qc``: QC tasks in the HZZ path, a merger, checks, the repository.

``-p 0`` (in this process) and ``-p 2`` (the command) must store the same merged
objects, bin by bin; they must equal the demo's own histograms of the same values
(filled by another module and merged by the parallel engine, not by QC); the checks
against the shipped reference must say Good, and say Bad for a distorted object.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from evflow.demo.qc import CHECKS_TOML, run_qc_demo
from evflow.qc.checksuite import CheckSuite
from evflow.qc.publication import PublishedObject
from evflow.qc.quality import Quality
from evflow.qc.repository import Repository

N_EVENTS = 300
OBJECTS = ["qc/hzz/m_mumu", "qc/hzz/mu_eta_phi", "qc/hzz/mu_pt", "qc/hzz/z_chi2"]


def latest_objects(repo_path: Path) -> dict[str, object]:
    with Repository(repo_path, readonly=True) as repo:
        assert repo.paths() == OBJECTS
        out = {}
        for path in OBJECTS:
            stored = repo.latest(path)
            assert stored is not None and stored.metadata["final"]
            assert stored.event_count == N_EVENTS
            out[path] = stored.obj
        return out


@pytest.fixture(scope="module")
def sequential(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return run_qc_demo(tmp_path_factory.mktemp("p0"), max_events=N_EVENTS, workers=0, quiet=True)


def test_sequential_qc_demo_stores_checked_objects(sequential) -> None:  # type: ignore[no-untyped-def]
    assert [r.path for r in sequential.rows] == OBJECTS
    assert all(r.quality == "Good" and r.events == N_EVENTS for r in sequential.rows)
    assert all(r.versions >= 2 for r in sequential.rows)  # several cycles, not only the end
    objs = latest_objects(sequential.repository)
    persistent = sequential.demo.summary.persistent
    # the same values through QC and through the demo's own histograms (same binning)
    for qc_name, demo_name in (("qc/hzz/m_mumu", "m_mumu"), ("qc/hzz/z_chi2", "z_chi2")):
        assert np.array_equal(objs[qc_name].values(flow=True),
                              persistent[demo_name].values(flow=True)), qc_name  # fmt: skip
    # every event with a dimuon candidate is selected by the trigger
    assert objs["qc/hzz/m_mumu"].sum(flow=True) == sequential.demo.summary.events_written
    report = sequential.report()
    for row in sequential.rows:
        assert f"{row.path}  " in report and f"{row.cycle:>5}" in report
    with Repository(sequential.repository, readonly=True) as repo:
        agg = repo.qualities("hzz")
        assert agg and agg[0].quality == "Good"


def test_parallel_qc_demo_command_merges_to_the_sequential_objects(
    sequential, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    out = subprocess.run(
        [sys.executable, "-m", "evflow", "demo", "--qc", "-n", str(N_EVENTS), "-p", "2",
         "-o", str(tmp_path)],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    table = out.stdout[out.stdout.index("QC: 4 objects") :].splitlines()
    assert table[1].split() == ["path", "run", "cycle", "versions", "events", "quality"]
    assert [line.split()[0] for line in table[2:]] == OBJECTS
    assert all(line.split()[4:] == [str(N_EVENTS), "Good"] for line in table[2:])
    parallel = latest_objects(tmp_path / "qc.sqlite")
    reference = latest_objects(sequential.repository)
    for path in OBJECTS:
        assert np.array_equal(parallel[path].values(flow=True),
                              reference[path].values(flow=True)), path  # fmt: skip
    with Repository(tmp_path / "qc.sqlite", readonly=True) as repo:
        info = repo.latest_info("qc/hzz/m_mumu")
        assert info is not None
        assert len(info.completeness["ended"]) == 2  # one source per worker
        assert sum(info.completeness["events_by_source"].values()) == N_EVENTS


def test_demo_checks_find_a_distorted_distribution(sequential) -> None:  # type: ignore[no-untyped-def]
    suite = CheckSuite.from_toml(CHECKS_TOML)
    good = latest_objects(sequential.repository)["qc/hzz/m_mumu"]
    shifted = good.copy()
    shifted.view()[:] = np.roll(good.view(), 10)  # the Z peak 25 GeV higher

    def published(obj: object) -> PublishedObject:
        return PublishedObject("qc/hzz/m_mumu", "hzz", "m_mumu", 0, 1, obj, {"fraction": 1.0},
                               0.0, 1, N_EVENTS)  # fmt: skip

    assert suite.run(published(good)).quality.quality is Quality.GOOD  # type: ignore[union-attr]
    bad = suite.run(published(shifted))
    by_check = {r.check: r for r in bad.checks}
    assert by_check["m_mumu_shape"].quality is Quality.BAD
    assert bad.quality is not None and bad.quality.quality is Quality.BAD
    # half the workers missing: every verdict is Null, with the reason
    incomplete = PublishedObject("qc/hzz/m_mumu", "hzz", "m_mumu", 0, 1, good,
                                 {"fraction": 0.25, "missing": ["w1", "w2", "w3"]}, 0.0, 1,
                                 N_EVENTS)  # fmt: skip
    null = suite.run(incomplete).quality
    assert null is not None and null.quality is Quality.NULL
    assert any("missing: w1, w2, w3" in f.reason for f in null.flags)

"""The demo: analysis modules on hand-made events, and the full run on uproot-HZZ.root
checked against an independent vectorised selection (uproot + awkward + numpy)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import awkward as ak
import numpy as np
import pytest
import uproot

from evflow import DataStore, EventMeta, RunMeta
from evflow.demo import (
    CandidateFilter,
    DimuonMass,
    FourLeptonMass,
    LeptonSelection,
    MassHistograms,
    hzz_path,
    run_demo,
)
from evflow.demo.analysis import INPUT_BRANCHES
from evflow.errors import OutputError, ParameterError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- the analysis, recomputed independently and vectorised ---------------------------------
def _select(arrays: ak.Array, branch: str, pt_min: float, eta_max: float) -> ak.Array:
    px, py, pz, e = (
        ak.values_astype(arrays[f"{branch}_{p}"], np.float64) for p in ["Px", "Py", "Pz", "E"]
    )
    q = arrays[f"{branch}_Charge"]
    pt = np.hypot(px, py)
    eta = np.arcsinh(pz / pt)
    keep = (pt > pt_min) & (abs(eta) < eta_max)
    leptons = ak.zip({"px": px, "py": py, "pz": pz, "e": e, "q": q, "pt": pt})[keep]
    return leptons[ak.argsort(leptons.pt, ascending=False, stable=True)]


def _mass(e: ak.Array, px: ak.Array, py: ak.Array, pz: ak.Array) -> ak.Array:
    m2 = e**2 - px**2 - py**2 - pz**2
    return np.sqrt(np.maximum(m2, 0.0))


def expected_selection(n_events: int | None = None) -> dict[str, np.ndarray]:
    arrays = uproot.open(hzz_path())["events"].arrays(INPUT_BRANCHES, entry_stop=n_events)
    mu = _select(arrays, "Muon", 5.0, 2.4)
    el = _select(arrays, "Electron", 5.0, 2.5)
    a, b = ak.unzip(ak.combinations(mu, 2))  # pairs (0,1), (0,2), ..., (1,2): i < j
    opposite = a.q * b.q < 0
    a1, b1 = ak.firsts(a[opposite]), ak.firsts(b[opposite])
    m_mumu = ak.fill_none(_mass(a1.e + b1.e, a1.px + b1.px, a1.py + b1.py, a1.pz + b1.pz), np.nan)
    leptons = ak.concatenate([mu, el], axis=1)
    lead = leptons[ak.argsort(leptons.pt, ascending=False, stable=True)][:, :4]
    ok = (ak.num(leptons) >= 4) & (ak.sum(lead.q, axis=1) == 0)
    m4 = _mass(
        ak.sum(lead.e, axis=1),
        ak.sum(lead.px, axis=1),
        ak.sum(lead.py, axis=1),
        ak.sum(lead.pz, axis=1),
    )
    m_4l = np.where(ak.to_numpy(ok), ak.to_numpy(m4), np.nan)
    m_mumu = ak.to_numpy(m_mumu).astype(np.float64)
    selected = np.flatnonzero(~np.isnan(m_mumu))
    return {
        "uids": selected,
        "m_mumu": m_mumu,
        "m_4l": m_4l,
        "mu_px": mu.px,
        "n_mu": ak.to_numpy(ak.num(mu)),
        "n_events": np.array(len(arrays)),
    }


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    return expected_selection()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory):
    return run_demo(tmp_path_factory.mktemp("demo") / "out", quiet=True)


def test_demo_output_root_file_matches_the_independent_selection(demo_run, expected) -> None:
    assert demo_run.summary.events_read == 2421
    tree = uproot.open(demo_run.selected_root)["events"]
    got = tree.arrays(["evflow_uid", "m_mumu", "m_4l", "mu_px", "n_mu"])
    uids = ak.to_numpy(got.evflow_uid).astype(np.int64)
    np.testing.assert_array_equal(uids, expected["uids"])
    assert len(uids) == demo_run.summary.events_written > 1000
    np.testing.assert_allclose(ak.to_numpy(got.m_mumu), expected["m_mumu"][uids], rtol=1e-12)
    np.testing.assert_allclose(ak.to_numpy(got.m_4l), expected["m_4l"][uids], rtol=1e-9)
    np.testing.assert_array_equal(ak.to_numpy(got.n_mu), expected["n_mu"][uids])
    want_px = expected["mu_px"][uids]
    assert ak.all(ak.num(got.mu_px) == ak.num(want_px))
    np.testing.assert_allclose(ak.to_numpy(ak.flatten(got.mu_px)), ak.to_numpy(ak.flatten(want_px)))
    assert np.count_nonzero(~np.isnan(expected["m_4l"][uids])) > 10  # the 4l branch is not empty


def test_demo_histograms_hold_every_candidate(demo_run, expected) -> None:
    m_mumu = expected["m_mumu"][~np.isnan(expected["m_mumu"])]
    m_4l = expected["m_4l"][~np.isnan(expected["m_4l"])]
    h2 = demo_run.summary.persistent["m_mumu"]
    h4 = demo_run.summary.persistent["m_4l"]
    want2, _ = np.histogram(m_mumu, bins=h2.axes[0].edges)
    want4, _ = np.histogram(m_4l, bins=h4.axes[0].edges)
    np.testing.assert_array_equal(h2.values(), want2)
    np.testing.assert_array_equal(h4.values(), want4)
    assert h2.sum(flow=True) == len(m_mumu) and h4.sum(flow=True) == len(m_4l)
    with uproot.open(demo_run.histograms_root) as f:
        np.testing.assert_array_equal(f["m_mumu"].values(), want2)


def test_demo_writes_a_valid_png(demo_run) -> None:
    data = demo_run.plot_png.read_bytes()
    assert data[:8] == PNG_MAGIC
    import matplotlib.pyplot as plt

    image = plt.imread(demo_run.plot_png)
    assert image.shape[0] >= 300 and image.shape[1] >= 800
    assert image.std() > 0.05  # not a blank canvas


def test_demo_module_statistics_count_the_trigger(demo_run, expected) -> None:
    stats = {s.module: s for s in demo_run.summary.modules}
    assert stats["RootInput"].calls == 2421
    assert stats["CandidateFilter"].dropped == 2421 - len(expected["uids"])
    assert stats["RootOutput"].calls == len(expected["uids"])
    assert all(stats[m].calls == 2421 for m in ("MuonSelection", "DimuonMass", "MassHistograms"))


def test_demo_max_events(tmp_path: Path) -> None:
    result = run_demo(tmp_path, max_events=300, quiet=True)
    assert result.summary.events_read == 300
    want = expected_selection(300)["uids"]
    got = uproot.open(result.selected_root)["events"]["evflow_uid"].array(library="np")
    np.testing.assert_array_equal(got.astype(np.int64), want)


def test_demo_unwritable_output_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="cannot create the demo output directory"):
        run_demo(blocker / "sub", quiet=True)


def test_demo_command_runs_and_reports_its_files(tmp_path: Path) -> None:
    out = tmp_path / "o"
    result = subprocess.run(
        [sys.executable, "-m", "evflow", "demo", "-n", "500", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "500 read" in result.stdout and "Module statistics" in result.stdout
    assert f"plot:            {out / 'masses.png'}" in result.stdout
    assert (out / "masses.png").read_bytes()[:8] == PNG_MAGIC
    assert uproot.open(out / "selected.root")["events"].num_entries > 200


# --- the modules on hand-made events ----------------------------------------------------------
def _event(muons: list[tuple[float, float, float, float, int]], electrons=()) -> DataStore:
    def arrays(prefix: str, rows) -> dict[str, np.ndarray]:
        rows = list(rows)
        cols = list(zip(*rows, strict=True)) if rows else [(), (), (), (), ()]
        out = {
            f"{prefix}_{p}": np.asarray(c, np.float32)
            for p, c in zip(["Px", "Py", "Pz", "E"], cols[:4], strict=True)
        }
        out[f"{prefix}_Charge"] = np.asarray(cols[4], np.int32)
        return out

    return DataStore(EventMeta(uid=1), {**arrays("Muon", muons), **arrays("Electron", electrons)})


def _run(store: DataStore, *modules) -> bool:
    for m in modules:
        m.initialize()
    return all(m.event(store) is not False for m in modules)


def test_lepton_selection_cuts_and_sorts_by_pt() -> None:
    store = _event(
        [
            (3.0, 0.0, 0.0, 3.0, 1),  # pT 3: below threshold
            (10.0, 0.0, 0.0, 10.0, -1),
            (0.0, 20.0, 0.0, 20.0, 1),
            (8.0, 0.0, 200.0, 200.2, 1),  # |eta| ~ 3.9: outside
        ]
    )
    _run(store, LeptonSelection(pt_min=5.0, eta_max=2.4))
    np.testing.assert_array_equal(store["mu_py"], [20.0, 0.0])
    np.testing.assert_array_equal(store["mu_q"], [1, -1])
    assert store["n_mu"] == 2
    with pytest.raises(ParameterError, match="'flavour' must be one of"):
        LeptonSelection(flavour="tau")


def test_dimuon_mass_takes_first_opposite_charge_pair() -> None:
    # the hardest muon (60 GeV along y) pairs with the first muon of opposite charge
    store = _event(
        [(0.0, 60.0, 0.0, 60.0, 1), (45.6, 0.0, 0.0, 45.6, 1), (-45.6, 0.0, 0.0, 45.6, -1)]
    )
    assert _run(
        store,
        LeptonSelection(),
        LeptonSelection(flavour="electron"),
        DimuonMass(),
        FourLeptonMass(),
        CandidateFilter(),
    )
    # pairs in pT order: (60y, +45.6x) same sign, (60y, -45.6x) opposite -> that one
    assert store["m_mumu"] == pytest.approx(math.sqrt(105.6**2 - 45.6**2 - 60.0**2))
    assert math.isnan(store["m_4l"])


def test_events_without_candidate_are_dropped() -> None:
    store = _event([(30.0, 0.0, 0.0, 30.0, 1), (0.0, 30.0, 0.0, 30.0, 1)])
    assert not _run(
        store,
        LeptonSelection(),
        LeptonSelection(flavour="electron"),
        DimuonMass(),
        CandidateFilter(),
    )
    assert math.isnan(store["m_mumu"])


def test_four_lepton_mass_needs_four_neutral_leptons() -> None:
    mu = [(40.0, 0.0, 0.0, 40.0, 1), (-40.0, 0.0, 0.0, 40.0, -1)]
    el = [(0.0, 30.0, 0.0, 30.0, 1), (0.0, -30.0, 0.0, 30.0, -1)]
    store = _event(mu, el)
    _run(
        store,
        LeptonSelection(),
        LeptonSelection(flavour="electron"),
        DimuonMass(),
        FourLeptonMass(),
    )
    assert store["m_4l"] == pytest.approx(140.0)  # all at rest in total: m = sum of E
    charged = _event(mu, [(0.0, 30.0, 0.0, 30.0, 1), (0.0, -30.0, 0.0, 30.0, 1)])
    _run(
        charged,
        LeptonSelection(),
        LeptonSelection(flavour="electron"),
        DimuonMass(),
        FourLeptonMass(),
    )
    assert math.isnan(charged["m_4l"])


def test_mass_histograms_live_in_persistent_and_flush_at_end_of_run() -> None:
    persistent: dict = {}
    hists = MassHistograms(block=3)
    hists.initialize()
    for m in (91.0, 92.0, float("nan"), 45.0, 91.5):
        store = DataStore(EventMeta(uid=0), {"m_mumu": m, "m_4l": float("nan")}, persistent)
        hists.event(store)
    assert persistent["m_mumu"].sum() == 3  # one block of 3 filled, one value pending
    hists.end_run(RunMeta())
    assert persistent["m_mumu"].sum() == 4
    assert persistent["m_4l"].sum() == 0
    # hist objects merge with + (what a parallel run does over workers)
    assert (persistent["m_mumu"] + persistent["m_mumu"]).sum() == 8


def test_parallel_demo_matches_the_independent_selection(
    tmp_path: Path, expected, demo_run
) -> None:
    result = run_demo(tmp_path, workers=2, quiet=True)
    assert result.summary.workers == 2 and result.summary.events_read == 2421
    got = uproot.open(result.selected_root)["events"].arrays(["evflow_uid", "m_mumu"])
    order = np.argsort(ak.to_numpy(got.evflow_uid))  # workers may reorder events
    uids = ak.to_numpy(got.evflow_uid)[order].astype(np.int64)
    np.testing.assert_array_equal(uids, expected["uids"])
    np.testing.assert_allclose(ak.to_numpy(got.m_mumu)[order], expected["m_mumu"][uids], rtol=1e-12)
    # histograms merged over the workers equal the sequential ones exactly
    for key in ("m_mumu", "m_4l"):
        np.testing.assert_array_equal(
            result.summary.persistent[key].values(flow=True),
            demo_run.summary.persistent[key].values(flow=True),
        )
    workers = {s.process for s in result.summary.modules if s.module == "MuonSelection"}
    assert workers == {"worker-0", "worker-1"}

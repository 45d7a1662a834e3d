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
    FourLeptonRefit,
    LeptonSelection,
    MassHistograms,
    ZMassFit,
    default_workers,
    hzz_path,
    run_demo,
)
from evflow.demo.analysis import INPUT_BRANCHES
from evflow.demo.zfit import (
    MUON_MASS_GEV,
    Z_MASS_GEV,
    breit_wigner_penalty,
    fit_lineshape,
    fit_mass_constraint,
)
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
        "mu_py": mu.py,
        "mu_pz": mu.pz,
        "n_mu": ak.to_numpy(ak.num(mu)),
        "n_events": np.array(len(arrays)),
    }


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    return expected_selection()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory):
    """The sequential demo (-p 0)."""
    return run_demo(tmp_path_factory.mktemp("demo") / "out", workers=0, quiet=True)


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory: pytest.TempPathFactory):
    """The demo as `evflow demo` runs it: one worker per core."""
    return run_demo(tmp_path_factory.mktemp("demo-par") / "out", quiet=True)


FIT_BRANCHES = [
    "z_i",
    "z_j",
    "z_converged",
    "z_mass_meas",
    "z_mass",
    "z_chi2",
    "z_mass_ls",
    "zmu_pt",
    "zmu_eta",
    "zmu_phi",
    "zfit_chi2",
    "m_4l_zfit",
]


def _read_sorted(file: Path, branches: list[str]) -> ak.Array:
    got = uproot.open(file)["events"].arrays(["evflow_uid", *branches])
    return got[np.argsort(ak.to_numpy(got.evflow_uid))]  # workers may reorder events


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
    assert image.shape[0] >= 700 and image.shape[1] >= 1000  # four panels
    for key in ("z_chi2", "z_mass_ls", "m_4l_zfit"):  # what the new panels show is booked
        assert demo_run.summary.persistent[key].sum() > 10
    assert image.std() > 0.05  # not a blank canvas


def test_demo_module_statistics_count_the_trigger(demo_run, expected) -> None:
    stats = {s.module: s for s in demo_run.summary.modules}
    assert stats["RootInput"].calls == 2421
    assert stats["CandidateFilter"].dropped == 2421 - len(expected["uids"])
    assert stats["RootOutput"].calls == len(expected["uids"])
    assert all(
        stats[m].calls == 2421
        for m in ("MuonSelection", "DimuonMass", "ZMassFit", "MassHistograms")
    )
    assert stats["ZMassFit"].time_s > 0.5 * sum(s.time_s for s in demo_run.summary.modules)


def test_demo_max_events(tmp_path: Path) -> None:
    result = run_demo(tmp_path, max_events=300, workers=0, quiet=True)
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
    # parallel by default: one worker per core, and the demo's own report line
    assert f"demo: {default_workers()} workers on {default_workers()} cores" in result.stdout
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


def test_parallel_demo_matches_the_independent_selection(parallel_run, expected, demo_run) -> None:
    result = parallel_run
    assert result.summary.workers == default_workers() > 0
    assert result.summary.events_read == 2421
    got = _read_sorted(result.selected_root, ["m_mumu", "m_4l", "mu_px", "n_mu"])
    uids = ak.to_numpy(got.evflow_uid).astype(np.int64)
    np.testing.assert_array_equal(uids, expected["uids"])
    np.testing.assert_allclose(ak.to_numpy(got.m_mumu), expected["m_mumu"][uids], rtol=1e-12)
    np.testing.assert_allclose(ak.to_numpy(got.m_4l), expected["m_4l"][uids], rtol=1e-9)
    np.testing.assert_array_equal(ak.to_numpy(got.n_mu), expected["n_mu"][uids])
    np.testing.assert_allclose(
        ak.to_numpy(ak.flatten(got.mu_px)), ak.to_numpy(ak.flatten(expected["mu_px"][uids]))
    )
    # histograms merged over the workers equal the sequential ones exactly
    for key, h in demo_run.summary.persistent.items():
        np.testing.assert_array_equal(
            result.summary.persistent[key].values(flow=True), h.values(flow=True)
        )
    workers = {s.process for s in result.summary.modules if s.module == "ZMassFit"}
    assert workers == {f"worker-{i}" for i in range(default_workers())}


def test_fitted_values_are_identical_in_sequential_and_parallel_runs(
    demo_run, parallel_run
) -> None:
    seq = _read_sorted(demo_run.selected_root, FIT_BRANCHES)
    par = _read_sorted(parallel_run.selected_root, FIT_BRANCHES)
    for key in ["evflow_uid", *FIT_BRANCHES]:
        a, b = seq[key], par[key]
        if a.ndim > 1:
            assert ak.all(ak.num(a) == ak.num(b))
            a, b = ak.flatten(a), ak.flatten(b)
        np.testing.assert_array_equal(ak.to_numpy(a), ak.to_numpy(b), err_msg=key)  # bit for bit


# --- the kinematic fit -------------------------------------------------------------------------
def _sigmas(pt: np.ndarray) -> tuple[np.ndarray, float, float]:
    """The demo's resolution model, written out: sigma(1/pT), sigma(eta), sigma(phi)."""
    rel = np.sqrt(0.02**2 + (1e-4 * pt) ** 2)
    return rel / pt, 1e-3, 1e-3


def _pt_mass(pt: np.ndarray, eta: np.ndarray, phi: np.ndarray, m: float = MUON_MASS_GEV) -> float:
    p = np.stack([pt * np.cos(phi), pt * np.sin(phi), pt * np.sinh(eta)])
    e = np.sqrt((p**2).sum(axis=0) + m * m)
    total = np.append(p.sum(axis=1), e.sum())
    return float(np.sqrt(total[3] ** 2 - (total[:3] ** 2).sum()))


def _chi2(pt0, eta0, phi0, pt, eta, phi) -> float:
    s_k, s_eta, s_phi = _sigmas(pt0)
    return float(
        (((1 / pt - 1 / pt0) / s_k) ** 2).sum()
        + (((eta - eta0) / s_eta) ** 2).sum()
        + (((phi - phi0) / s_phi) ** 2).sum()
    )


def test_demo_z_fit_on_real_data_meets_the_constraint_and_its_chi2(demo_run, expected) -> None:
    got = _read_sorted(demo_run.selected_root, FIT_BRANCHES)
    uids = ak.to_numpy(got.evflow_uid).astype(np.int64)
    ok = ak.to_numpy(got.z_converged)
    assert ok.mean() > 0.9  # nearly every dimuon event has a converged Z candidate
    chi2 = ak.to_numpy(got.z_chi2)
    m_meas = ak.to_numpy(got.z_mass_meas)
    checked = 0
    for n in np.flatnonzero(ok):
        uid, i, j = uids[n], int(got.z_i[n]), int(got.z_j[n])
        px, py, pz = (ak.to_numpy(expected[k][uid])[[i, j]] for k in ("mu_px", "mu_py", "mu_pz"))
        pt0, eta0, phi0 = np.hypot(px, py), np.arcsinh(pz / np.hypot(px, py)), np.arctan2(py, px)
        pt, eta, phi = (ak.to_numpy(got[k][n]) for k in ("zmu_pt", "zmu_eta", "zmu_phi"))
        # the stored fitted muons make m_Z, and their chi2 is the stored one
        assert _pt_mass(pt, eta, phi) == pytest.approx(Z_MASS_GEV, abs=1e-6)
        assert got.z_mass[n] == pytest.approx(Z_MASS_GEV, abs=1e-6)
        assert _chi2(pt0, eta0, phi0, pt, eta, phi) == pytest.approx(chi2[n], rel=1e-6, abs=1e-9)
        assert m_meas[n] == pytest.approx(_pt_mass(pt0, eta0, phi0), rel=1e-12)
        assert chi2[n] == pytest.approx(np.min(ak.to_numpy(got.zfit_chi2[n])))  # best pair
        checked += 1
    assert checked > 1000
    # chi2 grows like ((m - m_Z) / sigma_m)^2: small near the peak, large off-shell
    near = ok & (np.abs(m_meas - Z_MASS_GEV) < 1.0)
    far = ok & (np.abs(m_meas - Z_MASS_GEV) > 10.0)
    assert near.sum() > 100 and far.sum() > 20
    assert np.median(chi2[near]) < 1.0 < 20.0 < np.median(chi2[far])
    # the line-shape fit pulls the candidates towards m_Z, never past it
    m_ls = ak.to_numpy(got.z_mass_ls)[ok]
    assert np.all(np.abs(m_ls - Z_MASS_GEV) <= np.abs(m_meas[ok] - Z_MASS_GEV) + 1e-6)
    assert np.std(m_ls[near[ok]] - Z_MASS_GEV) < np.std(m_meas[near] - Z_MASS_GEV)


def test_mass_constrained_fit_is_the_constrained_minimum() -> None:
    pt0, eta0, phi0 = np.array([40.0, 35.0]), np.array([0.3, -0.5]), np.array([0.1, 2.9])
    fit = fit_mass_constraint(pt0, eta0, phi0)
    assert fit.converged and fit.n_iter < 10
    assert fit.mass_measured_gev == pytest.approx(_pt_mass(pt0, eta0, phi0))
    assert fit.mass_fit_gev == pytest.approx(Z_MASS_GEV, abs=1e-7)
    assert fit.chi2 == pytest.approx(_chi2(pt0, eta0, phi0, fit.pt_gev, fit.eta, fit.phi), rel=1e-9)
    # Lagrange condition, checked with finite differences: grad chi2 is parallel to grad M
    x = np.concatenate([1 / fit.pt_gev, fit.eta, fit.phi])
    x0 = np.concatenate([1 / pt0, eta0, phi0])
    s_k, s_eta, s_phi = _sigmas(pt0)
    var = np.concatenate([s_k**2, [s_eta**2] * 2, [s_phi**2] * 2])
    grad_chi2 = 2 * (x - x0) / var

    def mass_of(v: np.ndarray) -> float:
        return _pt_mass(1 / v[:2], v[2:4], v[4:])

    grad_m = np.array(
        [
            (mass_of(x + dx) - mass_of(x - dx)) / (2 * dx[k])
            for k, dx in enumerate(np.diag(np.abs(x) * 1e-6 + 1e-9))
        ]
    )
    cos = grad_chi2 @ grad_m / np.linalg.norm(grad_chi2) / np.linalg.norm(grad_m)
    assert abs(cos) == pytest.approx(1.0, abs=1e-6)
    # and no other point on the constraint surface nearby has a smaller chi2
    rng = np.random.default_rng(7)
    for _ in range(50):
        y = x + rng.normal(0, np.sqrt(var) * 0.3)
        y[:2] *= (mass_of(y) / Z_MASS_GEV) ** 2  # M ~ 1/sqrt(k1 k2): back onto M = m_Z
        for _ in range(3):
            y[:2] *= (mass_of(y) / Z_MASS_GEV) ** 1
        assert mass_of(y) == pytest.approx(Z_MASS_GEV, abs=1e-3)
        assert ((y - x0) ** 2 / var).sum() > fit.chi2
    # a pair measured at m_Z is left alone
    at_z = fit_mass_constraint(fit.pt_gev, fit.eta, fit.phi)
    assert at_z.converged and at_z.chi2 < 1e-12


def test_lineshape_fit_moves_near_on_shell_pairs_and_keeps_off_shell_ones() -> None:
    eta, phi = np.array([0.3, -0.5]), np.array([0.1, 2.9])
    for pt in ([40.0, 35.0], [46.0, 44.0], [10.0, 8.0], [60.0, 50.0]):
        fit, nll = fit_lineshape(np.array(pt), eta, phi)
        m0, m = fit.mass_measured_gev, fit.mass_fit_gev
        assert fit.converged
        assert min(m0, Z_MASS_GEV) - 1e-6 <= m <= max(m0, Z_MASS_GEV) + 1e-6
        assert nll == pytest.approx(
            fit.chi2 + breit_wigner_penalty(m) - breit_wigner_penalty(Z_MASS_GEV), rel=1e-6
        )
        # a minimum of chi2(m) - 2 ln BW(m): both neighbours (hard fits at m +- d) are worse
        for d in (0.3 * fit.sigma_mass_gev, -0.3 * fit.sigma_mass_gev):
            other = fit_mass_constraint(np.array(pt), eta, phi, target_gev=m + d)
            worse = other.chi2 + breit_wigner_penalty(m + d) - breit_wigner_penalty(Z_MASS_GEV)
            assert worse >= nll - 0.05
        if abs(m0 - Z_MASS_GEV) > 50:  # far off-shell: stays within its resolution
            assert abs(m - m0) < 0.5 * fit.sigma_mass_gev
        if abs(m0 - Z_MASS_GEV) < 2 * fit.sigma_mass_gev:  # on-shell: pulled to the pole
            assert abs(m - Z_MASS_GEV) < 0.5 * abs(m0 - Z_MASS_GEV)


def _z_pair(mass_gev: float, pz_gev: float = 0.0) -> list[tuple[float, float, float, float, int]]:
    """Two back-to-back muons along x (plus a common pz) with pair mass ``mass_gev``."""
    p = math.sqrt((mass_gev / 2) ** 2 - MUON_MASS_GEV**2)
    e = math.sqrt(p * p + pz_gev * pz_gev / 4 + MUON_MASS_GEV**2)
    return [(p, 0.0, pz_gev / 2, e, 1), (-p, 0.0, pz_gev / 2, e, -1)]


def test_z_fit_modules_pick_the_most_z_like_pair_and_refit_m4l() -> None:
    path = [
        LeptonSelection(),
        LeptonSelection(flavour="electron"),
        DimuonMass(),
        FourLeptonMass(),
        ZMassFit(),
        FourLeptonRefit(),
    ]
    # muons in pT order: (mu0+, mu1-) nearly collinear is the first pair (a few GeV),
    # (mu0+, mu2-) back to back (98 GeV) is the Z candidate
    muons = [
        (0.0, 60.0, 0.0, 60.0, 1),
        (0.0, 50.0, 5.0, math.hypot(50.0, 5.0), -1),
        (0.0, -40.0, 0.0, 40.0, -1),
    ]
    store = _event(muons)
    _run(store, *path)
    assert len(store["zfit_chi2"]) == 2 and store["zfit_converged"][1]
    assert (store["z_i"], store["z_j"]) == (0, 2)  # not the first pair, which DimuonMass takes
    assert store["m_mumu"] < 10.0 < 90.0 < store["z_mass_meas"] < 100.0
    assert store["z_chi2"] == store["zfit_chi2"].min() < store["zfit_chi2"].max()
    assert store["z_mass"] == pytest.approx(Z_MASS_GEV, abs=1e-6)
    assert math.isnan(store["m_4l_zfit"])  # fewer than four leptons
    # four leptons, Z -> mu mu exactly on shell: the refit leaves m_4l unchanged
    el = [(0.0, 20.0, 5.0, math.sqrt(425.0), 1), (0.0, -20.0, 5.0, math.sqrt(425.0), -1)]
    store = _event(_z_pair(Z_MASS_GEV, 10.0), el)
    _run(store, *path)
    assert store["z_chi2"] < 1e-9
    assert store["m_4l_zfit"] == pytest.approx(store["m_4l"], rel=1e-5)
    # a Z measured 2 GeV low: the refit moves m_4l up
    store = _event(_z_pair(Z_MASS_GEV - 2.0, 10.0), el)
    _run(store, *path)
    assert store["z_mass_meas"] < store["z_mass_ls"] < Z_MASS_GEV
    assert store["m_4l_zfit"] > store["m_4l"] + 0.5
    # no muon pair: the fit writes empty arrays and NaN, so every event has the same branches
    store = _event([(30.0, 0.0, 0.0, 30.0, 1)])
    _run(store, *path)
    assert store["z_i"] == -1 and not store["z_converged"] and math.isnan(store["z_chi2"])
    assert len(store["zfit_chi2"]) == 0 and len(store["zmu_pt"]) == 0


def test_keep_branches_drops_what_the_output_does_not_write() -> None:
    from evflow.demo import KeepBranches

    store = DataStore(EventMeta(uid=4), {"m_mumu": 91.0, "Muon_Px": np.ones(2), "zfit_chi2": []})
    _run(store, KeepBranches(keep=["m_mumu", "z_chi2"]))
    assert dict(store) == {"m_mumu": 91.0} and store.meta.uid == 4

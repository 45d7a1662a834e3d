"""The demo's analysis modules: lepton selection, masses, histograms, a trigger.

Every module here does all its work through the store, so all are ``parallel = True``.
Definitions (the demo's test recomputes them independently with awkward arrays):

- a selected lepton has pT > ``pt_min`` GeV and |eta| < ``eta_max``; selected leptons
  are stored sorted by pT, highest first (stable order for equal pT);
- ``m_mumu``: mass of the first opposite-charge pair (i < j, in that pT order) of
  selected muons, NaN when there is none;
- ``m_4l``: mass of the four highest-pT selected leptons (muons and electrons) when
  there are at least four and their charges sum to zero, NaN otherwise.

The kinematic fits (the reconstruction step with real CPU cost) are in ``reco.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from evflow.event import DataStore, RunMeta
from evflow.processing.module import Module, Param

# input branches of uproot-HZZ.root that the analysis reads
FLAVOURS = {"muon": ("Muon", "mu"), "electron": ("Electron", "el")}
INPUT_BRANCHES = [
    f"{branch}_{part}"
    for branch, _ in FLAVOURS.values()
    for part in ("Px", "Py", "Pz", "E", "Charge")
] + ["EventWeight"]


class LeptonSelection(Module):
    """Keep leptons of one flavour above a pT threshold and inside an |eta| range.

    Reads ``Muon_Px`` ... (or ``Electron_*``), writes ``mu_px``, ``mu_py``, ``mu_pz``,
    ``mu_e`` (float64, GeV), ``mu_q`` (int32) sorted by pT, and ``n_mu``.
    """

    parallel = True
    flavour = Param(str, "muon", "which leptons", choices=tuple(FLAVOURS))
    pt_min = Param(float, 5.0, "minimum transverse momentum, GeV")
    eta_max = Param(float, 2.4, "maximum |pseudorapidity|")

    def initialize(self) -> None:
        branch, out = FLAVOURS[self.flavour]
        self._in = [f"{branch}_{p}" for p in ("Px", "Py", "Pz", "E")]
        self._charge = f"{branch}_Charge"
        self._out = out

    def event(self, store: DataStore) -> bool | None:
        px, py, pz, e = (np.asarray(store[k], dtype=np.float64) for k in self._in)
        q = np.asarray(store[self._charge], dtype=np.int32)
        pt = np.hypot(px, py)
        with np.errstate(divide="ignore", invalid="ignore"):
            eta = np.arcsinh(pz / pt)
        keep = (pt > self.pt_min) & (np.abs(eta) < self.eta_max)
        order = np.argsort(-pt[keep], kind="stable")
        out = self._out
        store[f"{out}_px"] = px[keep][order]
        store[f"{out}_py"] = py[keep][order]
        store[f"{out}_pz"] = pz[keep][order]
        store[f"{out}_e"] = e[keep][order]
        store[f"{out}_q"] = q[keep][order]
        store[f"n_{out}"] = int(keep.sum())
        return None


def invariant_mass(e: float, px: float, py: float, pz: float) -> float:
    """sqrt(E^2 - p^2) in GeV, 0 for (rounding-)negative squares."""
    m2 = e * e - px * px - py * py - pz * pz
    return math.sqrt(m2) if m2 > 0 else 0.0


class DimuonMass(Module):
    """``m_mumu``: mass of the first opposite-charge pair of selected muons (or NaN)."""

    parallel = True

    def event(self, store: DataStore) -> bool | None:
        q = store["mu_q"]
        mass = math.nan
        n = len(q)
        for i in range(n):
            for j in range(i + 1, n):
                if q[i] * q[j] < 0:
                    mass = invariant_mass(
                        float(store["mu_e"][i] + store["mu_e"][j]),
                        float(store["mu_px"][i] + store["mu_px"][j]),
                        float(store["mu_py"][i] + store["mu_py"][j]),
                        float(store["mu_pz"][i] + store["mu_pz"][j]),
                    )
                    break
            if not math.isnan(mass):
                break
        store["m_mumu"] = mass
        return None


class FourLeptonMass(Module):
    """``m_4l``: mass of the four highest-pT selected leptons if neutral (or NaN)."""

    parallel = True

    def event(self, store: DataStore) -> bool | None:
        px = np.concatenate([store["mu_px"], store["el_px"]])
        mass = math.nan
        if len(px) >= 4:
            py = np.concatenate([store["mu_py"], store["el_py"]])
            pz = np.concatenate([store["mu_pz"], store["el_pz"]])
            e = np.concatenate([store["mu_e"], store["el_e"]])
            q = np.concatenate([store["mu_q"], store["el_q"]])
            lead = np.argsort(-np.hypot(px, py), kind="stable")[:4]
            if int(q[lead].sum()) == 0:
                mass = invariant_mass(
                    float(e[lead].sum()),
                    float(px[lead].sum()),
                    float(py[lead].sum()),
                    float(pz[lead].sum()),
                )
        store["m_4l"] = mass
        return None


def persistent_hist(store: DataStore, key: str, make: Callable[[], Any]) -> Any:
    """The histogram ``key`` of this process's run-level store, made on first use.

    Objects in ``store.persistent`` are merged over workers at the end of a parallel
    run (hist objects add with ``+``), so every process must create the same binning.
    """
    h = store.persistent.get(key)
    if h is None:
        h = store.persistent[key] = make()
    return h


def mass_hist(name: str, label: str, bins: int, low_gev: float, high_gev: float) -> Any:
    import hist

    return hist.Hist(hist.axis.Regular(bins, low_gev, high_gev, name=name, label=label))


# histograms the demo books: store key -> (axis label, bins, low, high)
HISTOGRAMS: dict[str, tuple[str, int, float, float]] = {
    "m_mumu": ("m(μ+μ-) [GeV]", 60, 0.0, 150.0),
    "m_4l": ("m(4l) [GeV]", 50, 50.0, 300.0),
    "m_4l_zfit": ("m(4l), Z refitted [GeV]", 50, 50.0, 300.0),
    "z_chi2": ("χ² of the m_Z-constrained fit", 50, 0.0, 25.0),
    "z_mass_meas": ("m(μ+μ-) of the Z candidate [GeV]", 40, 70.0, 110.0),
    "z_mass_ls": ("m(μ+μ-), line-shape fit [GeV]", 40, 70.0, 110.0),
}


class MassHistograms(Module):
    """Fill the ``HISTOGRAMS`` (GeV, chi2) in ``store.persistent``.

    Every histogram is booked in every process (parallel runs merge them by name);
    values missing from the store or NaN are not filled.

    A hist ``fill`` costs ~40 µs whatever the number of values, so values are
    collected and filled in blocks of ``block`` and at ``end_run`` (before the
    histograms are merged or written).
    """

    parallel = True
    block = Param(int, 1000, "values collected before one fill call")

    def initialize(self) -> None:
        self._pending: dict[str, list[float]] = {k: [] for k in HISTOGRAMS}
        self._hists: dict[str, Any] = {}

    def event(self, store: DataStore) -> bool | None:
        if not self._hists:
            self._hists = {
                key: persistent_hist(store, key, partial(mass_hist, key, *spec))
                for key, spec in HISTOGRAMS.items()
            }
        for key, pending in self._pending.items():
            value = store.get(key)  # a path without the fit has no z_chi2
            if value is not None and not math.isnan(value):
                pending.append(value)
                if len(pending) >= self.block:
                    self._fill(key)
        return None

    def end_run(self, run: RunMeta) -> None:
        for key in self._pending:
            self._fill(key)

    def _fill(self, key: str) -> None:
        pending = self._pending[key]
        if pending and key in self._hists:
            self._hists[key].fill(np.asarray(pending))
            pending.clear()


class CandidateFilter(Module):
    """The trigger decision: drop events without a dimuon candidate."""

    parallel = True

    def event(self, store: DataStore) -> bool | None:
        return not math.isnan(store["m_mumu"])


class KeepBranches(Module):
    """Drop every store entry not in ``keep`` (what the output writes).

    At the end of the parallel part it saves the workers encoding, and the output
    process decoding, ~30 intermediate arrays per event that nobody reads.
    """

    parallel = True
    keep = Param((list, tuple), (), "store keys to keep")

    def initialize(self) -> None:
        self._keep: frozenset[str] = frozenset(self.keep)

    def event(self, store: DataStore) -> bool | None:
        for key in [k for k in store if k not in self._keep]:
            del store[key]
        return None

"""Build and run the demo path on uproot-HZZ.root; write the histograms and a plot."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import Any

from evflow.demo.analysis import (
    HISTOGRAMS as BOOKED,
)
from evflow.demo.analysis import (
    INPUT_BRANCHES,
    CandidateFilter,
    DimuonMass,
    FourLeptonMass,
    KeepBranches,
    LeptonSelection,
    MassHistograms,
)
from evflow.demo.reco import FourLeptonRefit, ZMassFit
from evflow.errors import InputError, OutputError
from evflow.processing.api import process
from evflow.processing.module import Module
from evflow.processing.path import Path
from evflow.processing.summary import RunSummary

# what selected.root holds: the results, not every intermediate array. Each branch
# costs ~0.5 ms CPU in every flush of the output, and a parallel run flushes (and
# confirms) every ~20 ms, so the list is kept short (measured: 45 branches ~23 ms per
# flush, 10 branches ~7 ms).
OUTPUT_BRANCHES = [
    "mu_px",
    "n_mu",
    "m_mumu",
    "m_4l",
    "m_4l_zfit",
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
]
HZZ_FILE = "uproot-HZZ.root"
SELECTED = "selected.root"
HISTOGRAMS = "histograms.root"
PLOT = "masses.png"


@dataclass(frozen=True)
class DemoResult:
    summary: RunSummary
    selected_root: FsPath
    histograms_root: FsPath
    plot_png: FsPath

    def report(self) -> str:
        """Figures that show what the workers bought: module CPU time against wall time."""
        s = self.summary
        busy_s = sum(m.time_s for m in s.modules)
        fit_s = sum(m.time_s for m in s.modules if m.module == "ZMassFit")
        fits = s.persistent.get("z_chi2")
        n_z = int(fits.sum(flow=True)) if fits is not None else 0
        mode = f"{s.workers} workers" if s.workers else "sequential (-p 0)"
        return (
            f"demo: {mode} on {default_workers()} cores; {s.events_read} events in "
            f"{s.wall_s:.2f} s = {s.rate_hz:,.0f} events/s\n"
            f"demo: time in modules {busy_s:.2f} s ({busy_s / max(s.wall_s, 1e-9):.2f}x the "
            f"wall time), of which the Z fits {fit_s:.2f} s "
            f"({1e3 * fit_s / max(s.events_read, 1):.2f} ms/event); {n_z} Z candidates"
        )


def hzz_path() -> str:
    """The local copy of uproot-HZZ.root shipped by scikit-hep-testdata 0.3.12."""
    try:
        import skhep_testdata

        return str(skhep_testdata.data_path(HZZ_FILE))
    except Exception as exc:  # missing package, or a newer version that wants internet
        raise InputError(
            f"cannot find {HZZ_FILE}: {exc} (install scikit-hep-testdata==0.3.12, the "
            f"last version that ships its ROOT files)"
        ) from exc


def build_path(input_file: str, output_file: str, qc_task: Module | None = None) -> Path:
    """RootInput -> lepton selections -> masses -> Z fits -> histograms -> trigger -> output.

    ``qc_task`` (a QcTask, ``evflow demo --qc``) sees every event, after the fits."""
    from evflow.io.root import RootInput, RootOutput

    path = Path()
    path.add(RootInput(file=input_file, tree="events", branches=INPUT_BRANCHES))
    path.add(LeptonSelection(name="MuonSelection", flavour="muon", pt_min=5.0, eta_max=2.4))
    path.add(LeptonSelection(name="ElectronSelection", flavour="electron", pt_min=5.0, eta_max=2.5))
    path.add(DimuonMass())
    path.add(FourLeptonMass())
    path.add(ZMassFit())  # the CPU-heavy reconstruction step (~3 ms per muon pair)
    path.add(FourLeptonRefit())
    if qc_task is not None:
        path.add(qc_task)
    path.add(MassHistograms())
    path.add(CandidateFilter())
    path.add(KeepBranches(keep=OUTPUT_BRANCHES))  # in the workers: less to send and decode
    path.add(RootOutput(file=output_file, tree="events", branches=OUTPUT_BRANCHES))
    return path


def default_workers() -> int:
    """The cores this process may run on (the demo's default number of workers)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_demo(
    output_dir: str | FsPath = "demo-output",
    max_events: int | None = None,
    workers: int | None = None,
    quiet: bool = False,
    qc_task: Module | None = None,
) -> DemoResult:
    """Run the demo; write selected.root, histograms.root and masses.png to ``output_dir``.

    ``workers=None``: one worker per core (``default_workers()``); 0: sequential.
    """
    out = FsPath(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"cannot create the demo output directory {str(out)!r}: {exc.strerror}"
        ) from None
    selected = out / SELECTED
    n_workers = default_workers() if workers is None else workers
    path = build_path(hzz_path(), str(selected), qc_task)
    import hist  # noqa: F401  (now, so that forked workers need not import it each)

    summary = process(path, max_events=max_events, workers=n_workers, quiet=quiet)
    hists: dict[str, Any] = {k: summary.persistent[k] for k in BOOKED if k in summary.persistent}
    write_histograms(out / HISTOGRAMS, hists)
    plot_masses(out / PLOT, hists, summary)
    return DemoResult(summary, selected, out / HISTOGRAMS, out / PLOT)


def write_histograms(file: FsPath, hists: dict[str, Any]) -> None:
    """The merged histograms as TH1D in a ROOT file (uproot converts hist objects)."""
    import uproot

    with uproot.recreate(file) as f:
        for name, h in hists.items():
            f[name] = h


def plot_masses(file: FsPath, hists: dict[str, Any], summary: RunSummary) -> None:
    """A PNG: dimuon mass, Z-candidate mass before/after the line-shape fit, fit chi2,
    four-lepton mass before/after the Z refit."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    panels = [
        ("dimuon mass (first opposite-charge pair)", [("m_mumu", "measured")]),
        (
            "Z candidate: line-shape fit",
            [("z_mass_meas", "measured"), ("z_mass_ls", "fitted (Z line shape)")],
        ),
        ("χ² of the m_Z = 91.19 GeV constrained fit", [("z_chi2", "Z candidates")]),
        (
            "four-lepton mass",
            [("m_4l", "measured"), ("m_4l_zfit", "Z candidate refitted")],
        ),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, panels, strict=True):
        entries = []
        for n, (key, label) in enumerate(keys):
            h = hists.get(key)
            if h is None:
                continue
            count = int(h.sum(flow=True))
            entries.append(count)
            style = {"fill": True, "alpha": 0.5} if n == 0 else {"linewidth": 2}
            ax.stairs(h.values(), h.axes[0].edges, label=f"{label} ({count})", **style)
            if n == 0:
                ax.set_xlabel(h.axes[0].label)
        if keys[0][0] == "z_chi2" and hists.get("z_chi2") is not None:
            _overlay_chi2_1dof(ax, hists["z_chi2"])
        ax.set_title(title if entries else f"{title} (no entries)")
        ax.set_ylabel("entries / bin")
        if entries:
            ax.legend(fontsize="small")
    mode = f"{summary.workers} workers" if summary.workers else "sequential"
    fig.suptitle(
        f"evflow demo: uproot-HZZ.root, {summary.events_read} events read, "
        f"{summary.events_written} selected ({mode}, {summary.wall_s:.1f} s)"
    )
    fig.savefig(file, dpi=100)
    plt.close(fig)


def _overlay_chi2_1dof(ax: Any, h: Any) -> None:
    """The chi2(1 dof) density scaled to the histogram's entries inside its range."""
    import math

    import numpy as np

    edges = h.axes[0].edges
    x = np.linspace(max(edges[0], 0.05), edges[-1], 200)
    density = np.exp(-x / 2) / np.sqrt(2 * math.pi * x)
    inside = float(h.values().sum())
    # normalise to the entries in range: P(chi2 < high) = erf(sqrt(high/2))
    scale = inside / math.erf(math.sqrt(edges[-1] / 2)) * (edges[1] - edges[0])
    ax.plot(x, density * scale, "k--", label="χ², 1 dof (scaled); tail: Z width, Z*")
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5)

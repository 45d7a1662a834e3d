"""Build and run the demo path on uproot-HZZ.root; write the histograms and a plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import Any

from evflow.demo.analysis import (
    INPUT_BRANCHES,
    CandidateFilter,
    DimuonMass,
    FourLeptonMass,
    LeptonSelection,
    MassHistograms,
)
from evflow.errors import InputError, OutputError
from evflow.processing.api import process
from evflow.processing.path import Path
from evflow.processing.summary import RunSummary

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


def build_path(input_file: str, output_file: str) -> Path:
    """RootInput -> lepton selections -> masses -> histograms -> trigger -> RootOutput."""
    from evflow.io.root import RootInput, RootOutput

    path = Path()
    path.add(RootInput(file=input_file, tree="events", branches=INPUT_BRANCHES))
    path.add(LeptonSelection(name="MuonSelection", flavour="muon", pt_min=5.0, eta_max=2.4))
    path.add(LeptonSelection(name="ElectronSelection", flavour="electron", pt_min=5.0, eta_max=2.5))
    path.add(DimuonMass())
    path.add(FourLeptonMass())
    path.add(MassHistograms())
    path.add(CandidateFilter())
    path.add(RootOutput(file=output_file, tree="events"))
    return path


def run_demo(
    output_dir: str | FsPath = "demo-output",
    max_events: int | None = None,
    workers: int = 0,
    quiet: bool = False,
) -> DemoResult:
    """Run the demo; write selected.root, histograms.root and masses.png to ``output_dir``."""
    out = FsPath(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"cannot create the demo output directory {str(out)!r}: {exc.strerror}"
        ) from None
    selected = out / SELECTED
    path = build_path(hzz_path(), str(selected))
    summary = process(path, max_events=max_events, workers=workers, quiet=quiet)
    hists: dict[str, Any] = {
        k: summary.persistent[k] for k in ("m_mumu", "m_4l") if k in summary.persistent
    }
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
    """A PNG with the dimuon and four-lepton mass histograms."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    titles = {"m_mumu": "dimuon mass", "m_4l": "four-lepton mass"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, key in zip(axes, ("m_mumu", "m_4l"), strict=True):
        h = hists.get(key)
        if h is not None:
            ax.stairs(h.values(), h.axes[0].edges, fill=True, alpha=0.6)
            ax.set_xlabel(h.axes[0].label)
            ax.set_title(f"{titles[key]} ({int(h.sum(flow=True))} entries)")
        else:
            ax.set_title(f"{titles[key]} (no entries)")
        ax.set_ylabel("events / bin")
    mode = f"{summary.workers} workers" if summary.workers else "sequential"
    fig.suptitle(
        f"evflow demo: uproot-HZZ.root, {summary.events_read} events read, "
        f"{summary.events_written} selected ({mode})"
    )
    fig.savefig(file, dpi=100)
    plt.close(fig)

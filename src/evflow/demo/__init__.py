"""The evflow demo: an H->ZZ-style analysis of uproot-HZZ.root (real data, offline)."""

from evflow.demo.analysis import (
    CandidateFilter,
    DimuonMass,
    FourLeptonMass,
    KeepBranches,
    LeptonSelection,
    MassHistograms,
)
from evflow.demo.reco import FourLeptonRefit, ZMassFit
from evflow.demo.runner import DemoResult, build_path, default_workers, hzz_path, run_demo

__all__ = [
    "CandidateFilter",
    "DemoResult",
    "DimuonMass",
    "FourLeptonMass",
    "FourLeptonRefit",
    "KeepBranches",
    "LeptonSelection",
    "MassHistograms",
    "ZMassFit",
    "build_path",
    "default_workers",
    "hzz_path",
    "run_demo",
]

"""The evflow demo: an H->ZZ-style analysis of uproot-HZZ.root (real data, offline)."""

from evflow.demo.analysis import (
    CandidateFilter,
    DimuonMass,
    FourLeptonMass,
    KeepBranches,
    LeptonSelection,
    MassHistograms,
)
from evflow.demo.hzz import DemoResult, build_path, default_workers, hzz_path, run_demo
from evflow.demo.reco import FourLeptonRefit, ZMassFit

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

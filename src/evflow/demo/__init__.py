"""The evflow demo: an H->ZZ-style analysis of uproot-HZZ.root (real data, offline)."""

from evflow.demo.analysis import (
    CandidateFilter,
    DimuonMass,
    FourLeptonMass,
    LeptonSelection,
    MassHistograms,
)
from evflow.demo.runner import DemoResult, build_path, hzz_path, run_demo

__all__ = [
    "CandidateFilter",
    "DemoResult",
    "DimuonMass",
    "FourLeptonMass",
    "LeptonSelection",
    "MassHistograms",
    "build_path",
    "hzz_path",
    "run_demo",
]

"""The demo analysis as a steering file: muons and electrons of uproot-HZZ.root, Z fits.

evflow run examples/hzz_steering.py -p 2 -o hzz-selected.root
"""

import evflow
from evflow.demo import (
    CandidateFilter,
    DimuonMass,
    FourLeptonMass,
    FourLeptonRefit,
    LeptonSelection,
    MassHistograms,
    ZMassFit,
    hzz_path,
)
from evflow.demo.analysis import INPUT_BRANCHES
from evflow.io.root import RootInput

path = evflow.Path()
path.add(RootInput(file=hzz_path(), tree="events", branches=INPUT_BRANCHES))
path.add(LeptonSelection(name="MuonSelection", flavour="muon", pt_min=5.0, eta_max=2.4))
path.add(LeptonSelection(name="ElectronSelection", flavour="electron", pt_min=5.0, eta_max=2.5))
path.add(DimuonMass())
path.add(FourLeptonMass())
path.add(ZMassFit(pt_rel=0.02))  # Z-mass and Z-line-shape fits of every mu+mu- pair
path.add(FourLeptonRefit())
path.add(MassHistograms())
path.add(CandidateFilter())
summary = evflow.process(path)

h = summary.persistent.get("m_mumu")
if h is not None:
    peak = h.axes[0].centers[h.values().argmax()]
    print(f"dimuon mass peak at {peak:.1f} GeV ({int(h.sum(flow=True))} candidates)")
chi2 = summary.persistent.get("z_chi2")
if chi2 is not None and chi2.sum(flow=True):
    below = chi2[: complex(0, 4.0)].sum() / chi2.sum(flow=True)
    print(f"Z candidates with fit chi2 < 4: {below:.0%}")

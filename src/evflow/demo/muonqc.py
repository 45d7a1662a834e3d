"""``MuonQc``: a QC task on the raw muon branches of uproot-HZZ.root.

Used by ``examples/topologies/file_qc.toml`` (a ``file-source`` reading the file ->
``qc-producer`` devices running this task -> merger -> repository). It needs no
analysis before it: the number of muons (``NMuon``), each muon's pT and, for events
with two or more muons, the invariant mass of the first two (``Muon_Px/Py/Pz/E``).
Every fill has weight one, so the merged histograms equal a sequential fill of the
same events bin by bin, whatever the order or the number of producers.
"""

from __future__ import annotations

import numpy as np

from evflow.event import DataStore
from evflow.qc.producer import QcTask

__all__ = ["MUON_BRANCHES", "MuonQc"]

#: the branches the task reads (a file-source may read only these)
MUON_BRANCHES = ("NMuon", "Muon_Px", "Muon_Py", "Muon_Pz", "Muon_E")


class MuonQc(QcTask):
    """Muon multiplicity, muon pT, mass of the first two muons."""

    def book(self) -> None:
        import hist

        reg = hist.axis.Regular
        self.objects["n_mu"] = hist.Hist(hist.axis.Integer(0, 8, name="n_mu", label="muons"))
        self.objects["mu_pt"] = hist.Hist(reg(50, 0, 100, name="mu_pt", label="muon pT [GeV]"))
        self.objects["m_mumu"] = hist.Hist(reg(60, 0, 150, name="m_mumu", label="m(μμ) [GeV]"))

    def fill(self, store: DataStore) -> None:
        px, py = store["Muon_Px"], store["Muon_Py"]
        self.objects["n_mu"].fill(int(store["NMuon"]))
        if len(px):
            self.objects["mu_pt"].fill(np.hypot(px, py))
        if len(px) >= 2:
            pz, e = store["Muon_Pz"], store["Muon_E"]
            m2 = (e[0] + e[1]) ** 2 - (px[0] + px[1]) ** 2 - (py[0] + py[1]) ** 2
            m2 -= (pz[0] + pz[1]) ** 2
            self.objects["m_mumu"].fill(float(np.sqrt(max(m2, 0.0))))

"""A steering file with a QC task: toy events, a histogram and a counter per cycle.

Start the repository and the merger first (docs/qc.md, "QC in 5 minutes"), then:

evflow run examples/qc_steering.py -p 2     # one QC source per worker: merger --inputs 2
evflow qc ls --repo qc.sqlite
"""

import hist

import evflow
from evflow.io.generators import ToyGenerator
from evflow.qc import QcTask


class ValueQc(QcTask):
    """The toy value's distribution and the number of events."""

    def book(self) -> None:
        self.objects["value"] = hist.Hist.new.Reg(20, 0, 1, name="value").Double()
        self.objects["events"] = 0

    def fill(self, store: evflow.DataStore) -> None:
        self.objects["value"].fill(store["value"])
        self.objects["events"] += 1


path = evflow.Path()
path.add(ToyGenerator(n_events=20_000, seed=1))
# session "qc5": the ipc directory the merger and repository were started with
path.add(ValueQc(name="toy", merger="ipc://qc-merger", session="qc5", cycle_s=1.0))
evflow.process(path)

"""A steering file: toy events, some CPU work, a trigger, a record file.

evflow run examples/toy_steering.py              # 2000 events, sequential
evflow run examples/toy_steering.py -n 500 -q    # the command line wins
evflow run examples/toy_steering.py -p 2         # two worker processes
"""

import evflow
from evflow.io.generators import BusyWork, ToyGenerator


class Trigger(evflow.Module):
    """Keep events whose toy value is above a threshold."""

    parallel = True  # uses nothing but the store: may run in many workers
    threshold = evflow.Param(float, 0.5, "keep events with value above this")

    def event(self, store: evflow.DataStore) -> bool:
        return store["value"] > self.threshold


path = evflow.Path()
path.add(ToyGenerator(n_events=2000, payload_bytes=1024, seed=1))
path.add(BusyWork(work_ms=0.05))
path.add(Trigger(threshold=0.3))
evflow.process(path, output="toy-selected.evf")

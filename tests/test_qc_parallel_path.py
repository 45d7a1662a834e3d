"""QcTask in a path: in every worker of ``evflow.process(workers=2)`` and sequentially."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path as FsPath

import hist

import evflow
from evflow import DataStore, Path
from evflow.io import ToyGenerator
from evflow.qc import QcTask
from evflow.qc.mergestate import MergeState


class ValueQc(QcTask):
    def book(self) -> None:
        self.objects["value"] = hist.Hist.new.Reg(16, 0, 1).Double()
        self.objects["tag"] = hist.Hist.new.Reg(16, 0, 16).Int64()
        self.objects["n"] = 0

    def fill(self, store: DataStore) -> None:
        self.objects["value"].fill(store["value"])
        self.objects["tag"].fill(store["tag"])
        self.objects["n"] += 1


def test_tasks_in_parallel_workers_merge_to_the_sequential_objects(tmp_path: FsPath) -> None:
    n, workers, state = 20_000, 2, tmp_path / "m.state"
    merger = subprocess.Popen(
        [sys.executable, "-m", "evflow", "device", "qc-merger", "--id", "m", "--session", "qcpar",
         "--cycle-s", "0.2", "--severity", "warn", "--inputs", str(workers), "--run-number", "7",
         "--state-file", str(state),
         "--channel-config", "name=qc-in,type=router,method=bind,address=ipc://qc-in"],
    )  # fmt: skip
    try:
        path = Path()
        path.add(ToyGenerator(n_events=n, run=7))
        path.add(ValueQc(name="vq", merger="ipc://qc-in", session="qcpar", cycle_s=0.05))
        summary = evflow.process(path, workers=workers, quiet=True)
        assert merger.wait(60) == 0
    finally:
        if merger.poll() is None:
            merger.kill()
            merger.wait()
    assert summary.events_read == n and summary.workers == workers
    merged = MergeState("check")
    merged.restore(state.read_bytes())  # the merger's last checkpoint: its final integral
    sources = [s for s in merged.sources if s.startswith("vq@")]
    assert len(sources) == workers and all(merged.sources[s].ended for s in sources)
    objs = merged.tasks["vq"].integral.merged
    ref_path = Path()
    ref_path.add(ToyGenerator(n_events=n, run=7))
    reference = ValueQc(name="vq")  # no merger: it keeps everything it filled
    ref_path.add(reference)
    evflow.process(ref_path, workers=0, quiet=True)
    assert objs["value"] == reference.objects["value"]
    assert objs["tag"] == reference.objects["tag"]
    assert objs["n"] == reference.objects["n"] == n
    assert merged.tasks["vq"].integral_events == n

"""``evflow demo --qc``: the H->ZZ demo with online quality control.

A ``HzzQc`` task in the path (in every worker with ``-p N``) fills the dimuon mass,
the muon pT, the muons' eta/phi map and the Z-fit chi2, and publishes deltas every
``QC_CYCLE_S`` to a ``qc-merger``; the merger publishes the merged objects every
cycle to a ``qc-repository`` device, which checks them against a reference and
stores them in ``<output>/qc.sqlite``. Merger and repository are processes under a
:class:`~evflow.runtime.supervisor.Supervisor` (the merger checkpoints, and is
restarted from its checkpoint if it dies).

The reference (``qc_reference.root``, shipped next to this file) holds the same
objects filled by the sequential demo over all 2421 events of uproot-HZZ.root
(``python -m evflow.demo.qc`` remakes it). The checks (``qc_checks.toml``) compare
shapes with Kolmogorov and chi2 tests, so a run over the first ``-n`` events is
judged on its shape, not on its number of entries.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evflow.demo.hzz import DemoResult, run_demo
from evflow.errors import OutputError, TimeoutError_
from evflow.event import DataStore, RunMeta
from evflow.qc.producer import QcTask

__all__ = ["HzzQc", "QcDemoResult", "make_reference", "run_qc_demo"]

HERE = Path(__file__).parent
CHECKS_TOML = HERE / "qc_checks.toml"
REFERENCE_ROOT = HERE / "qc_reference.root"
REPOSITORY = "qc.sqlite"
TASK = "hzz"
QC_CYCLE_S = 0.25  # producers publish twice per merger cycle: each contributes to every one
MERGER_CYCLE_S = 0.5
MERGER_ADDRESS = "ipc://qc-merger"
REPOSITORY_ADDRESS = "ipc://qc-repository"


class HzzQc(QcTask):
    """Dimuon mass, muon pT, muon eta/phi, chi2 of the Z-mass-constrained fit.

    A hist ``fill`` costs ~40 us whatever the number of values, so values are
    collected per event and filled once per publication (and at the end of the run).
    """

    def book(self) -> None:
        import hist

        reg = hist.axis.Regular
        self.objects["m_mumu"] = hist.Hist(reg(60, 0, 150, name="m_mumu", label="m(μμ) [GeV]"))
        self.objects["mu_pt"] = hist.Hist(reg(50, 0, 100, name="mu_pt", label="muon pT [GeV]"))
        self.objects["mu_eta_phi"] = hist.Hist(
            reg(12, -2.4, 2.4, name="eta", label="muon η"),
            reg(16, -math.pi, math.pi, name="phi", label="muon φ"),
        )
        self.objects["z_chi2"] = hist.Hist(reg(50, 0, 25, name="z_chi2", label="Z fit χ²"))
        self._pending: dict[str, list[Any]] = {k: [] for k in ("m", "px", "py", "pz", "chi2")}

    def fill(self, store: DataStore) -> None:
        pending = self._pending
        m = store.get("m_mumu")
        if m is not None and not math.isnan(m):
            pending["m"].append(m)
        if len(store["mu_px"]):
            pending["px"].append(store["mu_px"])
            pending["py"].append(store["mu_py"])
            pending["pz"].append(store["mu_pz"])
        chi2 = store.get("z_chi2")
        if chi2 is not None and not math.isnan(chi2):
            pending["chi2"].append(chi2)

    def flush(self) -> None:
        """Fill the objects with what was collected since the last call."""
        pending = self._pending
        if pending["m"]:
            self.objects["m_mumu"].fill(np.asarray(pending["m"]))
        if pending["px"]:
            px, py, pz = (np.concatenate(pending[k]) for k in ("px", "py", "pz"))
            pt = np.hypot(px, py)
            self.objects["mu_pt"].fill(pt)
            self.objects["mu_eta_phi"].fill(np.arcsinh(pz / pt), np.arctan2(py, px))
        if pending["chi2"]:
            self.objects["z_chi2"].fill(np.asarray(pending["chi2"]))
        for values in pending.values():
            values.clear()

    def publish_cycle(self, force: bool = False) -> int | None:
        self.flush()
        return super().publish_cycle(force)

    def end_run(self, run: RunMeta) -> None:
        self.flush()  # also without a merger: the objects then hold everything
        super().end_run(run)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


@dataclass(frozen=True)
class QcRow:
    path: str
    run: int | None  # (None: the object was stored without one; shown as "-")
    cycle: int | None
    events: int | None
    versions: int
    quality: str
    flags: str


@dataclass(frozen=True)
class QcDemoResult:
    demo: DemoResult
    repository: Path
    rows: list[QcRow]

    def report(self) -> str:
        width = max([len(r.path) for r in self.rows] + [4])
        lines = [
            f"QC: {len(self.rows)} objects in {self.repository} "
            f"(evflow qc ls --repo {self.repository})",
            f"  {'path':<{width}}  {'run':>4}  {'cycle':>5}  {'versions':>8}  "
            f"{'events':>7}  quality",
        ]
        for r in self.rows:
            flags = f"  ({r.flags})" if r.flags else ""
            lines.append(
                f"  {r.path:<{width}}  {_or_dash(r.run):>4}  {_or_dash(r.cycle):>5}  "
                f"{r.versions:>8}  {_or_dash(r.events):>7}  {r.quality}{flags}"
            )
        return "\n".join(lines)


def run_qc_demo(
    output_dir: str | Path = "demo-output",
    max_events: int | None = None,
    workers: int | None = None,
    quiet: bool = False,
    timeout_s: float = 120.0,
) -> QcDemoResult:
    """The demo with a QcTask in every worker, a merger and the repository device."""
    from evflow.demo.hzz import default_workers
    from evflow.qc.layers import MergerSpec, launch_layers
    from evflow.qc.repository_device import repository_channel, run_repository
    from evflow.runtime.supervisor import Supervisor

    out = Path(output_dir)
    repo = out / REPOSITORY
    try:
        out.mkdir(parents=True, exist_ok=True)
        for suffix in ("", "-wal", "-shm"):  # every run starts a fresh repository
            Path(f"{repo}{suffix}").unlink(missing_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot prepare the QC repository {repo}: {exc.strerror}") from None
    if not logging.getLogger().handlers:  # the merger's and repository's rate logs: no
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    sources = max(1, default_workers() if workers is None else workers)
    sup = Supervisor(bus=False).start()
    try:
        with tempfile.TemporaryDirectory(prefix="evflow-qc-demo-") as state_dir:
            params = {"repo": str(repo), "checks": str(CHECKS_TOML), "inputs": 1}
            # ROUTER in, the merger's DEALER out: its END (and final publications) are
            # re-sent until acknowledged, so the start order does not matter
            sup.add_function(
                "qc-repository", run_repository, "qc-repository",
                [repository_channel(REPOSITORY_ADDRESS, "router")], sup.session, params,
                restart="never",
            )  # fmt: skip
            spec = MergerSpec("qc-merger", 0, MERGER_ADDRESS, ())
            launch_layers(
                sup, [spec], out_address=REPOSITORY_ADDRESS, out_type="dealer",
                state_dir=state_dir, cycle_s=MERGER_CYCLE_S, expected_count=sources,
                inputs=sources, expected="",
            )  # fmt: skip
            task = HzzQc(name=TASK, merger=MERGER_ADDRESS, session=sup.session,
                         cycle_s=QC_CYCLE_S)  # fmt: skip
            demo = run_demo(out, max_events=max_events, workers=workers, quiet=quiet,
                            qc_task=task)  # fmt: skip
            task.terminate()  # the sequential run's task lives in this process
            _wait_done(sup, "qc-repository", timeout_s)
    finally:
        sup.shutdown()
        sup.close()
    return QcDemoResult(demo, repo, read_rows(repo))


def _wait_done(sup: Any, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    proc = sup.processes[name]
    while proc.state == "running" or proc.state == "backoff":
        if time.monotonic() > deadline:
            raise TimeoutError_(
                f"QC demo: the repository did not receive the merger's end within {timeout_s} s"
            )
        sup.poll(0.1)
    if proc.state != "done":
        failed = "; ".join(e.message for e in sup.failed) or proc.state
        raise OutputError(f"QC demo: the repository device failed: {failed}")


def read_rows(repo_path: Path) -> list[QcRow]:
    """The latest version of every object in the repository, with its quality."""
    from evflow.qc.repository import Repository

    rows = []
    with Repository(repo_path, readonly=True) as repo:
        for path in repo.paths():
            info = repo.latest_info(path)
            if info is None:
                continue
            rows.append(
                QcRow(
                    path,
                    info.run,
                    info.cycle,
                    info.event_count,
                    len(repo.versions(path)),
                    info.quality or "-",
                    "; ".join(str(f) for f in info.flags),
                )
            )
    return rows


def make_reference(file: Path = REFERENCE_ROOT) -> Path:
    """Fill ``HzzQc`` over every event of the sequential demo; write its objects (ROOT)."""
    import uproot

    task = HzzQc(name=TASK)  # no merger: it keeps everything it fills
    with tempfile.TemporaryDirectory(prefix="evflow-qc-ref-") as tmp:
        run_demo(tmp, workers=0, quiet=True, qc_task=task)
    with uproot.recreate(file) as f:
        for name, obj in task.objects.items():
            f[name] = obj
    return file


if __name__ == "__main__":
    print(f"wrote {make_reference()}")

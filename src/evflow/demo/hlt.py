"""``evflow demo --hlt``: the trigger-farm chain on uproot-HZZ.root.

replay device (its own process: HZZ events at a set rate, cut into N fragment streams)
-> event builder (the source of a parallel run) -> workers: pieces joined, muons and
electrons selected, dimuon and four-lepton masses, a Z-peak calibration running as an
asynchronous task whose scale factor corrects the dimuon mass of later events -> the
events with a dimuon candidate to a record file. The summary gives the builder's
counts, the achieved replay rate and every calibration update with the event it was
first applied to.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any

import numpy as np

from evflow.demo.analysis import (
    INPUT_BRANCHES,
    CandidateFilter,
    DimuonMass,
    FourLeptonMass,
    KeepBranches,
    LeptonSelection,
)
from evflow.demo.hzz import hzz_path
from evflow.errors import ConfigurationError, EvflowError, OutputError
from evflow.event import DataStore
from evflow.hlt.asyncmodule import AsyncTaskModule
from evflow.hlt.builder_device import EventBuilderInput
from evflow.hlt.replay import join_fragments
from evflow.io.records import RecordOutput, RecordReader, decode_record
from evflow.processing.api import process
from evflow.processing.path import Path
from evflow.processing.summary import RunSummary

__all__ = ["HltDemoResult", "ZCalibration", "run_hlt_demo"]

Z_MASS = 91.1876
SELECTED = "hlt-selected.evr"


def z_peak_task(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The Z peak of the dimuon masses handed over: an iterated truncated mean."""
    m = arrays["m_mumu"]
    peak = Z_MASS
    for _ in range(50):
        window = m[np.abs(m - peak) < 8.0]
        if len(window) < 10:
            return {"scale": 1.0, "peak": float("nan"), "n": len(window)}
        peak = float(window.mean())
    return {"scale": Z_MASS / peak, "peak": peak, "n": len(window)}


class ZCalibration(AsyncTaskModule):
    """Hands the dimuon masses of every ``every`` candidates to the Z-peak task and
    scales ``m_mumu`` by the newest factor (``m_mumu_corr``, ``z_scale``)."""

    task = staticmethod(z_peak_task)

    def initialize(self) -> None:
        super().initialize()
        self._masses: list[float] = []

    def inputs(self, store: DataStore) -> dict[str, np.ndarray] | None:
        self._masses.append(float(store["m_mumu"]))
        if len(self._masses) < 200:
            return None
        m, self._masses = np.array(self._masses), []
        return {"m_mumu": m}

    def apply(self, store: DataStore, constants: dict[str, Any] | None) -> None:
        scale = float(constants["scale"]) if constants else 1.0
        store["z_scale"] = scale
        store["m_mumu_corr"] = float(store["m_mumu"]) * scale


KEEP = [
    "m_mumu",
    "m_mumu_corr",
    "z_scale",
    "m_4l",
    "hlt_state",
    "ZCalibration_version",
    "ZCalibration_first",
    "ZCalibration_from_event",
    "ZCalibration_process",
]


@dataclass
class HltDemoResult:
    summary: RunSummary
    builder: dict[str, Any]
    replay: dict[str, Any]
    streams: int
    updates: list[dict[str, Any]] = field(default_factory=list)
    selected: FsPath | None = None

    def report(self) -> str:
        b, r, s = self.builder, self.replay, self.summary
        lines = [
            f"replay: {r.get('sent', 0)} events in {r.get('passes', 0)} pass(es) as "
            f"{self.streams} fragment streams, achieved {r.get('achieved_hz', 0.0):,.1f} Hz "
            f"({r.get('rate_hz', 0.0):,.0f} Hz asked), worst lag {r.get('max_lag_ms', 0.0):.1f} ms",
            f"event builder: built {b.get('built', 0)}, incomplete {b.get('incomplete', 0)}, "
            f"late {b.get('late', 0)}, duplicate {b.get('duplicate', 0)}",
            f"path: {s.events_read} events read, {s.events_written} with a dimuon candidate "
            f"written, {s.workers} workers, {s.wall_s:.2f} s",
            f"calibration updates: {len(self.updates)} (Z peak -> scale of m_mumu)",
        ]
        for u in self.updates:
            lines.append(
                f"  process {u['process']}: version {u['version']} from the input of event "
                f"{u['from_event']}, first applied to event {u['first_event']}, "
                f"scale {u['scale']:.4f}"
            )
        return "\n".join(lines)


def build_hlt_path(address: str, streams: int, timeout_s: float, out: FsPath) -> Path:
    path = Path()
    path.add(
        EventBuilderInput(
            address=address,
            sources=str(streams),
            timeout_s=timeout_s,
            stats_file=str(out / "builder.json"),
            end_timeout_s=10.0,
            # replayed events: the pieces, joined as bytes, are the event again; on the
            # parallel fast path no store is made in the input (docs/hlt.md)
            merge=join_fragments,
        )
    )
    path.add(LeptonSelection(name="MuonSelection", flavour="muon", pt_min=5.0, eta_max=2.4))
    path.add(LeptonSelection(name="ElectronSelection", flavour="electron", pt_min=5.0, eta_max=2.5))
    path.add(DimuonMass())
    path.add(FourLeptonMass())
    path.add(CandidateFilter())
    path.add(ZCalibration(policy="replace", timeout_s=30.0))
    path.add(KeepBranches(keep=KEEP))
    path.add(RecordOutput(file=str(out / SELECTED), fsync=False))
    return path


def run_hlt_demo(
    output_dir: str | FsPath = "demo-output",
    *,
    streams: int = 6,
    rate_hz: float = 2000.0,
    passes: int = 2,
    workers: int = 2,
    timeout_s: float = 1.0,
    quiet: bool = False,
) -> HltDemoResult:
    if not 4 <= streams <= 12:
        raise ConfigurationError(f"--streams must be 4 to 12, got {streams}")
    if rate_hz < 0 or passes < 1:
        raise ConfigurationError(f"--rate must be >= 0 and --passes >= 1 (got {rate_hz}, {passes})")
    out = FsPath(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the output directory {str(out)!r}: {exc}") from None
    for name in ("builder.json", "replay.json"):
        (out / name).unlink(missing_ok=True)
    hzz = hzz_path()
    tmp = tempfile.mkdtemp(prefix="evflow-hlt-")
    address = f"ipc://{tmp}/fragments"
    replay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "evflow",
            "device",
            "replay",
            "--id",
            "replay",
            "--file",
            hzz,
            "--branches",
            ",".join(INPUT_BRANCHES),
            "--streams",
            str(streams),
            "--builder",
            address,
            "--event-rate",
            str(rate_hz),
            "--passes",
            str(passes),
            "--severity",
            "warn",
            "--stats-file",
            str(out / "replay.json"),
        ]
    )
    try:
        summary = process(
            build_hlt_path(address, streams, timeout_s, out), workers=workers, quiet=quiet
        )
        code = replay.wait(30)
        if code != 0:
            raise EvflowError(f"the replay device failed (exit code {code})")
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    builder = json.loads((out / "builder.json").read_text())
    replayed = json.loads((out / "replay.json").read_text())["replay"]
    return HltDemoResult(
        summary, builder, replayed, streams, _updates(out / SELECTED), out / SELECTED
    )


def _updates(file: FsPath) -> list[dict[str, Any]]:
    out = []
    with RecordReader(str(file)) as reader:
        for rec in reader:
            s = decode_record(str(file), rec)
            if s.get("ZCalibration_first"):
                out.append(
                    {
                        "process": int(s["ZCalibration_process"]),
                        "version": int(s["ZCalibration_version"]),
                        "from_event": int(s["ZCalibration_from_event"]),
                        "first_event": s.meta.event,
                        "scale": float(s["z_scale"]),
                    }
                )
    return sorted(out, key=lambda u: (u["first_event"], u["process"]))

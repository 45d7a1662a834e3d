"""`evflow demo --hlt`: replay -> event builder -> parallel path with an async calibration."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("skhep_testdata")

DEMO = [sys.executable, "-m", "evflow", "demo", "--hlt"]


def test_hlt_demo_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [*DEMO, "-o", str(out), "--streams", "4", "--rate", "3000", "--passes", "1", "-p", "2"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "event builder: built 2421, incomplete 0, late 0, duplicate 0" in text
    rate = re.search(r"achieved ([\d,.]+) Hz \(3,000 Hz asked\)", text)
    assert rate is not None, text
    assert 2000 < float(rate.group(1).replace(",", "")) < 3100
    n_updates = int(re.search(r"calibration updates: (\d+)", text).group(1))  # type: ignore[union-attr]
    assert n_updates >= 1
    lines = re.findall(r"from the input of event (\d+), first applied to event (\d+)", text)
    assert len(lines) == n_updates
    assert all(int(src) < int(first) for src, first in lines)  # fed back to later events
    written = int(re.search(r"(\d+) with a dimuon candidate written", text).group(1))  # type: ignore[union-attr]
    assert 1000 < written < 2421
    assert (out / "hlt-selected.evr").stat().st_size > 0


def test_hlt_demo_bad_streams(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*DEMO, "-o", str(tmp_path), "--streams", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "evflow: error: --streams must be 4 to 12, got 2"

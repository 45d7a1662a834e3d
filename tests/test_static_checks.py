"""The code checks we hold ourselves to: ``ruff check`` clean, and ``mypy`` clean on
``src`` and ``benchmarks``.

Run as tests so that CI (the README's one test command) enforces them; each prints the
tool's own findings when it fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# mypy --no-incremental takes minutes on a loaded machine; the tool's own bound (300 s)
# says more than pytest-timeout's default of 120 s would
pytestmark = pytest.mark.timeout(330)


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_finds_nothing() -> None:
    done = _run("ruff", "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing_in_src_and_benchmarks() -> None:
    done = _run("mypy", "--no-incremental", "src", "benchmarks")
    assert done.returncode == 0, done.stdout + done.stderr

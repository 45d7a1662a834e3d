"""A test-suite run leaves no large files in pytest's temporary directories: the
project's pytest settings remove a passing test's ``tmp_path`` (a failing test's
stays, to look at)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

INNER = """
def test_writes_a_large_file(tmp_path):
    (tmp_path / "big.evr").write_bytes(b"x" * 8_000_000)


def test_fails_with_a_large_file(tmp_path):
    (tmp_path / "kept.evr").write_bytes(b"x" * 8_000_000)
    assert False, "kept for a look"
"""


def test_a_passing_tests_large_files_do_not_outlive_the_session(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    base = tmp_path / "base"
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
            "--basetemp", str(base), str(tmp_path / "test_inner.py"),
        ],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1 and "1 failed, 1 passed" in done.stdout, done.stdout[-2000:]
    left = sorted(p.name for p in base.rglob("*.evr"))
    assert left == ["kept.evr"], left

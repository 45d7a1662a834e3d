"""benchmarks/run_all.py: the table it writes into BENCHMARKS.md (not the figures:
timing belongs in the benchmarks themselves)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_run_all() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module
    spec.loader.exec_module(module)
    return module


def test_the_table_replaces_only_what_lies_between_the_markers() -> None:
    ra = load_run_all()
    old = f"# Benchmarks\n\nintro\n{ra.BEGIN}\nold table\n{ra.END}\n## Kept section\ntext\n"
    new = ra.rewrite(old, f"{ra.BEGIN}\nnew table\n{ra.END}")
    assert "old table" not in new and "new table" in new
    assert new.startswith("# Benchmarks\n\nintro\n") and new.endswith("## Kept section\ntext\n")
    assert ra.rewrite(new, f"{ra.BEGIN}\nthird\n{ra.END}").count(ra.BEGIN) == 1


def test_a_file_without_a_table_gets_one_under_its_title() -> None:
    ra = load_run_all()
    new = ra.rewrite("# Benchmarks\nbody\n", f"{ra.BEGIN}\nT\n{ra.END}")
    assert new.splitlines()[0] == "# Benchmarks"
    assert new.index(ra.BEGIN) < new.index("body")


def test_each_row_names_its_anchor_goal_load_and_command_and_a_failure_says_so() -> None:
    ra = load_run_all()
    rows = {
        "codec": {"value": "5 µs", "anchor_value": "10 µs", "ratio": 0.5, "goal_met": True,
                  "load": 0.7},
        "hop-1k": {"error": "exit 1: boom", "load": 3.0},
    }  # fmt: skip
    text = ra.table(rows, quick=True)
    codec_row = next(line for line in text.splitlines() if line.startswith("| codec"))
    assert "pickle protocol 5" in codec_row and "0.50x" in codec_row and "| yes |" in codec_row
    assert "0.70" in codec_row and "`python benchmarks/bench_codec.py`" in codec_row
    failed = next(line for line in text.splitlines() if "1 kB one hop" in line)
    assert "failed: exit 1: boom" in failed and "3.00" in failed
    assert all(name in ra.BY_NAME for name in rows)

"""docs/architecture.md's example of a new device kind works as written.

The page's ``<!-- doc-example: NAME -->`` code blocks are written to files and the
topology is started with ``evflow up``, as the page shows: the device counts every
message the samplers sent, and the topology ends with exit code 0 and leaves no
session directory behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
EXAMPLE = re.compile(r"<!-- doc-example: (\S+) -->\n```\w*\n(.*?)```", re.S)


def test_the_device_kind_example_runs_in_a_topology(tmp_path: Path) -> None:
    blocks = dict(EXAMPLE.findall(DOC.read_text(encoding="utf-8")))
    assert set(blocks) == {"tally.py", "tally.toml"}, sorted(blocks)
    for name, text in blocks.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    runtime_dir = tmp_path / "rt"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")]),
        "EVFLOW_RUNTIME_DIR": str(runtime_dir),
    }
    done = subprocess.run(
        [sys.executable, "-m", "evflow", "up", "-v", "tally.toml", "--preload", "tally"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # 2 samplers x 500 messages of 100 B, both ENDs answered (else the samplers complain)
    assert "tally: 1000 messages, 100000 B" in out, out
    assert "END acknowledgements" not in out, out
    assert not runtime_dir.exists() or not any(runtime_dir.iterdir()), list(runtime_dir.iterdir())

"""The layers of docs/architecture.md hold: ``lint-imports`` checks the contracts of
pyproject.toml (``[tool.importlinter]``) on ``src/evflow``.

The contracts hold without exceptions (issue 23 paid the ``ignore_imports`` debt). These
tests check that they pass as written, and that they bite: a new forbidden import, a
new import circle, a new import of another package's underscore module and an
exception naming an import that does not exist each fail with the tool's message. The
mutations are made on a copy of ``src/`` in a temporary directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "pyproject.toml"

LAYERS = "evflow layers: each imports only from the layers below it"
CIRCLES = "no import circles between the modules (or sub-packages) of one package"
PRIVATE = "an underscore module is imported only from inside its own package"


def _lint(src: Path, config: Path = CONFIG) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with ``config`` on the ``evflow`` package found in ``src``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command;"
            " sys.exit(lint_imports_command())",
            "--no-cache",
            "--no-logo",
            str(config),
        ],
        cwd=src.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def src_copy(tmp_path: Path) -> Path:
    """A copy of ``src/`` (Python files only) to break on purpose."""
    dest = tmp_path / "src"
    shutil.copytree(
        ROOT / "src",
        dest,
        ignore=lambda _dir, names: [
            n for n in names if n == "__pycache__" or n.endswith(".egg-info")
        ],
    )
    return dest


def _append(module: Path, line: str) -> None:
    with module.open("a", encoding="utf-8") as f:
        f.write(f"\n{line}\n")


def test_the_layers_hold_with_the_recorded_debt() -> None:
    done = _lint(ROOT / "src")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert f"{LAYERS} KEPT" in out, out
    assert f"{CIRCLES} KEPT" in out, out
    assert f"{PRIVATE} KEPT" in out, out


def test_a_new_upward_import_fails(src_copy: Path) -> None:
    # grimp reads the source without running it: an import anywhere in the file counts
    _append(src_copy / "evflow" / "wire" / "messages.py", "import evflow.cli  # upward")
    done = _lint(src_copy)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert f"{LAYERS} BROKEN" in out, out
    assert "evflow.wire is not allowed to import evflow.cli" in out, out
    assert "evflow.wire.messages -> evflow.cli" in out, out
    # the contract's guidance (the tool wraps it to the terminal's width)
    assert "do not add an ignore_imports entry" in " ".join(out.split()), out


def test_an_import_between_independent_apps_fails(src_copy: Path) -> None:
    _append(src_copy / "evflow" / "qc" / "objects.py", "import evflow.hlt.replay")
    done = _lint(src_copy)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "evflow.qc is not allowed to import evflow.hlt" in out, out


def test_a_new_import_circle_fails(src_copy: Path) -> None:
    # address.py imports paths.py (session_dir): paths.py importing address.py back
    # closes a circle
    _append(src_copy / "evflow" / "transport" / "paths.py", "import evflow.transport.address")
    done = _lint(src_copy)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert f"{CIRCLES} BROKEN" in out, out
    assert "No cycles are allowed in evflow.transport" in out, out


def test_an_underscore_module_imported_from_another_package_fails(src_copy: Path) -> None:
    _append(src_copy / "evflow" / "qc" / "objects.py", "import evflow.runtime._zygote_server")
    done = _lint(src_copy)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert f"{PRIVATE} BROKEN" in out, out
    assert "evflow.qc.objects -> evflow.runtime._zygote_server" in out, out


def test_the_contracts_hold_without_exceptions() -> None:
    # issue 23 paid the debt: no contract lists an import it lets through
    config = tomllib.loads(CONFIG.read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    assert [c["id"] for c in contracts] == ["layers", "no-circles", "private-modules"]
    assert all(not c.get("ignore_imports") for c in contracts), contracts


def test_an_exception_whose_import_does_not_exist_fails(tmp_path: Path) -> None:
    # an ignore_imports entry must name a real import, or the list overstates the debt
    text = CONFIG.read_text(encoding="utf-8")
    anchor = 'exhaustive_ignores = ["__main__"]\n'
    stale = "evflow.wire.codec -> evflow.cli"
    assert text.count(anchor) == 1
    changed = tmp_path / "pyproject.toml"
    changed.write_text(text.replace(anchor, f'{anchor}ignore_imports = ["{stale}"]\n'))
    done = _lint(ROOT / "src", changed)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert stale in out, out

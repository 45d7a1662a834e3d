"""evflow runs on a plain ``pip install -e .``: no runtime import of a test-only package.

The suite itself runs with the ``[test]`` extra, so a runtime ``import httpx`` passed every
test and broke ``--dashboard`` for the first user. CI proves the documented commands in a
fresh venv (``.ci/plain_install_check``, called by ``.ci/run``); this file holds the
cheap part in the suite: no module of ``src/evflow`` imports a package that only the
``[test]`` extra installs, not even inside a function.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "evflow"


def _test_only_modules() -> set[str]:
    """Import names of the [test] extra's packages that the runtime does not also need."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}

    extra = names(project["optional-dependencies"]["test"]) - names(project["dependencies"])
    modules = {n.replace("-", "_") for n in extra}
    return modules | {"_pytest"}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_no_runtime_module_imports_a_test_only_package() -> None:
    test_only = _test_only_modules()
    assert {"httpx", "pytest", "hypothesis", "playwright"} <= test_only
    bad = [
        f"{path.relative_to(ROOT)}:{line}: import {name}"
        for path in sorted(SRC.rglob("*.py"))
        for line, name in _imports(path)
        if name in test_only
    ]
    assert not bad, "runtime code imports test-only packages (absent on a plain install):\n" + (
        "\n".join(bad)
    )


def test_ci_runs_the_plain_install_check_before_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    check = ci.index("python .ci/plain_install_check")
    assert check < ci.index('bash -c "$TEST_CMD"')
    script = (ROOT / ".ci" / "plain_install_check").read_text()
    assert "--system-site-packages" not in script
    for command in ('"demo"', '"--dashboard"', '"serve"', '"dashboard"'):
        assert command in script

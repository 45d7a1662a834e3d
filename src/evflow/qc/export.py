"""The latest QC objects as ROOT files (through uproot) for ROOT users.

``qc/<task>/<object>`` goes to ``<dir>/<task>.root`` under the key ``<object>``
(deeper paths become ROOT directories). 1 to 3 dimensional histograms become
TH1/TH2/TH3 (integer storages as doubles); anything else is skipped with its reason.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evflow.errors import OutputError
from evflow.qc.checks import is_histogram
from evflow.qc.repository import Repository


@dataclass
class ExportReport:
    """What went where: ``written`` as (path, file, key), ``skipped`` as (path, reason)."""

    written: list[tuple[str, Path, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def root_location(path: str) -> tuple[str, str]:
    """``qc/task/a/b`` -> (``task``, ``a/b``): the file stem and the key inside it."""
    parts = [p for p in path.split("/") if p]
    if parts and parts[0] == "qc":
        parts = parts[1:]
    if len(parts) < 2:
        return ("qc", "/".join(parts) or "object")
    return parts[0], "/".join(parts[1:])


def rootable(obj: Any) -> Any:
    """A histogram uproot can write as TH1/TH2/TH3; raises ValueError saying why not."""
    if not is_histogram(obj):
        raise ValueError(f"a {type(obj).__name__} has no ROOT histogram form")
    if not 1 <= obj.ndim <= 3:
        raise ValueError(f"{obj.ndim}-dimensional histograms have no TH1/TH2/TH3 form")
    if obj.values().dtype.kind in "iu":
        import hist

        as_double = hist.Hist(*obj.axes, storage=hist.storage.Double())
        as_double.view(flow=True)[...] = obj.view(flow=True)
        return as_double
    return obj


def export_latest(repo: Repository, out_dir: str | Path, prefix: str = "") -> ExportReport:
    """Write the newest version of every path below ``prefix`` into ``out_dir``."""
    import uproot

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create export directory {out}: {exc.strerror}") from None
    report = ExportReport()
    by_file: dict[str, list[tuple[str, str, Any]]] = defaultdict(list)
    for path in repo.paths(prefix):
        stored = repo.latest(path)
        if stored is None:
            continue
        try:
            obj = rootable(stored.obj)
        except ValueError as exc:
            report.skipped.append((path, str(exc)))
            continue
        stem, key = root_location(path)
        by_file[stem].append((path, key, obj))
    for stem, items in sorted(by_file.items()):
        target = out / f"{stem}.root"
        try:
            with uproot.recreate(target) as f:
                for path, key, obj in items:
                    try:
                        f[key] = obj
                    except (ValueError, TypeError) as exc:
                        report.skipped.append((path, f"uproot cannot write it: {exc}"))
                        continue
                    report.written.append((path, target, key))
        except OSError as exc:
            raise OutputError(f"cannot write {target}: {exc.strerror or exc}") from None
    return report

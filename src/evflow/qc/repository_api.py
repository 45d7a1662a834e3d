"""The repository's HTTP API as plain functions returning JSON-able dicts.

In the spirit of CCDB's REST paths; ``evflow.qc.http`` mounts them on starlette, any
other web layer can call them directly:

    /qc/latest/<path>              latest(repo, path)
    /qc/browse/<prefix>            browse(repo, prefix): paths below it, versions of it
    /qc/get/<path>?at=T&run=R      get(repo, path, at=T, run=R) (or version=ID)
    /qc/qualities?check=C&run=R    qualities(repo, check=C, run=R)

Times are unix seconds. A missing object raises ``NotFoundError``; a bad parameter
``ValueError``; the web layer maps them to 404 and 400.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from evflow.errors import NotFoundError
from evflow.qc.checks import is_histogram
from evflow.qc.repository import Repository
from evflow.qc.versions import StoredObject


def object_to_json(obj: Any) -> dict[str, Any]:
    """A histogram, array or number as plain JSON (nan and inf become null)."""
    if is_histogram(obj):
        axes = []
        for axis in obj.axes:
            entry: dict[str, Any] = {
                "name": getattr(axis, "name", ""),
                "label": getattr(axis, "label", ""),
                "type": type(axis).__name__,
                "size": len(axis),
            }
            if "Category" in type(axis).__name__:  # labels matter, edges are 0..n
                entry["categories"] = [_clean(v) for v in axis]
            else:
                entry["edges"] = _clean(np.asarray(axis.edges))
            axes.append(entry)
        variances = obj.variances()
        values = obj.values()
        return {
            "type": "histogram",
            "storage": type(obj.storage_type()).__name__,
            "axes": axes,
            "values": _clean(values),
            "variances": None if variances is None else _clean(variances),
            "sum": _clean(float(np.sum(values))),
            "sum_with_flow": _clean(float(np.sum(obj.values(flow=True)))),
        }
    if isinstance(obj, np.ndarray):
        return {
            "type": "array",
            "dtype": obj.dtype.str,
            "shape": list(obj.shape),
            "values": _clean(obj),
        }
    if isinstance(obj, int | float | np.number):
        return {"type": "number", "value": _clean(obj)}
    return {"type": type(obj).__name__, "repr": repr(obj)[:1000]}


def latest(repo: Repository, path: str) -> dict[str, Any]:
    """The newest version of ``path`` with its object."""
    return _stored(repo, path, repo.latest(path))


def get(
    repo: Repository,
    path: str,
    *,
    at: float | None = None,
    run: int | None = None,
    version: int | None = None,
) -> dict[str, Any]:
    """The version of ``path`` valid at ``at``, the newest of ``run``, or version ``version``."""
    if version is not None:
        stored = repo.get(version)
        if stored.path != path:
            raise NotFoundError(f"version {version} is of {stored.path}, not of {path}")
        return _stored(repo, path, stored)
    return _stored(repo, path, repo.latest(path, at=at, run=run), at=at, run=run)


def browse(repo: Repository, path: str = "") -> dict[str, Any]:
    """Paths below ``path`` and, when ``path`` is an object, its versions (newest first)."""
    return {
        "path": path,
        "paths": repo.paths(path),
        "versions": [v.to_dict() for v in repo.versions(path)] if path else [],
    }


def paths(repo: Repository, prefix: str = "") -> dict[str, Any]:
    """Every path with its newest version's run, cycle and quality."""
    rows = []
    for p in repo.paths(prefix):
        info = repo.latest_info(p)
        if info is not None:
            rows.append(
                {
                    "path": p,
                    "id": info.id,
                    "run": info.run,
                    "cycle": info.cycle,
                    "quality": info.quality,
                    "created": info.created,
                }
            )
    return {"prefix": prefix, "objects": rows}


def qualities(repo: Repository, check: str | None = None, run: int | None = None) -> dict[str, Any]:
    """Stored check and aggregator results, newest first."""
    return {
        "check": check,
        "run": run,
        "qualities": [q.to_dict() for q in repo.qualities(check, run=run)],
    }


def _stored(
    repo: Repository,
    path: str,
    stored: StoredObject | None,
    *,
    at: float | None = None,
    run: int | None = None,
) -> dict[str, Any]:
    if stored is None:
        what = [f"at={at}"] if at is not None else []
        what += [f"run={run}"] if run is not None else []
        where = f" ({', '.join(what)})" if what else ""
        raise NotFoundError(f"no QC object {path}{where} in {repo.path}")
    return {"version": stored.to_dict(), "object": object_to_json(stored.obj)}


def _clean(value: Any) -> Any:
    """numpy and non-finite floats to JSON: arrays to nested lists, nan/inf to None."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            return [_clean(v) for v in value] if value.ndim > 1 else _floats(value.tolist())
        return value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _floats(values: list[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]

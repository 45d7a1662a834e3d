"""``evflow qc ls|get|export|check|serve --repo PATH``: read the QC repository.

``ls`` prints one line per object (path, run, cycle, quality); ``get`` a summary of one
object (``--out`` writes it: .root through uproot, .json as the HTTP API's JSON,
anything else as the encoded object); ``export DIR`` writes the latest objects as ROOT
files; ``check CONFIG.toml`` runs checks on the latest objects and prints the verdicts;
``serve`` serves the HTTP API (``evflow.qc.http``) read-only with uvicorn.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path
from typing import Any

from evflow.errors import NotFoundError, OutputError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "qc",
        help="list, read, export and check the objects of a QC repository",
        description="Read the QC repository (an SQLite file written by the QC mergers).",
    )
    sub = parser.add_subparsers(dest="qc_command", metavar="ACTION")
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])

    def with_repo(p: argparse.ArgumentParser) -> None:
        p.add_argument("--repo", required=True, metavar="PATH", help="the repository file")

    ls = sub.add_parser("ls", help="one line per object: path, run, cycle, quality")
    with_repo(ls)
    ls.add_argument("prefix", nargs="?", default="", help="only paths starting with this")
    ls.add_argument("--versions", action="store_true", help="every kept version, not the latest")
    ls.set_defaults(func=cmd_ls)

    get = sub.add_parser("get", help="summary of one object (latest, at a time or of a run)")
    with_repo(get)
    get.add_argument("object", metavar="OBJECT", help="its path, e.g. qc/hzz/pt")
    get.add_argument("--run", type=int, default=None, help="the newest version of this run")
    get.add_argument(
        "--at",
        type=parse_time,
        default=None,
        metavar="T",
        help="the version valid at T (unix seconds or ISO date, UTC)",
    )
    get.add_argument("--version", type=int, default=None, metavar="ID", help="by version id")
    get.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="also write the object: .root (uproot), .json, else encoded bytes",
    )
    get.set_defaults(func=cmd_get)

    export = sub.add_parser("export", help="latest objects as ROOT files (TH1/TH2/TH3)")
    with_repo(export)
    export.add_argument("dir", metavar="DIR", help="output directory (one file per task)")
    export.add_argument("--prefix", default="", help="only paths starting with this")
    export.set_defaults(func=cmd_export)

    serve = sub.add_parser("serve", help="serve the HTTP API read-only (/qc/latest/...)")
    with_repo(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check", help="run checks (TOML) on the latest objects")
    with_repo(check)
    check.add_argument("config", metavar="CONFIG.toml", help="checks and aggregators")
    check.add_argument("--store", action="store_true", help="store the verdicts in the repo")
    check.set_defaults(func=cmd_check)


def parse_time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither unix seconds nor an ISO date (2026-11-25T08:00:00)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _open(path: str, *, readonly: bool = True) -> Any:
    from evflow.qc.repository import Repository

    if not readonly and not Path(path).is_file():
        Repository(path, readonly=True).close()  # raises: no repository there
    return Repository(path, readonly=readonly)


def cmd_ls(args: argparse.Namespace) -> int:
    with _open(args.repo) as repo:
        rows = []
        for path in repo.paths(args.prefix):
            infos = repo.versions(path) if args.versions else [repo.latest_info(path)]
            for info in infos:
                if info is not None:
                    rows.append(info)
        width = max((len(r.path) for r in rows), default=0)
        for r in rows:
            version = f"  v{r.id}" if args.versions else ""
            print(f"{r.path:<{width}}  run {r.run}  cycle {r.cycle}  {r.quality or '-'}{version}")
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with _open(args.repo) as repo:
        if args.version is not None:
            stored = repo.get(args.version)
        else:
            stored = repo.latest(args.object, at=args.at, run=args.run)
        if stored is None or stored.path != args.object:
            known = repo.paths()
            what = "" if args.run is None else f" of run {args.run}"
            what += "" if args.at is None else f" valid at {_time(args.at)}"
            hint = f"{len(known)} paths, see: evflow qc ls --repo {args.repo}"
            raise NotFoundError(f"no QC object {args.object}{what} in {args.repo} ({hint})")
        print(summary(stored))
        if args.out:
            write_object(stored, Path(args.out), repo)
            print(f"written to {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from evflow.qc.export import export_latest

    with _open(args.repo) as repo:
        report = export_latest(repo, args.dir, args.prefix)
    for path, file, key in report.written:
        print(f"{path} -> {file}:{key}")
    for path, reason in report.skipped:
        print(f"{path} skipped: {reason}")
    print(f"{len(report.written)} objects written, {len(report.skipped)} skipped")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from starlette.applications import Starlette

    from evflow.qc.http import qc_mount

    with _open(args.repo):  # fail now, with one line, if there is no repository
        pass
    app = Starlette(routes=[qc_mount(Path(args.repo))])
    print(f"serving {args.repo} on http://{args.host}:{args.port}/qc/", flush=True)
    # uvicorn handles SIGINT/SIGTERM: it finishes open requests and returns
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from evflow.qc.checksuite import CheckSuite
    from evflow.qc.publication import PublishedObject

    with _open(args.repo, readonly=not args.store) as repo:
        suite = CheckSuite.from_toml(args.config, repository=repo)
        for path in repo.paths():
            stored = repo.latest(path)
            if stored is None:
                continue
            published = PublishedObject(
                path=stored.path,
                task=stored.task or "",
                name=stored.name or "",
                run=stored.run or 0,
                cycle=stored.cycle or 0,
                obj=stored.obj,
                completeness=stored.completeness,
                created=stored.created,
                sequence=stored.sequence or 0,
                event_count=stored.event_count or 0,
                metadata=stored.metadata,
            )
            result = suite.run(published)
            for q in result.checks + result.aggregates:
                flags = "; ".join(str(f) for f in q.flags)
                print(f"{path}  {q.check}  {q.quality.label}" + (f"  ({flags})" if flags else ""))
                if args.store:
                    own = q in result.checks
                    repo.store_quality(
                        q, run=stored.run, cycle=stored.cycle, version_id=stored.id if own else None
                    )
    return 0


def summary(stored: Any) -> str:
    """A few lines about one stored version and its object."""
    from evflow.qc.checksuite import completeness_fraction

    until = "now (newest)" if stored.valid_until is None else _time(stored.valid_until)
    lines = [
        f"{stored.path}  version {stored.id}  run {stored.run}  cycle {stored.cycle}",
        f"valid     {_time(stored.valid_from)} .. {until}",
        f"quality   {stored.quality or 'not checked'}",
    ]
    lines += [f"  flag    {f}" for f in stored.flags]
    fraction = completeness_fraction(stored.completeness)
    if fraction is not None:
        missing = stored.completeness.get("missing") or []
        lines.append(
            f"sources   {fraction:.0%} complete"
            + (f", missing {', '.join(map(str, missing))}" if missing else "")
        )
    lines.append(f"events    {stored.event_count}")
    lines.append(f"hash      sha256:{stored.hash[:16]}  ({stored.size} bytes)")
    lines.append(f"object    {describe(stored.obj)}")
    return "\n".join(lines)


def describe(obj: Any) -> str:
    import numpy as np

    from evflow.qc.checks import is_histogram, mean

    if is_histogram(obj):
        axes = ", ".join(
            f"{getattr(a, 'name', '') or 'axis'}: {len(a)} bins"
            + (f" [{a.edges[0]:g}, {a.edges[-1]:g})" if hasattr(a, "edges") else "")
            for a in obj.axes
        )
        text = f"{obj.ndim}D histogram ({axes}), sum {float(obj.values(flow=True).sum()):g}"
        if obj.ndim == 1 and obj.values().sum() > 0:
            text += f", mean {mean(obj):.6g}"
        return text
    if isinstance(obj, np.ndarray):
        return f"array {obj.dtype} shape {obj.shape}"
    return f"{type(obj).__name__} {obj!r}"[:200]


def write_object(stored: Any, out: Path, repo: Any) -> None:
    try:
        if out.suffix == ".root":
            import uproot

            from evflow.qc.export import rootable

            try:
                obj = rootable(stored.obj)
            except ValueError as exc:
                raise OutputError(f"cannot write {stored.path} to {out}: {exc}") from None
            with uproot.recreate(out) as f:
                f[stored.name or stored.path.rsplit("/", 1)[-1]] = obj
        elif out.suffix == ".json":
            from evflow.qc.repository_api import get

            out.write_text(json.dumps(get(repo, stored.path, version=stored.id), indent=1))
        else:
            out.write_bytes(repo.raw(stored.id))
    except OSError as exc:
        raise OutputError(f"cannot write {out}: {exc.strerror or exc}") from None


def _time(unix_s: float) -> str:
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"

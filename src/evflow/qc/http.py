"""The repository's HTTP API on starlette: ``qc_mount(repo_path)`` for the web layer.

Routes (below the mount point, ``/qc`` by default), all JSON except ``raw``:
``/latest/<path>``, ``/browse/<prefix>``, ``/get/<path>?at=T&run=R&version=ID``,
``/objects?prefix=P``, ``/qualities?check=C&run=R``, ``/raw/<version>`` (the encoded
object for ``evflow.qc.objects.decode_object``). Errors are ``{"error": message}``
with 404 (no such object), 400 (a bad parameter) or 503 (no readable repository).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from evflow.errors import InputError, NotFoundError
from evflow.qc import repository_api
from evflow.qc.repository import Repository


class _Reader:
    """Opens the repository read-only on first use (the writer may create it later)."""

    def __init__(self, repo: Repository | str | Path) -> None:
        self._repo = repo if isinstance(repo, Repository) else None
        self._path = Path(repo) if not isinstance(repo, Repository) else repo.path
        self._lock = threading.Lock()

    def __call__(self) -> Repository:
        with self._lock:
            if self._repo is None:
                self._repo = Repository(self._path, readonly=True)
            return self._repo

    def close(self) -> None:
        with self._lock:
            if self._repo is not None:
                self._repo.close()
                self._repo = None


def qc_routes(repo: Repository | str | Path) -> list[Route]:
    """The API routes over ``repo`` (a Repository, or the path of one to open read-only)."""
    reader = _Reader(repo)

    def endpoint(handler: Callable[[Repository, Request], Any]) -> Callable[..., Any]:
        async def run(request: Request) -> Response:
            try:
                out = handler(reader(), request)
            except NotFoundError as exc:
                return JSONResponse({"error": str(exc)}, status_code=404)
            except ValueError as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
            except InputError as exc:
                return JSONResponse({"error": str(exc)}, status_code=503)
            if isinstance(out, bytes):
                return Response(out, media_type="application/octet-stream")
            return JSONResponse(out)

        return run

    def path_of(request: Request) -> str:
        return str(request.path_params.get("path", "")).strip("/")

    routes = [
        Route("/latest/{path:path}", endpoint(lambda r, q: repository_api.latest(r, path_of(q)))),
        Route("/browse", endpoint(lambda r, q: repository_api.browse(r, ""))),
        Route("/browse/{path:path}", endpoint(lambda r, q: repository_api.browse(r, path_of(q)))),
        Route(
            "/get/{path:path}",
            endpoint(
                lambda r, q: repository_api.get(
                    r,
                    path_of(q),
                    at=_number(q, "at", float),
                    run=_number(q, "run", int),
                    version=_number(q, "version", int),
                )
            ),
        ),
        Route(
            "/objects",
            endpoint(lambda r, q: repository_api.paths(r, q.query_params.get("prefix", ""))),
        ),
        Route(
            "/qualities",
            endpoint(
                lambda r, q: repository_api.qualities(
                    r, q.query_params.get("check"), _number(q, "run", int)
                )
            ),
        ),
        Route("/raw/{version:int}", endpoint(lambda r, q: r.raw(q.path_params["version"]))),
    ]
    return routes


def qc_mount(repo: Repository | str | Path, path: str = "/qc") -> Mount:
    """A starlette ``Mount`` of the API at ``path``."""
    return Mount(path, routes=qc_routes(repo))


def _number(request: Request, name: str, kind: type[int] | type[float]) -> Any:
    text = request.query_params.get(name)
    if text is None or text == "":
        return None
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number (unix seconds)"
        raise ValueError(f"query parameter {name}={text!r} is not {what}") from None

"""The dashboard's ASGI app (starlette): pages, JSON, SSE streams, /metrics, the QC API.

Routes:

- ``/`` the run page; ``/qc`` the QC viewer; ``/summary`` the big-screen qualities
- ``/metrics`` the Prometheus exposition of the collector
- ``/api/run`` the run page's figures; ``/api/history?device=D&key=K&minutes=M``
  (from Prometheus when ``prometheus_url`` is set, else the collector's memory)
- ``/api/stream/run`` and ``/api/stream/qc``: server-sent events
- ``/api/qc/...`` the repository's CCDB-style API (:func:`evflow.qc.http.qc_mount`)
- ``/static/...`` our JS/CSS; ``/static/plotly.min.js`` from the plotly package

With a ``token`` every request needs ``?token=`` once (it is then kept in a cookie).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from evflow.errors import InputError
from evflow.monitor.collector import MetricsStore
from evflow.monitor.prometheus import CONTENT_TYPE, exposition, make_registry
from evflow.monitor.web.live import Topic
from evflow.monitor.web.views import run_view
from evflow.qc import repository_api
from evflow.qc.http import qc_mount
from evflow.qc.repository import Repository

STATIC = Path(__file__).with_name("static")
COOKIE = "evflow_token"
#: PromQL per history key (``$d``: the device label matcher)
PROMQL = {
    "events_in_hz": "rate(evflow_events_processed_total{$d}[15s])",
    "events_out_hz": "rate(evflow_events_out_total{$d}[15s])",
    "cpu_percent": "100 * rate(evflow_cpu_seconds_total{$d}[15s])",
    "rss_b": "evflow_rss_bytes{$d}",
    "events_in": "evflow_events_processed_total{$d}",
    "events_out": "evflow_events_out_total{$d}",
}


def plotly_js() -> Path:
    """plotly.js as shipped inside the plotly Python package (served, never fetched)."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


class QcSource:
    """The repository for the QC stream (opened read-only on first use)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._repo: Repository | None = None

    def repo(self) -> Repository | None:
        if self.path is None:
            return None
        if self._repo is None:
            try:
                self._repo = Repository(self.path, readonly=True)
            except InputError:
                return None  # not written yet: the viewer says so
        return self._repo

    def token(self) -> Any:
        repo = self.repo()
        if repo is None:
            return None
        rows = repository_api.paths(repo)["objects"]
        return tuple((r["path"], r["id"], r["quality"]) for r in rows)

    def view(self) -> dict[str, Any]:
        repo = self.repo()
        if repo is None:
            return {"repository": str(self.path) if self.path else None, "objects": []}
        out = repository_api.paths(repo)
        out["repository"] = str(self.path)
        return out

    def close(self) -> None:
        if self._repo is not None:
            self._repo.close()
            self._repo = None


def build_app(
    store: MetricsStore,
    *,
    repo: str | Path | None = None,
    prometheus_url: str | None = None,
    token: str | None = None,
    interval_s: float = 0.5,
) -> Starlette:
    """The dashboard over ``store`` (and the QC repository at ``repo``, if any)."""
    registry = make_registry(store)
    qc = QcSource(Path(repo) if repo is not None else None)
    run_topic = Topic("run", lambda: run_view(store), lambda: store.version, interval_s)
    qc_topic = Topic("qc", qc.view, qc.token, max(interval_s, 1.0))
    topics = {"run": run_topic, "qc": qc_topic}

    async def page(request: Request) -> Response:
        name = {"/": "run.html", "/qc": "qc.html", "/summary": "summary.html"}[request.url.path]
        return FileResponse(STATIC / name, media_type="text/html")

    async def metrics(request: Request) -> Response:
        return Response(exposition(registry), media_type=CONTENT_TYPE)

    async def api_run(request: Request) -> Response:
        return JSONResponse(run_view(store))

    def api_history(request: Request) -> Response:
        q = request.query_params
        key = q.get("key", "events_in_hz")
        if key not in PROMQL:
            return _bad(f"key={key!r} is not one of {', '.join(PROMQL)}")
        try:
            minutes = float(q.get("minutes", "10"))
        except ValueError:
            return _bad(f"minutes={q.get('minutes')!r} is not a number")
        if not 0 < minutes <= 24 * 60:
            return _bad(f"minutes={minutes} must be in (0, 1440]")
        device = q.get("device", "")
        if len(device) > 128:
            return _bad("device id too long")
        if prometheus_url:
            return _from_prometheus(prometheus_url, key, device, minutes)
        since = store.wall() - minutes * 60
        points = [p for p in store.history(device, key) if p[0] >= since]
        return JSONResponse(
            {"source": "memory", "t": [t for t, _ in points], "v": [v for _, v in points]}
        )

    async def stream(request: Request) -> Response:
        topic = topics[request.path_params["topic"]]
        return StreamingResponse(
            topic.stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def plotly(request: Request) -> Response:
        return FileResponse(plotly_js(), media_type="application/javascript")

    routes: list[Any] = [
        Route("/", page),
        Route("/qc", page),
        Route("/summary", page),
        Route("/metrics", metrics),
        Route("/api/run", api_run),
        Route("/api/history", api_history),
        Route("/api/stream/{topic:str}", _only(stream, set(topics))),
        Route("/static/plotly.min.js", plotly),
        Mount("/static", StaticFiles(directory=STATIC)),
    ]
    if repo is not None:
        routes.append(qc_mount(repo, "/api/qc"))
    else:
        routes.append(Route("/api/qc/{rest:path}", _no_repo))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(t.run()) for t in topics.values()]
        try:
            yield
        finally:
            for t in topics.values():
                t.closing = True
            for task in tasks:
                task.cancel()
            qc.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.topics = topics
    app.state.store = store
    if token:
        app.add_middleware(_TokenMiddleware, token=token)
    return app


def _only(handler: Callable[[Request], Awaitable[Response]], names: set[str]) -> Any:
    async def run(request: Request) -> Response:
        if request.path_params.get("topic") not in names:
            return JSONResponse({"error": f"no stream {request.path_params.get('topic')!r}"}, 404)
        return await handler(request)

    return run


async def _no_repo(request: Request) -> Response:
    return JSONResponse(
        {"error": "no QC repository: start the dashboard with --repo PATH"}, status_code=503
    )


def _bad(message: str) -> Response:
    return JSONResponse({"error": message}, status_code=400)


def _from_prometheus(url: str, key: str, device: str, minutes: float) -> Response:
    matcher = f'device="{device}"' if device else 'role="worker"'
    query = PROMQL[key].replace("$d", matcher)
    if not device:
        query = f"sum({query})"
    end = time.time()
    params = {"query": query, "start": end - minutes * 60, "end": end, "step": "2s"}
    # the stdlib client: the dashboard runs on a plain install (no test extras)
    full = url.rstrip("/") + "/api/v1/query_range?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(full, timeout=5.0) as reply:
            data = json.loads(reply.read())
        if not isinstance(data, dict):
            raise ValueError("the reply is not a JSON object")
    except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
        return JSONResponse({"error": f"Prometheus at {url} did not answer: {exc}"}, 502)
    result = (data.get("data") or {}).get("result") or []
    values = result[0]["values"] if result else []
    return JSONResponse(
        {
            "source": "prometheus",
            "query": query,
            "t": [float(t) for t, _ in values],
            "v": [float(v) for _, v in values],
        }
    )


class _TokenMiddleware:
    """Refuses requests without the token (query ``token=`` or the cookie it sets)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            response = JSONResponse({"error": "this dashboard needs ?token=..."}, 403)
            await response(scope, receive, send)
            return
        if request.query_params.get("token"):

            async def send_with_cookie(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    headers = list(message.get("headers", []))
                    cookie = f"{COOKIE}={self.token}; Path=/; HttpOnly; SameSite=Strict"
                    headers.append((b"set-cookie", cookie.encode()))
                    message = {**message, "headers": headers}
                await send(message)

            await self.app(scope, receive, send_with_cookie)
            return
        await self.app(scope, receive, send)

"""The dashboard's web server: real uvicorn on 127.0.0.1, real HTTP, bad input."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from starlette.exceptions import StarletteDeprecationWarning

from _qc_repo_helpers import gauss_hist, published
from evflow.errors import ConfigurationError
from evflow.monitor.collector import MetricsStore
from evflow.monitor.prometheus import parse_exposition, total
from evflow.monitor.report import write_report
from evflow.monitor.web import Dashboard, start_dashboard
from evflow.monitor.web.app import build_app
from evflow.qc.quality import Flag, Quality, QualityObject
from evflow.qc.repository import Repository
from evflow.wire.messages import MsgType

with warnings.catch_warnings():
    # this starlette prefers the httpx2 fork for its TestClient; httpx works the same here
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from starlette.testclient import TestClient

PATH = "qc/hzz/pt"


def _feed(store: MetricsStore, n_workers: int = 3) -> None:
    for i in range(n_workers):
        store.ingest(
            MsgType.METRICS,
            {
                "from": f"worker-{i}",
                "metrics": {"pid": 100 + i, "events_in": 10 * i, "node_state": "RUNNING"},
            },
        )
    store.ingest(MsgType.METRICS, {"from": "output", "metrics": {"pid": 99, "events_in": 30}})


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "qc.sqlite"
    with Repository(path) as r:
        r.store(
            published(PATH, gauss_hist(500), cycle=0),
            QualityObject(Quality.BAD, "mean", (PATH,), (Flag("mean_out_of_range", "m=9"),)),
        )
    return path


@pytest.fixture
def dash(repo: Path) -> Iterator[Dashboard]:
    store = MetricsStore(host="h1")
    _feed(store)
    with start_dashboard([], "auto", repo=repo, store=store, interval_s=0.1) as d:
        yield d


def test_pages_metrics_and_plotly_are_served_locally(dash: Dashboard) -> None:
    base = f"http://127.0.0.1:{dash.port}"
    with httpx.Client(base_url=base, timeout=10) as c:
        for page in ("/", "/qc", "/summary"):
            r = c.get(page)
            assert r.status_code == 200 and "<html" in r.text
            assert "http://" not in r.text and "https://" not in r.text  # nothing from outside
        js = c.get("/static/plotly.min.js")
        assert js.status_code == 200 and len(js.content) > 1_000_000
        samples = parse_exposition(c.get("/metrics").text)
        assert total(samples, "evflow_events_processed_total", role="worker") == 30
        run = c.get("/api/run").json()
        assert [d["id"] for d in run["devices"]] == ["worker-0", "worker-1", "worker-2", "output"]
        assert ["worker-1", "output"] in run["edges"]
        latest = c.get(f"/api/qc/latest/{PATH}").json()
        assert latest["version"]["quality"] == "Bad"


def test_port_in_use_is_one_clear_error_and_auto_takes_the_next(dash: Dashboard) -> None:
    with pytest.raises(ConfigurationError, match=f"port {dash.port} on 127.0.0.1 is in use"):
        start_dashboard([], dash.port, store=MetricsStore())
    with start_dashboard([], "auto", store=MetricsStore()) as other:
        assert other.port != dash.port


def test_malformed_query_strings_get_400_never_500(dash: Dashboard) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{dash.port}", timeout=10) as c:
        for url in (
            "/api/history?minutes=abc",
            "/api/history?minutes=-1",
            "/api/history?key=nope",
            f"/api/history?device={'x' * 500}",
            f"/api/qc/get/{PATH}?at=yesterday",
            f"/api/qc/get/{PATH}?version=1e9x",
        ):
            r = c.get(url)
            assert r.status_code == 400, url
            assert r.json()["error"]
        assert c.get("/api/history?%zz=&&==&minutes").status_code in (200, 400)
        assert c.get("/api/stream/nothing").status_code == 404
        assert c.get("/api/qc/latest/qc/no/such").status_code == 404


async def _first_events(port: int, n_clients: int) -> list[str]:
    async def one(client: httpx.AsyncClient) -> str:
        async with client.stream("GET", "/api/stream/run") as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return line  # and disconnect mid-stream
        return ""

    limits = httpx.Limits(max_connections=n_clients + 5)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=30, limits=limits
    ) as client:
        return await asyncio.gather(*(one(client) for _ in range(n_clients)))


def test_hundred_sse_clients_at_once_then_all_disconnect_mid_stream(dash: Dashboard) -> None:
    lines = asyncio.run(_first_events(dash.port, 100))
    assert len(lines) == 100 and all('"worker-2"' in line for line in lines)
    topic = dash.app.state.topics["run"]
    deadline = time.monotonic() + 30
    while topic.clients and time.monotonic() < deadline:
        time.sleep(0.05)
    assert topic.clients == 0  # every stream ended with its client
    with httpx.Client(timeout=10) as c:  # and the server still serves
        assert c.get(f"http://127.0.0.1:{dash.port}/metrics").status_code == 200


def test_a_live_update_reaches_a_connected_client(dash: Dashboard) -> None:
    async def wait_for_update() -> str:
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{dash.port}", timeout=20) as client,
            client.stream("GET", "/api/stream/run") as r,
        ):
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 1:  # now a device appears
                        dash.store.ingest(MsgType.STATE, {"from": "worker-9", "state": "ERROR"})
                    elif "worker-9" in line:
                        return line
        return ""

    line = asyncio.run(asyncio.wait_for(wait_for_update(), 20))
    assert '"state":"ERROR"' in line


def test_token_is_required_when_asked() -> None:
    app = build_app(MetricsStore(), token="s3cret")
    with TestClient(app) as c:
        assert c.get("/metrics").status_code == 403
        assert c.get("/metrics?token=wrong").status_code == 403
        assert c.get("/metrics?token=s3cret").status_code == 200
        assert c.get("/api/run").status_code == 200  # the cookie it set


def test_non_loopback_bind_gets_a_token() -> None:
    with start_dashboard([], "auto", host="0.0.0.0", store=MetricsStore()) as d:
        assert d.token and f"token={d.token}" in d.url
        with httpx.Client(timeout=10) as c:
            assert c.get(f"http://127.0.0.1:{d.port}/metrics").status_code == 403
            assert c.get(d.metrics_url).status_code == 200


def test_a_wildcard_bind_prints_a_url_a_browser_can_open() -> None:
    with start_dashboard([], "auto", host="0.0.0.0", store=MetricsStore()) as d:
        host = httpx.URL(d.url).host
        assert host not in ("0.0.0.0", "", "127.0.0.1", "localhost"), d.url
        with httpx.Client(timeout=10) as c:
            assert c.get(d.url).status_code == 200  # the page, through that name


def test_hostile_metrics_never_make_metrics_or_the_run_page_fail() -> None:
    store = MetricsStore(host="h1")
    _feed(store)
    # int('²') raised in the sort; int keys broke the exposition's sort and names
    store.ingest(MsgType.METRICS, {"from": "w-²", "metrics": {"pid": 7, "events_in": 1}})
    store.ingest(MsgType.METRICS, {"from": "w-3", "metrics": {"pid": 8, "extra": {1: 2}}})
    store.ingest(MsgType.METRICS, {"from": "w-4", "metrics": {"pid": 9, 5: 1}})
    with TestClient(build_app(store)) as c:
        assert c.get("/metrics").status_code == 200
        run = c.get("/api/run")
        assert run.status_code == 200
    ids = [d["id"] for d in run.json()["devices"]]
    assert "w-²" in ids and "w-3" not in ids and "w-4" not in ids
    assert run.json()["refused"] == 2


def test_rates_fall_to_zero_once_a_device_ended_or_went_silent() -> None:
    from evflow.monitor.web.views import run_view

    now = [1000.0]
    store = MetricsStore(host="h", wall=lambda: now[0])
    rates = {"messages_in_hz": 50.0, "messages_out_hz": 50.0, "events_in_hz": 400.0}
    for w in ("worker-0", "worker-1", "output"):
        store.ingest(MsgType.METRICS, {"from": w, "metrics": {"pid": 1, "rates": rates}})
    rows = {d["id"]: d for d in run_view(store)["devices"]}
    assert rows["worker-0"]["msg_in_hz"] == 50.0 and rows["output"]["events_in_hz"] == 400.0
    assert run_view(store)["rate"]["events_hz"][-1] > 0.0
    store.ingest(MsgType.STATE, {"from": "worker-0", "state": "EXITING"})
    now[0] += 1.0
    rows = {d["id"]: d for d in run_view(store)["devices"]}
    assert rows["worker-0"]["ended"] and rows["worker-0"]["msg_in_hz"] == 0.0
    assert rows["worker-1"]["msg_in_hz"] == 50.0  # still running
    now[0] += 30.0  # the run is over: nothing heard since
    view = run_view(store)
    assert all(d["msg_in_hz"] == d["msg_out_hz"] == d["events_in_hz"] == 0.0
               for d in view["devices"])  # fmt: skip
    assert view["rate"]["events_hz"][-1] == 0.0
    assert view["progress"]["rate_hz"] == 0.0 and view["progress"]["eta_s"] is None


def test_path_roles_publish_their_message_counts(tmp_path: Path) -> None:
    """msg/s in and out of a parallel run's roles come from counters they publish."""
    script = tmp_path / "run.py"
    script.write_text(
        "import json, evflow\n"
        "from evflow.io.generators import BusyWork, ToyGenerator\n"
        "from evflow.monitor import runhook\n"
        "runhook.request(runhook.RunMonitor())\n"
        "modules = [ToyGenerator(n_events=3000, payload_bytes=100), BusyWork(work_ms=0.5)]\n"
        "evflow.process(evflow.Path(modules), workers=2, quiet=True)\n"
        "runhook.release()\n"
        "nodes = runhook.used[-1].store.nodes()\n"
        "keys = ('messages_in', 'messages_out')\n"
        "print(json.dumps({r.node_id: [r.metrics.get(k) for k in keys] for r in nodes}))\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    for role in ("input", "worker-0", "worker-1", "output"):
        msg_in, msg_out = counts[role]
        assert msg_in and msg_in > 0 and msg_out and msg_out > 0, (role, counts)


def test_missing_repository_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no QC repository at"):
        start_dashboard([], "auto", repo=tmp_path / "nope.sqlite")
    proc = subprocess.run(
        [sys.executable, "-m", "evflow", "dashboard", "--repo", str(tmp_path / "nope.sqlite")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"evflow: error: dashboard: no QC repository at {tmp_path / 'nope.sqlite'} (the file "
        "does not exist; give the path of a repository that a run wrote with its QC writer)"
    ]


def test_dashboard_command_serves_a_repository_until_sigterm(repo: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with subprocess.Popen(
        [sys.executable, "-m", "evflow", "dashboard", "--repo", str(repo), "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert line.strip() == f"evflow: dashboard at http://127.0.0.1:{port}/"
            r = httpx.get(f"http://127.0.0.1:{port}/api/qc/objects", timeout=10)
            assert [o["path"] for o in r.json()["objects"]] == [PATH]
        finally:
            proc.terminate()
            assert proc.wait(timeout=20) == 0  # SIGTERM: an orderly stop


def test_static_report_has_metrics_and_qc_plots(tmp_path: Path, repo: Path) -> None:
    store = MetricsStore(host="h1")
    _feed(store)
    page = write_report(tmp_path / "report", store, repo=repo, title="a run")
    text = page.read_text()
    assert "worker-2" in text and PATH in text and "Bad" in text and "mean_out_of_range" in text
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    assert pngs == ["devices.png", "event_rate.png", "qc_hzz_pt.png"]
    assert all((page.parent / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_run_with_a_busy_dashboard_port_fails_before_it_starts(tmp_path: Path) -> None:
    steering = tmp_path / "steering.py"
    marker = tmp_path / "ran"
    steering.write_text(f"open({str(marker)!r}, 'w').close()\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "evflow",
                "run",
                str(steering),
                "-p",
                "2",
                "--dashboard",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"evflow: error: dashboard: port {port} on 127.0.0.1 is in use by another program; "
        "choose another with --dashboard PORT, or --dashboard auto for the next free one"
    ]
    assert not marker.exists()  # the steering file never ran
    # a port that is no port is a bad command line: exit 2, one line after the usage
    for value in ("80a", "99999", "0"):
        bad = subprocess.run(
            [sys.executable, "-m", "evflow", "run", str(steering), "--dashboard", value],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2, bad.stderr
        assert (
            bad.stderr.strip()
            .splitlines()[-1]
            .endswith(
                f"error: argument --dashboard: expected a port number (1-65535) or 'auto', "
                f"got {value!r}"
            )
        )
    assert not marker.exists()


def test_dashboard_command_names_its_own_option_for_a_busy_or_bad_port(repo: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "evflow", "dashboard", "--repo", str(repo), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"evflow: error: dashboard: port {port} on 127.0.0.1 is in use by another program; "
        "choose another with --port PORT, or --port auto for the next free one"
    ]
    bad = subprocess.run(
        [sys.executable, "-m", "evflow", "dashboard", "--repo", str(repo), "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "error: argument --port: expected a port number (1-65535) or 'auto'" in bad.stderr


def test_sequential_run_says_it_has_nothing_to_monitor(tmp_path: Path) -> None:
    steering = tmp_path / "steering.py"
    steering.write_text(
        "import evflow\nfrom evflow.io.generators import ToyGenerator\n"
        "evflow.process(evflow.Path([ToyGenerator(n_events=5)]), quiet=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "evflow", "run", str(steering), "--dashboard", "auto"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert "--dashboard/--report need a parallel run (-p N with N >= 1)" in proc.stderr


def test_dashboard_command_refuses_a_session_without_a_bus_and_no_target() -> None:
    for argv, expected in (
        (["--session", "nope-1"], "evflow: error: no bus in session 'nope-1' (sessions with"),
        ([], "evflow: error: evflow dashboard needs something to show: --bus PUB,SUB"),
        (["--bus", "http://x"], "evflow: error: invalid bus address 'http://x'"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "evflow", "dashboard", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1, argv
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_ctrl_c_ends_the_linger_of_a_complete_run_with_exit_0(tmp_path: Path) -> None:
    import os
    import signal

    steering = tmp_path / "steering.py"
    steering.write_text(
        "import evflow\nfrom evflow.io.generators import ToyGenerator, BusyWork\n"
        "evflow.process(evflow.Path([ToyGenerator(n_events=50), BusyWork(work_ms=0.1)]),"
        f" output={str(tmp_path / 'out.evf')!r})\n"
    )
    cmd = [sys.executable, "-m", "evflow", "run", str(steering), "-p", "2", "-q"]
    cmd += ["--dashboard", "auto", "--dashboard-linger", "60"]
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        assert proc.stderr.readline().startswith("evflow: dashboard at http://127.0.0.1:")
        assert proc.stderr.readline().startswith("evflow: run done; the dashboard stays up 60 s")
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert proc.stderr.read() == ""


class _FakePrometheus(http.server.BaseHTTPRequestHandler):
    """Answers /api/v1/query_range as Prometheus does; anything else: a 500 page."""

    queries: ClassVar[list[dict[str, list[str]]]] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/api/v1/query_range":
            self.send_error(500, "boom")
            return
        self.queries.append(urllib.parse.parse_qs(url.query))
        body = json.dumps(
            {"status": "success", "data": {"result": [{"values": [[1.0, "3"], [3.0, "7"]]}]}}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_history_from_prometheus_and_one_error_when_it_does_not_answer() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakePrometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    prom = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with (
            start_dashboard([], "auto", store=MetricsStore(), prometheus_url=prom) as good,
            start_dashboard([], "auto", store=MetricsStore(), prometheus_url=prom + "/x") as bad,
        ):
            r = httpx.get(f"http://127.0.0.1:{good.port}/api/history?device=output&key=events_out")
            assert r.status_code == 200
            assert r.json() == {
                "source": "prometheus",
                "query": 'evflow_events_out_total{device="output"}',
                "t": [1.0, 3.0],
                "v": [3.0, 7.0],
            }
            assert _FakePrometheus.queries[-1]["query"] == [
                'evflow_events_out_total{device="output"}'
            ]
            r = httpx.get(f"http://127.0.0.1:{bad.port}/api/history")
            assert r.status_code == 502
            assert r.json()["error"].startswith(f"Prometheus at {prom}/x did not answer: ")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)

"""Shared by the monitoring tests: free ports, a slow toy run with a dashboard, Prometheus."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

PROMETHEUS = "/usr/bin/prometheus"
CHROMIUM = "/usr/bin/chromium"

STEERING = textwrap.dedent(
    """
    import os
    import evflow
    from evflow.io.generators import BusyWork, ToyGenerator

    path = evflow.Path()
    path.add(ToyGenerator(n_events=int(os.environ["N_EVENTS"]), payload_bytes=256, seed=1))
    path.add(BusyWork(work_ms=float(os.environ["WORK_MS"])))
    evflow.process(path, output=os.environ["OUT_FILE"])
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def need(binary: str, what: str) -> None:
    """Skip (saying why) only when the machine lacks the binary."""
    if not (Path(binary).exists() or shutil.which(Path(binary).name)):
        pytest.skip(f"{binary} is not installed ({what}; Debian package in CI)")


@contextmanager
def slow_run(
    tmp_path: Path,
    *,
    n_events: int,
    work_ms: float,
    port: int,
    args: list[str] = (),
    steering_text: str = STEERING,
) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """``evflow run -p 2 --dashboard PORT`` of a toy path; yields (process, output file)
    once the dashboard answers. The process is stopped (SIGKILL of its group) at exit."""
    steering = tmp_path / "slow_steering.py"
    steering.write_text(steering_text)
    out = tmp_path / "out.evf"
    env = {**os.environ, "N_EVENTS": str(n_events), "WORK_MS": str(work_ms), "OUT_FILE": str(out)}
    cmd = [sys.executable, "-m", "evflow", "run", str(steering), "-p", "2", "-q"]
    cmd += ["--dashboard", str(port), *args]
    with subprocess.Popen(
        cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert line.strip() == f"evflow: dashboard at http://127.0.0.1:{port}/", line
            yield proc, out
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@contextmanager
def prometheus(tmp_path: Path, target_port: int, interval_s: float = 1.0) -> Iterator[str]:
    """Debian's Prometheus on 127.0.0.1 scraping ``target_port``; yields its URL."""
    need(PROMETHEUS, "real Prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {int(interval_s * 1000)}ms\n"
        "scrape_configs:\n  - job_name: evflow\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{target_port}']\n"
    )
    log = (tmp_path / "prometheus.log").open("w")
    with subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    ) as proc:
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            else:
                text = (tmp_path / "prometheus.log").read_text()
                pytest.fail(f"Prometheus did not get ready: {text}")
            yield url
        finally:
            proc.kill()
            proc.wait(timeout=20)
            log.close()


def query(url: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=5)
    r.raise_for_status()
    return list(r.json()["data"]["result"])


def events_in(file: Path) -> int:
    from evflow.io.records import RecordInput

    return RecordInput(file=str(file)).total()

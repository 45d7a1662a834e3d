"""The dashboard in a real browser: Debian's Chromium driven by playwright (headless).

Screenshots are saved under the test's tmp path (and copied to docs/img/ when
EVFLOW_DOC_SCREENSHOTS=1, for the docs).
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hist
import numpy as np
import pytest

from _monitor_helpers import CHROMIUM, free_port, need, slow_run
from _qc_repo_helpers import gauss_hist, published
from evflow.monitor.web import start_dashboard
from evflow.qc.checks import MeanInRange
from evflow.qc.repository import Repository

pytestmark = [pytest.mark.browser, pytest.mark.slow]

DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
PT = "qc/hzz/pt"
MAP = "qc/hzz/eta_phi"


@pytest.fixture
def page() -> Iterator[Any]:
    need(CHROMIUM, "a real browser")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 900})
        finally:
            browser.close()


def _shot(page: Any, tmp_path: Path, name: str) -> None:
    file = tmp_path / name
    page.screenshot(path=str(file), full_page=True)
    print(f"screenshot: {file}")
    if os.environ.get("EVFLOW_DOC_SCREENSHOTS") == "1":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        shutil.copy(file, DOCS_IMG / name)


def _wait(page: Any, js: str, timeout_s: float = 20.0) -> Any:
    """Poll a JS expression until it is truthy (playwright's wait_for_function)."""
    return page.wait_for_function(js, timeout=timeout_s * 1000).json_value()


def test_run_page_shows_workers_and_a_restart_after_sigkill(page: Any, tmp_path: Path) -> None:
    port = free_port()
    with slow_run(tmp_path, n_events=4000, work_ms=5.0, port=port) as (proc, _out):
        page.goto(f"http://127.0.0.1:{port}/")
        _wait(
            page,
            "['worker-0', 'worker-1'].every("
            "w => (window.evRun.states[w] || []).includes('RUNNING'))",
        )
        for w in ("worker-0", "worker-1"):
            row = page.locator(f'tr[data-device="{w}"]')
            assert row.locator(".state").get_attribute("data-state") == "RUNNING"
            assert row.locator(".restarts").inner_text() == "0"
        victim = page.evaluate("window.evRun.last.devices.find(d => d.id === 'worker-0').pid")
        os.kill(victim, signal.SIGKILL)
        _wait(
            page,
            "document.querySelector('tr[data-device=\"worker-0\"] .restarts').textContent === '1'",
        )
        _wait(page, "window.evRun.last.devices.find(d => d.id === 'worker-0').state === 'RUNNING'")
        # the row shows the restart as a state of its own for a while
        assert page.locator('tr[data-device="worker-0"] .state-RESTARTED').count() == 1
        assert page.locator('tr[data-device="worker-1"] .state-RESTARTED').count() == 0
        pids = page.evaluate("window.evRun.pids['worker-0']")
        assert pids[0] == victim and pids[-1] != victim  # the page shows the replacement
        assert page.locator('tr[data-device="worker-1"] .restarts').inner_text() == "0"
        assert page.locator("#graph circle").count() >= 4  # input, 2 workers, output
        _wait(page, "!document.getElementById('progress').hidden")
        # time per module over the last minutes: the worker path's BusyWork is there
        _wait(
            page,
            "(document.getElementById('moduleplot').data || [])"
            ".some(t => t.name.includes('Busy') && t.y.some(v => v > 0))",
        )
        _shot(page, tmp_path, "dashboard-run.png")
        os.killpg(proc.pid, signal.SIGINT)  # an orderly stop of the rest of the run
        proc.wait(timeout=60)


def _store(repo: Repository, path: str, obj: Any, cycle: int, check: MeanInRange) -> None:
    pub = published(path, obj, cycle=cycle)
    repo.store(pub, check(pub))


def test_qc_viewer_plots_the_repository_object_and_its_quality(page: Any, tmp_path: Path) -> None:
    db = tmp_path / "qc.sqlite"
    check = MeanInRange("pt_mean", (PT, MAP), min=3.0, max=7.0)
    h2 = hist.Hist.new.Reg(12, -3, 3, name="eta").Reg(10, 0, 6.3, name="phi").Double()
    rng = np.random.default_rng(3)
    h2.fill(rng.normal(0, 1, 3000), rng.uniform(0, 6.3, 3000))
    with Repository(db) as repo:
        _store(repo, PT, gauss_hist(2000, loc=5.0, seed=1), 0, check)
        _store(repo, MAP, h2, 0, MeanInRange("eta", (MAP,), min=-1, max=1))
        with start_dashboard([], free_port(), repo=db, interval_s=0.2) as dash:
            page.goto(f"{dash.url}qc?path={PT}")
            _wait(page, f"window.evQc.shown && window.evQc.shown.path === '{PT}'")
            shown = page.evaluate("document.getElementById('qcplot').data[0].y")
            assert shown == repo.latest(PT).obj.values().tolist()
            assert page.locator("#quality").get_attribute("data-quality") == "Good"
            good = page.eval_on_selector("#quality", "e => getComputedStyle(e).backgroundColor")
            # the next cycle's check fails: the page turns Bad by itself (no reload)
            _store(repo, PT, gauss_hist(2500, loc=8.5, seed=2), 1, check)
            _wait(page, "document.getElementById('quality').dataset.quality === 'Bad'")
            bad = page.eval_on_selector("#quality", "e => getComputedStyle(e).backgroundColor")
            assert good != bad
            shown = page.evaluate("document.getElementById('qcplot').data[0].y")
            assert shown == repo.latest(PT).obj.values().tolist()
            assert "mean_out_of_range" in page.locator("#flags").inner_text()
            # the history slider goes back to cycle 0
            page.eval_on_selector(
                "#history", "e => { e.value = 0; e.dispatchEvent(new Event('input')); }"
            )
            _wait(page, "window.evQc.shown.quality === 'Good'")
            # reference overlay and ratio: the object against itself is 1 everywhere
            page.eval_on_selector(
                "#history", "e => { e.value = e.max; e.dispatchEvent(new Event('input')); }"
            )
            page.select_option("#reference", PT)
            _wait(page, "document.getElementById('qcplot').data.length === 3")
            ratio = page.evaluate("document.getElementById('qcplot').data[2].y")
            assert {round(r, 12) for r in ratio if r is not None} == {1.0}
            _shot(page, tmp_path, "dashboard-qc.png")
            # 2D: a heat map whose z (y rows) is the transposed histogram
            page.locator(f'li.leaf[data-path="{MAP}"]').click()
            _wait(page, f"window.evQc.shown && window.evQc.shown.path === '{MAP}'")
            z = page.evaluate("document.getElementById('qcplot').data[0].z")
            assert page.evaluate("document.getElementById('qcplot').data[0].type") == "heatmap"
            assert z == repo.latest(MAP).obj.values().T.tolist()
            # layout: add, reload the page, still there (saved), export is JSON of paths
            page.click("#add")
            page.reload()
            _wait(page, f"document.querySelector('#layout [data-path=\"{MAP}\"] .main-svg')")
            assert page.evaluate("window.evQc.layout") == [MAP]
            # the big-screen summary: one tile per object in its quality colour
            page.goto(f"{dash.url}summary")
            _wait(page, "document.querySelectorAll('.tile').length === 2")
            assert page.locator(f'.tile[data-path="{PT}"]').get_attribute("data-quality") == "Bad"
            _shot(page, tmp_path, "dashboard-summary.png")

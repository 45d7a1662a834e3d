"""``evflow qc ls|get|export|check``: outputs, ROOT files read back, and one-line errors."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import hist
import httpx
import numpy as np
import pytest
import uproot

from _qc_repo_helpers import gauss_hist, published
from evflow.cli import main
from evflow.qc.objects import decode_object
from evflow.qc.quality import Flag, Quality, QualityObject
from evflow.qc.repository import Repository

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


def _objects() -> dict[str, object]:
    rng = np.random.default_rng(3)
    h2 = hist.Hist.new.Reg(6, 0, 3, name="x").Variable([0, 1, 2, 5], name="y").Weight()
    h2.fill(rng.uniform(-1, 4, 500), rng.uniform(0, 6, 500), weight=rng.uniform(0, 2, 500))
    h3 = hist.Hist.new.Reg(4, 0, 1).Reg(3, 0, 1).Reg(2, 0, 1).Int64()
    h3.fill(*rng.uniform(0, 1, (3, 300)))
    h4 = hist.Hist.new.Reg(2, 0, 1).Reg(2, 0, 1).Reg(2, 0, 1).Reg(2, 0, 1).Double()
    return {
        "qc/hzz/pt": gauss_hist(1000, seed=1),
        "qc/hzz/xy": h2,
        "qc/tracks/h3": h3,
        "qc/tracks/h4": h4,
        "qc/tracks/ids": np.arange(5),
    }


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "qc.sqlite"
    with Repository(path) as repo:
        repo.store(published("qc/hzz/pt", gauss_hist(10), run=1, cycle=0, created=T0))
        for i, (path_, obj) in enumerate(_objects().items()):
            quality = QualityObject(Quality.BAD, "x", (path_,), (Flag("mean_out_of_range", "7"),))
            repo.store(
                published(path_, obj, run=2, cycle=3, created=T0 + 10 + i, seen=1, expected=2),
                quality if path_ == "qc/hzz/pt" else None,
            )
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_prints_one_line_per_object(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "qc", "ls", "--repo", str(db))
    assert code == 0
    assert out.splitlines() == [
        "qc/hzz/pt      run 2  cycle 3  Bad",
        "qc/hzz/xy      run 2  cycle 3  -",
        "qc/tracks/h3   run 2  cycle 3  -",
        "qc/tracks/h4   run 2  cycle 3  -",
        "qc/tracks/ids  run 2  cycle 3  -",
    ]
    code, out, _ = _run(capsys, "qc", "ls", "--repo", str(db), "--versions", "qc/hzz/pt")
    assert [line.split()[:6] for line in out.splitlines()] == [
        ["qc/hzz/pt", "run", "2", "cycle", "3", "Bad"],
        ["qc/hzz/pt", "run", "1", "cycle", "0", "-"],
    ]


def test_get_prints_a_summary_latest_by_run_and_at(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "qc", "get", "--repo", str(db), "qc/hzz/pt")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "qc/hzz/pt  version 2  run 2  cycle 3"
    assert lines[1] == "valid     2023-11-14 22:13:30.000 UTC .. now (newest)"
    assert "quality   Bad" in lines and "  flag    mean_out_of_range: 7" in lines
    assert "sources   50% complete, missing src1" in lines
    assert any(
        line.startswith("object    1D histogram (x: 40 bins [0, 10)), sum 1000") for line in lines
    )
    _, out, _ = _run(capsys, "qc", "get", "--repo", str(db), "qc/hzz/pt", "--run", "1")
    assert out.splitlines()[0] == "qc/hzz/pt  version 1  run 1  cycle 0"
    _, out, _ = _run(capsys, "qc", "get", "--repo", str(db), "qc/hzz/pt", "--at", str(T0 + 5))
    assert "version 1" in out.splitlines()[0]
    _, out, _ = _run(
        capsys, "qc", "get", "--repo", str(db), "qc/hzz/pt", "--at", "2023-11-14T22:13:25"
    )
    assert "version 1" in out.splitlines()[0] and "2023-11-14 22:13:30.000 UTC" in out


def test_get_out_writes_root_json_or_the_encoded_object(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = _objects()["qc/hzz/pt"]
    root = tmp_path / "pt.root"
    assert _run(capsys, "qc", "get", "--repo", str(db), "qc/hzz/pt", "--out", str(root))[0] == 0
    with uproot.open(root) as f:
        assert np.array_equal(f["pt"].values(flow=True), expected.values(flow=True))  # type: ignore[union-attr]
    as_json = tmp_path / "pt.json"
    _run(capsys, "qc", "get", "--repo", str(db), "qc/hzz/pt", "--out", str(as_json))
    assert json.loads(as_json.read_text())["object"]["values"] == expected.values().tolist()
    raw = tmp_path / "pt.qco"
    _run(capsys, "qc", "get", "--repo", str(db), "qc/hzz/pt", "--out", str(raw))
    assert decode_object(raw.read_bytes()) == expected
    code, _, err = _run(
        capsys, "qc", "get", "--repo", str(db), "qc/tracks/ids", "--out", str(tmp_path / "a.root")
    )
    assert code == 1 and "a ndarray has no ROOT histogram form" in err


def test_export_writes_th1_th2_th3_readable_with_equal_bins(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "export"
    code, out, _ = _run(capsys, "qc", "export", "--repo", str(db), str(out_dir))
    assert code == 0
    assert f"qc/hzz/pt -> {out_dir / 'hzz.root'}:pt" in out
    assert "qc/tracks/h4 skipped: 4-dimensional histograms have no TH1/TH2/TH3 form" in out
    assert "qc/tracks/ids skipped: a ndarray has no ROOT histogram form" in out
    assert out.splitlines()[-1] == "3 objects written, 2 skipped"
    objects = _objects()
    with uproot.open(out_dir / "hzz.root") as f:
        assert f["pt"].classname == "TH1D" and f["xy"].classname == "TH2D"  # type: ignore[union-attr]
        for key in ("pt", "xy"):
            back = f[key].to_hist()  # type: ignore[union-attr]
            original = objects[f"qc/hzz/{key}"]
            assert np.allclose(back.values(flow=True), original.values(flow=True))  # type: ignore[attr-defined]
            for a, b in zip(back.axes, original.axes, strict=True):  # type: ignore[attr-defined]
                assert np.array_equal(a.edges, b.edges)
        assert np.allclose(f["xy"].variances(flow=True), objects["qc/hzz/xy"].variances(flow=True))  # type: ignore[union-attr,attr-defined]
    with uproot.open(out_dir / "tracks.root") as f:
        assert f["h3"].classname == "TH3D"  # type: ignore[union-attr]
        assert np.array_equal(f["h3"].values(flow=True), objects["qc/tracks/h3"].values(flow=True))  # type: ignore[union-attr,attr-defined]
        assert set(f.keys(cycle=False)) == {"h3"}


def test_check_runs_a_toml_suite_on_the_latest_objects(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "checks.toml"
    config.write_text(
        '[checks.mean]\ntype = "mean_in_range"\nobjects = ["qc/hzz/pt"]\nmin = 4\nmax = 6\n'
        '[checks.ref]\ntype = "chi2_reference"\nobjects = ["qc/hzz/pt"]\n'
        'reference = {path = "qc/hzz/pt", run = 1}\n'
    )
    code, out, _ = _run(capsys, "qc", "check", "--repo", str(db), str(config))
    assert code == 0
    # the object is only half complete: no threshold set, so the checks speak
    assert out.splitlines() == ["qc/hzz/pt  mean  Good", "qc/hzz/pt  ref  Good"]
    code, _, _ = _run(capsys, "qc", "check", "--repo", str(db), str(config), "--store")
    with Repository(db, readonly=True) as repo:
        assert [q.quality for q in repo.qualities("mean")] == ["Good"]


def test_errors_are_one_clear_line(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.sqlite"
    code, out, err = _run(capsys, "qc", "ls", "--repo", str(missing))
    assert (code, out) == (1, "")
    assert err == f"evflow: error: no QC repository at {missing} (the file does not exist)\n"
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"\x00garbage" * 512)
    code, _, err = _run(capsys, "qc", "get", "--repo", str(corrupt), "qc/a/b")
    assert code == 1 and err.count("\n") == 1
    assert f"{corrupt} is not a QC repository (file is not a database)" in err
    code, _, err = _run(capsys, "qc", "get", "--repo", str(db), "qc/hzz/nope")
    assert code == 1 and err == (
        f"evflow: error: no QC object qc/hzz/nope in {db} "
        f"(5 paths, see: evflow qc ls --repo {db})\n"
    )
    code, _, err = _run(capsys, "qc", "check", "--repo", str(missing), "x.toml", "--store")
    assert code == 1 and "no QC repository at" in err and not missing.exists()
    with pytest.raises(SystemExit) as exit_:
        main(["qc", "get", "--repo", str(db), "qc/hzz/pt", "--at", "soon"])
    assert exit_.value.code == 2 and "'soon' is neither unix seconds nor an ISO date" in (
        capsys.readouterr().err
    )


def test_the_evflow_command_runs_qc_ls(db: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "evflow", "qc", "ls", "--repo", str(db), "qc/tracks/"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()] == [
        "qc/tracks/h3",
        "qc/tracks/h4",
        "qc/tracks/ids",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_answers_the_http_api_and_stops_on_sigterm(db: Path) -> None:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "evflow", "qc", "serve", "--repo", str(db), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().startswith(f"serving {db} on http://127.0.0.1:{port}/qc/")
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/qc/latest/qc/hzz/pt", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.1)
        assert response.status_code == 200
        assert response.json()["version"]["run"] == 2
        missing = httpx.get(f"http://127.0.0.1:{port}/qc/latest/qc/none", timeout=5)
        assert missing.status_code == 404
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
        # uvicorn shuts down cleanly, then re-raises the signal: the usual status for it
        assert server.returncode == -signal.SIGTERM, err
        assert "Traceback" not in err
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()


def test_serve_without_a_repository_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "evflow", "qc", "serve", "--repo", str(tmp_path / "x.sqlite")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1 and done.stdout == ""
    missing = tmp_path / "x.sqlite"
    assert (
        done.stderr == f"evflow: error: no QC repository at {missing} (the file does not exist)\n"
    )

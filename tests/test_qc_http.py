"""The repository's HTTP API: the plain JSON functions and their starlette mount."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import hist
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.exceptions import StarletteDeprecationWarning

from _qc_repo_helpers import gauss_hist, published
from evflow.errors import NotFoundError
from evflow.qc import repository_api
from evflow.qc.http import qc_mount
from evflow.qc.objects import decode_object
from evflow.qc.quality import Flag, Quality, QualityObject
from evflow.qc.repository import Repository

with warnings.catch_warnings():
    # this starlette prefers the httpx2 fork for its TestClient; httpx works the same here
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from starlette.testclient import TestClient

PATH = "qc/hzz/pt"
T0 = 1_700_000_000.0


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "qc.sqlite"
    with Repository(path) as repo:
        for i, (run, cycle) in enumerate([(1, 0), (1, 1), (2, 0)]):
            quality = QualityObject(Quality.GOOD if i else Quality.BAD, "q", (PATH,), ())
            vid = repo.store(
                published(PATH, gauss_hist(100 + i, seed=i), run=run, cycle=cycle, created=T0 + i),
                quality,
            )
            repo.store_quality(
                QualityObject(Quality.MEDIUM, "ks", (PATH,), (Flag("ks_marginal", "p=0.03"),)),
                run=run,
                cycle=cycle,
                version_id=vid,
            )
        arr = np.array([1.0, np.nan, np.inf])
        repo.store(published("qc/hzz/arr", arr, created=T0))
        repo.store(published("qc/other/n", 7, created=T0))
    return path


@pytest.fixture
def client(db: Path) -> Iterator[TestClient]:
    with TestClient(Starlette(routes=[qc_mount(db)])) as c:
        yield c


def test_plain_functions_return_json_able_dicts(db: Path) -> None:
    with Repository(db, readonly=True) as repo:
        latest = repository_api.latest(repo, PATH)
        json.dumps(latest, allow_nan=False)
        assert latest["version"]["run"] == 2 and latest["version"]["valid_until"] is None
        obj = latest["object"]
        assert obj["type"] == "histogram" and obj["axes"][0]["edges"][0] == 0.0
        assert len(obj["values"]) == 40 and obj["sum_with_flow"] == 102
        assert obj["values"] == gauss_hist(102, seed=2).values().tolist()
        got = repository_api.get(repo, PATH, at=T0 + 1.5)
        assert (got["version"]["run"], got["version"]["cycle"]) == (1, 1)
        assert repository_api.get(repo, PATH, run=1)["version"]["cycle"] == 1
        browse = repository_api.browse(repo, "qc/hzz")
        assert browse["paths"] == ["qc/hzz/arr", PATH] and browse["versions"] == []
        assert [v["cycle"] for v in repository_api.browse(repo, PATH)["versions"]] == [0, 1, 0]
        arr = repository_api.latest(repo, "qc/hzz/arr")["object"]
        assert arr["values"] == [1.0, None, None]  # nan and inf are not JSON
        json.dumps(arr, allow_nan=False)
        assert repository_api.latest(repo, "qc/other/n")["object"] == {"type": "number", "value": 7}
        categories = hist.Hist.new.StrCat(["e", "mu"], name="flavour").Reg(2, 0, 1).Double()
        categories.fill(["mu", "mu", "e"], [0.2, 0.7, 0.7])
        as_json = repository_api.object_to_json(categories)
        assert as_json["axes"][0]["categories"] == ["e", "mu"]
        assert as_json["axes"][1]["edges"] == [0.0, 0.5, 1.0]
        assert as_json["values"] == [[0.0, 1.0], [1.0, 1.0]]
        listing = repository_api.paths(repo)["objects"]
        assert [(o["path"], o["quality"]) for o in listing][-1] == ("qc/other/n", None)
        with pytest.raises(NotFoundError, match=r"no QC object qc/hzz/pt \(run=9\)"):
            repository_api.get(repo, PATH, run=9)


def test_latest_browse_get_over_http(client: TestClient) -> None:
    latest = client.get(f"/qc/latest/{PATH}")
    assert latest.status_code == 200
    assert latest.json()["version"]["cycle"] == 0 and latest.json()["version"]["run"] == 2
    assert latest.json()["version"]["quality"] == "Good"
    browse = client.get("/qc/browse/qc/hzz/pt").json()
    assert [(v["run"], v["cycle"]) for v in browse["versions"]] == [(2, 0), (1, 1), (1, 0)]
    assert browse["versions"][-1]["valid_until"] == T0 + 1
    assert client.get("/qc/browse").json()["paths"] == ["qc/hzz/arr", PATH, "qc/other/n"]
    at = client.get(f"/qc/get/{PATH}", params={"at": T0 + 0.5}).json()
    assert at["version"]["cycle"] == 0 and at["version"]["quality"] == "Bad"
    by_run = client.get(f"/qc/get/{PATH}", params={"run": 1}).json()
    assert (by_run["version"]["run"], by_run["version"]["cycle"]) == (1, 1)
    first_id = browse["versions"][-1]["id"]
    by_id = client.get(f"/qc/get/{PATH}", params={"version": first_id}).json()
    assert by_id["version"]["id"] == first_id
    raw = client.get(f"/qc/raw/{first_id}")
    assert raw.headers["content-type"] == "application/octet-stream"
    assert decode_object(raw.content) == gauss_hist(100, seed=0)
    quals = client.get("/qc/qualities", params={"check": "ks", "run": 1}).json()["qualities"]
    assert [(q["quality"], q["cycle"]) for q in quals] == [("Medium", 1), ("Medium", 0)]
    assert quals[0]["flags"] == [{"name": "ks_marginal", "reason": "p=0.03"}]
    objects = client.get("/qc/objects", params={"prefix": "qc/hzz/"}).json()["objects"]
    assert [o["path"] for o in objects] == ["qc/hzz/arr", PATH]


def test_http_errors_are_json_with_the_right_status(client: TestClient, tmp_path: Path) -> None:
    missing = client.get("/qc/latest/qc/nothing/here")
    assert missing.status_code == 404 and "no QC object qc/nothing/here" in missing.json()["error"]
    bad_at = client.get(f"/qc/get/{PATH}", params={"at": "yesterday"})
    assert bad_at.status_code == 400
    assert bad_at.json()["error"] == "query parameter at='yesterday' is not a number (unix seconds)"
    other = client.get(f"/qc/get/{PATH}", params={"version": 999})
    assert other.status_code == 404 and "no version 999" in other.json()["error"]
    with TestClient(Starlette(routes=[qc_mount(tmp_path / "none.sqlite")])) as nothing:
        response = nothing.get(f"/qc/latest/{PATH}")
        assert response.status_code == 503 and "no QC repository at" in response.json()["error"]


def test_the_mount_sees_versions_stored_after_it_opened(db: Path, client: TestClient) -> None:
    assert client.get(f"/qc/latest/{PATH}").json()["version"]["run"] == 2
    with Repository(db) as writer:
        h = hist.Hist.new.Reg(40, 0, 10).Double()
        writer.store(published(PATH, h, run=3, cycle=0))
    assert client.get(f"/qc/latest/{PATH}").json()["version"]["run"] == 3

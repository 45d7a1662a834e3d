"""The SQLite repository: versions, validity, latest at a time and by run, retention,
bad files, and readers in other processes while a writer process writes."""

from __future__ import annotations

import itertools
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import hist
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _proc import finish, wait_for_line
from _qc_repo_helpers import gauss_hist, published
from evflow.errors import ClosedError, InputError, NotFoundError, OutputError
from evflow.qc.quality import Flag, Quality, QualityObject
from evflow.qc.repository import Repository

PATH = "qc/hzz/pt"
T0 = 1_700_000_000.0


@pytest.fixture
def repo(tmp_path: Path) -> Repository:
    r = Repository(tmp_path / "qc.sqlite")
    yield r
    r.close()


def test_versions_close_the_previous_validity_interval(repo: Repository) -> None:
    ids = [
        repo.store(published(PATH, gauss_hist(100 * (c + 1), seed=c), cycle=c, created=T0 + 10 * c))
        for c in range(3)
    ]
    versions = repo.versions(PATH)
    assert [v.id for v in versions] == ids[::-1]  # newest first
    assert [(v.valid_from, v.valid_until) for v in versions] == [
        (T0 + 20, None),
        (T0 + 10, T0 + 20),
        (T0, T0 + 10),
    ]
    newest = repo.latest(PATH)
    assert newest is not None and newest.id == ids[-1] and newest.cycle == 2
    assert newest.obj == gauss_hist(300, seed=2)  # bin by bin
    assert newest.completeness["expected"] == ["src0", "src1"]
    assert len(newest.hash) == 64 and newest.size > 0
    assert repo.paths() == [PATH] and repo.paths("qc/hzz/") == [PATH] and repo.paths("qc/x") == []


def test_latest_at_a_time_and_by_run(repo: Repository) -> None:
    # run 1: cycles at T0, T0+10; run 2: cycles at T0+20, T0+30
    for i, (run, cycle) in enumerate([(1, 0), (1, 1), (2, 0), (2, 1)]):
        repo.store(published(PATH, gauss_hist(10 + i), run=run, cycle=cycle, created=T0 + 10 * i))
    at = repo.latest(PATH, at=T0 + 15)
    assert at is not None and (at.run, at.cycle) == (1, 1)
    assert repo.latest(PATH, at=T0 + 10).cycle == 1  # type: ignore[union-attr]  # from is inclusive
    assert repo.latest(PATH, at=T0 + 9.999).cycle == 0  # type: ignore[union-attr]
    assert repo.latest(PATH, at=T0 + 1e6).run == 2  # type: ignore[union-attr]  # still valid
    assert repo.latest(PATH, at=T0 - 1) is None  # before the first version
    by_run = repo.latest(PATH, run=1)
    assert by_run is not None and (by_run.run, by_run.cycle) == (1, 1)
    assert by_run.obj.sum() == 11
    early = repo.latest(PATH, run=2, at=T0 + 25)
    assert early is not None and (early.run, early.cycle) == (2, 0)
    assert repo.latest(PATH, run=3) is None and repo.latest("qc/nothing") is None


def test_a_late_version_is_slotted_into_the_history(repo: Repository) -> None:
    repo.store(published(PATH, gauss_hist(1), cycle=0, created=T0))
    repo.store(published(PATH, gauss_hist(3), cycle=2, created=T0 + 20))
    repo.store(published(PATH, gauss_hist(2), cycle=1, created=T0 + 10))  # arrives last
    intervals = [(v.cycle, v.valid_from, v.valid_until) for v in repo.versions(PATH)]
    assert intervals == [(2, T0 + 20, None), (1, T0 + 10, T0 + 20), (0, T0, T0 + 10)]
    assert repo.latest(PATH).cycle == 2  # type: ignore[union-attr]


def test_quality_flags_metadata_and_check_results_are_stored(repo: Repository) -> None:
    quality = QualityObject(Quality.MEDIUM, "object_quality", (PATH,), (Flag("empty_bins", "40%"),))
    vid = repo.store(published(PATH, gauss_hist(5), metadata={"n": np.int64(3)}), quality)
    stored = repo.get(vid)
    assert stored.quality == "Medium" and stored.flags == (Flag("empty_bins", "40%"),)
    assert stored.metadata == {"n": 3}
    qid = repo.store_quality(
        QualityObject(Quality.BAD, "ks", (PATH,), (Flag("ks_failed", "p 1e-9"),), {"pvalue": 1e-9}),
        run=1,
        cycle=0,
        version_id=vid,
    )
    [q] = repo.qualities("ks")
    assert (q.id, q.quality, q.version_id, q.run, q.metadata) == (
        qid,
        "Bad",
        vid,
        1,
        {"pvalue": 1e-9},
    )
    assert repo.checks() == ["ks"] and repo.qualities("other") == []
    json.dumps(stored.to_dict())  # the web layer serves these as they are
    with pytest.raises(NotFoundError, match="no version 999"):
        repo.get(999)


def test_identical_contents_are_stored_once(repo: Repository) -> None:
    h = gauss_hist(100)
    a = repo.store(published(PATH, h, cycle=0, created=T0))
    b = repo.store(published(PATH, h, cycle=1, created=T0 + 1))
    assert repo.get(a).hash == repo.get(b).hash
    conn = sqlite3.connect(repo.path)
    assert conn.execute("SELECT count(*) FROM blobs").fetchone()[0] == 1
    conn.close()


def test_retention_keeps_the_last_n_per_path_and_frees_their_bytes(tmp_path: Path) -> None:
    with Repository(tmp_path / "qc.sqlite", retention={"keep_last": 2}) as repo:
        for c in range(5):
            vid = repo.store(published(PATH, gauss_hist(10 + c), cycle=c, created=T0 + c))
            repo.store_quality(QualityObject(Quality.GOOD, "q", (PATH,)), version_id=vid)
            repo.store(published("qc/hzz/eta", gauss_hist(5 + c), cycle=c, created=T0 + c))
        assert [v.cycle for v in repo.versions(PATH)] == [4, 3]
        assert [v.cycle for v in repo.versions("qc/hzz/eta")] == [4, 3]
        assert len(repo.qualities("q")) == 2  # the results of deleted versions go too
        assert repo.latest(PATH, at=T0 + 0.5) is None  # that history is gone
    conn = sqlite3.connect(tmp_path / "qc.sqlite")
    assert conn.execute("SELECT count(*) FROM blobs").fetchone()[0] == 4
    conn.close()


def test_retention_by_age_never_removes_the_newest(tmp_path: Path) -> None:
    now = time.time()
    with Repository(tmp_path / "qc.sqlite", retention={"max_age_s": 3600}) as repo:
        repo.store(published(PATH, gauss_hist(1), cycle=0, created=now - 3 * 3600))
        repo.store(published(PATH, gauss_hist(2), cycle=1, created=now - 2 * 3600))
        repo.store(published("qc/hzz/old", gauss_hist(3), cycle=0, created=now - 9 * 3600))
        repo.store(published(PATH, gauss_hist(3), cycle=2, created=now - 60))
        # cycle 0 stopped being valid 2 h ago: gone; cycle 1 stopped 60 s ago: kept
        assert [v.cycle for v in repo.versions(PATH)] == [2, 1]
        assert repo.prune() == 0
        assert [v.cycle for v in repo.versions("qc/hzz/old")] == [0]  # newest of its path


def test_bad_retention_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        Repository(tmp_path / "a.sqlite", retention={"keep_last": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        Repository(tmp_path / "a.sqlite", retention={"keep": 3})


def test_missing_corrupt_and_foreign_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"no QC repository at .*nope.sqlite \(the file does"):
        Repository(tmp_path / "nope.sqlite", readonly=True)
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(InputError, match=r"garbage.sqlite is not a QC repository \(file is not a"):
        Repository(garbage, readonly=True)
    with pytest.raises(InputError, match="is not a QC repository"):
        Repository(garbage)
    foreign = tmp_path / "foreign.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE meta (key TEXT, value TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(InputError, match="SQLite file but not a QC repository"):
        Repository(foreign, readonly=True)
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    for readonly in (True, False):  # a writer must not add its tables to such a file
        with pytest.raises(InputError, match="SQLite file but not a QC repository"):
            Repository(other, readonly=readonly)
    conn = sqlite3.connect(other)
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["users"]
    conn.close()
    future = tmp_path / "future.sqlite"
    Repository(future).close()
    conn = sqlite3.connect(future)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(InputError, match="has schema version 99; this evflow reads version 1"):
        Repository(future, readonly=True)
    with pytest.raises(OutputError, match=r"directory .* does not exist"):
        Repository(tmp_path / "no" / "dir" / "qc.sqlite")


def test_a_reader_cannot_write_and_a_tampered_object_fails_its_hash(tmp_path: Path) -> None:
    with Repository(tmp_path / "qc.sqlite") as writer:
        vid = writer.store(published(PATH, gauss_hist(50)))
    with (
        Repository(tmp_path / "qc.sqlite", readonly=True) as reader,
        pytest.raises(OutputError, match="read-only"),
    ):
        reader.store(published(PATH, gauss_hist(50)))
    conn = sqlite3.connect(tmp_path / "qc.sqlite")
    conn.execute("UPDATE versions SET hash = 'ab' || substr(hash, 3) WHERE id = ?", (vid,))
    conn.execute("INSERT INTO blobs SELECT 'ab' || substr(hash, 3), data FROM blobs")
    conn.execute("UPDATE blobs SET data = zeroblob(length(data)) WHERE hash LIKE 'ab%'")
    conn.commit()
    conn.close()
    with (
        Repository(tmp_path / "qc.sqlite", readonly=True) as reader,
        pytest.raises(InputError, match=f"version {vid} fails its hash check"),
    ):
        reader.get(vid)


def test_a_closed_repository_says_so(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "qc.sqlite")
    repo.store(published(PATH, gauss_hist(5)))
    repo.close()
    with pytest.raises(ClosedError, match=r"QC repository .*qc.sqlite is closed"):
        repo.latest(PATH)
    with pytest.raises(ClosedError):
        repo.store(published(PATH, gauss_hist(5)))
    repo.close()  # twice is fine


def test_histograms_of_every_kind_round_trip(repo: Repository) -> None:
    objects = {
        "qc/t/h2": hist.Hist.new.Reg(4, 0, 1).Variable([0, 1, 5]).Weight(),
        "qc/t/h3": hist.Hist.new.Reg(3, 0, 1).Reg(2, 0, 1).Integer(0, 4).Int64(),
        "qc/t/arr": np.arange(12.0).reshape(3, 4),
        "qc/t/count": 42,
    }
    objects["qc/t/h2"].fill([0.1, 0.7], [0.5, 3], weight=[2.0, 0.5])
    objects["qc/t/h3"].fill([0.2], [0.7], [3])
    for path, obj in objects.items():
        repo.store(published(path, obj))
    for path, obj in objects.items():
        got = repo.latest(path).obj  # type: ignore[union-attr]
        if hasattr(obj, "axes"):
            assert got == obj and got.storage_type == obj.storage_type
        else:
            assert np.array_equal(got, obj)


_WRITER = """
import sys, time, hist
sys.path.insert(0, {tests!r})
from _qc_repo_helpers import published
from evflow.qc.repository import Repository
from pathlib import Path
repo = Repository({db!r}, retention={{"keep_last": 20}})
print("ready", flush=True)
# wait (bounded) until every reader has read once, so that reading overlaps writing
deadline = time.monotonic() + 60
while len(list(Path({db!r}).parent.glob("reader-*.started"))) < {readers}:
    assert time.monotonic() < deadline, "the readers never started"
    time.sleep(0.01)
for cycle in range({cycles}):
    for name in ("pt", "eta"):
        h = hist.Hist.new.Reg(500, 0, 1).Double()
        h[...] = [cycle + 1] * 500  # every bin holds cycle+1: readers check consistency
        repo.store(published("qc/hzz/" + name, h, cycle=cycle, metadata={{"cycle": cycle}}))
repo.close()
print("done", flush=True)
"""

_READER = """
import json, sys, time
from evflow.qc.repository import Repository
deadline = time.monotonic() + 60
while True:
    try:
        repo = Repository({db!r}, readonly=True)
        open({marker!r}, "w").close()  # the writer waits for every reader's marker
        break
    except Exception:
        pass
    assert time.monotonic() < deadline, "no repository appeared"
    time.sleep(0.01)
reads, last, seen_cycles = 0, -1, set()
while last < {cycles} - 1:
    assert time.monotonic() < deadline, "the writer never finished"
    for path in ("qc/hzz/pt", "qc/hzz/eta"):
        stored = repo.latest(path)
        if stored is None:
            continue
        values = stored.obj.values()
        # one version = one consistent state: every bin from the same cycle as the row
        assert (values == stored.cycle + 1).all(), (stored.cycle, set(values.tolist()))
        assert stored.metadata["cycle"] == stored.cycle
        if path == "qc/hzz/pt":
            assert stored.cycle >= last, (stored.cycle, last)  # never goes back
            last = stored.cycle
        seen_cycles.add(stored.cycle)
        versions = repo.versions(path)
        assert [v.valid_until for v in versions][0] is None
        reads += 1
repo.close()
print(json.dumps({{"reads": reads, "distinct": len(seen_cycles), "last": last}}))
"""


@pytest.mark.slow
def test_readers_in_other_processes_read_while_a_writer_process_writes(tmp_path: Path) -> None:
    db = str(tmp_path / "qc.sqlite")
    cycles = 300
    tests_dir = str(Path(__file__).parent)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _WRITER.format(db=db, cycles=cycles, tests=tests_dir, readers=3),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _READER.format(db=db, cycles=cycles, marker=marker)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for marker in [str(tmp_path / f"reader-{i}.started") for i in range(3)]
    ]
    # one deadline for all, inside the test's own timeout (a loaded machine is slow)
    deadline = time.monotonic() + 100
    try:
        w_out, _ = writer.communicate(timeout=deadline - time.monotonic())
        assert writer.returncode == 0 and w_out.split() == ["ready", "done"]
        results = []
        for reader in readers:
            out, err = reader.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert reader.returncode == 0, err
            results.append(json.loads(out))
    finally:
        for p in [writer, *readers]:
            if p.poll() is None:
                p.kill()
                p.wait()
            for pipe in (p.stdout, p.stderr):  # also after a failure: no unclosed file
                if pipe is not None:
                    pipe.close()
    for r in results:
        assert r["last"] == cycles - 1
        assert r["reads"] > 0
    # the readers overlapped the writer: at least one saw several cycles come in
    assert max(r["distinct"] for r in results) > 1, results
    with Repository(db, readonly=True) as repo:
        assert [v.cycle for v in repo.versions("qc/hzz/pt")] == list(
            range(cycles - 1, cycles - 21, -1)
        )


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=12))
def test_validity_intervals_chain_whatever_the_arrival_order(
    tmp_path_factory: pytest.TempPathFactory, offsets: list[int]
) -> None:
    db = tmp_path_factory.mktemp("hyp") / "qc.sqlite"
    with Repository(db) as repo:
        ids = [
            repo.store(published(PATH, c, cycle=i, created=T0 + c)) for i, c in enumerate(offsets)
        ]
        versions = repo.versions(PATH)
        assert sorted(v.id for v in versions) == sorted(ids)
        chain = sorted(versions, key=lambda v: (v.valid_from, v.id))
        for before, after in itertools.pairwise(chain):
            assert before.valid_until == after.valid_from  # no gap, no overlap
        assert chain[-1].valid_until is None
        for probe in range(-1, 22):
            at = T0 + probe + 0.5
            # brute force: of the versions created at or before `at`, the newest (ties: last stored)
            candidates = [v for v in chain if v.valid_from <= at]
            expected = candidates[-1].id if candidates else None
            got = repo.latest(PATH, at=at)
            assert (got.id if got else None) == expected


_KILLED_WRITER = """
import sys, hist, numpy as np
sys.path.insert(0, {tests!r})
from _qc_repo_helpers import published
from evflow.qc.repository import Repository
repo = Repository({db!r}, retention={{"keep_last": 5}})
rng = np.random.default_rng(0)
cycle = 0
while True:
    h = hist.Hist.new.Reg(2000, 0, 1).Double()
    h.fill(rng.uniform(0, 1, 100))
    repo.store(published("qc/hzz/pt", h, cycle=cycle))
    cycle += 1
    if cycle == 20:
        print("writing", flush=True)
"""


def test_a_writer_killed_mid_write_leaves_a_consistent_repository(tmp_path: Path) -> None:
    db = tmp_path / "qc.sqlite"
    tests_dir = str(Path(__file__).parent)
    for round_ in range(3):
        writer = subprocess.Popen(
            [sys.executable, "-c", _KILLED_WRITER.format(db=str(db), tests=tests_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # shown if it dies before "writing"
            text=True,
        )
        try:
            wait_for_line(writer, "writing", timeout_s=60)
            time.sleep(0.05 * round_)  # the moment of the kill varies: what this test is about
        finally:
            writer.kill()  # SIGKILL, somewhere inside a transaction or between two
            finish(writer, timeout_s=30)  # reaps it and closes its pipe
        with Repository(db, readonly=True) as reader:
            versions = reader.versions(PATH)
            assert 1 <= len(versions) <= 5 and versions[0].valid_until is None
            for newer, older in itertools.pairwise(versions):
                assert older.valid_until == newer.valid_from
            for v in versions:
                assert reader.get(v.id).obj.sum() == 100  # bytes present, hash checked
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    conn.close()
    with Repository(db) as repo:  # a new writer carries on
        vid = repo.store(published(PATH, gauss_hist(7)))
        assert repo.latest(PATH).id == vid  # type: ignore[union-attr]

"""RepositoryWriter: checks and stores what a merger publishes; a full disk opens a gap
(logged once, bounded pending, merging goes on) and storing resumes when space returns."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import hist
import numpy as np
import pytest

from _qc_repo_helpers import gauss_hist, published
from evflow.errors import ConfigurationError, StorageFullError
from evflow.qc.checks import EmptyBinFraction, MeanInRange
from evflow.qc.checksuite import Aggregator, CheckSuite
from evflow.qc.publication import PublishedObject
from evflow.qc.quality import Quality
from evflow.qc.repository import Repository
from evflow.qc.storage import RepositoryWriter

PATH = "qc/hzz/pt"
T0 = 1_700_000_000.0


def test_writer_stores_objects_their_checks_and_aggregates(tmp_path: Path) -> None:
    suite = CheckSuite(
        [MeanInRange("mean", min=4, max=6), EmptyBinFraction("empty", bad_above=0.9)],
        [Aggregator("all", ("mean", "empty"))],
    )
    with Repository(tmp_path / "qc.sqlite") as repo:
        writer = RepositoryWriter(repo, suite)
        writer(published(PATH, gauss_hist(10_000), cycle=0, created=T0))
        writer(published(PATH, gauss_hist(10_000, loc=8), cycle=1, created=T0 + 1))
        assert writer.statistics().stored == 2 and writer.statistics().storing
        latest = repo.latest(PATH)
        assert latest is not None and latest.quality == "Bad"
        assert [f.name for f in latest.flags] == ["mean_out_of_range"]
        assert repo.latest(PATH, at=T0 + 0.5).quality == "Good"  # type: ignore[union-attr]
        mean_results = repo.qualities("mean")
        assert [(q.quality, q.cycle, q.version_id) for q in mean_results] == [
            ("Bad", 1, latest.id),
            ("Good", 0, latest.id - 1),
        ]
        [agg, _] = repo.qualities("all")
        assert agg.quality == "Bad" and agg.version_id is None
        assert repo.checks() == ["all", "empty", "mean"]


def test_an_object_that_cannot_be_encoded_is_logged_once_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Repository(tmp_path / "qc.sqlite") as repo:
        writer = RepositoryWriter(repo)
        with caplog.at_level(logging.ERROR, logger="evflow.qc.storage"):
            for cycle in range(3):
                writer(published("qc/t/odd", {"not": "a qc object"}, cycle=cycle))  # type: ignore[arg-type]
            writer(published(PATH, gauss_hist(10)))
        stats = writer.statistics()
        assert (stats.unstorable, stats.stored, stats.pending) == (3, 1, 0)
        assert len([r for r in caplog.records if "qc/t/odd cannot be stored" in r.message]) == 1
        assert repo.paths() == [PATH]


def test_a_closed_repository_is_a_gap_not_an_exception_in_the_merger(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "qc.sqlite")
    writer = RepositoryWriter(repo, retry_interval_s=0.0)
    repo.close()
    writer(published(PATH, gauss_hist(3)))
    stats = writer.statistics()
    assert (stats.storing, stats.pending, stats.stored) == (False, 1, 0)


class _FlakyRepository:
    """A repository whose writes fail while ``full`` is set (a disk full, simulated)."""

    def __init__(self, real: Repository) -> None:
        self.real = real
        self.full = False
        self.attempts = 0

    def store(self, published: PublishedObject, quality: object = None) -> int:
        self.attempts += 1
        if self.full:
            raise StorageFullError("QC repository x: disk full (simulated)")
        return self.real.store(published, quality)  # type: ignore[arg-type]

    def store_quality(self, *args: object, **kwargs: object) -> int:
        if self.full:
            raise StorageFullError("QC repository x: disk full (simulated)")
        return self.real.store_quality(*args, **kwargs)  # type: ignore[arg-type]

    def record_gap(self, *args: object) -> int:
        return self.real.record_gap(*args)  # type: ignore[arg-type]


def test_a_gap_keeps_the_newest_pending_retries_on_its_interval_and_is_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    with Repository(tmp_path / "qc.sqlite") as real:
        repo = _FlakyRepository(real)
        writer = RepositoryWriter(
            repo,  # type: ignore[arg-type]
            max_pending=3,
            retry_interval_s=5.0,
            clock=lambda: now[0],
        )
        with caplog.at_level(logging.WARNING, logger="evflow.qc.storage"):
            writer(published(PATH, gauss_hist(1), cycle=0, created=T0))
            repo.full = True
            for cycle in range(1, 8):
                writer(published(PATH, gauss_hist(1 + cycle), cycle=cycle, created=T0 + cycle))
                now[0] += 1.0
            # one attempt when the gap opened, one when the retry interval had passed
            assert repo.attempts == 1 + 2
            stats = writer.statistics()
            assert (stats.storing, stats.pending, stats.lost, stats.gaps) == (False, 3, 4, 1)
            repo.full = False
            writer(published(PATH, gauss_hist(9), cycle=8, created=T0 + 8))
            assert writer.statistics().pending == 3  # still waiting for the retry time
            now[0] += 5.0
            writer(published(PATH, gauss_hist(10), cycle=9, created=T0 + 9))
        stats = writer.statistics()
        assert (stats.storing, stats.pending, stats.stored, stats.lost) == (True, 0, 5, 5)
        # the oldest were dropped: a later integral holds their entries
        assert [v.cycle for v in real.versions(PATH)] == [9, 8, 7, 6, 0]
        [gap] = real.gaps()
        assert (gap.stored_late, gap.lost) == (4, 5) and "simulated" in gap.reason
        messages = [r.message for r in caplog.records]
        assert sum("QC storing paused" in m for m in messages) == 1
        assert sum("QC storing resumed" in m for m in messages) == 1


def test_pending_is_bounded_in_memory_too(tmp_path: Path) -> None:
    with Repository(tmp_path / "qc.sqlite") as real:
        repo = _FlakyRepository(real)
        repo.full = True
        writer = RepositoryWriter(repo, max_pending=1000, max_pending_bytes=100_000)  # type: ignore[arg-type]
        for cycle in range(10):
            big = hist.Hist.new.Reg(5000, 0, 1).Double()  # 40 kB of storage
            writer(published(PATH, big, cycle=cycle))
        stats = writer.statistics()
        assert (stats.pending, stats.lost) == (2, 8)
        huge = hist.Hist.new.Reg(50_000, 0, 1).Double()  # alone above the bound: still kept
        writer(published(PATH, huge, cycle=10))
        assert writer.statistics().pending == 1


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for this test only."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(ballast: Path, leave_bytes: int) -> None:
    """Fill the disk with ``ballast``, then give back ``leave_bytes``."""
    chunk = b"\xff" * 4096
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    size = 0
    try:
        while True:
            size += os.write(fd, chunk)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(ballast, max(0, size - leave_bytes))


def test_full_disk_merging_goes_on_storing_resumes_the_gap_is_logged(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    suite = CheckSuite([EmptyBinFraction("empty", medium_above=0.99, bad_above=1.0)])
    repo = Repository(small_disk / "qc.sqlite")
    try:
        writer = RepositoryWriter(repo, suite, max_pending=4, retry_interval_s=0.0)
        rng = np.random.default_rng(11)
        merged = hist.Hist.new.Reg(5000, 0, 1).Double()  # ~40 kB encoded
        history: dict[int, hist.Hist] = {}
        ballast = small_disk / "ballast"
        _fill(ballast, leave_bytes=300_000)
        with caplog.at_level(logging.WARNING, logger="evflow.qc.storage"):
            cycle = 0

            def merge_and_publish() -> None:
                nonlocal cycle
                merged.fill(rng.uniform(0, 1, 2000))  # the merger merges a delta
                history[cycle] = merged.copy()
                writer(published(PATH, merged.copy(), cycle=cycle, created=T0 + cycle))
                cycle += 1

            while writer.statistics().storing:
                merge_and_publish()
                assert cycle < 200, "the disk never filled"
            for _ in range(8):  # the merger goes on while the disk is full
                merge_and_publish()
            full_at = cycle
            stats = writer.statistics()
            assert not stats.storing and stats.pending == 4 and stats.lost > 0
            stored_before = stats.stored
            ballast.unlink()  # space returns
            for _ in range(3):
                merge_and_publish()
        stats = writer.statistics()
        assert stats.storing and stats.pending == 0 and stats.gaps == 1
        assert stats.received == cycle  # every merged cycle reached the writer
        assert stats.stored + stats.lost == cycle
        paused = [r.message for r in caplog.records if "QC storing paused" in r.message]
        assert len(paused) == 1 and "disk full" in paused[0], paused
        assert sum("QC storing resumed" in r.message for r in caplog.records) == 1
        [gap] = repo.gaps()
        assert gap.lost == stats.lost and gap.stored_late == 4 + 1
        kept = sorted(v.cycle for v in repo.versions(PATH))
        lost = set(range(stored_before, full_at - 4))
        assert kept == [c for c in range(cycle) if c not in lost]
        for c in kept:  # the late ones hold exactly what was merged at their cycle
            stored = repo.latest(PATH, at=T0 + c)
            assert stored is not None and stored.cycle == c and stored.obj == history[c]
            assert stored.quality == Quality.GOOD.label
    finally:
        repo.close()


def test_open_builds_the_writer_from_a_toml_file_with_retention(tmp_path: Path) -> None:
    config = tmp_path / "checks.toml"
    config.write_text(
        "min_completeness = 0.9\n"
        '[checks.mean]\ntype = "mean_in_range"\nobjects = ["qc/hzz/*"]\nmin = 4\nmax = 6\n'
    )
    writer = RepositoryWriter.open(
        tmp_path / "qc.sqlite", checks=config, retention={"keep_last": 2}
    )
    for cycle in range(4):
        writer(published(PATH, gauss_hist(100 + cycle), cycle=cycle, seen=1 if cycle == 3 else 2))
    writer.close()
    with Repository(tmp_path / "qc.sqlite", readonly=True) as repo:
        assert [(v.cycle, v.quality) for v in repo.versions(PATH)] == [(3, "Null"), (2, "Good")]
        assert repo.latest(PATH).flags[-1].name == "incomplete"  # type: ignore[union-attr]
    config.write_text("[checks.x]\ntype = 'nope'\n")
    with pytest.raises(ConfigurationError, match=r"checks\.toml: check 'x' has type 'nope'"):
        RepositoryWriter.open(tmp_path / "qc.sqlite", checks=config)

"""A QC repository in a directory nobody may write: read it, and refuse to write it
with the reason. Reads never leave ``-wal``/``-shm`` files beside the repository.

The tests run as root, which ignores permission bits, so a directory is made
read-only with ``chattr +i`` (the immutable attribute: even root cannot create files
in it) or with a read-only bind mount in a private mount namespace (``unshare -m``:
nothing of it outlives the command).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from _qc_repo_helpers import gauss_hist, published
from evflow.errors import OutputError
from evflow.qc.repository import Repository

PATHS = ["qc/det/a", "qc/det/b"]


def make_repository(directory: Path) -> Path:
    directory.mkdir()
    repo = directory / "qc.sqlite"
    with Repository(repo) as writer:
        for cycle in range(3):
            for path in PATHS:
                writer.store(published(path, gauss_hist(100 + cycle), cycle=cycle))
    return repo


def beside(repo: Path) -> list[str]:
    return sorted(p.name for p in repo.parent.iterdir())


def evflow(prefix: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "evflow", *args], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_reads_leave_no_wal_or_shm_files(tmp_path: Path) -> None:
    repo = make_repository(tmp_path / "repo")
    assert beside(repo) == ["qc.sqlite"]  # the writer left WAL mode when it closed
    for args in (["ls"], ["ls", "--versions"], ["get", "qc/det/a"],
                 ["export", str(tmp_path / "out")]):  # fmt: skip
        out = evflow([], "qc", *args, "--repo", str(repo))
        assert out.returncode == 0, out.stderr
        assert beside(repo) == ["qc.sqlite"], args
    with Repository(repo, readonly=True) as reader:
        assert reader.paths() == PATHS
    assert beside(repo) == ["qc.sqlite"]
    # a writer that comes back turns WAL on again, and leaves it when it closes
    with Repository(repo) as writer:
        writer.store(published(PATHS[0], gauss_hist(7), cycle=9))
        assert "qc.sqlite-wal" in beside(repo)
    assert beside(repo) == ["qc.sqlite"]


@contextlib.contextmanager
def read_only(directory: Path, how: str) -> Iterator[list[str]]:
    """``directory`` read-only while the block runs; yields the prefix of a command that
    must see it so (the mount exists only inside that command's namespace)."""
    if how == "chattr":
        done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"chattr +i does not work here: {done.stderr.strip()}")
        try:
            yield []
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        return
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) for a private read-only bind mount")
    script = (
        'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && '
        'if touch "$0/.probe" 2>/dev/null; then exit 97; fi && exec "$@"'
    )
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(directory)]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"a read-only bind mount does not work here: {probe.stderr.strip()}")
    yield prefix


@pytest.mark.parametrize("how", ["chattr", "mount"])
def test_a_read_only_directory_is_read_and_not_written(tmp_path: Path, how: str) -> None:
    repo = make_repository(tmp_path / "repo")
    out_dir = tmp_path / "out"
    with read_only(repo.parent, how) as prefix:
        ls = evflow(prefix, "qc", "ls", "--repo", str(repo))
        assert ls.returncode == 0, ls.stderr
        assert [line.split()[0] for line in ls.stdout.splitlines()] == PATHS
        get = evflow(prefix, "qc", "get", "qc/det/b", "--repo", str(repo))
        assert get.returncode == 0, get.stderr
        assert "cycle 2" in get.stdout
        export = evflow(prefix, "qc", "export", str(out_dir), "--repo", str(repo))
        assert export.returncode == 0, export.stderr
        assert "2 objects written" in export.stdout
        # writing needs the directory: one line naming the file, the directory and why
        checks = tmp_path / "checks.toml"
        checks.write_text('[checks.m]\ntype = "mean_in_range"\nobjects = ["qc/det/a"]\n'
                          "min = 0.0\nmax = 1.0\n")  # fmt: skip
        store = evflow(prefix, "qc", "check", str(checks), "--store", "--repo", str(repo))
        assert store.returncode == 1
        if how == "chattr":  # the file may be written, not the directory
            why = (
                f"its directory {repo.parent} is not writable (Operation not permitted; a "
                "writer creates qc.sqlite-wal and qc.sqlite-shm there)"
            )
        else:  # the whole file system is read-only
            why = "the file is not writable (Read-only file system)"
        assert store.stderr == (
            f"evflow: error: QC repository {repo} cannot be opened read-write: {why}\n"
        )
        device = evflow(
            prefix, "device", "qc-repository", "--id", "r", "--repo", str(repo), "--session",
            f"ro-{how}", "--channel-config", "name=qc-in,type=pull,method=bind,address=ipc://r",
        )  # fmt: skip
        assert device.returncode == 1
        assert device.stderr.splitlines()[-1] == (
            f"evflow: error: device 'r': OutputError: QC repository {repo} cannot be opened "
            f"read-write: {why}"
        )
        if how == "chattr":  # (the mount exists inside the commands only)
            with pytest.raises(OutputError, match="cannot be opened read-write: its directory"):
                Repository(repo)
        assert beside(repo) == ["qc.sqlite"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["det.root"]
    assert os.listdir(repo.parent) == ["qc.sqlite"]

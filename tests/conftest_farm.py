"""Fixtures for several real hosts (namespaces + sshd) and a real Slurm cluster.

Imported by ``conftest.py``. Session-scoped: the hosts start once (about 1 s) and are
torn down at the end of the session, also when tests fail. The function-scoped
fixtures hand the same farm to each test and afterwards undo ``kill_host`` /
``cut_link`` and fail the test if it left processes on any host.

- ``farm``: a :class:`farm_hosts.NamespaceFarm` with 3 hosts h1..h3 running sshd.
- ``slurm``: a :class:`farm_slurm.SlurmCluster` on those hosts (nodes h1..h3).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from farm_hosts import NamespaceFarm, missing_for_farm
from farm_slurm import SlurmCluster, missing_for_slurm

FARM_HOSTS = 3


@pytest.fixture(scope="session")
def farm_session() -> Iterator[NamespaceFarm]:
    reason = missing_for_farm()
    if reason:
        pytest.skip(f"namespace hosts unavailable: {reason}")
    with NamespaceFarm(FARM_HOSTS) as farm:
        yield farm


@pytest.fixture(scope="session")
def slurm_session(farm_session: NamespaceFarm) -> Iterator[SlurmCluster]:
    reason = missing_for_slurm()
    if reason:
        pytest.skip(f"Slurm unavailable: {reason}")
    with SlurmCluster(farm_session) as cluster:
        yield cluster


def _check_hosts_clean(farm: NamespaceFarm) -> None:
    left = {name: farm.leftovers(name) for name in farm.hosts}
    left = {name: procs for name, procs in left.items() if procs}
    if left:
        for name in left:
            farm.kill_host(name, include_daemons=False)
        pytest.fail(f"processes outlived the test on farm hosts: {left}")


@pytest.fixture
def farm(farm_session: NamespaceFarm) -> Iterator[NamespaceFarm]:
    """The session's hosts; after the test: revived, and checked for leftovers."""
    yield farm_session
    farm_session.revive()
    _check_hosts_clean(farm_session)


@pytest.fixture
def slurm(slurm_session: SlurmCluster, farm: NamespaceFarm) -> Iterator[SlurmCluster]:
    """The session's Slurm cluster (``farm`` checks the hosts after the test)."""
    yield slurm_session
    slurm_session.cancel_all()

"""The Slurm launcher on a real Slurm cluster (munge, slurmctld, one slurmd per
namespace host): srun places the command on the named node, and terminate, controller
SIGKILL and scancel leave nothing on it; a missing or busy node is one clear error."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys

import psutil
import pytest

from _wait import poll_until, wait_until
from evflow.errors import ConfigurationError
from evflow.topology.launch import get_launcher
from evflow.topology.launch.slurm import BatchJob, SlurmLauncher
from evflow.transport.hosts import HostSpec
from farm_hosts import NamespaceFarm, probe_argv, probe_env, read_json_line
from farm_slurm import SlurmCluster

pytestmark = [pytest.mark.netns, pytest.mark.slurm]


def _jobs() -> str:
    """The jobs Slurm has (queued or running), one ``ID STATE`` a line; "" when none."""
    return subprocess.run(
        ["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True
    ).stdout.strip()


def _no_jobs(timeout_s: float = 60) -> str:
    """What Slurm still has once its queue is empty (nothing) or ``timeout_s`` passed
    (a cancelled job takes a moment to leave the queue)."""
    poll_until(lambda: not _jobs(), timeout_s, interval_s=0.1)
    return _jobs()


def _job_state(job: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True
    ).stdout.strip()


def _block(node: str) -> str:
    """Submit a job that takes every CPU of ``node``; return its id once it runs.

    It runs for longer than any test waits: a launcher that waited for the node to be
    free would still be waiting when the test's own time-out fails it."""
    out = subprocess.run(
        ["sbatch", "--parsable", "--exclusive", f"--nodelist={node}", "--output=/dev/null",
         "--wrap=sleep 600"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    job = out.stdout.strip()
    wait_until(lambda: _job_state(job) == "RUNNING", 60, f"the blocking job {job} to run")
    return job


def test_get_launcher_finds_slurm() -> None:
    assert isinstance(get_launcher("slurm"), SlurmLauncher)


def test_srun_runs_the_command_on_each_node(farm: NamespaceFarm, slurm: SlurmCluster) -> None:
    handles = {
        name: SlurmLauncher().start_command(
            spec, probe_argv(), probe_env(PROBE_MARKER=name), capture_stdout=True
        )
        for name, spec in farm.host_specs().items()
    }
    try:
        for name, handle in handles.items():
            report = read_json_line(handle.stdout)
            assert report["netns"] == farm.hosts[name].netns_inode()
            assert farm.hosts[name].address in report["addresses"]
            assert report["marker"] == name
            assert report["pid"] == handle.remote_pid
    finally:
        for handle in handles.values():
            handle.terminate(1.0)
    for name, handle in handles.items():
        assert handle.poll() is not None
        assert farm.leftovers(name) == []
    assert _no_jobs() == ""


def test_srun_terminate_ends_escaping_descendants(farm: NamespaceFarm, slurm: SlurmCluster) -> None:
    handle = SlurmLauncher().start_command(
        farm.host_specs()["h2"], probe_argv(sys.executable, "--children", "3"), probe_env(),
        capture_stdout=True,
    )  # fmt: skip
    try:
        read_json_line(handle.stdout)
        assert len(farm.leftovers("h2", timeout_s=0)) >= 5
    finally:
        handle.terminate(0.3)
    assert farm.leftovers("h2") == []
    assert _no_jobs() == ""


def test_controller_sigkill_ends_the_job(farm: NamespaceFarm, slurm: SlurmCluster) -> None:
    script = (
        "import sys, time\n"
        "from farm_hosts import probe_argv, probe_env\n"
        "from evflow.transport.hosts import HostSpec\n"
        "from evflow.topology.launch.slurm import SlurmLauncher\n"
        "h = SlurmLauncher().start_command(HostSpec(name='h3'),\n"
        "    probe_argv(sys.executable, '--children', '2'), probe_env())\n"
        "print(h.remote_pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    controller = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, env={**os.environ, **probe_env()}
    )
    try:
        remote_pid = int(controller.stdout.readline())  # type: ignore[union-attr]
        assert remote_pid in farm.pids("h3")
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait()
        controller.stdout.close()  # type: ignore[union-attr]
    assert farm.leftovers("h3") == []
    assert _no_jobs() == ""


def test_unknown_node_is_one_error(farm: NamespaceFarm, slurm: SlurmCluster) -> None:
    spec = dataclasses.replace(farm.host_specs()["h1"], slurm="nosuchnode")
    with pytest.raises(ConfigurationError) as err:  # (a hang: the test's time-out fails it)
        SlurmLauncher().start_command(spec, probe_argv(), probe_env())
    assert "'nosuchnode'" in str(err.value) and "Invalid node name" in str(err.value)
    assert "'h1'" in str(err.value)


def test_busy_node_is_one_error_not_a_hang(farm: NamespaceFarm, slurm: SlurmCluster) -> None:
    """Every CPU of h1 is taken by another job: srun --immediate gives up and says so."""
    job = _block("h1")
    try:
        with pytest.raises(ConfigurationError) as err:
            SlurmLauncher(immediate_s=1).start_command(
                farm.host_specs()["h1"], probe_argv(), probe_env()
            )
        assert "no free Slurm node 'h1'" in str(err.value), str(err.value)
        assert _job_state(job) == "RUNNING"  # it gave up while the node was busy
    finally:
        subprocess.run(["scancel", job], check=False)
    assert _no_jobs() == ""


def _probes(farm: NamespaceFarm, host: str) -> int:
    """Processes on ``host`` running the probe (the guard forks it: its command line
    is the guard's, the probe's argv included)."""
    count = 0
    for pid in farm.pids(host):
        with contextlib.suppress(psutil.NoSuchProcess):
            count += "_farm_probe" in " ".join(psutil.Process(pid).cmdline())
    return count


def test_sbatch_detached_run_and_scancel(farm: NamespaceFarm, slurm: SlurmCluster) -> None:
    launcher = SlurmLauncher(detached=True)
    job = launcher.start_command(farm.host_specs()["h2"], probe_argv(sys.executable,
                                 "--children", "2"), probe_env())  # fmt: skip
    assert isinstance(job, BatchJob)
    try:
        # the probe and its 2 escaped descendants
        wait_until(lambda: _probes(farm, "h2") >= 3, 60, f"job {job.job_id} to run")
        assert job.poll() is None
    finally:
        job.terminate(0.5)
    assert job.poll() is not None
    assert farm.leftovers("h2") == []


def test_sbatch_exit_code_reaches_poll(farm: NamespaceFarm, slurm: SlurmCluster) -> None:
    job = SlurmLauncher(detached=True).start_command(
        farm.host_specs()["h3"], probe_argv(sys.executable, "--exit", "3"), probe_env()
    )
    wait_until(lambda: job.poll() is not None, 60, f"job {job.job_id} to end", interval_s=0.2)
    assert job.poll() == 3


def test_sbatch_on_a_busy_node_is_one_error(farm: NamespaceFarm, slurm: SlurmCluster) -> None:
    """sbatch has no --immediate: a job still pending after immediate_s is cancelled and
    reported with Slurm's reason."""
    job = _block("h1")
    try:
        with pytest.raises(ConfigurationError) as err:
            SlurmLauncher(detached=True, immediate_s=1).start_command(
                HostSpec(name="h1"), ["/bin/sleep", "60"]
            )
        assert "no free Slurm node 'h1'" in str(err.value), str(err.value)
        assert "still pending" in str(err.value)
        assert _job_state(job) == "RUNNING"  # it gave up while the node was busy
    finally:
        subprocess.run(["scancel", job], check=False)
    assert _no_jobs() == ""

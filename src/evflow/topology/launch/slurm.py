"""The Slurm launcher: one agent per node with ``srun``, or a detached one with ``sbatch``.

Slurm allocates; we only start agents. A host's node is ``HostSpec.slurm_node`` (its
``slurm`` key, else its name). Attached (the default)::

    srun --nodelist=NODE -N1 -n1 --immediate=S --job-name=evflow-HOST \\
        <python> -m evflow.topology.launch._guard -- <python> -m evflow agent ...

srun forwards its stdin to the task and the environment (``--export=ALL``), so the
guard (see ``_guard``) ends the agent's process tree when the controller ends the
launch or dies. ``--immediate`` makes a Slurm without a free node say so within S
seconds instead of queueing for ever. Detached (``SlurmLauncher(detached=True)``):
``sbatch --parsable ... --wrap '<guard --detached> ...'``; the job outlives the
controller and ends with ``scancel``.

The Slurm clients find their cluster as usual (``SLURM_CONF``, ``/etc/slurm``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

from evflow.errors import ConfigurationError
from evflow.topology.launch._process import GuardedProcess, guarded
from evflow.transport.hosts import HostSpec

#: seconds srun/sbatch wait for the node before giving up (--immediate)
IMMEDIATE_S = 5
#: the task must report it started within this after the allocation
START_TIMEOUT_S = 30.0
_CLIENT_TIMEOUT_S = 20.0
_ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING"}
_NO_NODE = ("busy", "not available", "Unable to allocate", "still pending")


def _slurm_error(host: HostSpec, tool: str, line: str, immediate_s: int) -> ConfigurationError:
    node = host.slurm_node
    if "Invalid node name" in line:
        hint = f'Slurm has no node {node!r}; set slurm = "NODE" for host {host.name!r}'
    elif any(s in line for s in _NO_NODE):
        hint = f"no free Slurm node {node!r} within {immediate_s} s (--immediate); try later"
    else:
        hint = "is the Slurm cluster up (sinfo)?"
    return ConfigurationError(
        f"host {host.name!r}: {tool} on node {node!r} failed: {line} ({hint})"
    )


class SlurmLauncher:
    name = "slurm"

    def __init__(
        self,
        detached: bool = False,
        immediate_s: int = IMMEDIATE_S,
        partition: str | None = None,
        output: str = "/dev/null",
    ) -> None:
        self.detached = detached
        self.immediate_s = immediate_s
        self.partition = partition
        #: sbatch's --output (the detached agent's stdout and stderr)
        self.output = output

    def _placement(self, host: HostSpec) -> list[str]:
        argv = [
            f"--nodelist={host.slurm_node}",
            "--nodes=1",
            "--ntasks=1",
            f"--job-name=evflow-{host.name}",
        ]
        if self.partition:
            argv.append(f"--partition={self.partition}")
        return argv

    def start_command(
        self,
        host: HostSpec,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        capture_stdout: bool = False,
    ) -> GuardedProcess | BatchJob:
        """Run ``argv`` on the host's node; return once it started there (srun) or was
        accepted (sbatch). A Slurm without that node, or without a free one, is one
        ConfigurationError with srun's/sbatch's own line."""
        if self.detached:
            return self.submit_command(host, argv, env)
        client_env = {**os.environ, **(env or {})}
        handle = GuardedProcess(
            host,
            [
                "srun",
                *self._placement(host),
                f"--immediate={self.immediate_s}",
                "--quiet",
                *guarded(host.python, argv, None),
            ],
            what="srun",
            capture_stdout=capture_stdout,
            env=client_env,
        )

        def failure(code: int | None, line: str) -> ConfigurationError:
            if code is None:
                return _slurm_error(host, "srun", line, self.immediate_s)
            if line.startswith("srun:") or line.startswith("error:"):
                return _slurm_error(host, "srun", line, self.immediate_s)
            return ConfigurationError(
                f"host {host.name!r}: {argv[0]!r} ended at once (exit {code}) on Slurm node "
                f"{host.slurm_node!r}: {line}"
            )

        handle.wait_started(START_TIMEOUT_S + self.immediate_s, failure)
        return handle

    def submit_command(
        self, host: HostSpec, argv: list[str], env: dict[str, str] | None = None
    ) -> BatchJob:
        """``sbatch`` a detached run of ``argv`` on the host's node; return once it runs.

        sbatch has no ``--immediate``: a job still pending after ``immediate_s`` is
        cancelled and reported with Slurm's reason (no free node)."""
        wrap = shlex.join(guarded(host.python, argv, None, detached=True))
        cmd = ["sbatch", "--parsable", *self._placement(host), f"--output={self.output}",
               f"--wrap={wrap}"]  # fmt: skip
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=_CLIENT_TIMEOUT_S + self.immediate_s,
            check=False,
        )
        if out.returncode != 0:
            lines = [ln for ln in out.stderr.splitlines() if ln.strip()] or ["(no output)"]
            raise _slurm_error(host, "sbatch", lines[-1].strip(), self.immediate_s)
        job = BatchJob(host, out.stdout.strip().split(";")[0], self.output)
        deadline = time.monotonic() + self.immediate_s
        while job.state() == "PENDING":
            if time.monotonic() > deadline:
                reason = _query(["squeue", "-h", "-j", job.job_id, "-o", "%r"]).strip()
                _query(["scancel", job.job_id])
                raise _slurm_error(
                    host, "sbatch", f"job {job.job_id} still pending: {reason} (cancelled)",
                    self.immediate_s,
                )  # fmt: skip
            time.sleep(0.1)
        return job

    def start_agent(
        self, host: HostSpec, agent_args: list[str], env: dict[str, str] | None = None
    ) -> GuardedProcess | BatchJob:
        return self.start_command(host, [host.python, "-m", "evflow", "agent", *agent_args], env)


class BatchJob:
    """An AgentHandle for an sbatch job: Slurm's own job state, scancel to end it."""

    def __init__(self, host: HostSpec, job_id: str, output: str) -> None:
        self.host = host
        self.job_id = job_id
        self.output = output
        self._code: int | None = None

    def __repr__(self) -> str:
        return f"<sbatch job {self.job_id} on {self.host.name}>"

    def state(self) -> str:
        """Slurm's state of the job (RUNNING, COMPLETED, ...; '' once Slurm forgot it)."""
        out = _query(["scontrol", "show", "job", "-o", self.job_id])
        m = re.search(r"JobState=(\S+)", out)
        return m.group(1) if m else ""

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        out = _query(["scontrol", "show", "job", "-o", self.job_id])
        m = re.search(r"JobState=(\S+)", out)
        if m and m.group(1) in _ACTIVE:
            return None
        code = re.search(r"ExitCode=(\d+):(\d+)", out)
        if code is None:
            self._code = 1  # Slurm no longer knows the job: it ended long ago
        else:
            status, sig = int(code.group(1)), int(code.group(2))
            self._code = 128 + sig if sig else status
        return self._code

    def terminate(self, grace_s: float = 2.0) -> None:
        """SIGTERM through Slurm (the guard ends the tree), then scancel for good."""
        if self.poll() is not None:
            return
        _query(["scancel", "--signal=TERM", "--full", self.job_id])
        deadline = time.monotonic() + grace_s + 3.0
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.poll() is None:
            _query(["scancel", self.job_id])
            deadline = time.monotonic() + 10.0
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)

    def error_output(self) -> str:
        if self.output == "/dev/null":
            return ""
        try:
            lines = Path(self.output).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-20:])


def _query(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=_CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return ""
    return out.stdout


LAUNCHER = SlurmLauncher()

"""A real Slurm cluster on the namespace hosts of a :class:`farm_hosts.NamespaceFarm`.

munged and slurmctld run in the root namespace (slurmctld on the bridge address), one
slurmd per host, entered with ``nsenter --net`` (not ``ip netns exec``, which hides
/sys/fs/cgroup); ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``
(the cgroup plugins fail here). Node names are the farm's host names. Private config,
state, spool, munge key and socket live in the farm's work directory; daemons are
killed by pid in ``close()``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from farm_hosts import NamespaceFarm, NsHost, alive, kill_pids, read_pid, run, wait_gone, wait_port


def missing_for_slurm() -> str | None:
    """Why this machine cannot run a Slurm cluster (None if it can)."""
    for tool in ("munged", "slurmctld", "slurmd", "srun", "sbatch", "squeue", "scontrol"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"needs {tool!r} (Debian's slurm-wlm and munge)"
    return None


class SlurmCluster:
    """munged + slurmctld (root namespace, on the bridge) + one slurmd per farm host.

    Node names are the farm's host names; ``env`` holds ``SLURM_CONF`` for the clients
    (srun, sbatch, squeue), which is also exported while the cluster runs.
    """

    def __init__(self, farm: NamespaceFarm) -> None:
        self.farm = farm
        self.dir = farm.workdir / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.sock"
        self.pids: dict[str, int] = {}
        self.env = {"SLURM_CONF": str(self.conf)}
        self._old_conf: str | None = None

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(parents=True, mode=0o755)
        (self.dir / "state").mkdir(mode=0o700)
        (self.dir / "spool").mkdir(mode=0o700)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        run("munged", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--log-file={munge_dir / 'munged.log'}", f"--pid-file={munge_dir / 'munged.pid'}",
             f"--seed-file={munge_dir / 'seed'}")  # fmt: skip
        self.pids["munged"] = read_pid(munge_dir / "munged.pid")
        ctld_port = _free_port(self.farm.controller_address)
        self.conf.write_text(self._config(ctld_port, _free_port(self.farm.controller_address)))
        self._old_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(self.conf)
        run("slurmctld", "-f", str(self.conf))
        self.pids["slurmctld"] = read_pid(self.dir / "slurmctld.pid")
        wait_port(self.farm.controller_address, ctld_port)
        for host in self.farm.hosts.values():
            self._start_slurmd(host)
        self.farm.revive_hooks.append(self._revive)
        self.wait_idle()

    def _config(self, ctld_port: int, slurmd_port: int) -> str:
        d = self.dir
        nodes = "\n".join(
            f"NodeName={h.name} NodeAddr={h.address} CPUs=4 State=UNKNOWN"
            for h in self.farm.hosts.values()
        )
        names = ",".join(self.farm.hosts)
        short = socket.gethostname().split(".")[0]
        return f"""\
ClusterName=evf{self.farm.tag}
SlurmctldHost={short}({self.farm.controller_address})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}/%n
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d / "slurmctld.log"}
SlurmdLogFile={d}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
KillWait=2
MinJobAge=300
PlugStackConfig=/dev/null
{nodes}
PartitionName=farm Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""

    def _start_slurmd(self, host: NsHost) -> None:
        pidfile = self.dir / f"slurmd.{host.name}.pid"
        pidfile.unlink(missing_ok=True)
        run("nsenter", f"--net={host.netns_path}", "slurmd", "-f", str(self.conf), "-N", host.name)
        host.daemons["slurmd"] = read_pid(pidfile)

    def _revive(self, host: NsHost) -> None:
        if not alive(host.daemons.get("slurmd", -1)):
            self._start_slurmd(host)
            run("scontrol", "update", f"nodename={host.name}", "state=resume", check=False)
            self.wait_idle()

    def node_states(self) -> dict[str, str]:
        out = run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.node_states()
            if states and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle within {timeout_s} s: {states}")
            time.sleep(0.1)

    def cancel_all(self) -> None:
        """Cancel every job of this cluster and wait until none is left."""
        run("scancel", "--full", "-u", "root", check=False, timeout_s=5)
        deadline = time.monotonic() + 30
        while run("squeue", "-h", "-o", "%i", check=False, timeout_s=5).strip():
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cancel_all()
        for host in self.farm.hosts.values():
            pid = host.daemons.pop("slurmd", None)
            if pid is not None:
                kill_pids([pid])
        for name in ("slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is not None:
                kill_pids([pid], signal.SIGTERM)
                if wait_gone([pid], 3):
                    kill_pids([pid])
        if self._revive in self.farm.revive_hooks:
            self.farm.revive_hooks.remove(self._revive)
        if self._old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._old_conf
        shutil.rmtree(self.dir, ignore_errors=True)


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":  # manual check: python tests/farm_slurm.py
    with NamespaceFarm(2) as farm, SlurmCluster(farm) as slurm:
        print(farm.hosts_toml(), slurm.node_states(), file=sys.stderr)
        print(farm.ssh("h1", "readlink /proc/self/ns/net").stdout, farm.hosts["h1"].netns_inode())

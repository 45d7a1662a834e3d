"""Several real hosts on one machine: network namespaces on a bridge, sshd, Slurm.

``NamespaceFarm`` creates N namespaces ``evf<pid>-h1..hN``, each with a veth into a
bridge in the root namespace (hosts ``10.201.X.1..N/24``; the root namespace, where
the controller runs, is ``10.201.X.254``; X is picked free so concurrent sessions do
not collide), and runs Debian's sshd in each with a private config and keys generated
here. ``SlurmCluster`` adds munge, slurmctld (root namespace) and one slurmd per host
(entered with ``nsenter --net``: RECIPES). Everything is torn down by pid and name in
``close()``, which is safe to call after any failure; a later start also removes what a
dead session (its pid is in the names) left behind.

Daemons fork into the background (reparented to init), so they are never children of
the test process and the per-test leftover check does not see them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from evflow.transport.hosts import HostSpec

NS_PREFIX = "evf"
_NAME_RE = re.compile(rf"^{NS_PREFIX}(\d+)-h\d+$")
_BRIDGE_RE = re.compile(rf"^{NS_PREFIX}b(\d+)$")
CONTROLLER_HOST = 254


def missing_for_farm() -> str | None:
    """Why this machine cannot run namespace hosts with sshd (None if it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    for tool in ("ip", "nsenter", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} (iproute2 / util-linux / openssh-client)"
    if not Path("/usr/sbin/sshd").exists():
        return "needs Debian's openssh-server (/usr/sbin/sshd)"
    return None


def run(*argv: str, check: bool = True, timeout_s: float = 20) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and not zombie(p)]
        if alive:
            time.sleep(0.02)
    return alive


def alive(pid: int) -> bool:
    """Running (a killed daemon stays a zombie until init reaps it)."""
    return pid > 0 and psutil.pid_exists(pid) and not zombie(pid)


def zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def read_pid(path: Path, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            pid = int(path.read_text().split()[0])  # may be half written
            if psutil.pid_exists(pid):
                return pid
        time.sleep(0.02)
    raise RuntimeError(f"daemon did not write its pid file {path} within {timeout_s} s")


def wait_port(address: str, port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((address, port), timeout=0.5).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {address}:{port}: {exc}") from None
            time.sleep(0.02)


def remove_dead_sessions() -> None:
    """Namespaces and bridges of earlier sessions whose process is gone."""
    for line in run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME_RE.match(name)
        if m and not psutil.pid_exists(int(m.group(1))):
            kill_pids(_netns_pids(name))
            run("ip", "netns", "del", name, check=False)
    # daemons of the root namespace (slurmctld, munged) and the work directory
    for workdir in Path(tempfile.gettempdir()).glob("evflow-farm-*-*"):
        m = re.match(r"evflow-farm-(\d+)-", workdir.name)
        if m and not psutil.pid_exists(int(m.group(1))):
            for pidfile in workdir.rglob("*.pid"):
                with contextlib.suppress(ValueError, IndexError, OSError):
                    kill_pids([int(pidfile.read_text().split()[0])])
            shutil.rmtree(workdir, ignore_errors=True)
    for line in run("ip", "-o", "link", "show", "type", "bridge", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        m = _BRIDGE_RE.match(name)
        if m and not psutil.pid_exists(int(m.group(1))):
            run("ip", "link", "del", name, check=False)


def _free_subnet() -> int:
    used = set(re.findall(r"inet 10\.201\.(\d+)\.", run("ip", "-4", "-o", "addr", check=False)))
    start = os.getpid() % 200
    for i in range(250):
        x = (start + i) % 250 + 1
        if str(x) not in used:
            return x
    raise RuntimeError("no free 10.201.X.0/24 subnet")


@dataclass
class NsHost:
    """One namespace host. ``daemons`` maps daemon name (sshd, slurmd) to its pid."""

    name: str
    netns: str
    address: str
    veth: str
    daemons: dict[str, int] = field(default_factory=dict)

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    def netns_inode(self) -> int:
        return os.stat(self.netns_path).st_ino


class NamespaceFarm:
    """N namespace hosts with sshd; see the module docstring. Use as a context manager."""

    def __init__(self, n_hosts: int = 3) -> None:
        tag = os.getpid()
        self.tag = tag
        self.workdir = Path(tempfile.mkdtemp(prefix=f"evflow-farm-{tag}-"))
        self.bridge = f"{NS_PREFIX}b{tag}"
        self.subnet = _free_subnet()
        self.controller_address = f"10.201.{self.subnet}.{CONTROLLER_HOST}"
        self.hosts: dict[str, NsHost] = {}
        for i in range(1, n_hosts + 1):
            name = f"h{i}"
            self.hosts[name] = NsHost(
                name=name,
                netns=f"{NS_PREFIX}{tag}-{name}",
                address=f"10.201.{self.subnet}.{i}",
                veth=f"{NS_PREFIX}{tag}{name}",
            )
        self.ssh_key = self.workdir / "id_ed25519"
        self.ssh_config = self.workdir / "ssh_config"
        #: called with a host name after revive() restarted sshd (Slurm restarts slurmd)
        self.revive_hooks: list[Callable[[NsHost], None]] = []
        self._cut: set[str] = set()
        self._killed: set[str] = set()

    # --- set-up ------------------------------------------------------------------------
    def __enter__(self) -> NamespaceFarm:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        remove_dead_sessions()
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for host in self.hosts.values():
            run("ip", "netns", "add", host.netns)
            run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
                 "netns", host.netns)  # fmt: skip
            run("ip", "link", "set", host.veth, "master", self.bridge, "up")
            run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            run("ip", "-n", host.netns, "link", "set", "eth0", "up")
            run("ip", "-n", host.netns, "link", "set", "lo", "up")
        self._make_keys()
        for host in self.hosts.values():
            self._start_sshd(host)

    def _make_keys(self) -> None:
        for key in ("host_ed25519", "id_ed25519"):
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.workdir / key))
        shutil.copy(self.workdir / "id_ed25519.pub", self.workdir / "authorized_keys")
        self.ssh_config.write_text(
            "Host *\n"
            f"  IdentityFile {self.ssh_key}\n"
            "  IdentitiesOnly yes\n"
            "  BatchMode yes\n"
            "  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n"
        )

    def _start_sshd(self, host: NsHost) -> None:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation dir
        d = self.workdir
        cfg = d / f"sshd_{host.name}.conf"
        pidfile = d / f"sshd_{host.name}.pid"
        pidfile.unlink(missing_ok=True)
        cfg.write_text(
            f"ListenAddress {host.address}:22\n"
            f"HostKey {d / 'host_ed25519'}\n"
            f"PidFile {pidfile}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PubkeyAuthentication yes\n"
            "PermitRootLogin prohibit-password\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "PrintMotd no\n"
            "MaxStartups 200\n"
            "MaxSessions 200\n"
            # meant to drop a vanished client (cut link) within ~3 s; but a session
            # whose remote command keeps writing survived an 8 s cut in
            # test_topology_farm_faults.py: do not count on it
            "ClientAliveInterval 1\n"
            "ClientAliveCountMax 3\n"
        )
        run("ip", "netns", "exec", host.netns, "/usr/sbin/sshd", "-f", str(cfg),
             "-E", str(d / f"sshd_{host.name}.log"))  # fmt: skip
        host.daemons["sshd"] = read_pid(pidfile)
        wait_port(host.address, 22)

    # --- what tests use ----------------------------------------------------------------
    def host_specs(self) -> dict[str, HostSpec]:
        """HostSpecs (address, ssh destination, Slurm node name = host name)."""
        return {
            h.name: HostSpec(name=h.name, address=h.address, ssh=f"root@{h.address}")
            for h in self.hosts.values()
        }

    def hosts_toml(self) -> str:
        lines = ["[hosts]"]
        for h in self.hosts.values():
            lines.append(f'{h.name} = {{ address = "{h.address}", ssh = "root@{h.address}" }}')
        return "\n".join(lines) + "\n"

    def write_hosts_file(self, path: Path) -> Path:
        path.write_text(self.hosts_toml())
        return path

    def ssh_env(self) -> dict[str, str]:
        """Environment that makes the ssh launcher use this farm's key and options."""
        return {"EVFLOW_SSH_CONFIG": str(self.ssh_config)}

    def ssh(
        self, name: str, command: str, timeout_s: float = 20
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on host ``name`` with the system ssh client and this farm's key."""
        dest = f"root@{self.hosts[name].address}"
        return subprocess.run(
            ["ssh", "-F", str(self.ssh_config), dest, command],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )

    def popen(self, name: str, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` in host ``name``'s network namespace directly (no ssh): a child
        of the test, which must end it (the per-test leftover checks see it)."""
        enter = ["nsenter", f"--net={self.hosts[name].netns_path}"]
        return subprocess.Popen([*enter, *argv], **kwargs)  # type: ignore[call-overload,no-any-return]

    def pids(self, name: str) -> list[int]:
        """Every process in host ``name``'s network namespace."""
        return _netns_pids(self.hosts[name].netns)

    def daemon_pids(self, name: str) -> set[int]:
        return set(self.hosts[name].daemons.values())

    def leftovers(self, name: str, timeout_s: float = 30.0) -> list[str]:
        """Processes on ``name`` other than its daemons, after waiting up to ``timeout_s``
        for them to end (sshd's per-connection processes and slurmstepd take a moment)."""
        deadline = time.monotonic() + timeout_s
        while True:
            daemons = self.daemon_pids(name)
            rest = [p for p in self.pids(name) if p not in daemons and not zombie(p)]
            if not rest or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        out = []
        for pid in rest:
            with contextlib.suppress(psutil.NoSuchProcess):
                out.append(f"{pid}:{' '.join(psutil.Process(pid).cmdline())[:100]}")
        return out

    def kill_host(self, name: str, include_daemons: bool = True) -> list[int]:
        """SIGKILL every process of host ``name`` (its daemons too unless told not to):
        the host is lost. ``revive()`` restarts its daemons."""
        keep = set() if include_daemons else self.daemon_pids(name)
        victims = [p for p in self.pids(name) if p not in keep]
        # all frozen first, then killed: a host dies at once. Killed one by one, a
        # device whose agent went first got its PDEATHSIG (SIGTERM) and sent END
        # before its own SIGKILL, which a dead host never does
        kill_pids(victims, signal.SIGSTOP)
        kill_pids(victims)
        if include_daemons:
            self._killed.add(name)
        return victims

    def cut_link(self, name: str) -> None:
        """Take host ``name`` off the network (its bridge port goes down)."""
        run("ip", "link", "set", self.hosts[name].veth, "down")
        self._cut.add(name)

    def restore_link(self, name: str) -> None:
        run("ip", "link", "set", self.hosts[name].veth, "up")
        self._cut.discard(name)

    def revive(self) -> None:
        """Undo kill_host/cut_link: links up, daemons restarted where they died."""
        for name in list(self._cut):
            self.restore_link(name)
        for name in list(self._killed):
            host = self.hosts[name]
            kill_pids(self.pids(name))
            wait_gone(self.pids(name), 5)
            if not alive(host.daemons.get("sshd", -1)):
                self._start_sshd(host)
            for hook in self.revive_hooks:
                hook(host)
            self._killed.discard(name)

    # --- teardown ----------------------------------------------------------------------
    def close(self) -> None:
        """Kill everything in the namespaces, delete them and the bridge, remove files."""
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                pids = _netns_pids(host.netns)
                kill_pids(pids)
                wait_gone(pids, 5)
            run("ip", "netns", "del", host.netns, check=False)
        run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)


# --- a stand-in for the agent (tests/_farm_probe.py) ------------------------------------
TESTS_DIR = Path(__file__).parent


def probe_argv(python: str = sys.executable, *args: str) -> list[str]:
    """argv running the probe with ``python`` (the launcher's env must carry probe_env())."""
    return [python, "-m", "_farm_probe", *args]


def probe_env(**extra: str) -> dict[str, str]:
    """PYTHONPATH for the probe (and this tree's evflow), plus ``extra``."""
    paths = [str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths), **extra}


def read_json_line(stream: object, timeout_s: float = 60) -> dict[str, object]:
    """The next line of ``stream`` (a pipe) as JSON, bounded by ``timeout_s``."""
    import json
    import select

    fd = stream.fileno()  # type: ignore[attr-defined]
    buf = b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no line within {timeout_s} s (got {buf!r})")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"stream ended before a line (got {buf!r})")
            buf += chunk
    return dict(json.loads(buf.split(b"\n", 1)[0]))

"""Start-up of a topology: time from ``evflow up`` to every device RUNNING.

Run: python benchmarks/bench_topology.py [--devices 16,64,256] [--hosts 1] [--repeat 3]
     python benchmarks/bench_topology.py --farm [--devices 16,64,256] [--repeat 2]   (root)
     python benchmarks/bench_topology.py --farm --quick     (256 devices, once each: < 1 min)
     ... --against DIR   (each run also with DIR/src on PYTHONPATH, alternated: A/B)

For N devices: N-2 samplers (1 message/s, 100 B) -> one merger -> one sink, all with
the local launcher; with ``--hosts K`` the samplers spread round robin over K local
agents (hosts h1..hK at 127.0.0.1; merger and sink on h1). Two figures per run:

- ``wall``: from starting the ``evflow up`` process to its "devices RUNNING" line
  (interpreter start and imports included: what a user waits for);
- ``controller``: what the controller itself measured (its own start to the last
  RUNNING state), and the laps it logs at debug level (agents up, spawned, each step);
- ``cpu``: CPU-seconds that every process of the run had used at that moment (the
  controller and its children, and with ``--farm`` every process in the namespace
  hosts but their sshd daemons: ssh sessions, guards, agents, zygotes, devices; the
  remote shells that ended are counted through their parents). On the shared 2-core
  machine this is the steadier figure: the wall time follows the other users' load.

With ``--farm`` the hosts are 3 network namespaces running sshd (``tests/farm_hosts.py``,
root needed) and agents start over ssh; each size runs twice side by side: plaintext
(``--insecure``) and with CURVE keys (``--keys``, every tcp socket and the bus CURVE;
binders then bind tcp only, so same-host peers use tcp too).

Each run is stopped with Ctrl-C afterwards (orderly shutdown); the stop time is shown
too. The goal: 256 devices RUNNING within 3 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LAP = re.compile(r"start-up: (.*) after ([0-9.]+) s")


def cpu_s(pids: list[int]) -> float:
    """CPU-seconds of these processes (every thread, ns-precise from schedstat) and of
    their children that ended and were waited for."""
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, psutil.NoSuchProcess):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0]) / 1e9
            times = psutil.Process(pid).cpu_times()
            total += times.children_user + times.children_system
    return total


def tree(pid: int) -> list[int]:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    return []


def topology(n: int, hosts: int) -> str:
    placement = ", ".join(f'"h{i + 1}"' for i in range(hosts))
    where = f"hosts = [{placement}]\n" if hosts > 1 else ""
    pin = 'hosts = ["h1"]\n' if hosts > 1 else ""
    return f"""name = "bench"
[devices.sampler]
class = "sampler"
instances = {n - 2}
{where}rate = 1.0
params = {{ msg_size = 100 }}
channels = [{{ name = "data", type = "dealer", connect = "merger.data-in" }}]
[devices.merger]
class = "merger"
{pin}channels = [
  {{ name = "data-in", type = "router", bind = true }},
  {{ name = "data-out", type = "dealer", connect = "sink.data" }},
]
[devices.sink]
class = "sink"
{pin}channels = [{{ name = "data", type = "router", bind = true }}]
"""


def run_once(
    workdir: Path,
    n: int,
    hosts: int,
    farm_args: list[str] | None = None,
    src: str | None = None,
    remote_pids: Any = None,
) -> dict[str, float]:
    """One ``evflow up``; ``remote_pids()`` lists the processes of the run outside the
    controller's tree (the namespace hosts')."""
    topo = workdir / f"bench{n}.toml"
    topo.write_text(topology(n, hosts))
    argv = [sys.executable, "-m", "evflow", "up", str(topo), "--quiet", "--severity", "debug"]
    if farm_args is not None:
        argv += farm_args
    elif hosts > 1:
        hosts_file = workdir / "hosts.toml"
        hosts_file.write_text(
            "[hosts]\n" + "".join(f'h{i + 1} = {{ address = "127.0.0.1" }}\n' for i in range(hosts))
        )
        argv += ["--hosts", str(hosts_file)]
    start = time.perf_counter()
    env = dict(os.environ)
    if src is not None:  # another source tree (A/B against an older commit)
        env["PYTHONPATH"] = src
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    assert proc.stderr is not None
    laps: dict[str, float] = {}
    tail: list[str] = []
    buf = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.5)
        if not ready:
            continue
        chunk = os.read(proc.stderr.fileno(), 65536)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            if "error" in line.lower():
                tail.append(line)
            if m := LAP.search(line):
                laps[m.group(1)] = float(m.group(2))
            if "devices RUNNING on" in line:
                laps["wall"] = time.perf_counter() - start
                pids = tree(proc.pid) + (remote_pids() if remote_pids is not None else [])
                laps["cpu"] = cpu_s(pids)
        if "wall" in laps:
            break
    stop = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    laps["stop"] = time.perf_counter() - stop
    if "wall" not in laps:
        errors = "\n".join(tail[-5:])
        raise SystemExit(f"{n} devices: never all RUNNING (laps {laps})\n{errors}")
    return laps


HEADER = (
    f"{'devices':>7} {'hosts':>5} {'mode':>10} {'wall s':>7} {'ctrl s':>7} {'agents':>7} "
    f"{'spawned':>8} {'cpu s':>6} {'stop s':>7}"
)


def row(n: int, hosts: int, mode: str, laps: dict[str, float]) -> str:
    return (
        f"{n:>7} {hosts:>5} {mode:>10} {laps['wall']:>7.2f} "
        f"{laps.get('all RUNNING', float('nan')):>7.2f} "
        f"{laps.get('agents up', float('nan')):>7.2f} "
        f"{laps.get('devices spawned', float('nan')):>8.2f} "
        f"{laps.get('cpu', float('nan')):>6.2f} {laps['stop']:>7.2f}"
    )


def trees(against: str | None) -> dict[str, str | None]:
    """Label -> PYTHONPATH override: this tree, and ``against``'s src when given."""
    if against is None:
        return {"": None}
    return {"": None, "-old": str(Path(against).resolve() / "src")}


def run_farm(sizes: list[int], repeat: int, against: str | None = None) -> None:
    """3 namespace hosts over ssh: plaintext and CURVE side by side for each size."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from farm_hosts import NamespaceFarm, missing_for_farm

    reason = missing_for_farm()
    if reason:
        raise SystemExit(f"--farm needs namespace hosts: {reason}")
    with tempfile.TemporaryDirectory(prefix="evb-") as tmp, NamespaceFarm(3) as farm:
        work = Path(tmp)
        os.environ["EVFLOW_RUNTIME_DIR"] = str(work / "rt")
        os.environ.update(farm.ssh_env())
        hosts_file = farm.write_hosts_file(work / "hosts.toml")
        keys = work / "keys"
        subprocess.run(
            [sys.executable, "-m", "evflow", "keys", str(keys), "--names", "controller",
             *farm.hosts],
            check=True, capture_output=True,
        )  # fmt: skip
        common = ["--hosts", str(hosts_file), "--launcher", "ssh"]

        def farm_pids() -> list[int]:
            return [p for h in farm.hosts for p in farm.pids(h) if p not in farm.daemon_pids(h)]

        modes = {"plain": [*common, "--insecure"], "curve": [*common, "--keys", str(keys)]}
        print(HEADER)
        for n in sizes:
            for _ in range(repeat):
                for mode, extra in modes.items():
                    for label, src in trees(against).items():  # alternated: A/B
                        laps = run_once(work, n, 3, extra, src, farm_pids)
                        print(row(n, 3, mode + label, laps), flush=True)
                    left = {h: farm.leftovers(h, timeout_s=10) for h in farm.hosts}
                    if any(left.values()):
                        raise SystemExit(f"left on the hosts after the run: {left}")
    print(f"load average at the end: {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="16,64,256")
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--farm", action="store_true", help="3 namespace hosts over ssh (root)")
    parser.add_argument("--quick", action="store_true", help="256 devices, one run each")
    parser.add_argument("--against", metavar="DIR", help="also run DIR/src, alternated (A/B)")
    args = parser.parse_args()
    if args.quick:
        args.devices, args.repeat = "256", 1
    sizes = [int(x) for x in args.devices.split(",")]
    print(f"load average at the start: {os.getloadavg()}")
    if args.farm:
        run_farm(sizes, args.repeat, args.against)
        return
    with tempfile.TemporaryDirectory(prefix="evb-") as tmp:
        os.environ["EVFLOW_RUNTIME_DIR"] = str(Path(tmp) / "rt")
        print(HEADER)
        for n in sizes:
            for _ in range(args.repeat):
                for label, src in trees(args.against).items():
                    laps = run_once(Path(tmp), n, args.hosts, src=src)
                    print(row(n, args.hosts, "local" + label, laps), flush=True)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()

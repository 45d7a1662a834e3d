"""Path runs across hosts: the chain over tcp between namespace hosts vs ipc on one host.

    sudo python benchmarks/bench_farm_paths.py [--repeat 2] [--events-1k 100000] [--events-1m 1000]

A chain ToyGenerator -> BusyWork(0 ms, a no-op worker) -> RecordOutput is run with:

- ``ipc``: ``evflow run -p 2`` on this host (the local engine, unchanged);
- ``tcp``: ``evflow run -p 1 --hosts`` with hosts h1 and h2 (network namespaces with
  sshd, ``tests/farm_hosts.py``): input and output here, one worker on each host;
- ``tcp+curve``: the same with ``EVFLOW_CURVE_KEYS``.

for 1 kB and 1 MB events, interleaved (same machine load), best of --repeat. The rate
is events / (wall - start-up to the first event), so the agents' start-up (ssh, Python
imports) is reported on its own. Then the time from a host's death (SIGKILL of every
process of h2, and separately its link cut) to the controller's "host lost" line, after
which the host's events go to the other worker. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parent / "src")
sys.path.insert(0, str(HERE.parent / "tests"))

from evflow.transport.curve import create_keys  # noqa: E402
from farm_hosts import NamespaceFarm, missing_for_farm  # noqa: E402

STEERING = """
import sys
import evflow
from evflow.io import BusyWork, RecordOutput, ToyGenerator

n, size, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
evflow.process(evflow.Path([ToyGenerator(n_events=n, payload_bytes=size), BusyWork(work_ms=0),
                            RecordOutput(file=out)]))
"""


def _figure(pattern: str, text: str) -> float:
    """The number ``pattern``'s group matches in a run's output."""
    found = re.search(pattern, text)
    if found is None:
        raise SystemExit(f"no {pattern!r} in the run's output:\n{text[-2000:]}")
    return float(found.group(1))


def run(tmp: Path, env: dict[str, str], n: int, size: int, extra: list[str]) -> dict[str, float]:
    out = tmp / "out.evr"
    argv = [sys.executable, "-m", "evflow", "run", str(tmp / "steer.py"), *extra,
            "--", str(n), str(size), str(out)]  # fmt: skip
    proc = subprocess.run(argv, env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {proc.stderr[-2000:]}")
    wall = _figure(r"written, \d+ dropped events in ([\d.]+) s", proc.stdout)
    first = _figure(r"start-up to first event \(s\): ([\d.]+)", proc.stdout)
    for f in tmp.glob("out.evr*"):
        f.unlink()
    return {"rate": n / max(wall - first, 1e-9), "startup_s": first, "wall_s": wall}


SPEEDUP = """
import sys
import evflow
from evflow.io import BusyWork, RecordOutput, ToyGenerator

n, out = int(sys.argv[1]), sys.argv[2]
evflow.process(evflow.Path([ToyGenerator(n_events=n), BusyWork(work_ms=10.0),
                            RecordOutput(file=out)]))
"""


def hosts_toml(farm: NamespaceFarm, names: list[str]) -> str:
    lines = ["[hosts]"]
    for h in names:
        address = farm.hosts[h].address
        lines.append(f'{h} = {{ address = "{address}", ssh = "root@{address}" }}')
    return "\n".join(lines) + "\n"


def speedup(farm: NamespaceFarm, tmp: Path, env: dict[str, str], n: int, repeat: int) -> None:
    """10 ms/event on 1, 2, 3 hosts of one worker each vs the sequential run."""
    (tmp / "speed.py").write_text(SPEEDUP)
    names = sorted(farm.hosts)

    def once(extra: list[str]) -> float:
        argv = [sys.executable, "-m", "evflow", "run", str(tmp / "speed.py"), *extra, "--",
                str(n), str(tmp / "s.evr")]  # fmt: skip
        proc = subprocess.run(argv, env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"run failed: {proc.stderr[-2000:]}")
        for f in tmp.glob("s.evr*"):
            f.unlink()
        wall = _figure(r"dropped events in ([\d.]+) s", proc.stdout)
        first = re.search(r"start-up to first event \(s\): ([\d.]+)", proc.stdout)
        return wall - (float(first.group(1)) if first else 0.0)

    best: dict[str, float] = {}
    for _ in range(repeat):
        best["sequential"] = min(best.get("sequential", 1e9), once(["-p", "0"]))
        for k in range(1, len(names) + 1):
            hosts = tmp / f"hosts{k}.toml"
            hosts.write_text(hosts_toml(farm, names[:k]))
            key = f"{k} host(s) x 1 worker"
            argv = ["-p", "1", "--hosts", str(hosts), "--insecure"]
            best[key] = min(best.get(key, 1e9), once(argv))
    print(f"| 10 ms/event, {n} events | time after the first event (s) | speedup |")
    print("|---|---|---|")
    for key, t in best.items():
        print(f"| {key} | {t:.2f} | {best['sequential'] / t:.2f}x |")


def death_to_lost(farm: NamespaceFarm, tmp: Path, env: dict[str, str], fault: str) -> float:
    """Seconds from the fault on h2 to the controller's 'host lost' line."""
    argv = [sys.executable, "-m", "evflow", "run", str(tmp / "steer.py"), "-q", "-p", "1",
            "--hosts", str(tmp / "hosts.toml"), "--launcher", "ssh", "--insecure", "--",
            "400000", "1024",
            str(tmp / "out.evr")]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, cwd=tmp, stderr=subprocess.PIPE, text=True)
    time.sleep(6.0)  # agents up, events flowing
    t0 = time.monotonic()
    if fault == "kill":
        farm.kill_host("h2")
    else:
        farm.cut_link("h2")
    assert proc.stderr is not None
    lost_s = float("nan")
    for line in proc.stderr:
        if "host 'h2' lost" in line:
            lost_s = time.monotonic() - t0
            break
    proc.terminate()
    proc.wait(60)
    farm.revive()
    for f in tmp.glob("out.evr*"):
        f.unlink()
    return lost_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--events-1k", type=int, default=100_000)
    parser.add_argument("--events-1m", type=int, default=1_000)
    parser.add_argument("--only-speedup", action="store_true")
    args = parser.parse_args()
    reason = missing_for_farm()
    if reason:
        raise SystemExit(f"needs namespace hosts: {reason}")
    with NamespaceFarm(3) as farm, tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "steer.py").write_text(STEERING)
        (tmp / "hosts.toml").write_text(hosts_toml(farm, ["h1", "h2"]))
        create_keys(tmp / "keys", ["controller", "h1", "h2"])
        base = {**os.environ, **farm.ssh_env(), "PYTHONPATH": SRC}
        modes = {
            "ipc": (base, ["-p", "2"]),
            "tcp": (base, ["-p", "1", "--hosts", str(tmp / "hosts.toml"), "--insecure"]),
            "tcp+curve": (
                {**base, "EVFLOW_CURVE_KEYS": str(tmp / "keys")},
                ["-p", "1", "--hosts", str(tmp / "hosts.toml")],
            ),
        }
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, best of {args.repeat}")
        if args.only_speedup:
            speedup(farm, tmp, base, 300, args.repeat)
            return
        print("| event size | mode | events/s | start-up to first event (s) |")
        print("|---|---|---|---|")
        for size, n in ((1024, args.events_1k), (1024**2, args.events_1m)):
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.repeat):
                for mode, (env, extra) in modes.items():
                    r = run(tmp, env, n, size, extra)
                    if mode not in best or r["rate"] > best[mode]["rate"]:
                        best[mode] = r
            for mode, r in best.items():
                ratio = r["rate"] / best["ipc"]["rate"]
                print(f"| {size} B | {mode} | {r['rate']:,.0f} ({ratio:.2f}x ipc) | "
                      f"{r['startup_s']:.2f} |")  # fmt: skip
        for fault in ("kill", "cut"):
            times = [death_to_lost(farm, tmp, base, fault) for _ in range(args.repeat)]
            print(f"host h2 {fault}: lost after {', '.join(f'{t:.2f}' for t in times)} s")
        speedup(farm, tmp, base, 300, args.repeat)


if __name__ == "__main__":
    main()

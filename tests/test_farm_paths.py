"""Path runs across hosts (``evflow run -p N --hosts``) on namespace hosts with real sshd.

Input and output run here; each host's agent (started over ssh, or srun once) forks
the workers, which reach the input and output over tcp. Every test checks what users
rely on: the same events and content as the sequential run, every uid exactly once,
also when a host is SIGKILLed or cut off; the summary names the lost host; Ctrl-C and
SIGTERM leave no process on any host (the ``farm`` fixture checks) and a readable file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import skhep_testdata

from evflow.io import RecordReader
from evflow.io.records import decode_record
from farm_hosts import NamespaceFarm

pytestmark = [pytest.mark.netns, pytest.mark.sshd]

HZZ = skhep_testdata.data_path("uproot-HZZ.root")
SRC = str(Path(__file__).resolve().parents[1] / "src")

MODULES = '''
import os
import numpy as np
from evflow.processing.module import Module


class Tag(Module):
    """Content that depends on the event, plus where it ran (this host's netns)."""

    parallel = True

    def initialize(self):
        self.marked = False

    def event(self, store):
        if not self.marked:  # the test waits for a host's first event (shared filesystem)
            ns = os.stat("/proc/self/ns/net").st_ino
            open(os.path.join(os.path.dirname(__file__), f"ran-{ns}"), "w").close()
            self.marked = True
        keys = sorted(k for k in store.keys() if k != "netns")
        store["tag"] = np.array([store.meta.uid * 7 + len(keys)])
        store["netns"] = np.array([os.stat("/proc/self/ns/net").st_ino])
        return None
'''

STEERING = """
import sys
import evflow
from evflow.io import BusyWork, RecordOutput, RootInput, ToyGenerator
from farmmods import Tag

kind, n, work_ms, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
if kind == "toy":
    source = ToyGenerator(n_events=n, payload_bytes=500, seed=11)
else:
    source = RootInput(file=kind, step_size=500)
evflow.process(evflow.Path([source, Tag(), BusyWork(work_ms=work_ms), RecordOutput(file=out)]))
"""


def read_events(file: Path) -> dict[int, dict[str, Any]]:
    """uid -> content (netns left out), asserting that no uid is there twice."""
    events: dict[int, dict[str, Any]] = {}
    with RecordReader(str(file)) as reader:
        for record in reader:
            store = decode_record(str(file), record)
            content = {}
            for key, value in store.items():
                if key == "netns":
                    continue
                if isinstance(value, np.ndarray):
                    content[key] = (value.dtype.str, value.shape, value.tobytes())
                else:
                    content[key] = repr(value)
            assert store.meta.uid not in events, f"uid {store.meta.uid} written twice"
            events[store.meta.uid] = content
    return events


def netns_of(file: Path) -> set[int]:
    with RecordReader(str(file)) as reader:
        return {int(decode_record(str(file), r)["netns"][0]) for r in reader}


class Run:
    def __init__(self, farm: NamespaceFarm, tmp: Path) -> None:
        self.farm = farm
        self.tmp = tmp
        (tmp / "farmmods.py").write_text(MODULES)
        (tmp / "steer.py").write_text(STEERING)
        self.hosts = farm.write_hosts_file(tmp / "hosts.toml")
        self.env = {**os.environ, **farm.ssh_env(), "PYTHONPATH": SRC}

    def argv(self, kind: str, n: int, work_ms: float, out: str, *opts: str) -> list[str]:
        return [sys.executable, "-m", "evflow", "run", str(self.tmp / "steer.py"), *opts,
                "--", kind, str(n), str(work_ms), str(self.tmp / out)]  # fmt: skip

    def remote(self, kind: str, n: int, work_ms: float, out: str, launcher: str = "ssh",
               **kw: Any) -> subprocess.Popen[str]:  # fmt: skip
        opts = ["-p", "1", "--hosts", str(self.hosts), "--launcher", launcher]
        if "EVFLOW_CURVE_KEYS" not in self.env:
            opts.append("--insecure")  # (plaintext on the test's own namespace hosts)
        return subprocess.Popen(
            self.argv(kind, n, work_ms, out, *opts), env=self.env, cwd=self.tmp,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw,
        )  # fmt: skip

    def sequential(self, kind: str, n: int, out: str) -> dict[int, dict[str, Any]]:
        argv = self.argv(kind, n, 0.0, out, "-p", "0", "-q")
        subprocess.run(argv, env=self.env, cwd=self.tmp, check=True, timeout=60)
        return read_events(self.tmp / out)

    def wait_events_on(self, name: str, timeout_s: float = 40.0) -> None:
        """Until a worker on host ``name`` has processed an event."""
        marker = self.tmp / f"ran-{self.farm.hosts[name].netns_inode()}"
        deadline = time.monotonic() + timeout_s
        while not marker.exists():
            assert time.monotonic() < deadline, f"no event on {name} after {timeout_s} s"
            time.sleep(0.05)


def finish(proc: subprocess.Popen[str], timeout_s: float = 90.0) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the run did not end within {timeout_s} s: {err[-2000:]}")
    return proc.returncode, out, err


def counter(text: str, name: str) -> int:
    match = re.search(rf"^\s*{re.escape(name)}: (\d+)", text, re.M)
    assert match, f"no {name!r} in the summary:\n{text}"
    return int(match.group(1))


def test_three_hosts_toy_same_events_and_content_as_sequential(farm, tmp_path) -> None:
    run = Run(farm, tmp_path)
    expected = run.sequential("toy", 900, "seq.evr")
    code, out, err = finish(run.remote("toy", 900, 1.0, "farm.evr"))
    assert code == 0, err
    assert read_events(tmp_path / "farm.evr") == expected
    hosts = {farm.hosts[h].netns_inode() for h in farm.hosts}
    ran_on = netns_of(tmp_path / "farm.evr")
    assert ran_on <= hosts, "workers ran outside the hosts' network namespaces"
    assert len(ran_on) >= 2, f"only one host processed events: {ran_on}"
    assert counter(out, "hosts") == 3 and counter(out, "hosts lost") == 0


def test_three_hosts_hzz_same_as_sequential(farm, tmp_path) -> None:
    run = Run(farm, tmp_path)
    expected = run.sequential(HZZ, 0, "seq.evr")
    assert len(expected) == 2421
    code, _, err = finish(run.remote(HZZ, 0, 0.0, "farm.evr"))
    assert code == 0, err
    assert read_events(tmp_path / "farm.evr") == expected
    assert netns_of(tmp_path / "farm.evr") <= {farm.hosts[h].netns_inode() for h in farm.hosts}


@pytest.mark.parametrize("fault", ["kill_host", "cut_link"])
def test_lost_host_run_completes_exactly_once(farm, tmp_path, fault) -> None:
    run = Run(farm, tmp_path)
    n = 6000
    expected = run.sequential("toy", n, "seq.evr")
    proc = run.remote("toy", n, 2.0, "farm.evr")
    run.wait_events_on("h2")
    time.sleep(0.3)  # a pace, not a synchronisation: more events in flight at h2
    if fault == "kill_host":
        farm.kill_host("h2")
    else:
        farm.cut_link("h2")
        time.sleep(5.0)  # the thing under test: a cut long enough to lose the host
        farm.restore_link("h2")
    code, out, err = finish(proc)
    assert code == 0, err
    assert read_events(tmp_path / "farm.evr") == expected  # every uid once, same content
    assert "host 'h2' lost" in err
    assert counter(out, "hosts lost") == 1
    assert counter(out, "host h2 lost: events re-sent") >= 1
    assert counter(out, "events lost") == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_cleans_every_host_and_output_is_readable(farm, tmp_path, sig) -> None:
    run = Run(farm, tmp_path)
    proc = run.remote("toy", 20_000, 2.0, "farm.evr")
    for name in farm.hosts:
        run.wait_events_on(name)
    time.sleep(0.3)  # a pace: the assertions hold whenever it comes (the drain writes)
    proc.send_signal(sig)
    code, _, err = finish(proc, 60.0)
    assert code == (130 if sig == signal.SIGINT else 143), err
    written = read_events(tmp_path / "farm.evr")  # readable, no uid twice
    assert 0 < len(written) < 20_000
    for name in farm.hosts:
        assert farm.leftovers(name) == [], name


def test_three_hosts_with_slurm(slurm, farm, tmp_path) -> None:
    run = Run(farm, tmp_path)
    expected = run.sequential("toy", 600, "seq.evr")
    code, _, err = finish(run.remote("toy", 600, 1.0, "farm.evr", launcher="slurm"))
    assert code == 0, err
    assert read_events(tmp_path / "farm.evr") == expected
    assert netns_of(tmp_path / "farm.evr") <= {farm.hosts[h].netns_inode() for h in farm.hosts}


def test_curve_keys_encrypt_and_refuse_an_unknown_host(farm, tmp_path) -> None:
    """EVFLOW_CURVE_KEYS: every tcp socket of the run is CURVE. With h3's public key
    gone from the directory (the allow-list), h3 is refused and the run completes on
    h1 and h2 alone, with the same events."""
    from evflow.transport.curve import create_keys

    create_keys(tmp_path / "keys", ["controller", "h1", "h2", "h3"])
    run = Run(farm, tmp_path)
    expected = run.sequential("toy", 600, "seq.evr")
    run.env["EVFLOW_CURVE_KEYS"] = str(tmp_path / "keys")
    code, _, err = finish(run.remote("toy", 600, 0.5, "farm.evr"))
    assert code == 0, err
    assert read_events(tmp_path / "farm.evr") == expected
    (tmp_path / "keys" / "h3.key").unlink()
    for marker in tmp_path.glob("ran-*"):
        marker.unlink()
    code, _, err = finish(run.remote("toy", 600, 0.5, "refused.evr"))
    assert code == 0, err
    assert read_events(tmp_path / "refused.evr") == expected
    assert "CURVE refused peer" in err
    assert farm.hosts["h3"].netns_inode() not in netns_of(tmp_path / "refused.evr")


def test_curve_run_from_a_farm_host_that_is_also_in_the_hosts_file(farm, tmp_path) -> None:
    """The controller on h1, h1 also a host of the run (a farm's first node): with keys,
    every uid once. Then h3's public key is gone: one line names h3 as refused and the
    run completes on h1 and h2 (issue 23: every socket was refused, the run hung)."""
    from evflow.transport.curve import create_keys

    create_keys(tmp_path / "keys", ["controller", "h1", "h2", "h3"])
    run = Run(farm, tmp_path)
    expected = run.sequential("toy", 600, "seq.evr")
    keys = ["--keys", str(tmp_path / "keys")]

    def on_h1(out: str) -> subprocess.Popen[str]:
        argv = run.argv("toy", 600, 0.5, out, "-p", "1", "--hosts", str(run.hosts),
                        "--launcher", "ssh", *keys)  # fmt: skip
        pipe = subprocess.PIPE
        proc = farm.popen(
            "h1", argv, env=run.env, cwd=tmp_path, stdout=pipe, stderr=pipe, text=True
        )
        return proc  # type: ignore[return-value]

    code, _, err = finish(on_h1("farm.evr"))
    assert code == 0, err
    assert read_events(tmp_path / "farm.evr") == expected
    assert "CURVE refused" not in err, err
    (tmp_path / "keys" / "h3.key").unlink()
    for marker in tmp_path.glob("ran-*"):
        marker.unlink()
    code, _, err = finish(on_h1("refused.evr"))
    assert code == 0, err
    assert read_events(tmp_path / "refused.evr") == expected
    refused = [ln for ln in err.splitlines() if "host 'h3'" in ln and "refused" in ln]
    assert len(refused) == 1, err
    assert "h3.key" in refused[0], refused
    assert farm.hosts["h3"].netns_inode() not in netns_of(tmp_path / "refused.evr")
    # from outside the farm, with no host's public key: no host can connect, and the
    # run ends at once with one line naming each host and its key
    for name in ("h1", "h2"):
        (tmp_path / "keys" / f"{name}.key").unlink()
    run.env["EVFLOW_CURVE_KEYS"] = str(tmp_path / "keys")
    code, _, err = finish(run.remote("toy", 600, 0.5, "none.evr"), 30.0)
    assert code != 0, err
    last = err.strip().splitlines()[-1]
    assert all(f"host {h!r}: its agent was refused" in last for h in farm.hosts), err
    assert all(f"keys/{h}.key" in last for h in farm.hosts), err


CHAOS = """
import sys
import evflow
from evflow.io.generators import ToyGenerator
from evflow.io.records import RecordOutput
from evflow.processing.faults import FaultInjector

out = sys.argv[1]
evflow.process(
    evflow.Path([
        ToyGenerator(n_events=20_000, payload_bytes=256, seed=3),
        FaultInjector(name="hangs", mode="hang", probability=0.0005, seed=11),
        FaultInjector(name="poison", mode="segfault", uids=[1234, 9999, 19998], poison=True),
        RecordOutput(file=out, fsync=False),
    ]),
    event_timeout_s=0.5, max_attempts=3, extra={"max_restarts": 10_000},
)
"""


@pytest.mark.chaos
def test_chaos_20000_events_over_three_hosts_every_uid_exactly_once(farm, tmp_path) -> None:
    """Hung events (killed by the timeout through their agent), poison events that
    crash their worker on every attempt, and one host SIGKILLed: every uid exactly
    once, the poison ones quarantined."""
    run = Run(farm, tmp_path)
    (tmp_path / "chaos.py").write_text(CHAOS)
    out = tmp_path / "chaos.evr"
    argv = [sys.executable, "-m", "evflow", "run", str(tmp_path / "chaos.py"), "-p", "1",
            "--hosts", str(run.hosts), "--insecure", "--allow-quarantine", "--",
            str(out)]  # fmt: skip
    proc = subprocess.Popen(argv, env=run.env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (out.exists() and out.stat().st_size > 1_000_000):  # about a fifth written
        assert time.monotonic() < deadline and proc.poll() is None, "the run made no progress"
        time.sleep(0.05)
    farm.kill_host("h3")
    code, stdout, err = finish(proc, 100.0)
    assert code == 0, err
    flags: dict[int, list[int]] = {}
    with RecordReader(str(out)) as reader:
        for record in reader:
            meta = decode_record(str(out), record).meta
            flags.setdefault(meta.uid, []).append(meta.flags)
    assert sorted(flags) == list(range(20_000))
    assert all(len(f) == 1 for f in flags.values()), "a uid written twice"
    from evflow.event import FLAG_QUARANTINED

    quarantined = {u for u, f in flags.items() if f[0] & FLAG_QUARANTINED}
    assert quarantined == {1234, 9999, 19998}
    assert "3 quarantined" in stdout
    assert counter(stdout, "timeouts") >= 1  # hung events were killed through their agents
    assert counter(stdout, "hosts lost") == 1


def test_a_bus_address_the_hosts_cannot_reach_is_one_error_not_a_hang(farm, tmp_path) -> None:
    """h2 reached by ssh, but named by a loopback address: its agent never reaches the
    run's bus (bound there). The run ends in seconds with one line naming the address."""
    run = Run(farm, tmp_path)
    h2 = farm.hosts["h2"].address
    run.hosts.write_text(f'[hosts]\nh2 = {{ address = "127.0.0.1", ssh = "root@{h2}" }}\n')
    code, _, err = finish(run.remote("toy", 100, 0.0, "farm.evr"), 60.0)
    assert code == 1, err
    errors = [ln for ln in err.splitlines() if ln.startswith("evflow: error:")]
    assert len(errors) == 1, err
    assert "host 'h2'" in errors[0] and "127.0.0.1" in errors[0] and "reachable" in errors[0]

"""Path runs across hosts with simulated hosts (local launcher, 127.0.0.1): no root
needed. The options and the hosts file, and a worker killed on a "remote" host: its
agent reaps it, the input re-sends its events, the agent forks a replacement."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _topo import Lines
from evflow.cli.run import workers_arg
from evflow.errors import ConfigurationError
from evflow.io import RecordReader
from evflow.io.records import decode_record
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel.run.farmplan import plan_hosts

SRC = str(Path(__file__).resolve().parents[1] / "src")

STEERING = '''
import os, signal, sys
import evflow
from evflow import Module
from evflow.io import BusyWork, RecordOutput, ToyGenerator


class KillOnce(Module):
    """SIGKILLs its worker at uid 120 (first attempt only)."""

    parallel = True

    def event(self, store):
        if store.meta.uid == 120 and store.meta.attempt == 1:
            os.kill(os.getpid(), signal.SIGKILL)


n, out = int(sys.argv[1]), sys.argv[2]
path = evflow.Path([ToyGenerator(n_events=n, seed=3), KillOnce(), BusyWork(work_ms=0.5),
                    RecordOutput(file=out)])
evflow.process(path, workers=1)
'''


def test_workers_per_host_on_the_command_line() -> None:
    assert workers_arg("3") == 3
    assert workers_arg("h1=2,h2=1") == {"h1": 2, "h2": 1}
    with pytest.raises(argparse.ArgumentTypeError):
        workers_arg("=2")
    with pytest.raises(argparse.ArgumentTypeError):
        workers_arg("h1=-1")


def test_plan_hosts_counts_and_errors(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.toml"
    hosts.write_text('[hosts]\na = { address = "127.0.0.1", workers = 3 }\nb = {}\n')
    _, counts = plan_hosts(ProcessOptions(workers=2, hosts=str(hosts)))
    assert counts == {"a": 3, "b": 2}
    _, counts = plan_hosts(ProcessOptions(workers=1, hosts=str(hosts), host_workers={"b": 4}))
    assert counts == {"b": 4}  # -p HOST=N names the hosts that get workers
    with pytest.raises(ConfigurationError, match=r"unknown host.*zz"):
        plan_hosts(ProcessOptions(workers=1, hosts=str(hosts), host_workers={"zz": 1}))
    with pytest.raises(ConfigurationError, match="need hosts"):
        ProcessOptions(workers=1, host_workers={"a": 1})
    hosts.write_text('[hosts]\na = { workers = "many" }\n')
    with pytest.raises(ConfigurationError, match="host 'a': workers must be"):
        plan_hosts(ProcessOptions(workers=1, hosts=str(hosts)))
    with pytest.raises(ConfigurationError, match="does not exist"):
        plan_hosts(ProcessOptions(workers=1, hosts=str(tmp_path / "none.toml")))


def test_worker_killed_on_a_host_is_replaced_by_its_agent(tmp_path: Path) -> None:
    (tmp_path / "steer.py").write_text(STEERING)
    (tmp_path / "hosts.toml").write_text(
        '[hosts]\nh1 = { address = "127.0.0.1" }\nh2 = { address = "127.0.0.1" }\n'
    )
    out = tmp_path / "out.evr"
    argv = [sys.executable, "-m", "evflow", "run", str(tmp_path / "steer.py"), "-p", "h1=1,h2=2",
            "--hosts", str(tmp_path / "hosts.toml"), "--launcher", "local", "--", "1500",
            str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    with RecordReader(str(out)) as reader:
        uids = [decode_record(str(out), r).meta.uid for r in reader]
    assert sorted(uids) == list(range(1500))  # every uid exactly once
    assert "workers lost: 1" in proc.stdout
    assert "workers restarted: 1" in proc.stdout
    assert "hosts: 2" in proc.stdout


REJOIN = """
import os, sys, time
import evflow
from evflow import Module
from evflow.io import BusyWork, RecordOutput, ToyGenerator


class HoldTail(Module):
    \"\"\"Marks its worker's pid on its first event (the test finds h2's worker by it) and
    holds the second half of the events until the test writes 'back': the run cannot end
    before the lost host has rejoined, however slow the machine.\"\"\"

    parallel = True

    def event(self, store):
        seen = os.path.join(HERE, "seen", str(os.getpid()))
        if not os.path.exists(seen):
            open(seen, "w").close()
        while store.meta.uid >= n // 2 and not os.path.exists(os.path.join(HERE, "back")):
            time.sleep(0.01)


n, out = int(sys.argv[1]), sys.argv[2]
HERE = os.path.dirname(os.path.abspath(out))
os.makedirs(os.path.join(HERE, "seen"), exist_ok=True)
evflow.process(evflow.Path([ToyGenerator(n_events=n, seed=4), HoldTail(), BusyWork(work_ms=1.0),
                            RecordOutput(file=out)]), workers=1, event_timeout_s=0,
               extra={"rejoin_s": 0.2})
"""


@pytest.mark.timeout(300)  # bounds for a loaded machine (each wait ends on its condition)
def test_host_whose_agent_is_killed_is_lost_and_rejoins(tmp_path: Path) -> None:
    import psutil

    (tmp_path / "steer.py").write_text(REJOIN)
    (tmp_path / "hosts.toml").write_text(
        '[hosts]\nh1 = { address = "127.0.0.1" }\nh2 = { address = "127.0.0.1" }\n'
    )
    out = tmp_path / "out.evr"
    hosts = str(tmp_path / "hosts.toml")
    argv = [sys.executable, "-m", "evflow", "run", str(tmp_path / "steer.py"), "--hosts",
            hosts, "--launcher", "local", "--", "6000", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC}
    with open(tmp_path / "stdout", "w") as stdout_file:
        proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=stdout_file,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines = Lines(proc)
    try:
        # kill h2's agent once h2 is in the pool: one of its workers has had an event
        agent = None
        deadline = time.monotonic() + 60
        while agent is None:
            assert time.monotonic() < deadline and proc.poll() is None, "h2 never took events"
            for child in psutil.Process(proc.pid).children():
                if "--host" in child.cmdline() and "h2" in child.cmdline():
                    pids = [p.pid for p in child.children(recursive=True)]
                    if any((tmp_path / "seen" / str(pid)).exists() for pid in pids):
                        agent = child
            time.sleep(0.05)
        agent.kill()  # the host's zygote and workers die with it (PDEATHSIG)
        lines.wait_for("host 'h2' lost (its agent ended)", 60)
        lines.wait_for("host 'h2' is back", 60)
        (tmp_path / "back").touch()  # the held second half of the events may go on now
        code, err = lines.finish(90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 0, err
    with RecordReader(str(out)) as reader:
        uids = [decode_record(str(out), r).meta.uid for r in reader]
    assert sorted(uids) == list(range(6000))
    assert "hosts lost: 1" in (tmp_path / "stdout").read_text()


@pytest.mark.timeout(150)  # the run's own bound (120 s) first: it says more
def test_agent_that_ends_before_it_answers_is_told_and_started_again(tmp_path: Path) -> None:
    """An agent killed before its first heartbeat was never in the pool: it is not "lost",
    but it must not be left out in silence either (a run of one host would wait forever)."""
    import psutil

    (tmp_path / "steer.py").write_text(REJOIN)
    (tmp_path / "hosts.toml").write_text(
        '[hosts]\nh1 = { address = "127.0.0.1" }\nh2 = { address = "127.0.0.1" }\n'
    )
    out = tmp_path / "out.evr"
    (tmp_path / "back").touch()  # nothing held: the run goes straight through
    hosts = str(tmp_path / "hosts.toml")
    argv = [sys.executable, "-m", "evflow", "run", str(tmp_path / "steer.py"), "--hosts",
            hosts, "--launcher", "local", "--", "2000", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        killed = False
        while not killed:  # at first sight: long before its imports let it answer
            assert proc.poll() is None, "the run ended before h2's agent started"
            for child in psutil.Process(proc.pid).children():
                if "--host" in child.cmdline() and "h2" in child.cmdline():
                    child.kill()
                    killed = True
            time.sleep(0.01)
        stdout, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "host 'h2': its agent ended (code -9) before it answered" in err
    assert "tries it again" in err
    with RecordReader(str(out)) as reader:
        uids = [decode_record(str(out), r).meta.uid for r in reader]
    assert sorted(uids) == list(range(2000))
    assert "hosts lost: 0" in stdout  # never in the pool, so never lost


def test_unreachable_hosts_are_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "steer.py").write_text(REJOIN)
    (tmp_path / "hosts.toml").write_text(
        '[hosts]\nh1 = { address = "127.0.0.1", ssh = "ssh://root@127.0.0.1:1" }\n'
    )
    argv = [sys.executable, "-m", "evflow", "run", str(tmp_path / "steer.py"), "--hosts",
            str(tmp_path / "hosts.toml"), "--insecure", "--", "10",
            str(tmp_path / "out.evr")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    warning, *lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert warning.startswith("evflow: warning: --insecure"), proc.stderr  # (asked for)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("evflow: error: host 'h1': ssh ssh://root@127.0.0.1:1 failed")
    assert "Connection refused" in lines[0]


PLAIN = """
import sys
import evflow
from evflow.io import BusyWork, RecordOutput, ToyGenerator

if __name__ == "__main__":
    path = evflow.Path([ToyGenerator(n_events=500), BusyWork(work_ms=0.1),
                        RecordOutput(file=sys.argv[1])])
    hosts = {"a": {"address": "127.0.0.1"}, "b": {"address": "127.0.0.1", "workers": 1}}
    s = evflow.process(path, workers=2, quiet=True, launcher="local", hosts=hosts)
    print(s.events_written, s.workers, s.counters["hosts"])
"""


def test_process_with_hosts_from_a_plain_script(tmp_path: Path) -> None:
    """``evflow.process(path, hosts={...})`` in a script run by ``python``: the agents
    import the script itself (its ``__main__`` guard runs the path there too)."""
    (tmp_path / "plain.py").write_text(PLAIN)
    out = tmp_path / "p.evr"
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, str(tmp_path / "plain.py"), str(out)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["500", "3", "2"]  # 2 workers on a, 1 on b (its own count)
    with RecordReader(str(out)) as reader:
        assert sorted(decode_record(str(out), r).meta.uid for r in reader) == list(range(500))


def test_hosts_over_ssh_without_keys_need_insecure(tmp_path: Path) -> None:
    """Events to other hosts in plaintext only when asked: one error naming the fix,
    before anything is started (the host need not even exist)."""
    (tmp_path / "steer.py").write_text(STEERING)
    (tmp_path / "hosts.toml").write_text(
        '[hosts]\nfar = { address = "10.255.255.1", ssh = "root@10.255.255.1" }\n'
    )
    argv = [sys.executable, "-m", "evflow", "run", str(tmp_path / "steer.py"), "--hosts",
            str(tmp_path / "hosts.toml"), "--", "100", str(tmp_path / "out.evr")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "EVFLOW_CURVE_KEYS"}
    proc = subprocess.run(argv, env={**env, "PYTHONPATH": SRC}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "hosts far" in lines[0] and "plaintext" in lines[0]
    assert "evflow keys DIR --names controller far" in lines[0] and "--insecure" in lines[0]
    assert not (tmp_path / "out.evr").exists()

"""``evflow up`` with the local launcher: real agents, devices, bus and sockets.

Several hosts are simulated on this machine: hosts named h1, h2, h3 at 127.0.0.1, each
with its own agent process (so devices of different hosts talk tcp). Every test also
relies on the autouse fixture of conftest.py: no process, ipc file or shm segment may
outlive it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from _topo import Lines, wait_for_controller
from evflow.qc.repository import Repository
from evflow.topology.loader import load_topology
from evflow.topology.resolve import resolve
from evflow.transport.hosts import load_hosts

EXAMPLES = Path(__file__).parent.parent / "examples" / "topologies"
HOSTS3 = "[hosts]\n" + "".join(f'h{i} = {{ address = "127.0.0.1" }}\n' for i in (1, 2, 3))


def evflow(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evflow", *args], capture_output=True, text=True, timeout=timeout_s
    )


def start_up(*args: str, quiet: bool = True) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "evflow", "up", *(["--quiet"] if quiet else []), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stats(stats_dir: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in stats_dir.glob("*.json")}


def check_delivery(found: dict[str, dict[str, Any]], samplers: int) -> None:
    sent = [v["sampler"]["sent"] for k, v in found.items() if k.startswith("sampler")]
    assert len(sent) == samplers
    assert all(v["sampler"]["acked"] == 1 for k, v in found.items() if k.startswith("sampler"))
    sink = found["sink"]["sink"]
    assert sink["received"] == sink["announced"] == sum(sent)
    assert sink["ends"] == 1


@pytest.mark.parametrize(("example", "samplers"), [("fan_in", 4), ("two_layer", 8)])
def test_examples_deliver_every_message(tmp_path: Path, example: str, samplers: int) -> None:
    out = tmp_path / "stats"
    proc = evflow("up", str(EXAMPLES / f"{example}.toml"), "--stats-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    found = stats(out)
    check_delivery(found, samplers)
    assert "RUNNING on 1 host(s)" in proc.stderr
    assert all(v["host"] == "localhost" for v in found.values())


def test_three_hosts_example_on_three_local_agents(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(HOSTS3)
    out = tmp_path / "stats"
    proc = evflow(
        "up", str(EXAMPLES / "three_hosts.toml"), "--hosts", str(hosts), "--stats-dir", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    found = stats(out)
    check_delivery(found, 3)
    placed = {k: v["host"] for k, v in found.items()}
    assert placed == {
        "sampler_0": "h1",
        "sampler_1": "h2",
        "sampler_2": "h3",
        "merger": "h2",
        "sink": "h3",
    }


SLOW = """
name = "slow"
[devices.sampler]
class = "sampler"
instances = 2
hosts = ["h1"]
rate = 200
max_iterations = 1000
params = { msg_size = 100 }
channels = [{ name = "data", type = "dealer", connect = "merger.data-in" }]
[devices.far]
class = "sampler"
instances = 2
hosts = ["h2"]
expendable = EXPENDABLE
rate = 200
max_iterations = MAX_FAR
params = { msg_size = 100 }
channels = [{ name = "data", type = "dealer", connect = "merger.data-in" }]
[devices.merger]
class = "merger"
hosts = ["h1"]
channels = [
  { name = "data-in", type = "router", bind = true },
  { name = "data-out", type = "dealer", connect = "sink.data" },
]
[devices.sink]
class = "sink"
hosts = ["h1"]
channels = [{ name = "data", type = "router", bind = true }]
"""


def slow_topology(tmp_path: Path, expendable: bool, far_messages: int = 1000) -> tuple[Path, Path]:
    """Samplers on h1 and h2 (``far_*``; 0 messages = until stopped) -> merger -> sink."""
    topo = tmp_path / "slow.toml"
    text = SLOW.replace("EXPENDABLE", "true" if expendable else "false")
    topo.write_text(text.replace("MAX_FAR", str(far_messages)))
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(HOSTS3)
    return topo, hosts


def alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever adopted it is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def agent_pid(session: str, host: str) -> int:
    proc = evflow("status", "--session", session, "--json", timeout_s=30)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert {d["id"]: d["state"] for d in data["devices"]}["sink"] == "RUNNING"
    return int(next(h["agent_pid"] for h in data["hosts"] if h["name"] == host))


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_lost_host_with_expendable_devices_lets_the_rest_finish(tmp_path: Path, how: str) -> None:
    """SIGKILL (seen by the launcher) or SIGSTOP (seen by the missing heartbeat) of the
    agent of h2: its samplers (endless: they cannot have ended before) are lost,
    reported within 2 s; the merger stops waiting for their END and the sink's counts
    still check out."""
    topo, hosts = slow_topology(tmp_path, expendable=True, far_messages=0)
    out = tmp_path / "stats"
    session = f"loss{how}"
    proc = start_up(
        str(topo), "--hosts", str(hosts), "--session", session, "--stats-dir", str(out),
        quiet=False,
    )  # fmt: skip
    lines = Lines(proc)
    try:
        lines.wait_for("devices RUNNING", 60)
        pid = agent_pid(session, "h2")
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        reported_at = lines.wait_for("host 'h2' lost", 10)
        # the documented contract (docs/topology.md): a killed agent in well under 2 s, a
        # hung one after 1.7 s (heartbeat timeout + ping); the controller holds its
        # judgement while itself starved of CPU, so a loaded machine adds to it: 5 s
        assert reported_at - killed_at < 5.0
        code, text = lines.finish()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes its pipes, also after a failure
    assert code == 0, text
    assert "far_0, far_1 lost" in text
    assert ("no heartbeat for" if how == "hang" else "its agent exited with code -9") in text
    found = stats(out)
    sink = found["sink"]["sink"]
    assert sink["received"] == sink["announced"] > 0
    assert found["merger"]["forwarded"]["lost_peers"] == ["far_0", "far_1"]
    for dev in ("sampler_0", "sampler_1"):
        assert found[dev]["sampler"]["sent"] == 1000 and found[dev]["sampler"]["acked"] == 1
    # the end summary counts the two lost samplers (they sent no figures of their own)
    assert "slow: 2 of 6 devices lost after " in text, text
    kind = r"\n  sampler x4 +messages in \d+, out \d+ \(2 sent no figures\); lost 2\n"
    assert re.search(kind, text), text


def test_lost_host_below_n_min_stops_the_topology_with_one_message(tmp_path: Path) -> None:
    topo, hosts = slow_topology(tmp_path, expendable=False, far_messages=0)
    session = "lossfatal"
    proc = start_up(str(topo), "--hosts", str(hosts), "--session", session)
    lines = Lines(proc)
    try:
        lines.wait_for("devices RUNNING", 60)
        os.kill(agent_pid(session, "h2"), signal.SIGKILL)
        code, text = lines.finish()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes its pipes, also after a failure
    assert code == 1, text
    errors = [line for line in text.splitlines() if line.startswith("evflow: error:")]
    assert len(errors) == 1, text
    assert "host 'h2' lost" in errors[0]
    assert "device 'far' needs n_min=2 copies, 0 left (lost: far_0, far_1)" in errors[0]
    assert "stopping the topology" in errors[0]


def test_detach_status_ctl_and_down(tmp_path: Path) -> None:
    topo, hosts = slow_topology(tmp_path, expendable=False, far_messages=0)
    topo.write_text(topo.read_text().replace("max_iterations = 1000", "max_iterations = 0"))
    out = tmp_path / "stats"
    up = evflow(
        "up", str(topo), "--hosts", str(hosts), "--session", "det", "--detach",
        "--stats-dir", str(out),
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert "every device RUNNING" in up.stdout
    status = evflow("status", "--json")
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["session"] == "det" and data["phase"] == "running"
    assert {d["id"]: (d["host"], d["state"]) for d in data["devices"]} == {
        "sampler_0": ("h1", "RUNNING"),
        "sampler_1": ("h1", "RUNNING"),
        "far_0": ("h2", "RUNNING"),
        "far_1": ("h2", "RUNNING"),
        "merger": ("h1", "RUNNING"),
        "sink": ("h1", "RUNNING"),
    }
    table = evflow("status", "--session", "det")
    assert table.returncode == 0 and "far_1" in table.stdout and "h2" in table.stdout
    stop = evflow("ctl", "--session", "det", "STOP", "--select", "sampler_0|far_1")
    assert stop.returncode == 0, stop.stderr
    assert sorted(r["node_id"] for r in json.loads(stop.stdout)) == ["far_1", "sampler_0"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        data = json.loads(evflow("status", "--json").stdout)
        states = {d["id"]: d["state"] for d in data["devices"]}
        if states["sampler_0"] == states["far_1"] == "READY":
            break
        time.sleep(0.2)
    assert states["sampler_0"] == states["far_1"] == "READY", states
    assert states["sampler_1"] == states["far_0"] == "RUNNING"
    # the detached controller is no child of ours: check by pid that it and its agents go
    pids = [data["pid"], *(h["agent_pid"] for h in data["hosts"])]
    down = evflow("down", "--session", "det")
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 60
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "controller or agents outlived down"
    found = stats(out)
    sink = found["sink"]["sink"]
    assert sink["received"] == sink["announced"] > 0  # stopped early, nothing lost
    assert evflow("status").returncode == 1
    # down shows what the detached controller's summary says, not only "down"
    said = down.stdout.splitlines()
    assert said[-1] == "session det: down"
    assert said[0].startswith("slow: 6 devices ended cleanly after "), said
    samplers = [v for k, v in found.items() if k.startswith(("sampler", "far"))]
    assert said[1:-1] == [
        f"  sampler x4 messages in {sum(v['messages_in'] for v in samplers)}, "
        f"out {sum(v['messages_out'] for v in samplers)}",
        f"  merger x1  messages in {found['merger']['messages_in']}, "
        f"out {found['merger']['messages_out']}",
        f"  sink x1    messages in {found['sink']['messages_in']}, "
        f"out {found['sink']['messages_out']}; received {sink['received']} of "
        f"{sink['announced']} announced",
    ], said


def test_ctrl_c_during_start_up_leaves_nothing_behind(tmp_path: Path) -> None:
    topo, hosts = slow_topology(tmp_path, expendable=False)
    rng = random.Random(11)
    # moments from the command's start: evflow's imports, the agents' start, the spawn
    # and each step of FairMQ's sequence (RUNNING comes after about 1-2 s here)
    moments = [0.2, *(rng.uniform(0.4, 2.2) for _ in range(9))]
    runtime = Path(os.environ["EVFLOW_RUNTIME_DIR"])
    codes = []
    for i, delay in enumerate(moments):
        proc = start_up(str(topo), "--hosts", str(hosts), "--session", f"cc{i}")
        if i % 2:  # counted from the controller's start: these Ctrl-Cs come while it
            # starts the devices (a loaded machine may take all of 2.2 s to get there)
            wait_for_controller(f"cc{i}", proc)
            delay /= 2
        time.sleep(delay)  # the moment of the Ctrl-C: what this test varies
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise AssertionError(f"run {i}: evflow up did not stop after Ctrl-C") from None
        codes.append(proc.returncode)
        assert not list(runtime.iterdir()), f"run {i} left {list(runtime.iterdir())}"
        before_main = "init_import_site" in err or (
            "KeyboardInterrupt" in err and "evflow: " not in err
        )
        if before_main:
            continue  # the interpreter was starting or importing evflow: nothing ran yet
        # a SIGINT before the interpreter installs its handler kills it by the signal
        assert proc.returncode in (0, 130, -signal.SIGINT), f"at {delay:.2f} s: {err}"
        assert "Traceback" not in err, err
        if proc.returncode == 130:
            assert err.strip().splitlines()[-1] == "evflow: interrupted", err
    assert 130 in codes


def test_ctrl_c_before_anything_started_says_interrupted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a Ctrl-C while the topology file is read (evflow up's first 0.3 s) exited 130
    # without a word
    from evflow.cli import main, up

    load = up._load

    def interrupted_load(args: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)  # handled at once, on this (the main) thread
        return load(args)

    monkeypatch.setattr(up, "_load", interrupted_load)
    code = main(["up", str(EXAMPLES / "fan_in.toml"), "--quiet"])
    assert code == 130
    assert capsys.readouterr().err == "evflow: interrupted\n"


def test_killed_device_is_restarted_and_walked_back_to_running(tmp_path: Path) -> None:
    topo, hosts = slow_topology(tmp_path, expendable=False)
    h1 = 'instances = 2\nhosts = ["h1"]'
    text = topo.read_text().replace(h1, h1 + '\nrestart = "on-failure"')
    topo.write_text(text)
    out = tmp_path / "stats"
    session = "restart"
    proc = start_up(
        str(topo), "-v", "--hosts", str(hosts), "--session", session, "--stats-dir", str(out),
        quiet=False,
    )  # fmt: skip
    lines = Lines(proc)
    try:
        lines.wait_for("devices RUNNING", 60)
        data = json.loads(evflow("status", "--session", session, "--json").stdout)
        pid = next(d["pid"] for d in data["devices"] if d["id"] == "sampler_1")
        os.kill(pid, signal.SIGKILL)
        lines.wait_for("sampler_1 restarted and RUNNING again", 20)
        code, text = lines.finish()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes its pipes, also after a failure
    assert code == 0, text
    found = stats(out)
    assert found["sampler_1"]["sampler"]["sent"] == 1000  # the new process sent them all
    assert found["sampler_1"]["sampler"]["acked"] == 1
    sink = found["sink"]["sink"]
    assert sink["received"] == sink["announced"] >= 2000
    # the end summary counts the restart (and no loss: the new process ended cleanly)
    assert "slow: 6 devices ended cleanly, 1 restart after " in text, text
    assert re.search(r"\n  sampler x4 +messages in \d+, out \d+; restarts 1\n", text), text


def test_an_agent_that_cannot_start_is_one_error_naming_the_host(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'python3.11: no evflow on this host' >&2\nexit 3\n")
    fake.chmod(0o755)
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[hosts]\nh1 = {{ address = "127.0.0.1", python = "{fake}" }}\n')
    proc = evflow("up", str(EXAMPLES / "fan_in.toml"), "--hosts", str(hosts), "--quiet")
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("evflow: error:")]
    assert errors == [
        "evflow: error: host 'h1': the agent exited with code 3 before it reached the control "
        "bus: python3.11: no evflow on this host"
    ], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_device_failing_at_start_up_is_one_error_with_its_own_message(tmp_path: Path) -> None:
    topo = tmp_path / "t.toml"
    text = (EXAMPLES / "fan_in.toml").read_text()
    topo.write_text(text.replace('class = "merger"', 'class = "_topo_devices:FailsInInit"'))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "evflow", "up", str(topo), "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("evflow: error:")]
    assert len(errors) == 1, proc.stderr
    assert "device(s) merger lost" in errors[0]
    assert "calibration file /nonexistent/calib.db not found" in errors[0]


def test_a_device_failing_on_its_way_down_is_reported_not_restarted(tmp_path: Path) -> None:
    """``evflow down`` with a ``restart = "on-failure"`` device that fails in post_run
    (a sink whose counts do not add up after a restart, say): its agent used to restart
    it while the topology stopped, and the new process, ended by END in IDLE, replaced
    the failed one's report."""
    topo = tmp_path / "t.toml"
    topo.write_text(
        'name = "fails-on-stop"\n[devices.flaky]\nclass = "_topo_devices:FailsOnStop"\n'
        'restart = "on-failure"\n'
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    session = "failsonstop"
    proc = subprocess.Popen(
        [sys.executable, "-m", "evflow", "up", "--quiet", "--session", session, str(topo)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    lines = Lines(proc)
    try:
        lines.wait_for("devices RUNNING", 60)
        status = json.loads(evflow("status", "--session", session, "--json").stdout)
        pid = int(status["devices"][0]["pid"])
        down = evflow("down", "--session", session)
        assert down.returncode == 0, down.stderr
        code, text = lines.finish()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes its pipes, also after a failure
    assert code == 0, text  # a stop asked for: a failure on the way out is reported only
    assert "restarting flaky" not in text, text
    report = [line for line in text.splitlines() if line.startswith("flaky (localhost): lost:")]
    assert len(report) == 1 and "received 999 of 1000" in report[0], text
    assert not alive(pid)


def test_a_qc_repository_with_a_writer_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    # a second `evflow up qc_layers.toml` in the same directory started all 20 devices
    # and failed after ~15 s at INIT_TASK with 18 lines and a device traceback
    from evflow.qc.repository_device import lock_writer

    repo = tmp_path / "qc-layers.sqlite"
    with lock_writer(repo):  # the running topology's repository device holds this
        proc = subprocess.run(
            [sys.executable, "-m", "evflow", "up", str(EXAMPLES / "qc_layers.toml")],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"evflow: error: device 'repository': QC repository {repo.name} already has a writer "
        "(another qc-repository device or process holds its lock); give each writer its own file"
    ]
    assert repo.stat().st_size == 0  # nothing was written to it


def _kind_lines(text: str) -> dict[str, str]:
    """The end summary's per-kind lines: kind -> the figures after it."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"  (\S+) x(\d+) +(.*)$", line)
        if m:
            out[m.group(1)] = f"x{m.group(2)} {m.group(3)}"
    return out


def _figures(found: dict[str, dict[str, Any]], ids: list[str]) -> str:
    return (
        f"messages in {sum(found[i]['messages_in'] for i in ids)}, "
        f"out {sum(found[i]['messages_out'] for i in ids)}"
    )


@pytest.mark.parametrize("example", ["fan_in", "two_layer", "qc_layers", "three_hosts"])
def test_up_through_a_pipe_is_a_few_lines_and_a_summary_that_adds_up(
    tmp_path: Path, example: str
) -> None:
    # through a pipe `evflow up` printed ~150 INFO lines and ended with "done 20"; the
    # result (stored 182, lost 0) was only in the devices' logs
    out = tmp_path / "stats"
    path = str(EXAMPLES / f"{example}.toml")
    args = ["up", path, "--stats-dir", str(out)]
    hosts = None
    if example == "three_hosts":  # three agents on this machine
        (tmp_path / "hosts.toml").write_text(HOSTS3)
        args += ["--hosts", str(tmp_path / "hosts.toml")]
        hosts = load_hosts(str(tmp_path / "hosts.toml"))
    kind_of = {
        d.id: d.cls.split(":")[-1] for d in resolve(load_topology(path, hosts)).devices.values()
    }
    proc = subprocess.run(
        [sys.executable, "-m", "evflow", *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    found = stats(out)
    kinds: dict[str, list[str]] = {}
    for dev_id in found:
        kinds.setdefault(kind_of[dev_id], []).append(dev_id)
    name = lines[0].split(":")[0]
    assert re.fullmatch(rf"{name}: {len(found)} devices RUNNING on \d host\(s\) after .*", lines[0])
    assert re.fullmatch(rf"{name}: {len(found)} devices ended cleanly after [\d.]+ s", lines[1])
    assert len(lines) == 2 + len(kinds), proc.stderr  # nothing else: no INFO, no states
    said = _kind_lines(proc.stderr)
    assert set(said) == set(kinds)
    for kind, ids in kinds.items():
        assert said[kind].startswith(f"x{len(ids)} {_figures(found, ids)}"), (kind, said[kind])
    if "sink" in kinds:
        sink = found["sink"]["sink"]
        sent = sum(v["sampler"]["sent"] for v in found.values() if "sampler" in v)
        assert sink["received"] == sink["announced"] == sent
        assert said["sink"].endswith(f"; received {sent} of {sent} announced")
    if "qc-repository" in kinds:
        with Repository(tmp_path / "qc-layers.sqlite", readonly=True) as repo:
            versions = sum(len(repo.versions(p)) for p in repo.paths())
        assert versions > 0
        assert said["qc-repository"].endswith(f"; objects stored {versions}")


def test_up_verbose_shows_what_every_process_does(tmp_path: Path) -> None:
    proc = evflow("up", str(EXAMPLES / "fan_in.toml"), "-v")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "][INFO][localhost] " in proc.stderr  # the agent's and the devices' logs
    assert "fan-in: RUNNING 6" in proc.stdout.splitlines()  # the state lines
    assert "fan-in: 6 devices ended cleanly after " in proc.stderr

"""Network and agent faults under a topology spread over three namespace hosts (ssh, CURVE).

4 samplers on h1 and h2 (sampler_1 and sampler_3 on h2) -> a merger on h1 -> a sink on
h3, at 200 messages/s each. The faults hit h2 while the topology runs:

- a link cut shorter than the heartbeat timeout: TCP carries on, nothing is lost, every
  message arrives;
- a link cut longer than the loss detection (expendable samplers): h2 is lost within
  the bound, the rest goes on; when the link comes back, h2's agent is told to kill its
  devices and exit (they stay lost: no split brain), within a bound of the link's return;
- the same with ``expendable = false``: one error naming h2, the topology stops;
- a cut longer than the agent's own controller-lost time: h2 clears itself while cut;
- the agent alone SIGKILLed: the host is lost as fast as a killed host, its devices go
  with it.

After each: no process on any host, and no ipc file, shm segment or session directory
(the ``farm`` fixture and the autouse runtime-dir fixture check them too).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from _topo import Lines
from farm_hosts import NamespaceFarm
from test_topology_farm import SPREAD, assert_clean, errors_of, evflow, make_keys, start_up
from test_topology_up import check_delivery, stats

pytestmark = [pytest.mark.netns]

RATE_HZ = 200  # each sampler's rate (SPREAD)
LOST = ("sampler_1", "sampler_3")  # the samplers SPREAD places on h2
KEPT = ("sampler_0", "sampler_2")  # ... and on h1
#: a killed host is reported within this (test_topology_farm); a cut one within this
KILLED_BOUND_S = 2.0
CUT_BOUND_S = 2.5


def start(
    farm: NamespaceFarm, tmp_path: Path, session: str, *, expendable: bool, messages: int
) -> tuple[subprocess.Popen[str], Lines, Path]:
    """SPREAD over ssh with keys, each sampler sending ``messages``; returns once RUNNING."""
    topo = tmp_path / "spread.toml"
    text = SPREAD.replace("EXPENDABLE", "true" if expendable else "false")
    topo.write_text(text.replace("max_iterations = 1000", f"max_iterations = {messages}"))
    hosts = farm.write_hosts_file(tmp_path / "hosts.toml")
    keys = make_keys(farm, tmp_path / "keys")
    out = tmp_path / "stats"
    proc = start_up(
        farm, str(topo), "--hosts", str(hosts), "--launcher", "ssh", "--keys", str(keys),
        "--stats-dir", str(out), "--session", session,
    )  # fmt: skip
    lines = Lines(proc)
    try:
        lines.wait_for("devices RUNNING", 60)
    except BaseException:
        stop(proc)
        raise
    return proc, lines, out


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def session_procs(farm: NamespaceFarm, name: str) -> list[int]:
    """Processes on host ``name`` besides its daemons (the ssh session, guard, agent...)."""
    daemons = farm.daemon_pids(name)
    return [p for p in farm.pids(name) if p not in daemons]


def wait_empty(farm: NamespaceFarm, name: str, lines: Lines, timeout_s: float) -> float | None:
    """The monotonic time at which host ``name`` had no session process left (None if
    it still had one after ``timeout_s``); ``evflow up``'s lines are read meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not session_procs(farm, name):
            return time.monotonic()
        lines.wait_exit(0.05)
    return None


def cut_for(farm: NamespaceFarm, name: str, lines: Lines, seconds: float) -> tuple[float, float]:
    """Cut ``name``'s link for ``seconds`` (reading lines meanwhile); (cut, restored) times."""
    cut_at = time.monotonic()
    farm.cut_link(name)
    try:
        lines.wait_exit(seconds - (time.monotonic() - cut_at))
    finally:
        farm.restore_link(name)
    return cut_at, time.monotonic()


def sent(found: dict[str, dict[str, Any]], dev: str) -> int:
    return int(found[dev]["sampler"]["sent"])


def check_rest_delivered(found: dict[str, dict[str, Any]], messages: int) -> dict[str, Any]:
    """h1's samplers sent everything and had their END acknowledged; the merger forwarded
    all it took and the sink got all it was announced. Returns the merger's figures."""
    for dev in KEPT:
        assert sent(found, dev) == messages and found[dev]["sampler"]["acked"] == 1
    merger: dict[str, Any] = found["merger"]["forwarded"]
    sink = found["sink"]["sink"]
    assert sink["received"] == sink["announced"] == merger["sent"][0] == merger["received"]
    return merger


def test_short_link_cut_loses_nothing(farm: NamespaceFarm, tmp_path: Path) -> None:
    """0.5 s without a link (the heartbeat timeout is 1.2 s): TCP resends what was sent
    meanwhile; no host or device is lost and every message arrives."""
    proc, lines, out = start(farm, tmp_path, "cutshort", expendable=False, messages=1000)
    try:
        lines.wait_exit(0.5)
        cut_for(farm, "h2", lines, 0.5)
        code, text = lines.finish()
    finally:
        stop(proc)
    assert code == 0, text
    assert " lost" not in text, text  # neither a host nor a device nor a peer
    found = stats(out)
    check_delivery(found, 4)  # the sink got what the 4 samplers sent, every END acked
    assert all(sent(found, d) == 1000 for d in (*LOST, *KEPT))
    merger = found["merger"]["forwarded"]
    assert merger["received"] == merger["sent"][0] == 4000
    assert_clean(farm)


def test_long_link_cut_loses_the_host_and_a_returning_host_is_shut_down(
    farm: NamespaceFarm, tmp_path: Path
) -> None:
    """2 s without a link: h2 is lost (its samplers are expendable) and the rest goes on.
    The link comes back (TCP then resends what waited, after its backoff): h2's agent is
    heard again, is told to kill its devices and exit, and does so well before the
    topology ends; the lost samplers never finish their stream (no END of theirs is
    acknowledged), and what the merger took from them is no more than they could send
    while alive. The sink behind the merger still checks its counts."""
    messages = 1600  # 8 s at 200/s: the topology is still running when h2 comes back
    proc, lines, out = start(farm, tmp_path, "cutlong", expendable=True, messages=messages)
    try:
        running_at = lines.wait_for("devices RUNNING", 0)
        lines.wait_exit(0.5)
        cut_at, restored_at = cut_for(farm, "h2", lines, 2.0)
        lost_at = lines.wait_for("host 'h2' lost", 0)  # reported while the link was down
        empty_at = wait_empty(farm, "h2", lines, 6.0)
        still_running = proc.poll() is None
        code, text = lines.finish()
    finally:
        stop(proc)
    print(
        f"\nlink cut: h2 reported lost after {lost_at - cut_at:.2f} s; link back after "
        f"{restored_at - cut_at:.2f} s; h2 empty "
        + (f"{empty_at - restored_at:.2f} s after the link came back" if empty_at else "never")
    )
    assert lost_at - cut_at < CUT_BOUND_S
    assert empty_at is not None, f"h2's agent and devices outlived its loss: {text[-3000:]}"
    assert empty_at - restored_at < 4.0, "h2 was shut down too late after it came back"
    assert still_running, "the topology ended before h2 came back: the test proves nothing"
    assert code == 0, text
    came_back = [line for line in text.splitlines() if "host 'h2' came back" in line]
    assert len(came_back) == 1, text
    assert "sampler_1, sampler_3 stay lost" in came_back[0]
    for dev in LOST:
        assert f"{dev} (h2): lost: host 'h2' lost" in text, text
    found = stats(out)
    for dev in LOST:  # killed on return: no clean end, no acknowledged END
        assert dev not in found or found[dev]["sampler"]["acked"] == 0, found[dev]
    merger = check_rest_delivered(found, messages)
    assert merger["lost_peers"] == list(LOST)
    from_lost = merger["received"] - sum(sent(found, d) for d in KEPT)
    alive_s = empty_at - running_at + 0.5  # they ran from just before RUNNING was shown
    print(f"the merger took {from_lost} messages from the lost samplers (alive {alive_s:.1f} s)")
    assert 0 <= from_lost <= len(LOST) * (RATE_HZ * alive_s + 1), (from_lost, alive_s)
    assert found["sink"]["sink"]["lost_peers"] == []
    assert_clean(farm)


def test_long_link_cut_of_a_needed_host_stops_the_topology(
    farm: NamespaceFarm, tmp_path: Path
) -> None:
    """The same cut with ``expendable = false``: one error naming h2 and the group, the
    topology stops; the link comes back during the stop and h2 is cleared too."""
    proc, lines, _ = start(farm, tmp_path, "cutfatal", expendable=False, messages=0)
    try:
        lines.wait_exit(0.5)
        cut_at = time.monotonic()
        farm.cut_link("h2")
        try:
            lost_at = lines.wait_for("host 'h2' lost", 5)
        finally:
            farm.restore_link("h2")
        code, text = lines.finish(30)
    finally:
        stop(proc)
    assert lost_at - cut_at < CUT_BOUND_S
    assert code == 1, text
    errors = errors_of(text)
    assert len(errors) == 1, text
    assert errors[0].startswith("evflow: error: host 'h2' lost"), errors[0]
    assert (
        "device 'sampler' needs n_min=4 copies, 2 left (lost: sampler_1, sampler_3)" in (errors[0])
    )
    assert "stopping the topology" in errors[0]
    assert "Traceback" not in text
    assert_clean(farm)


def evflow_procs(farm: NamespaceFarm, name: str) -> list[int]:
    """The guard, agent, zygote and devices on ``name`` (not sshd's session process)."""
    out = []
    for pid in session_procs(farm, name):
        with contextlib.suppress(psutil.NoSuchProcess):
            if any("evflow" in arg for arg in psutil.Process(pid).cmdline()):
                out.append(pid)
    return out


def test_link_cut_longer_than_the_controller_lost_time_clears_the_host_while_cut(
    farm: NamespaceFarm, tmp_path: Path
) -> None:
    """A cut longer than the agent's controller-lost time (6 s): h2 is lost, and its
    agent, hearing nothing from the controller, stops its devices (SIGKILL after its
    grace: their sockets cannot drain) and exits, while the link is still down. The link
    comes back after that: nothing of h2 comes back with it (sshd's session ends too),
    and the rest of the topology finishes with the sink's counts checked."""
    messages = 2200  # 11 s at 200/s
    proc, lines, out = start(farm, tmp_path, "cutlonger", expendable=True, messages=messages)
    try:
        lines.wait_exit(0.5)
        cut_at = time.monotonic()
        farm.cut_link("h2")
        try:
            lost_at = lines.wait_for("host 'h2' lost", 5)
            cleared_at = None
            while cleared_at is None and time.monotonic() - cut_at < 12.0:
                lines.wait_exit(0.1)
                cleared_at = None if evflow_procs(farm, "h2") else time.monotonic()
            lines.wait_exit(7.0 - (time.monotonic() - cut_at))  # a cut of 7 s at least
        finally:
            farm.restore_link("h2")
        restored_at = time.monotonic()
        empty_at = wait_empty(farm, "h2", lines, 5.0)
        code, text = lines.finish()
    finally:
        stop(proc)
    print(
        f"\nlong cut: h2 lost after {lost_at - cut_at:.2f} s, its evflow processes gone "
        + (f"{cleared_at - cut_at:.2f} s after the cut" if cleared_at else "not within 12 s")
        + f"; link back after {restored_at - cut_at:.2f} s"
    )
    assert lost_at - cut_at < CUT_BOUND_S
    assert cleared_at is not None, "h2's agent and devices outlived a 12 s cut"
    assert empty_at is not None, "h2's ssh session outlived the link's return by 5 s"
    assert code == 0, text
    assert "came back" not in text, text  # nothing was left to come back
    found = stats(out)
    assert check_rest_delivered(found, messages)["lost_peers"] == list(LOST)
    assert_clean(farm)


def agent_pid(farm: NamespaceFarm, session: str, host: str) -> int:
    status = evflow(farm, "status", "--session", session, "--json")
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    return int(next(h["agent_pid"] for h in data["hosts"] if h["name"] == host))


def test_killed_agent_alone_is_a_lost_host(farm: NamespaceFarm, tmp_path: Path) -> None:
    """SIGKILL of h2's agent process only (not its guard, not sshd): its devices die
    with it (PDEATHSIG), the host is reported lost as fast as a killed host, the rest
    finishes with the sink's counts checked, and nothing is left on h2."""
    messages = 1000
    proc, lines, out = start(farm, tmp_path, "agentkill", expendable=True, messages=messages)
    try:
        pid = agent_pid(farm, "agentkill", "h2")
        assert pid in session_procs(farm, "h2"), "the agent does not run in h2's namespace"
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        lost_at = lines.wait_for("host 'h2' lost", 10)
        empty_at = wait_empty(farm, "h2", lines, 10)
        code, text = lines.finish()
    finally:
        stop(proc)
    print(
        f"\nkilled agent: h2 lost after {lost_at - killed_at:.2f} s, empty "
        + (f"after {empty_at - killed_at:.2f} s" if empty_at else "never")
    )
    assert lost_at - killed_at < KILLED_BOUND_S
    assert empty_at is not None and empty_at - killed_at < 5.0
    host_line = next(line for line in text.splitlines() if "host 'h2' lost" in line)
    assert "its agent exited with code" in host_line or "no heartbeat" in host_line, host_line
    for dev in LOST:
        assert f"{dev} (h2): lost" in text, text
    assert code == 0, text
    found = stats(out)
    check_rest_delivered(found, messages)
    assert_clean(farm)

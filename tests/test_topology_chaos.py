"""Chaos for a running topology: devices of ``evflow up`` SIGKILLed at random while data
flows, each time checked to come back and carry the data again.

4 endless samplers (200 msg/s each) -> 2 mergers -> a top merger -> a sink, one host,
ipc channels, every device ``restart = "on-failure"`` (the default ``max_restarts = 3``;
no device is killed more than 3 times). A seeded RNG (printed and named in every
failure; ``EVFLOW_CHAOS_SEED=N`` replays one, ``=random`` explores a new one, the
default is DEFAULT_SEED) plans rounds of kills at random moments:
one device, two devices within 0.5 s, or one device killed and its new process killed
again while the controller walks it back; binders (mergers, sink) and connectors
(samplers, and the mergers' outputs) alike. Checked, each something docs/topology.md
promises ("Hosts lost, devices lost, desired state", "Stopping"):

- after each round, every killed device is back within RESTART_BOUND_S: a new pid,
  RUNNING in ``evflow status``, ``restarts`` counting its kills; no other device has a
  new pid; the controller runs on and has logged no loss and no error (n_min holds);
- data then flows end to end again within FLOW_BOUND_S: the message counters of every
  device (``evflow ctl get-metrics``) grow by more than its buffers could take while
  its peer is gone (a sender with no live peer stalls once 50 messages wait);
- ``evflow down`` stops it all: nothing is restarted on the way down, the controller
  exits 0 and leaves no process, ipc file, session directory or shm segment behind
  (conftest.py checks it once more).

Message counts are not checked: devices have no ledger, and what was in flight to or
from a killed process is gone (the sink may end in ERROR on its count check at the end).

It takes about 45 s. With the controller's hand-back of a restarted binder's endpoints
taken out (the old hang: a fresh ipc path nobody connects to), it fails at the first
round that kills a binder ("data does not flow"); before the agents stopped restarting
during ``evflow down``, it failed in 2 of 11 runs (a sink at max_restarts failing its
count check on the way down: "giving up").
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
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest

from _topo import Lines

SAMPLERS = [f"sampler_{i}" for i in range(4)]
BINDERS = ["merger_0", "merger_1", "top", "sink"]  # the mergers also connect (data-out)
DEVICES = [*SAMPLERS, *BINDERS]
MAX_KILLS = 3  # per device: the default max_restarts; one more would be a loss
# a restart takes the backoff (0.1 s, doubled per restart: 0.4 s at most here), the
# agent's next heartbeat (0.25 s) and the controller's walk of 6 steps, each looked at
# again every 0.4 s: about 3 s on an idle 2-core machine; 15 s leaves room for the load
# of other jobs and still tells a slow restart from one that never comes
RESTART_BOUND_S = 15.0
# the counters are read about 1.5 s apart (a pause and ``ctl``'s 1 s of collecting):
# a flowing sampler passes about 300 messages in that time, the mergers 600, the top
# merger and the sink 1200; a device behind or before a broken link stalls at once or
# once its 50-message buffer is full
FLOW_MIN = 120
FLOW_BOUND_S = 15.0
# the whole chaos before ``evflow down`` (about 40 s): past it the test fails by itself,
# with the seed and the controller's words, before pytest's timeout would kill it
CHAOS_BUDGET_S = 120.0

TOPOLOGY = """
name = "chaos"

[devices.sampler]
class = "sampler"
instances = 4
rate = 200
max_iterations = 0
restart = "on-failure"
params = { msg_size = 64 }
channels = [{ name = "data", type = "dealer", connect = "merger.data-in", sndBufSize = 50 }]

[devices.merger]
class = "merger"
instances = 2
restart = "on-failure"
channels = [
  { name = "data-in", type = "router", bind = true, rcvBufSize = 50 },
  { name = "data-out", type = "dealer", connect = "top.data-in", sndBufSize = 50 },
]

[devices.top]
class = "merger"
restart = "on-failure"
channels = [
  { name = "data-in", type = "router", bind = true, rcvBufSize = 50 },
  { name = "data-out", type = "dealer", connect = "sink.data", sndBufSize = 50 },
]

[devices.sink]
class = "sink"
restart = "on-failure"
channels = [{ name = "data", type = "router", bind = true, rcvBufSize = 50 }]
"""

# what the controller says when a device is lost or the topology fails
TROUBLE = re.compile(r"evflow: error|lost: tolerated|device \S+ on host \S+ lost|giving up")
RESTARTING = re.compile(r"\] restarting \S+ \(restart \d+")  # an agent starts a new process


def evflow(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evflow", *args], capture_output=True, text=True, timeout=timeout_s
    )


def plan_rounds(rng: random.Random) -> list[tuple[str, list[str]]]:
    """Rounds of (kind, victims): a binder and another device within 0.5 s, a device
    killed again while it is walked back, a sampler alone, then two rounds of any kind."""
    kills: Counter[str] = Counter()

    def pick(among: list[str], but: str = "", n: int = 1) -> str:
        dev = rng.choice([d for d in among if d != but and kills[d] + n <= MAX_KILLS])
        kills[dev] += n
        return dev

    first = pick(BINDERS)
    rounds = [("two", [first, pick(DEVICES, but=first)])]
    rounds.append(("again", [pick(DEVICES, n=2)]))
    rounds.append(("one", [pick(SAMPLERS)]))
    for _ in range(2):
        kind = rng.choice(["one", "two", "again"])
        if kind == "one":
            rounds.append((kind, [pick(DEVICES)]))
        elif kind == "two":
            dev = pick(DEVICES)
            rounds.append((kind, [dev, pick(DEVICES, but=dev)]))
        else:
            rounds.append((kind, [pick(DEVICES, n=2)]))
    rng.shuffle(rounds)
    return rounds


class Chaos:
    """A running ``evflow up`` and what the test did to it (for the failure message)."""

    def __init__(self, proc: subprocess.Popen[str], session: str, seed: int) -> None:
        self.proc = proc
        self.lines = Lines(proc)
        self.session = session
        self.seed = seed
        self.t0 = time.monotonic()
        self.log: list[str] = []
        self.killed: Counter[str] = Counter()
        self.dead_pids: set[int] = set()
        self.pids: dict[str, int] = {}

    def note(self, what: str) -> None:
        self.log.append(f"{time.monotonic() - self.t0:6.2f} s  {what}")

    def pause(self, seconds: float) -> None:
        """Sleep while reading the controller's output (its pipe must not fill up)."""
        assert not self.lines.wait_exit(seconds), "evflow up ended during the chaos"
        spent = time.monotonic() - self.t0
        assert spent < CHAOS_BUDGET_S, f"the chaos took more than {CHAOS_BUDGET_S} s"

    def status(self) -> dict[str, Any]:
        out = evflow("status", "--session", self.session, "--json")
        assert out.returncode == 0, f"evflow status failed: {out.stderr}"
        data: dict[str, Any] = json.loads(out.stdout)
        return data

    def devices(self) -> dict[str, dict[str, Any]]:
        data = self.status()
        assert data["phase"] == "running", data
        assert not any(h["lost"] for h in data["hosts"]), data["hosts"]
        return {d["id"]: d for d in data["devices"]}

    def kill(self, dev: str, pid: int) -> None:
        # only a process of this topology (a pid the status named may be gone already)
        mine = {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        assert pid in mine, f"{dev}: pid {pid} is not a process of this topology"
        os.kill(pid, signal.SIGKILL)
        self.killed[dev] += 1
        self.dead_pids.add(pid)
        self.note(f"SIGKILL {dev} (pid {pid}, kill {self.killed[dev]})")

    def new_pid(self, dev: str, timeout_s: float) -> int:
        """The pid of ``dev``'s next process, as soon as its agent reports it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid = self.devices()[dev]["pid"]
            if pid not in self.dead_pids and pid is not None:
                return int(pid)
            self.pause(0.05)
        raise AssertionError(f"{dev} not restarted within {timeout_s} s")

    def run_round(self, rng: random.Random, kind: str, victims: list[str]) -> None:
        self.pause(rng.uniform(0.2, 1.5))  # a random moment of the flow
        if kind == "again":
            (dev,) = victims
            self.kill(dev, self.pids[dev])
            pid = self.new_pid(dev, RESTART_BOUND_S)
            self.pause(rng.uniform(0.0, 1.5))  # somewhere in its walk back to RUNNING
            self.kill(dev, pid)
        else:
            for i, dev in enumerate(victims):
                if i:
                    self.pause(rng.uniform(0.0, 0.5))
                self.kill(dev, self.pids[dev])
        self.wait_recovered(victims)
        self.wait_flow()

    def wait_recovered(self, victims: list[str]) -> None:
        """Every device RUNNING, the victims in new processes, the others in their own."""
        started = time.monotonic()
        deadline = started + RESTART_BOUND_S
        while True:
            devs = self.devices()
            waiting = [
                d
                for d in victims
                if devs[d]["pid"] in self.dead_pids
                or devs[d]["restarts"] != self.killed[d]
                or (devs[d]["state"], devs[d]["process"]) != ("RUNNING", "running")
            ]
            if not waiting:
                break
            assert time.monotonic() < deadline, (
                f"not RUNNING again within {RESTART_BOUND_S} s: "
                + ", ".join(f"{d} {devs[d]}" for d in waiting)
            )
            self.pause(0.3)
        self.note(f"{', '.join(victims)} RUNNING again after {time.monotonic() - started:.1f} s")
        for d, row in devs.items():
            assert (row["state"], row["process"]) == ("RUNNING", "running"), row
            assert row["restarts"] == self.killed[d], row
            if d not in victims:
                assert row["pid"] == self.pids[d], f"{d} restarted but was not killed: {row}"
        self.pids = {d: int(row["pid"]) for d, row in devs.items()}
        trouble = [line for _, line in self.lines.seen if TROUBLE.search(line)]
        assert not trouble, trouble

    def counters(self) -> dict[str, dict[str, Any]]:
        out = evflow("ctl", "--session", self.session, "get-metrics", "--timeout", "1")
        assert out.returncode == 0, f"evflow ctl get-metrics failed: {out.stderr}"
        return {m["node_id"]: m for m in json.loads(out.stdout) if m["node_id"] in DEVICES}

    def wait_flow(self) -> None:
        """Each device's counters grow by FLOW_MIN in one process: every link carries data."""
        started = time.monotonic()
        deadline = started + FLOW_BOUND_S
        base = self.counters()
        while True:
            self.pause(0.3)
            now = self.counters()
            short: dict[str, Any] = {}
            for dev in DEVICES:
                if dev not in now or dev not in base:
                    short[dev] = "no answer"
                    continue
                assert now[dev]["pid"] == base[dev]["pid"] == self.pids[dev], (
                    f"{dev} has a new process nobody killed: {base[dev]['pid']} -> "
                    f"{now[dev]['pid']} (known {self.pids[dev]})"
                )
                kinds = ["messages_out"] if dev in SAMPLERS else ["messages_in"]
                kinds += ["messages_out"] if dev.startswith(("merger", "top")) else []
                grown = {k: now[dev][k] - base[dev][k] for k in kinds}
                if min(grown.values()) < FLOW_MIN:
                    short[dev] = grown
            if not short:
                break
            assert time.monotonic() < deadline, (
                f"data does not flow within {FLOW_BOUND_S} s (messages since "
                f"{time.monotonic() - started:.1f} s ago): {short}"
            )
        self.note(f"data flows through every device ({time.monotonic() - started:.1f} s)")

    def down(self) -> None:
        """``evflow down``: the controller exits 0 and nothing of the session is left."""
        tree = psutil.Process(self.proc.pid).children(recursive=True)
        restarts = sum(1 for _, line in self.lines.seen if RESTARTING.search(line))
        self.note(f"evflow down ({len(tree)} processes below the controller)")
        out = evflow("down", "--session", self.session, timeout_s=60)
        assert out.returncode == 0, f"evflow down failed: {out.stderr}"
        assert self.lines.wait_exit(30), "evflow up did not end after evflow down"
        code, text = self.lines.finish(30)
        assert code == 0, f"evflow up exited with {code} after down"
        trouble = [line for line in text.splitlines() if TROUBLE.search(line)]
        assert not trouble, trouble
        # a device failing on its way down (the sink's count check) is not restarted
        late = [line for line in text.splitlines() if RESTARTING.search(line)][restarts:]
        assert not late, f"restarted during the stop: {late}"
        left = []
        for p in tree:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
            except psutil.NoSuchProcess:
                pass
        assert not left, f"processes outlived evflow down: {left}"
        runtime = Path(os.environ["EVFLOW_RUNTIME_DIR"])
        files = [str(p) for p in runtime.rglob("*")]
        assert not files, f"ipc files or session directories left: {files}"
        shm = [n for n in os.listdir("/dev/shm") if n.startswith(f"evflow-{self.session}")]
        assert not shm, f"shm segments left: {shm}"
        self.note("down: nothing left")

    def output_tail(self) -> str:
        said = [line for _, line in self.lines.seen if "msg/s" not in line]
        return "\n".join(said[-60:])


#: the seed CI runs (one that passed in a loop): a red CI must be replayable as it is;
#: ``EVFLOW_CHAOS_SEED=random`` explores a new one, ``EVFLOW_CHAOS_SEED=N`` replays N
DEFAULT_SEED = 17


def chaos_seed() -> int:
    given = os.environ.get("EVFLOW_CHAOS_SEED", "")
    if given == "random":
        return random.SystemRandom().randrange(2**32)
    return int(given) if given else DEFAULT_SEED


@pytest.mark.chaos
@pytest.mark.timeout(300)  # CHAOS_BUDGET_S, then evflow down's own bounds (60 + 30 + 30 s)
def test_random_kills_of_a_running_topology_restart_and_data_flows_again(
    tmp_path: Path,
) -> None:
    seed = chaos_seed()
    print(f"chaos seed {seed} (EVFLOW_CHAOS_SEED={seed} replays it)")
    rng = random.Random(seed)
    rounds = plan_rounds(rng)
    topo = tmp_path / "chaos.toml"
    topo.write_text(TOPOLOGY)
    session = f"chaos{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "evflow", "up", "--quiet", "-v", "--session", session, str(topo)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    chaos = Chaos(proc, session, seed)
    chaos.note(f"plan: {rounds}")
    try:
        chaos.lines.wait_for("devices RUNNING", 60)
        chaos.pids = {d: int(row["pid"]) for d, row in chaos.devices().items()}
        chaos.wait_flow()  # the check sees the flow before it is asked to see it again
        for kind, victims in rounds:
            chaos.run_round(rng, kind, victims)
        chaos.down()
    except Exception as exc:  # any failure: stop the topology, name the seed
        if proc.poll() is None:  # Ctrl-C: the orderly stop, for conftest's checks
            proc.send_signal(signal.SIGINT)
            chaos.lines.wait_exit(30)
        raise AssertionError(
            f"chaos seed {seed} (EVFLOW_CHAOS_SEED={seed} replays it): {exc}\n"
            "what the test did:\n" + "\n".join(chaos.log) + "\n"
            "evflow up's last lines (rate lines left out):\n" + chaos.output_tail()
        ) from exc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes its pipes, also after a failure
    print("\n".join(chaos.log))
    assert sum(chaos.killed.values()) >= 6, chaos.killed


# --- whole topologies, from start to end (issue 21, "A chaos test for topologies") ------
#
# Three kinds of ``evflow up`` topology, every device ``restart = "on-failure"``: data
# (3 samplers -> merger -> proxy -> splitter -> sink), QC (4 toy sources -> 4
# producers -> 2 mergers -> 1 -> a repository, the mergers checkpointing) and the
# trigger chain (replay as 3 fragment streams -> event builder -> sink). Each run
# follows a seeded plan (tests/_topo_chaos.py): devices SIGKILLed at random moments,
# hostile messages on the bus and on every data and qc-in socket, and in about one run
# of four the controller SIGINTed or SIGKILLed. Each must end within END_BOUND_S with
# exact counts (sink received = announced; QC: the final objects equal the sequential
# fill bin by bin) or with one error line naming a device, and leave nothing behind.
# ``benchmarks/bench_topology_chaos.py`` runs the same plans by the dozen.

#: runs per kind in CI: seeds DEFAULT_SEED (or EVFLOW_CHAOS_SEED) + 0 .. RUNS_PER_KIND-1
RUNS_PER_KIND = 4


@pytest.mark.chaos
@pytest.mark.timeout(300)  # a run's own bounds: END_BOUND_S, 30 s for a Ctrl-C, the cleanup
@pytest.mark.parametrize("kind", ["data", "qc", "trigger"])
@pytest.mark.parametrize("i", range(RUNS_PER_KIND))
def test_chaos_runs_of_whole_topologies_end_exactly_or_with_one_clear_error(
    kind: str, i: int
) -> None:
    from _topo_chaos import chaos_seed, plan_run, run_once

    seed = chaos_seed() + i
    plan = plan_run(kind, seed)
    print(f"chaos seed {seed} (EVFLOW_CHAOS_SEED={seed - i} replays it): {plan.describe()}")
    out = run_once(plan)
    print(out.line())
    assert out.ok, f"EVFLOW_CHAOS_SEED={seed - i} replays it: " + out.report()

"""``qc-repository`` as a real process: producers -> merger(s) -> checks -> SQLite.

Producers are forked and run ``evflow.qc.toy.ToyQc`` (as ``test_qc_layers`` does) over their
share of a deterministic event stream; mergers are ``qc-merger`` devices; the repository is
``evflow device qc-repository`` (exec'd) with a check suite from a TOML file in which
one check passes, one fails and one raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from evflow.errors import InputError
from evflow.qc.layers import build_layers, launch_layers
from evflow.qc.repository import Repository
from evflow.runtime.supervisor import Supervisor
from evflow.transport.channel import parse_channel_config
from evflow.transport.opening import open_channel
from evflow.transport.paths import session_dir
from evflow.wire.messages import MsgType, encode_message

sys.path.insert(0, str(Path(__file__).parent))
from test_qc_layers import RUN, reference, run_producer
from test_qc_merger_device import ctl_metrics

CHECKS = """
[checks.h1_mean]
type = "mean_in_range"
objects = ["qc/det/h1"]
min = 0.3
max = 0.7

[checks.h2_mean]
type = "mean_in_range"
objects = ["qc/det/h2"]
min = 5.0
max = 6.0

[checks.h3_raises]
type = "function"
objects = ["qc/det/h3"]
function = "math:sqrt"

[aggregators.det]
type = "worst_of"
checks = ["h1_mean", "h2_mean"]
"""
NAMES = ["count", "h1", "h2", "h3", "hn", "rows", "sums"]
EXPECTED_QUALITY = {"h1": "Good", "h2": "Bad", "h3": "Null"}


def repository_argv(
    sup: Supervisor, repo: Path, checks: Path, address: str, *extra: str
) -> list[str]:
    argv = [
        sys.executable, "-m", "evflow", "device", "qc-repository", "--id", "qc-repository",
        "--session", sup.session, "--severity", "warn", "--repo", str(repo),
        "--checks", str(checks), "--channel-config",
        f"name=qc-in,type=pull,method=bind,address={address}", *extra,
    ]  # fmt: skip
    if sup.bus_endpoints:
        argv += ["--bus", str(sup.bus_endpoints)]
    return argv


def wait_for(sup: Supervisor, until: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        sup.poll(0.1)


def start_run(
    sup: Supervisor,
    tmp_path: Path,
    p: int,
    n_events: int,
    layout: list[int],
    repo_address: str,
    out_type: str = "push",
) -> str:
    """Mergers (forked) and producers; returns the top merger's name."""
    producers = [f"prod-{j}" for j in range(p)]
    specs, routes = build_layers(producers, layout)
    launch_layers(sup, specs[:-1], state_dir=tmp_path, cycle_s=0.1, run_number=RUN)
    launch_layers(sup, specs[-1:], out_address=repo_address, out_type=out_type,
                  state_dir=tmp_path, cycle_s=0.1, run_number=RUN)  # fmt: skip
    for j, src in enumerate(producers):
        sup.add_function(src, run_producer, j, p, n_events, routes[src], sup.session)
    return specs[-1].id


def check_repository(repo_path: Path, n_events: int, top: str) -> dict[str, int]:
    """Every cycle of every object stored with its quality; the last one equals the
    sequential fill. Returns the number of versions per object."""
    ref = reference(list(range(n_events)))
    counts = {}
    with Repository(repo_path, readonly=True) as repo:
        assert repo.paths() == [f"qc/det/{n}" for n in NAMES]
        for name in NAMES:
            versions = repo.versions(f"qc/det/{name}")  # newest first
            cycles = [v.cycle for v in reversed(versions)]
            assert cycles == list(range(cycles[0], cycles[0] + len(cycles))), (name, cycles)
            assert len(cycles) >= 3 and versions[0].metadata["final"]
            assert all(v.metadata["merger"] == top for v in versions)
            assert all(v.quality == EXPECTED_QUALITY.get(name) for v in versions), name
            # validity intervals chain: each version ends where the next begins
            for older, newer in zip(versions[1:], versions, strict=False):
                assert older.valid_until == newer.valid_from
            latest = repo.latest(f"qc/det/{name}")
            assert latest is not None and latest.event_count == n_events
            assert latest.completeness["missing"] == []
            counts[name] = len(versions)
        for name in ("h1", "h2", "h3", "hn"):
            got = repo.latest(f"qc/det/{name}")
            assert got is not None
            assert np.array_equal(got.obj.view(flow=True), ref[name].view(flow=True)), name
        assert repo.latest("qc/det/count").obj == n_events  # type: ignore[union-attr]
        rows = repo.latest("qc/det/rows").obj.sorted_by("i")  # type: ignore[union-attr]
        assert np.array_equal(rows["i"], np.arange(n_events))
        # the failing check says why; the raising one gives Null with the exception
        h2 = repo.latest_info("qc/det/h2")
        assert h2 is not None and any(f.name for f in h2.flags)
        h3 = repo.latest_info("qc/det/h3")
        assert h3 is not None and any("check_raised" in f.name for f in h3.flags)
        assert len(repo.qualities("h1_mean")) == counts["h1"]
        agg = repo.qualities("det")
        assert agg and agg[0].quality == "Bad"  # worst of Good and Bad
    return counts


def test_producers_merger_repository_device_store_every_cycle(tmp_path: Path) -> None:
    n_events, p = 3000, 3
    repo_path, checks = tmp_path / "qc.sqlite", tmp_path / "checks.toml"
    checks.write_text(CHECKS)
    address = "ipc://qc-repo-in"
    context: zmq.Context[Any] = zmq.Context()
    sup = Supervisor(bus=True).start()
    junk = None
    try:
        # inputs 0: it runs until stopped, so that the test can read its metrics at the end
        sup.add_command("qc-repository", repository_argv(sup, repo_path, checks, address),
                        device_id="qc-repository")  # fmt: skip
        # a PUSH qc-out delivers only once connected: the repository binds first
        ipc_file = session_dir(sup.session) / address.removeprefix("ipc://")
        wait_for(sup, ipc_file.exists, 30, "the repository device to bind")
        top = start_run(sup, tmp_path, p, n_events, [1], address)
        wait_for(sup, lambda: sup.processes[top].state == "done", 60, "the merger's end")
        wait_for(sup, lambda: ctl_metrics(sup, "qc-repository")["qc_repository"]["ends"] == 1,
                 30, "the merger's END at the repository")  # fmt: skip
        wait_for(sup, lambda: all(sup.processes[f"prod-{j}"].state == "done" for j in range(p)),
                 30, "the producers' end")  # fmt: skip
        metrics = ctl_metrics(sup, "qc-repository")["qc_repository"]
        counts = check_repository(repo_path, n_events, top)
        total = sum(counts.values())
        assert metrics["received"] == metrics["stored"] == total
        assert metrics["pending"] == 0 and metrics["gaps"] == 0 and metrics["lost"] == 0
        assert metrics["qualities"] == {
            "Good": counts["h1"], "Bad": counts["h2"], "Null": counts["h3"],
            "unchecked": total - counts["h1"] - counts["h2"] - counts["h3"],
        }  # fmt: skip
        assert metrics["mergers"] == {top: total}

        # a second writer on the same file is refused, with one clear line
        second = subprocess.run(
            repository_argv(sup, repo_path, checks, "ipc://qc-repo-in-2")[:-2],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 1
        # the device framework logs a hook's exception (with its traceback), then the
        # command ends with one line naming the device and the problem
        assert second.stderr.splitlines()[-1] == (
            "evflow: error: device 'qc-repository': ConfigurationError: QC repository "
            f"{repo_path} already has a writer (another qc-repository device or process "
            "holds its lock); give each writer its own file"
        )

        # garbage on its socket: random frames, a RESULT that is no publication, a
        # publication with a broken object; counted and dropped, the device lives on
        (cfg,) = parse_channel_config(f"name=junk,type=push,method=connect,address={address}")
        junk = open_channel(context, cfg, sup.session)
        junk.send([os.urandom(40)])
        junk.send(encode_message(MsgType.RESULT, {"x": 1}, [b"1"]))
        header = {"qc": 1, "src": "m", "path": "qc/x/y", "task": "x", "name": "y", "run": 1,
                  "cycle": 1, "seq": 1, "events": 1, "completeness": {}, "created": 1.0,
                  "metadata": {}}  # fmt: skip
        junk.send(encode_message(MsgType.RESULT, header, [b"\xc1garbage"]))
        junk.send(encode_message(MsgType.EVENTS, {}, []))
        wait_for(sup, lambda: sum(ctl_metrics(sup, "qc-repository")["qc_repository"]["dropped"]
                                  .values()) >= 4, 30, "the garbage to be counted")  # fmt: skip
        after = ctl_metrics(sup, "qc-repository")
        assert after["qc_repository"]["dropped"] == {"bad_message": 1, "garbage": 2,
                                                     "unexpected": 1}  # fmt: skip
        assert after["qc_repository"]["stored"] == total
        assert after["node_state"] == "RUNNING"

        ls = subprocess.run(
            [sys.executable, "-m", "evflow", "qc", "ls", "--repo", str(repo_path)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert ls.returncode == 0, ls.stderr
        lines = ls.stdout.splitlines()
        assert [line.split()[0] for line in lines] == [f"qc/det/{n}" for n in NAMES]
        for line, name in zip(lines, NAMES, strict=True):
            assert line.split()[1:5] == ["run", str(RUN), "cycle",
                                         str(check_cycle(repo_path, name))]  # fmt: skip
            assert line.split()[-1] == EXPECTED_QUALITY.get(name, "-")
    finally:
        if junk is not None:
            junk.close(0)
        sup.shutdown()
        sup.close()
        context.term()
    assert sup.processes["qc-repository"].returncode == 0  # stopped in order


def check_cycle(repo_path: Path, name: str) -> int:
    with Repository(repo_path, readonly=True) as repo:
        info = repo.latest_info(f"qc/det/{name}")
        assert info is not None
        return info.cycle


def test_two_merger_layers_feed_the_repository_device(tmp_path: Path) -> None:
    n_events, p = 3000, 4
    repo_path, checks, stats = tmp_path / "qc.sqlite", tmp_path / "checks.toml", tmp_path / "s"
    checks.write_text(CHECKS)
    address = "ipc://qc-repo-layers"
    sup = Supervisor(bus=False).start()
    try:
        # inputs 1: it ends after the top merger's END, having stored everything. The top
        # merger's qc-out is a DEALER and the repository's qc-in a ROUTER: the merger
        # re-sends END (and its final publications) until the repository acknowledges,
        # so everything starts at once, in any order
        argv = repository_argv(sup, repo_path, checks, address, "--inputs", "1",
                               "--stats-file", str(stats))  # fmt: skip
        sup.add_command("qc-repository", [a.replace("type=pull", "type=router") for a in argv])
        top = start_run(sup, tmp_path, p, n_events, [2, 1], address, out_type="dealer")
        assert top == "qc-merger-1-0"
        wait_for(sup, lambda: sup.processes["qc-repository"].state == "done", 90,
                 "the repository device's end")  # fmt: skip
        assert sup.processes[top].state == "done"
    finally:
        sup.shutdown()
        sup.close()
    counts = check_repository(repo_path, n_events, top)
    summary = json.loads(stats.read_text())["qc_repository"]
    assert summary["stored"] == summary["received"] == sum(counts.values())
    assert summary["ends"] == 1 and summary["pending"] == 0
    with Repository(repo_path, readonly=True) as repo:
        latest = repo.latest_info("qc/det/h1")
        assert latest is not None
        assert latest.completeness["ended"] == [f"prod-{j}" for j in range(p)]
        assert latest.completeness["mergers"]["ended"] == ["qc-merger-0-0", "qc-merger-0-1"]


def test_bad_checks_file_and_missing_repo_are_one_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[checks.x\ntype=1")
    base = [sys.executable, "-m", "evflow", "device", "qc-repository", "--id", "r", "--session",
            "qcrepobad", "--severity", "error", "--channel-config",
            "name=qc-in,type=pull,method=bind,address=ipc://r-in"]  # fmt: skip
    out = subprocess.run([*base, "--repo", str(tmp_path / "q.sqlite"), "--checks", str(broken)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1
    assert f"check config {broken} is not valid TOML" in out.stderr.splitlines()[-1]
    out = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--repo PATH is required" in out.stderr


def test_repository_channel_must_receive(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "evflow", "device", "qc-repository", "--id", "r", "--session",
         "qcrepobad2", "--severity", "error", "--repo", str(tmp_path / "q.sqlite"),
         "--channel-config", "name=qc-in,type=push,method=bind,address=ipc://r-in2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1 and "must receive (pull or router)" in out.stderr


def test_repository_device_killed_mid_run_restarts_and_stores_the_final_objects(
    tmp_path: Path,
) -> None:
    """SIGKILL of the repository device mid-run: the supervisor restarts it on the same
    file (the kernel dropped its lock, SQLite's WAL recovers), the merger's final
    publications are re-sent until acknowledged, the end result is exact."""
    n_events, p = 24_000, 2
    repo_path, checks = tmp_path / "qc.sqlite", tmp_path / "checks.toml"
    checks.write_text(CHECKS)
    address = "ipc://qc-repo-kill"
    sup = Supervisor(bus=False).start()
    try:
        argv = repository_argv(sup, repo_path, checks, address, "--inputs", "1")
        sup.add_command("qc-repository", [a.replace("type=pull", "type=router") for a in argv],
                        restart="on-failure", max_restarts=2, backoff_s=0.2)  # fmt: skip
        top = start_run(sup, tmp_path, p, n_events, [1], address, out_type="dealer")

        def stored() -> int:
            try:
                with Repository(repo_path, readonly=True) as repo:
                    return len(repo.versions("qc/det/h1"))
            except InputError:  # not yet created, or its schema not yet written
                return 0

        wait_for(sup, lambda: stored() >= 3, 60, "three stored cycles")
        assert sup.processes[top].state == "running", "the run ended before the kill"
        killed_at = stored()
        sup.kill("qc-repository")
        wait_for(sup, lambda: sup.processes["qc-repository"].state == "done", 90,
                 "the restarted repository device's end")  # fmt: skip
        assert len(sup.processes["qc-repository"].pids) == 2  # restarted once
    finally:
        sup.shutdown()
        sup.close()
    ref = reference(list(range(n_events)))
    with Repository(repo_path, readonly=True) as repo:
        versions = repo.versions("qc/det/h1")
        assert len(versions) > killed_at and versions[0].metadata["final"]
        for name in ("h1", "h2", "h3", "hn"):
            got = repo.latest(f"qc/det/{name}")
            assert got is not None and got.event_count == n_events
            assert np.array_equal(got.obj.view(flow=True), ref[name].view(flow=True)), name
        assert repo.latest_info("qc/det/h2").quality == "Bad"  # type: ignore[union-attr]


def test_the_quick_start_of_the_docs(tmp_path: Path) -> None:
    """docs/qc.md "QC in 5 minutes": the two devices, `evflow run` of the example
    steering file with two workers, `evflow qc ls` (in a session of its own)."""
    examples = Path(__file__).parent.parent / "examples"
    session = f"qc5-{os.getpid()}"
    steering = tmp_path / "qc_steering.py"
    steering.write_text((examples / "qc_steering.py").read_text().replace('"qc5"', f'"{session}"'))
    evflow = [sys.executable, "-m", "evflow"]
    common = ["--session", session, "--severity", "warn"]
    repo = subprocess.Popen(
        [*evflow, "device", "qc-repository", "--id", "qc-repository", *common,
         "--repo", "qc.sqlite", "--checks", str(examples / "qc_checks.toml"), "--inputs", "1",
         "--channel-config", "name=qc-in,type=router,method=bind,address=ipc://qc-repository"],
        cwd=tmp_path,
    )  # fmt: skip
    merger = subprocess.Popen(
        [*evflow, "device", "qc-merger", "--id", "qc-merger", *common, "--cycle-s", "0.5",
         "--inputs", "2",
         "--channel-config", "name=qc-in,type=router,method=bind,address=ipc://qc-merger",
         "--channel-config",
         "name=qc-out,type=dealer,method=connect,address=ipc://qc-repository"],
        cwd=tmp_path,
    )  # fmt: skip
    try:
        run = subprocess.run([*evflow, "run", str(steering), "-p", "2", "-n", "4000", "-q"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=90)  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert merger.wait(60) == 0 and repo.wait(60) == 0
    finally:
        for proc in (merger, repo):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ls = subprocess.run([*evflow, "qc", "ls", "--repo", "qc.sqlite"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ls.returncode == 0, ls.stderr
    rows = [line.split() for line in ls.stdout.splitlines()]
    assert [(r[0], r[-1]) for r in rows] == [("qc/toy/events", "-"), ("qc/toy/value", "Good")]
    with Repository(tmp_path / "qc.sqlite", readonly=True) as stored:
        assert stored.latest("qc/toy/events").obj == 4000  # type: ignore[union-attr]


def test_a_storing_gap_is_retried_while_no_publication_arrives(tmp_path: Path) -> None:
    """The device retries a failed store on its interval even when the mergers are quiet
    (in process: the device in a thread, the disk full simulated)."""
    import threading

    import hist

    from evflow.qc.publication import PublishedObject, encode_publication
    from evflow.qc.repository_device import QcRepositoryDevice
    from evflow.runtime.states import State
    from test_qc_storage import _FlakyRepository

    session = f"qcrepogap-{os.getpid()}"
    (cfg,) = parse_channel_config("name=qc-in,type=pull,method=bind,address=ipc://gap-in")
    device = QcRepositoryDevice("r", [cfg], session=session, repo=str(tmp_path / "q.sqlite"),
                                retry_interval_s=0.05)  # fmt: skip
    thread = threading.Thread(target=device.run, daemon=True)
    thread.start()
    context: zmq.Context[Any] = zmq.Context()
    (out,) = parse_channel_config("name=o,type=push,method=connect,address=ipc://gap-in")
    sender = open_channel(context, out, session)
    try:
        deadline = time.monotonic() + 30
        while device.state is not State.RUNNING:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        flaky = _FlakyRepository(device.writer.repository)
        flaky.full = True
        device.writer.repository = flaky  # type: ignore[assignment]
        h = hist.Hist.new.Reg(4, 0, 1).Double()
        h.fill([0.1, 0.6])
        pub = PublishedObject("qc/t/h", "t", "h", 1, 1, h, {}, time.time(), 1, 2)
        sender.send(encode_publication(pub, "m"))
        while device.metrics().get("qc_repository", {}).get("pending") != 1:
            assert time.monotonic() < deadline, "the publication never arrived"
            time.sleep(0.01)
        assert device.writer.statistics().storing is False
        flaky.full = False  # the disk has room again; nothing else arrives
        while device.writer.statistics().pending:
            assert time.monotonic() < deadline, "the gap was not retried"
            time.sleep(0.01)
        stats = device.writer.statistics()
        assert (stats.storing, stats.stored, stats.gaps) == (True, 1, 1)
        device.writer.repository = flaky.real
    finally:
        sender.close(0)
        context.term()
        device.request_shutdown()
        thread.join(30)
    assert not thread.is_alive()
    with Repository(tmp_path / "q.sqlite", readonly=True) as repo:
        stored = repo.latest("qc/t/h")
        assert stored is not None and stored.obj == h
        assert len(repo.gaps()) == 1

"""Trigger-farm figures: event-building rate, framework CPU share of the HLT chain.

    python benchmarks/bench_hlt.py [--quick] [--only core|build|cpu|replay|shm] [--rounds N]
                                   [--work-ms MS] [--workers 0,2]
                                   [--shm-modes zmq,shm-copy,shm-zero,shm-batch]
                                   [--shm-sizes 100000,...]

core:   EventBuilder alone (no sockets), 12 sources, batches of 256 and 32 consecutive
        fragments: CPU per event with every event complete, and with one source lost
        at a fifth of the run (every later event incomplete: the fault path).
build:  the core line, then 12 inputs (4 sender processes x 3 sources, real sockets)
        -> FragmentReceiver + EventBuilder in this process, for 64 B, 1 kB and 10 kB
        fragments, batched (256 fragments per message) and one fragment per message.
        "built/s" is wall-clock (the senders share the 2 cores); "builder CPU/event"
        is this process's CPU time per built event (receive, build, free), so
        "builder-bound rate" = 1 / it is what one core of building alone would sustain.
cpu:    replay device (4 streams; 1 kHz in ticks of ~32 events (auto), of 100 ms, or
        one event at a time, or as fast as possible) -> EventBuilderInput (the pieces joined as
        bytes there, merge=join_fragments, or by JoinFragments in the workers) ->
        MeteredWork (BusyWork, 1 ms of CPU) -> RecordOutput, sequential and with 2
        workers. While the run goes, every process of it (replay device, path process
        or input, workers, output, zygote; all their threads, zmq's included) is
        sampled from /proc/PID/task/TID/schedstat (ns on a CPU), and the work's own CPU
        from the module's meter (thread CPU inside event()). The framework share is
        (all CPU - work CPU) / all CPU over the window from 20 % to 90 % of the events
        (steady state: start-up and drain left out; the replay plays 25 % more, so its
        end is not in the window either); "whole run" is the same from
        RUSAGE_CHILDREN over everything, start-up included. Per process: framework
        us per event (the workers' and the sequential path's minus the work).
        "no replay" is the share without the replay device's CPU (in the HLT the
        replay was the C-RORC's firmware). ``--work-ms 0`` measures the framework's
        cost per event alone (it is the same as with 1 ms: the cost is per tick and
        per event of a paced chain, not cache pollution by the work).
replay: ReplayInput at 1, 10, 50 kHz for 5 s each: achieved rate and worst lag.
shm:    a device channel (push -> pull, two processes): zmq over ipc, shm with the
        copying send/recv, shm zero-copy (new_message filled in place, recv(views=True)),
        and shm zero-copy batched (the same buffers, send_many of B messages per ZeroMQ
        message, recv_many), alternated, for 100 kB, 1 MB, 10 MB payloads: the sender
        fills a new buffer per message, the receiver reads every byte; GB/s at the
        receiver (as FairMQ's figure, which is one message per send: compare it with
        shm-zero; shm-batch is the HLT's answer). ``--only shm --quick`` takes well
        under a minute. High-water marks: 4 ZeroMQ messages per side
        (``EVFLOW_BENCH_SHM_HWM`` to change), ``--shm-batch N`` messages per batch.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from evflow.event import DataStore
from evflow.hlt.eventbuilder import BuilderConfig, EventBuilder
from evflow.hlt.fragments import FragmentBatch
from evflow.hlt.links import FragmentReceiver
from evflow.io.generators import BusyWork, burn_cpu

GROUPS = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def build_rate(frag_bytes: int, batch: int, n_events: int) -> dict[str, float]:
    ctx: zmq.Context[Any] = zmq.Context()
    b = EventBuilder(BuilderConfig(sources=range(12), timeout_s=10.0, max_events=8192))
    recv = FragmentReceiver(ctx, b, "tcp://127.0.0.1:0", credit=32)
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "evflow.hlt.synthetic", recv.endpoints[0]),
                *("--sources", ",".join(map(str, g)), "--events", str(n_events)),
                *("--batch", str(batch), "--frag-bytes", str(frag_bytes)),
            ]
        )
        for g in GROUPS
    ]
    t_first = None
    cpu0 = time.process_time()
    while not (recv.all_ended() and b.n_open == 0 and not recv.pending()):
        recv.pump(5)
        if t_first is None and b.counters.fragments:
            t_first = time.monotonic()
            cpu0 = time.process_time()
        b.take_built()
    wall = time.monotonic() - (t_first or time.monotonic())
    cpu = time.process_time() - cpu0
    for p in procs:
        p.wait()
    recv.close()
    ctx.term()
    assert b.counters.complete == n_events, b.metrics()
    return {
        "built_per_s": n_events / wall,
        "cpu_us_per_event": cpu / n_events * 1e6,
        "builder_bound_per_s": n_events / cpu,
    }


def builder_core(n_events: int, batch: int, lost_source: int | None) -> float:
    """CPU us per event of ``EventBuilder`` alone (no sockets): 12 sources, batches of
    ``batch`` consecutive fragments; with ``lost_source``, that source stops at a fifth
    of the events and every later event leaves incomplete (inferred from the others
    moving on, or timed out on a manual clock): the fault path."""
    n_events -= n_events % batch  # whole batches
    now = [0.0]
    b = EventBuilder(
        BuilderConfig(sources=range(12), timeout_s=0.05, max_events=8192), clock=lambda: now[0]
    )
    data = bytes(64 * batch)
    lens = np.full(batch, 64, np.int64)
    offs = np.arange(batch, dtype=np.int64) * 64
    stop_at = n_events // 5
    built = 0
    t0 = time.process_time()
    for first in range(0, n_events, batch):
        ids = np.arange(first, first + batch, dtype=np.int64)
        for src in range(12):
            if src == lost_source and first >= stop_at:
                continue
            b.add(FragmentBatch(src, ids, lens, offs, data))
        now[0] += 0.01
        b.poll()
        built += sum(len(x) for x in b.take_built())
    b.flush()
    built += sum(len(x) for x in b.take_built())
    cpu = time.process_time() - t0
    assert built == n_events, (built, n_events)
    return cpu / n_events * 1e6


def bench_core(quick: bool) -> None:
    n_core = 40_000 if quick else 200_000
    print(f"\nEventBuilder alone (no sockets), 12 sources, 64 B, {n_core} events: CPU us/event")
    print(f"{'per batch':>10} {'all complete':>13} {'one source lost':>16}")
    for batch in (256, 32):
        ok = min(builder_core(n_core, batch, None) for _ in range(3))
        lost = min(builder_core(n_core, batch, 7) for _ in range(3))
        print(f"{batch:>10} {ok:>12.2f} {lost:>16.2f}")


def bench_build(quick: bool) -> None:
    print("\nevent building, 12 inputs (4 sender processes), real tcp sockets")
    print(
        f"{'fragment':>9} {'per msg':>8} {'events':>7} {'built/s':>10} "
        f"{'builder CPU/event':>18} {'builder-bound/s':>16}"
    )
    scale = 0.2 if quick else 1.0
    for frag, n in ((64, 100_000), (1024, 50_000), (10_240, 8_000)):
        for batch, n_ev in ((256, n), (1, max(2000, n // 10))):
            n_ev = int(n_ev * scale)
            r = build_rate(frag, batch, n_ev)
            print(
                f"{frag:>8}B {batch:>8} {n_ev:>7} {r['built_per_s']:>10,.0f} "
                f"{r['cpu_us_per_event']:>15.1f} µs {r['builder_bound_per_s']:>16,.0f}"
            )


class MeteredWork(BusyWork):
    """``BusyWork`` that counts its calls and the CPU it burnt (this thread's, in ns) in
    a small file per process, which the benchmark reads while the run goes on."""

    def __init__(self, name: str | None = None, meter_dir: str = "", **params: object) -> None:
        super().__init__(name, **params)
        self.meter_dir = meter_dir
        self._meter: Any = None

    def initialize(self) -> None:
        f = os.path.join(self.meter_dir, f"work-{os.getpid()}.bin")
        with open(f, "wb") as fh:
            fh.write(bytes(16))
        with open(f, "r+b") as fh:
            self._map = mmap.mmap(fh.fileno(), 16)
        self._meter = memoryview(self._map).cast("q")

    def event(self, store: DataStore) -> bool | None:
        t0 = time.thread_time_ns()
        burn_cpu(self.work_ms)
        m = self._meter
        m[1] += time.thread_time_ns() - t0
        m[0] += 1
        return None


def _read_meters(d: str) -> tuple[int, int]:
    """(calls, work ns) over every process's meter file."""
    calls = ns = 0
    for f in Path(d).glob("work-*.bin"):
        raw = f.read_bytes()
        if len(raw) == 16:  # (a file just made may be empty for a moment)
            c, n = np.frombuffer(raw, np.int64)
            calls, ns = calls + int(c), ns + int(n)
    return calls, ns


def _tree_cpu(root: int, seen: dict[tuple[int, int], int]) -> dict[int, tuple[str, int]]:
    """pid -> (name, CPU ns of all its threads) for ``root`` and its descendants.

    From ``/proc/PID/task/TID/schedstat`` (time on a CPU, ns): the zmq I/O threads count.
    ``seen`` keeps every thread's last figure, so a thread that ended still counts (up to
    its last sample).
    """
    parent: dict[int, int] = {}
    for st in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = st.read_text()
        except OSError:
            continue
        parent[int(st.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])
    tree, todo = {root}, [root]
    kids: dict[int, list[int]] = {}
    for pid, pp in parent.items():
        kids.setdefault(pp, []).append(pid)
    while todo:
        for k in kids.get(todo.pop(), []):
            tree.add(k)
            todo.append(k)
    names = {}
    for pid in tree:
        try:
            names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
            for t in Path(f"/proc/{pid}/task").glob("*/schedstat"):
                seen[pid, int(t.parent.name)] = int(t.read_text().split()[0])
        except (OSError, ValueError):
            continue
    out: dict[int, tuple[str, int]] = {}
    for (pid, _), ns in seen.items():
        name = names.get(pid) or out.get(pid, ("?", 0))[0]
        out[pid] = (name, out.get(pid, (name, 0))[1] + ns)
    return out


def _cpu_chain(
    workers: int, n_events: int, rate: float, tick_ms: float, out_dir: str, join: str
) -> None:
    """Runs in a child: replay device -> builder source -> 1 ms/event path -> output."""
    import evflow
    from evflow.hlt.builder_device import EventBuilderInput
    from evflow.hlt.replay import JoinFragments, join_fragments
    from evflow.io import RecordOutput, RecordWriter, ToyGenerator
    from evflow.wire.codec import encode_event

    rec = os.path.join(out_dir, "toy.evr")
    with RecordWriter(rec) as w:
        for s in ToyGenerator(n_events=1000, payload_bytes=1024).events():
            w.write_frames(s.meta.uid, 0, encode_event(s))
    address = f"ipc://{out_dir}/frags"
    replay = subprocess.Popen(
        [
            *(sys.executable, "-m", "evflow", "device", "replay", "--id", "replay"),
            *("--file", rec, "--streams", "4", "--builder", address),
            *("--event-rate", str(rate), "--tick-ms", str(tick_ms)),
            *("--events", str(n_events), "--severity", "warn"),
            *("--stats-file", os.path.join(out_dir, "replay.json")),
        ]
    )
    stats = os.path.join(out_dir, "builder.json")
    cfg: dict[str, Any] = {
        "address": address,
        "sources": "4",
        "timeout_s": 2.0,
        "stats_file": stats,
    }
    if join == "builder":  # the pieces joined as bytes in the builder, decoded on demand
        modules: list[Any] = [EventBuilderInput(merge=join_fragments, **cfg)]
    else:  # the pieces decoded and joined by a module in the workers
        modules = [EventBuilderInput(**cfg), JoinFragments()]
    work_ms = float(os.environ.get("EVFLOW_BENCH_WORK_MS", "1.0"))
    modules.append(MeteredWork(work_ms=work_ms, meter_dir=out_dir))
    modules.append(RecordOutput(file=os.path.join(out_dir, "out.evr"), fsync=False))
    path = evflow.Path(modules)
    run = evflow.process(path, workers=workers, quiet=True)
    replay.wait()
    calls = sum(m.calls for m in run.modules if m.module == "MeteredWork")
    Path(out_dir, "chain.json").write_text(json.dumps({"busy_calls": calls, "wall_s": run.wall_s}))


def _role(name: str, pid: int, child: int) -> str:
    if pid == child:
        return "path" if name.startswith("python") else name
    return "replay" if name.startswith("python") else name.split(".")[0].rstrip("-0123456789")


#: the replay plays this much more than the window's ``n`` events: a sequential path
#: (1 ms of work + its framework per event) falls behind a 1 kHz replay, and the
#: replay's end (ENDs, ACKs, its exit: ~30 ms of CPU) must not fall into the window
REPLAY_MORE = 1.25


def _chain_cpu(workers: int, n: int, rate: float, tick_ms: float, join: str) -> dict[str, Any]:
    """One run; the window is the events between 20 % and 90 % of ``n`` (the replay
    plays ``REPLAY_MORE`` times ``n``), sampled while it runs: every process's CPU and
    the work's own CPU in it."""
    n_replay = int(n * REPLAY_MORE)
    # (not "evflow-*": test clean-ups of other runs on this machine may remove those)
    with tempfile.TemporaryDirectory(prefix="benchhlt-") as d:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        args = [str(workers), str(n_replay), str(rate), str(tick_ms), d, join]
        child = subprocess.Popen(
            [sys.executable, __file__, "--cpu-child", *args], start_new_session=True
        )
        first: tuple[int, int, dict[int, tuple[str, int]]] | None = None
        seen: dict[tuple[int, int], int] = {}
        last = first
        deadline = time.monotonic() + 60 + n_replay * 0.01
        try:
            while child.poll() is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"cpu run ({workers} workers, {rate} Hz) did not end")
                time.sleep(0.05)
                calls, work = _read_meters(d)
                if calls < 0.2 * n or calls > 0.9 * n:
                    continue
                sample = (calls, work, _tree_cpu(child.pid, seen))
                first = first or sample
                last = sample
        finally:
            if child.poll() is None:  # we failed or it hung: none of its processes stays
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert child.returncode == 0
        total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        work_all = _read_meters(d)[1] / 1e9
        rep = json.loads(Path(d, "replay.json").read_text())["replay"]
        assert json.loads(Path(d, "builder.json").read_text())["complete"] == n_replay
    assert first is not None and last is not None and last[0] > first[0], "no window sampled"
    events = last[0] - first[0]
    roles: dict[str, float] = {}
    for pid, (name, ns) in last[2].items():
        start = first[2].get(pid, (name, 0))[1]
        role = _role(name, pid, child.pid)
        roles[role] = roles.get(role, 0.0) + (ns - start) / 1e3 / events
    cpu_us = sum(roles.values())
    work_us = (last[1] - first[1]) / 1e3 / events
    chain_us = cpu_us - roles.get("replay", 0.0)  # without the readout emulator
    return {
        "events": events,
        "cpu_us": cpu_us,
        "framework": (cpu_us - work_us) / cpu_us,
        "chain_framework": (chain_us - work_us) / chain_us,
        "roles": roles,
        "work_us": work_us,
        "whole": (total - work_all) / total,
        "replay_hz": rep["achieved_hz"],
    }


# (rate Hz, replay tick ms (-1 auto), where the pieces are joined)
CPU_CASES = (
    (1000.0, -1.0, "builder"),
    (1000.0, 100.0, "builder"),  # longer ticks: each costs every process a message
    (1000.0, -1.0, "workers"),
    (1000.0, 0.0, "builder"),
    (0.0, 0.0, "builder"),
)


def bench_cpu(quick: bool, work_ms: float = 1.0, workers_list: tuple[int, ...] = (0, 2)) -> None:
    """Steady state: a window of the run (20-90 % of the events), every process counted."""
    n = 2500 if quick else 8000
    os.environ["EVFLOW_BENCH_WORK_MS"] = str(work_ms)  # read by the chain's child
    print(
        f"\nframework CPU share, {work_ms:g} ms CPU per event in the path; {n} events, "
        f"steady-state window (20-90 %); us per event by process (work: the module's own "
        f"CPU); 'no replay': the share without the readout emulator's CPU (the HLT's "
        f"replay ran in the C-RORC's FPGA)"
    )
    print(
        f"{'workers':>8} {'rate':>9} {'tick':>6} {'join in':>8} {'CPU/event':>10} "
        f"{'framework':>10} {'no replay':>10} {'whole run':>10} {'replay Hz':>10}  "
        f"framework us/event by process"
    )
    for workers in workers_list:
        for rate, tick, join in CPU_CASES:
            if not rate and not work_ms:
                print(f"{workers:>8} {'max':>9}  (no work: over before it can be sampled)")
                continue
            r = _chain_cpu(workers, n, rate, tick, join)
            label = f"{rate:.0f} Hz" if rate else "max"
            tick_label = "auto" if tick < 0 else f"{tick:.0f}ms"
            roles = dict(r["roles"])
            # the work's CPU is in the path process (sequential) or in the workers
            key = "path" if workers == 0 else "worker"
            roles[key] = roles.get(key, 0.0) - r["work_us"]
            parts = " ".join(f"{k} {v:.0f}" for k, v in sorted(roles.items()))
            print(
                f"{workers:>8} {label:>9} {tick_label:>6} {join:>8} "
                f"{r['cpu_us'] / 1e3:>8.3f}ms {r['framework']:>9.1%} "
                f"{r['chain_framework']:>9.1%} {r['whole']:>9.1%} {r['replay_hz']:>10,.0f}  {parts}"
            )


def bench_replay(quick: bool) -> None:
    from evflow.hlt.replay import ReplayInput
    from evflow.io import RecordWriter, ToyGenerator
    from evflow.wire.codec import encode_event

    secs = 1.0 if quick else 5.0
    print(f"\nreplay on the monotonic timeline, {secs:.0f} s per rate")
    with tempfile.TemporaryDirectory() as d:
        rec = os.path.join(d, "r.evr")
        with RecordWriter(rec) as w:
            for s in ToyGenerator(n_events=1000, payload_bytes=256).events():
                w.write_frames(s.meta.uid, 0, encode_event(s))
        for rate in (1_000.0, 10_000.0, 50_000.0):
            src = ReplayInput(file=rec, rate_hz=rate, passes=max(1, int(rate * secs) // 1000))
            for _ in src.events():
                pass
            r = src.report
            print(
                f"  {rate:>8,.0f} Hz asked: {r.events:>7} events, achieved {r.achieved_hz:>10,.1f} "
                f"Hz ({r.achieved_hz / rate - 1:+.3%}), worst lag {r.max_lag_ms:.1f} ms"
            )


def _shm_child(role: str, mode: str, size: int, n: int, address: str, out: str) -> None:
    """One end of a device channel: the sender writes every payload, the receiver reads it.

    ``mode``: ``zmq`` (transport zmq, ipc), ``shm-copy`` (transport shm, the copying
    ``send``/``recv``), ``shm-zero`` (transport shm, ``new_message`` filled in place and
    ``recv(views=True)`` read in place), ``shm-batch`` (the same, ``send_many`` of
    ``shm_batch(size)`` messages per ZeroMQ message and ``recv_many``).
    """
    from evflow.transport.channel import parse_channel_config
    from evflow.transport.opening import open_channel
    from evflow.wire.messages import MsgType, decode_message, encode_message

    ctx: zmq.Context[Any] = zmq.Context()
    kind, method = ("push", "connect") if role == "send" else ("pull", "bind")
    transport = "zmq" if mode == "zmq" else "shm"
    hwm = int(os.environ.get("EVFLOW_BENCH_SHM_HWM", "4"))  # ZeroMQ messages queued per side
    (cfg,) = parse_channel_config(
        f"name=data,type={kind},method={method},address={address},transport={transport}"
        f",sndBufSize={hwm},rcvBufSize={hwm},linger=-1,shmSize={max(64 << 20, 16 * size)}"
    )
    ch = open_channel(ctx, cfg, "benchshm")
    zero = mode in ("shm-zero", "shm-batch")
    batch = shm_batch(size) if mode == "shm-batch" else 1
    cpu0 = time.process_time()
    main0 = time.thread_time()  # this thread: Python and its calls, not libzmq's I/O thread
    if role == "send":
        msgs = []
        for i in range(n):
            if zero:
                buf: Any = ch.new_message(size, wait_s=1.0)
                buf.array().fill(i & 255)  # written in place, in the region
            else:
                payload = np.empty(size, np.uint8)
                payload.fill(i & 255)  # written
                buf = payload.data
            msgs.append(encode_message(MsgType.EVENTS, None, [buf]))
            if len(msgs) == batch or i == n - 1:
                ch.send_many(msgs) if batch > 1 else ch.send(msgs[0])
                msgs = []
        cpu_s, main_s = time.process_time() - cpu0, time.thread_time() - main0
        # a closing PUSH can lose its last messages (docs/architecture.md): wait for the receiver
        deadline = time.monotonic() + 120
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.01)
        Path(out + ".send").write_text(
            json.dumps({"cpu_s": cpu_s, "main_s": main_s, **_shm_counters(ch)})
        )
    else:
        t0 = 0.0
        bad = 0
        got: list[Any] = []
        for i in range(n):
            while not got:  # as the device's data loop: poll only when nothing is there
                try:
                    if batch > 1:
                        got = ch.recv_many(zmq.NOBLOCK, views=True)[::-1]
                    else:
                        got = [ch.recv(zmq.NOBLOCK, views=True) if zero else ch.recv(zmq.NOBLOCK)]
                except zmq.Again:
                    if not ch.poll(20_000):
                        raise SystemExit(f"receiver: only {i} of {n} messages ({ch!r})") from None
            msg = decode_message(got.pop())
            if i == 0:
                t0 = time.monotonic()
                cpu0 = time.process_time()
                main0 = time.thread_time()
            frame = msg.payload[0]
            data = np.asarray(frame) if zero else np.frombuffer(frame, np.uint8)
            words = data[: size - size % 8].view(np.uint64)
            bad += int(np.bitwise_xor.reduce(words)) != 0  # read, every byte (even: 0)
            bad += int(data[-1]) != i & 255
            del data, words
            if zero:
                frame.release()
        elapsed = time.monotonic() - t0
        Path(out).write_text(
            json.dumps(
                {
                    "gb_per_s": (n - 1) * size / elapsed / 1e9,
                    "cpu_us_per_msg": (time.process_time() - cpu0) / (n - 1) * 1e6,
                    "main_us_per_msg": (time.thread_time() - main0) / (n - 1) * 1e6,
                    "bad": bad,
                }
            )
        )
    ch.close()
    ctx.term()


def _shm_counters(ch: Any) -> dict[str, int]:
    return {k: getattr(ch, k, 0) for k in ("shm_frames_out", "shm_zero_copy", "shm_copied")}


SHM_MODES = ("zmq", "shm-copy", "shm-zero", "shm-batch")
#: FairMQ 1.10 shmem, one hop, payload written and read, one message per send (issue 15)
FAIRMQ_GB_PER_S = {100_000: 5.8, 1_000_000: 7.9}


def shm_batch(size: int) -> int:
    """Messages per ZeroMQ message in shm-batch mode (``EVFLOW_BENCH_SHM_BATCH`` or
    ``--shm-batch`` sets it): about 1.6 MB per batch, 2 to 16 messages. Larger batches
    of large messages lose more to caches (the sender writes past L2 before the
    receiver reads) than they save in calls."""
    fixed = int(os.environ.get("EVFLOW_BENCH_SHM_BATCH", "0"))
    return fixed or max(2, min(16, 1_600_000 // size))


def bench_shm(
    quick: bool, rounds: int = 0, modes: tuple[str, ...] = SHM_MODES, sizes: tuple[int, ...] = ()
) -> None:
    """The modes side by side, alternating, ``rounds`` times per size (median)."""
    rounds = rounds or (1 if quick else 3)
    print(
        "\ndevice channel, one hop, payload written by the sender and read by the receiver "
        f"(GB/s at the receiver, median of {rounds}); CPU us per message, all threads "
        "(in parentheses: the main thread, i.e. Python and its calls, without libzmq's I/O "
        "thread)"
    )
    print(f"{'payload':>8}  {'mode':<10}{'GB/s':>7}{'vs zmq':>8}{'rx CPU us/msg':>18}{'tx':>14}")
    for size in sizes or (100_000, 1_000_000, 10_000_000):
        n = max(20, int((250e6 if quick else 1.5e9) // size))
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                runs[mode].append(_shm_pair(mode, size, n))
        med = {m: _median([x["gb_per_s"] for x in runs[m]]) for m in modes}
        for m in modes:
            rx = _median([x["cpu_us_per_msg"] for x in runs[m]])
            rx_main = _median([x["main_us_per_msg"] for x in runs[m]])
            tx = _median([x["send"]["cpu_s"] / n * 1e6 for x in runs[m]])
            tx_main = _median([x["send"]["main_s"] / n * 1e6 for x in runs[m]])
            vs = f"{med[m] / med['zmq']:.2f}x" if "zmq" in med else "-"
            print(
                f"{size / 1e6:>6.1f}MB  {m:<10}{med[m]:>7.2f}{vs:>8}"
                f"{rx:>11.0f} ({rx_main:>3.0f}){tx:>8.0f} ({tx_main:>3.0f})"
            )
        fairmq = FAIRMQ_GB_PER_S.get(size)
        tail = f"FairMQ 1.10 shmem, one message per send: {fairmq} GB/s; " if fairmq else ""
        print(f"{'':>10}({tail}{n} messages per run, shm-batch: {shm_batch(size)} per send_many)")


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _shm_pair(mode: str, size: int, n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="evflow-bench-shm-") as d:
        addr, out = f"ipc://{d}/c", os.path.join(d, "r.json")
        args = [mode, str(size), str(n), addr, out]
        rx = subprocess.Popen([sys.executable, __file__, "--shm-child", "recv", *args])
        tx = subprocess.Popen([sys.executable, __file__, "--shm-child", "send", *args])
        assert rx.wait() == 0 and tx.wait() == 0
        got: dict[str, Any] = json.loads(Path(out).read_text())
        got["send"] = json.loads(Path(out + ".send").read_text())
    if got["bad"]:
        raise SystemExit(f"{mode}: {got['bad']} messages read wrong")
    return got


def main() -> None:
    argv = sys.argv
    if len(argv) > 1 and argv[1] == "--shm-child":
        _shm_child(argv[2], argv[3], int(argv[4]), int(argv[5]), argv[6], argv[7])
        return
    if len(argv) > 1 and argv[1] == "--cpu-child":
        _cpu_chain(int(argv[2]), int(argv[3]), float(argv[4]), float(argv[5]), argv[6], argv[7])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("core", "build", "cpu", "replay", "shm"))
    ap.add_argument("--rounds", type=int, default=0, help="shm: alternated rounds per size")
    ap.add_argument("--shm-modes", default=",".join(SHM_MODES), help="shm: modes, comma-separated")
    ap.add_argument("--shm-sizes", default="", help="shm: payload bytes, comma-separated")
    ap.add_argument("--shm-batch", type=int, default=0, help="shm-batch: messages per send")
    ap.add_argument(
        "--work-ms",
        type=float,
        default=1.0,
        help="cpu: the work per event (0: the framework's own cost per event alone)",
    )
    ap.add_argument("--workers", default="0,2", help="cpu: worker counts, comma-separated")
    a = ap.parse_args()
    print(
        f"bench_hlt {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} cores "
        f"(load {os.getloadavg()[0]:.1f})"
    )
    if a.only in (None, "build", "core"):
        bench_core(a.quick)
    if a.only in (None, "build"):
        bench_build(a.quick)
    if a.only in (None, "cpu"):
        bench_cpu(a.quick, a.work_ms, tuple(int(w) for w in a.workers.split(",")))
    if a.only in (None, "replay"):
        bench_replay(a.quick)
    if a.only in (None, "shm"):
        if a.shm_batch:  # the child processes read it too
            os.environ["EVFLOW_BENCH_SHM_BATCH"] = str(a.shm_batch)
        modes = tuple(a.shm_modes.split(","))
        sizes = tuple(int(x) for x in a.shm_sizes.split(",") if x)
        bench_shm(a.quick, a.rounds, modes, sizes)


if __name__ == "__main__":
    main()

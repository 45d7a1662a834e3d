"""The headline figures of evflow in one command, and the table at the top of BENCHMARKS.md.

    python benchmarks/run_all.py --quick        # under 10 minutes on 2 quiet cores
    python benchmarks/run_all.py                # full: more messages, more repeats
    python benchmarks/run_all.py --only hop-1k,codec --no-write

Each figure runs in a fresh interpreter (``--figure NAME``), so that no figure inherits
another's ZeroMQ context, zygote or memory; it prints one JSON line that this driver
collects. Every figure is a ratio measured side by side in that one process against its
anchor (raw pyzmq, pickle, the sequential run, the fault-free run, boost-histogram's own
add), with the absolute value beside it. The load average is taken before and after each
figure and written beside it: a figure measured on a busy machine says little.

The table between the ``run_all`` markers in BENCHMARKS.md is rewritten (unless
``--no-write``); plots go to ``benchmarks/plots/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCHMARKS_MD = HERE.parent / "BENCHMARKS.md"
PLOTS = HERE / "plots"
BEGIN = "<!-- run_all:begin (rewritten by benchmarks/run_all.py; edit there) -->"
END = "<!-- run_all:end -->"


@dataclass
class Result:
    """What one figure measured: ``value`` and ``anchor`` in words, ``ratio`` against
    the anchor (None where there is none), and whether the goal holds."""

    value: str
    anchor_value: str
    ratio: float | None
    goal_met: bool | None
    detail: str = ""


@dataclass
class Figure:
    name: str
    title: str
    anchor: str
    goal: str
    command: str
    measure: Callable[[bool], Result]


# --- measurements (each runs in its own interpreter) -----------------------------------------
def _hop(size: int, quick: bool) -> Result:
    """Built-in sampler -> sink over ipc against raw pyzmq PUSH/PULL, interleaved."""
    import bench_transport as bt

    seconds, repeat = (0.6, 2) if quick else (2.0, 3)
    n = max(50, int(bt.GUESS_MSG_S.get(size, 1000) * seconds))
    with tempfile.TemporaryDirectory(prefix="evb-") as tmpdir:
        tmp = Path(tmpdir)
        os.environ["EVFLOW_RUNTIME_DIR"] = str(tmp)
        raws, ours = [], []
        for _ in range(repeat):
            raws.append(bt.run_raw("ipc", tmp, n, size))
            ours.append(bt.run_evflow("ipc", tmp, n, size))
    raw, evf = max(r[0] for r in raws), max(o[0] for o in ours)
    raw_cpu = min(r[1] for r in raws) / n * 1e6 / 2  # µs per message, per side (mean)
    evf_cpu = min(o[1] for o in ours) / n * 1e6 / 2
    gb = size / 1e9
    rate = f"{evf:,.0f} msg/s ({evf * gb:.2f} GB/s), {evf_cpu:.1f} µs CPU/msg/side"
    anchor = f"{raw:,.0f} msg/s ({raw * gb:.2f} GB/s), {raw_cpu:.1f} µs"
    goal = evf >= raw and (size > 1024 or evf_cpu <= 2.5)
    return Result(rate, anchor, evf / raw, goal, f"n={n}, best of {repeat}")


def _chain(size: int, quick: bool) -> Result:
    """A parallel path (generator -> 2 no-op workers -> output) against a bare
    ROUTER -> DEALER -> PUSH/PULL chain moving the same bytes."""
    import bench_parallel as bp

    n = {1024: 100_000, 1_000_000: 2_000}[size] // (4 if quick else 1)
    evf = bp._evflow_row(n, size, fast=True)
    raw_s = bp.raw_chain(n, size, workers=2)
    raw_rate = n / raw_s
    value = f"{evf['rate']:,.0f} ev/s ({evf['gbs']:.2f} GB/s), input {evf['in_us']:.1f} µs/ev"
    anchor = f"{raw_rate:,.0f} msg/s ({raw_rate * size / 1e9:.2f} GB/s)"
    goal = evf["gbs"] >= 3.0 if size >= 1_000_000 else None
    return Result(value, anchor, evf["rate"] / raw_rate, goal, f"n={n}")


def _speedup(quick: bool) -> Result:
    """T(1)/T(p), p = 1..4, 10 ms of numpy-free busy work per event; plotted."""
    import bench_parallel as bp

    n = 150 if quick else 400
    times: dict[int, float] = {}
    for _ in range(2 if quick else 3):
        for p in (1, 2, 3, 4):
            t = bp.run(n, 1024, 10.0, p).wall_s
            times[p] = min(t, times.get(p, t))
    PLOTS.mkdir(exist_ok=True)
    bp.plot_speedup({10.0: times}, PLOTS / "parallel_speedup.png")
    s2 = times[1] / times[2]
    curve = ", ".join(f"p={p}: {times[1] / t:.2f}x" for p, t in times.items())
    cores = len(os.sched_getaffinity(0))
    return Result(
        f"{s2:.2f}x at p=2 ({curve})",
        "sequential p=1",
        s2,
        s2 >= 0.85 * min(2, cores),
        "plot: benchmarks/plots/parallel_speedup.png",
    )


def _demo(quick: bool) -> Result:
    """The README's demo, sequential (-p 0) against -p 2, alternated."""
    import statistics

    import bench_demo as bd

    runs: dict[int, list[float]] = {0: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="evb-demo-") as tmp:
        for _ in range(2 if quick else 3):
            for workers in runs:
                out = os.path.join(tmp, f"p{workers}")
                runs[workers].append(bd.run_once(workers, out)["run_s"])
    seq, par = statistics.median(runs[0]), statistics.median(runs[2])
    return Result(f"{par:.2f} s with -p 2", f"{seq:.2f} s with -p 0", seq / par, seq / par > 1.0)


def _codec(quick: bool) -> Result:
    """encode + decode of a 1 kB event against pickle protocol 5 with out-of-band buffers."""
    import bench_codec as bc

    from evflow.wire.codec import decode_event, encode_event

    store = bc.make_store(1024)
    frames, pk = encode_event(store), bc.pickle_encode(store)
    n, repeats = (2000, 9) if quick else (4000, 35)
    t = bc.per_call_us(
        {
            "enc": lambda: encode_event(store),
            "dec": lambda: decode_event(frames),
            "penc": lambda: bc.pickle_encode(store),
            "pdec": lambda: bc.pickle_decode(pk),
        },
        n,
        repeats,
    )
    ours, theirs = t["enc"] + t["dec"], t["penc"] + t["pdec"]
    return Result(f"{ours:.2f} µs", f"{theirs:.2f} µs", ours / theirs, ours < theirs)


def _goodput(quick: bool) -> Result:
    """4 workers, 1 kB events of 2 ms: a worker SIGKILLed every 100 ms against no faults."""
    import bench_reliability as br

    n = 3000 if quick else 10_000
    free = br.goodput_run(n, None)
    chaos = br.goodput_run(n, 0.1)
    ratio = chaos["wall_s"] / free["wall_s"]
    per_kill = chaos["retries"] / max(chaos["kills"], 1)
    return Result(
        f"{chaos['wall_s']:.2f} s, {chaos['kills']:.0f} kills, {per_kill:.0f} re-sent per kill",
        f"{free['wall_s']:.2f} s fault-free",
        ratio,
        ratio <= 2.0,
        f"{n} events, exactly once in both (asserted)",
    )


def _qc_merge(quick: bool) -> Result:
    """One merge of a 500 kB histogram by the merger (batched deltas) against `h += d`."""
    import bench_qc_merger as bq

    budget = 0.5 if quick else 3.0
    bins = bq.SIZES["500 kB"]
    batched = bq.filled_payload(bq.BATCH["500 kB"], bins)
    iadd = 1e3 * bq.time_iadd(bins, budget)
    ours = 1e3 * bq.time_merges(batched, bq.BATCH["500 kB"], budget)
    return Result(f"{ours:.3f} ms", f"{iadd:.3f} ms (h += d)", ours / iadd, ours <= 1.48)


def _topology_startup(quick: bool) -> Result:
    """`evflow up` of 64 sampler/sink devices on this host: time to all RUNNING."""
    import bench_topology as bt

    with tempfile.TemporaryDirectory(prefix="evb-") as tmp:
        os.environ["EVFLOW_RUNTIME_DIR"] = str(Path(tmp) / "rt")
        laps = bt.run_once(Path(tmp), 64, 1, src=None)
    wall, stop = laps["wall"], laps["stop"]
    return Result(
        f"{wall:.2f} s to all RUNNING, {stop:.2f} s to stop",
        "-",
        None,
        wall <= 5.0,
        f"controller CPU {laps['cpu']:.2f} s",
    )


FIGURES = [
    Figure("hop-1k", "1 kB one hop, sampler -> sink, ipc", "raw pyzmq PUSH/PULL",
           ">= 1.0x raw pyzmq, <= 2.5 µs CPU/msg/side (#24)",
           "python benchmarks/bench_transport.py --sizes 1024 --transports ipc",
           lambda q: _hop(1024, q)),
    Figure("hop-100k", "100 kB one hop, ipc", "raw pyzmq PUSH/PULL", ">= 1.0x raw pyzmq (#24)",
           "python benchmarks/bench_transport.py --sizes 102400 --transports ipc",
           lambda q: _hop(100 * 1024, q)),
    Figure("hop-1M", "1 MB one hop, ipc", "raw pyzmq PUSH/PULL", ">= 1.0x raw pyzmq (#24)",
           "python benchmarks/bench_transport.py --sizes 1048576 --transports ipc",
           lambda q: _hop(1024**2, q)),
    Figure("chain-1k", "1 kB path chain, 2 no-op workers", "raw pyzmq chain",
           "input CPU falling", "python benchmarks/bench_parallel.py --serial",
           lambda q: _chain(1024, q)),
    Figure("chain-1M", "1 MB path chain, 2 no-op workers", "raw pyzmq chain",
           ">= 3 GB/s (#24)", "python benchmarks/bench_parallel.py --serial",
           lambda q: _chain(1_000_000, q)),
    Figure("speedup", "speedup, 10 ms/event", "sequential (p=1)", ">= 0.85 x cores at p=2",
           "python benchmarks/bench_parallel.py --speedup", _speedup),
    Figure("demo", "`evflow demo` run time", "the same demo with -p 0", "faster than -p 0",
           "python benchmarks/bench_demo.py", _demo),
    Figure("codec", "codec, 1 kB event encode + decode", "pickle protocol 5",
           "faster than pickle", "python benchmarks/bench_codec.py", _codec),
    Figure("goodput", "goodput, SIGKILL of a worker every 100 ms", "fault-free run",
           "<= 2x the fault-free wall time",
           "python benchmarks/bench_reliability.py --only goodput", _goodput),
    Figure("qc-merge", "QC merge of a 500 kB histogram (batched deltas)", "boost-histogram h += d",
           "<= 1.48 ms (ALICE prototype, 2016)", "python benchmarks/bench_qc_merger.py merge",
           _qc_merge),
    Figure("topology-startup", "`evflow up`, 64 devices on one host", "-", "<= 5 s",
           "python benchmarks/bench_topology.py --devices 64", _topology_startup),
]  # fmt: skip
BY_NAME = {f.name: f for f in FIGURES}


def run_one(name: str, quick: bool) -> None:
    """Child side: measure one figure and print it as the last line, JSON."""
    sys.path.insert(0, str(HERE))
    result = BY_NAME[name].measure(quick)
    print(json.dumps(asdict(result)), flush=True)


def measure_in_child(name: str, quick: bool, timeout_s: float) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--figure", name, *(["--quick"] if quick else [])]
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"took longer than {timeout_s:.0f} s", "load": load_before}
    out: dict[str, Any] = {"seconds": time.monotonic() - start}
    out["load"] = max(load_before, os.getloadavg()[0])
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        out["error"] = f"exit {proc.returncode}: {tail}"
        return out
    out.update(json.loads(lines[-1]))
    return out


def table(rows: dict[str, dict[str, Any]], quick: bool) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = [
        BEGIN,
        f"Last run: {stamp}, `python benchmarks/run_all.py{' --quick' if quick else ''}`, "
        f"{os.cpu_count()} cores. Load = the higher 1-minute load average before/after "
        "the figure; above about 1.5 the figure is not worth quoting.",
        "",
        "| figure | anchor | goal | evflow | anchor's value | ratio | goal met | load "
        "| reproduce |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        f = BY_NAME[name]
        if "error" in row:
            cells = [f.title, f.anchor, f.goal, f"failed: {row['error']}", "-", "-", "no"]
        else:
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            met = {True: "yes", False: "**no**", None: "-"}[row["goal_met"]]
            cells = [f.title, f.anchor, f.goal, row["value"], row["anchor_value"], ratio, met]
        cells += [f"{row['load']:.2f}", f"`{f.command}`"]
        head.append("| " + " | ".join(cells) + " |")
    head += ["", "Plots: [speedup](benchmarks/plots/parallel_speedup.png), "
             "[QC merge time](benchmarks/plots/qc_merge_time.png).", END]  # fmt: skip
    return "\n".join(head)


def rewrite(markdown: str, new_table: str) -> str:
    """Replace the marked table, or put it under the first heading when there is none."""
    if BEGIN in markdown and END in markdown:
        before, rest = markdown.split(BEGIN, 1)
        after = rest.split(END, 1)[1]
        return before + new_table + after
    first, _, rest = markdown.partition("\n")
    return f"{first}\n\n{new_table}\n{rest}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages and repeats (< 10 min)")
    ap.add_argument("--only", default="", help="figure names, comma-separated")
    ap.add_argument("--no-write", action="store_true", help="print the table, leave the file")
    ap.add_argument("--figure", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.figure:
        run_one(args.figure, args.quick)
        return 0
    names = [n for n in args.only.split(",") if n] or list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown figure(s) {', '.join(unknown)} (known: {', '.join(BY_NAME)})")
    rows: dict[str, dict[str, Any]] = {}
    timeout_s = 180.0 if args.quick else 900.0
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", end=" ", flush=True)
        rows[name] = row = measure_in_child(name, args.quick, timeout_s)
        shown = row.get("error") or f"{row['value']} (vs {row['anchor_value']})"
        print(f"{shown}  [{row.get('seconds', 0):.0f} s, load {row['load']:.2f}]", flush=True)
    text = table(rows, args.quick)
    if args.no_write:
        print(text)
    else:
        BENCHMARKS_MD.write_text(rewrite(BENCHMARKS_MD.read_text(), text))
        print(f"rewrote the table in {BENCHMARKS_MD}")
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

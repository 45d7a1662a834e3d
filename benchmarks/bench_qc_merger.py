"""QC merger benchmarks, side by side with the ALICE TPC QC prototype (Lesiak 2016).

    python benchmarks/bench_qc_merger.py [merge|wire|producers|hwm|all] [--quick]

- ``merge``: CPU time of one merge of a 1 kB, 500 kB and 5 MB histogram in one process:
  boost-histogram's ``h += d`` (the C++ add), the evflow merger on one delta per message,
  and on deltas batched in one message (1000 x 1 kB, 20 x 500 kB, 4 x 5 MB), publication
  every cycle included. ROOT's ``TH1D::Merge``, ``TH1D::Add`` and a ``TBufferFile``
  read + ``Merge`` (looped in C++ through cling) in the same run when ``import ROOT``
  works (``pip install root``); otherwise one line says it is skipped and why.
- ``wire``: one ``qc-merger`` process fed by 2 producer processes over ipc with batched
  deltas (1000 x 1 kB histograms per message) as fast as their credits allow: merged
  histograms per second of that one merger process (from its ``get-metrics``).
- ``producers``: 2..500 logical producers (DEALER sockets in 2 processes) publishing 100
  x 1 kB histograms once a second each (100 objects/s): merged objects/s, merger CPU and
  RSS over time; then 1, 2 and 4 mergers (plus a top merger) at 500 producers.
- ``hwm``: 4 producers sending one 1 kB delta per message as fast as they can, with the
  high-water mark (producer DEALER send and merger ROUTER receive) 1, 4, 20, 100, 1000.

Figures go to ``benchmarks/plots/qc_*.png``; tables print as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hist
import numpy as np
import psutil
import zmq

from evflow.errors import TimeoutError_
from evflow.processing.parallel.deltas import DeltaEncoder
from evflow.qc.layers import build_layers, launch_layers, layer_layout
from evflow.qc.mergestate import MergeState
from evflow.qc.producer import QcPublisher, take_payload
from evflow.runtime.bus import BusController
from evflow.runtime.supervisor import Supervisor

PLOTS = Path(__file__).parent / "plots"
#: bins (without flow) of a 1 kB, 500 kB and 5 MB Double histogram (8 bytes per bin)
SIZES = {"1 kB": 126, "500 kB": 62_498, "5 MB": 624_998}
BATCH = {"1 kB": 1000, "500 kB": 20, "5 MB": 4}
THESIS_MS = {"1 kB": 0.012, "500 kB": 1.48, "5 MB": None}
RUN = 1
#: producers start and connect before the measurement starts
WARMUP_S = 2.0


def filled_payload(n_hists: int, bins: int) -> list[bytes]:
    objs = {f"h{i}": hist.Hist.new.Reg(bins, 0, 1).Double() for i in range(n_hists)}
    x = np.random.default_rng(1).random(2000)
    for h in objs.values():
        h.fill(x)
    return take_payload(objs, DeltaEncoder(), "delta", set())


def header(src: str, seq: int) -> dict[str, Any]:
    return {"qc": 1, "src": src, "task": "bench", "run": RUN, "cycle": seq, "seq": seq,
            "events": 1, "mode": "delta"}  # fmt: skip


# --- merge: one process ---------------------------------------------------------------
def time_merges(payload: list[bytes], per_message: int, budget_s: float) -> float:
    """CPU seconds per merged histogram, a publication every CPU second (the merger's
    cycle). CPU time of this process: on a shared machine, time spent waiting for a
    core is not counted (memory bandwidth taken by others still is)."""
    state = MergeState("bench", run=RUN)
    state.accept(header("s", 1), payload)
    state.publish()
    seq, merged = 1, 0
    t0 = last = time.process_time()
    while True:
        for _ in range(10):
            seq += 1
            state.accept(header("s", seq), payload)
            merged += per_message
        now = time.process_time()
        if now - last >= 1.0 or now - t0 >= budget_s:
            state.publish()
            last = time.process_time()
            if last - t0 >= budget_s:
                return (last - t0) / merged


def time_iadd(bins: int, budget_s: float) -> float:
    a = hist.Hist.new.Reg(bins, 0, 1).Double()
    d = a.copy()
    d.fill(np.random.default_rng(2).random(1000))
    n, t0 = 0, time.process_time()
    while time.process_time() - t0 < budget_s:
        for _ in range(10):
            a += d
        n += 10
    return (time.process_time() - t0) / n


_ROOT_CPP = r"""
#include <ctime>
#include "TBufferFile.h"
#include "TH1D.h"
#include "TList.h"
#include "TRandom3.h"
namespace evflow_bench {
// CPU seconds of this process per operation, looped in C++ (no Python call per merge):
// what 0 = a.Merge(list of d), 1 = a.Add(d), 2 = d read from a TBufferFile (as a merger
// receives it) + Merge
double cpu_s() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
double time_th1(int bins, int what, double budget) {
  TH1D a("a", "a", bins, 0, 1), d("d", "d", bins, 0, 1);
  a.SetDirectory(nullptr);
  d.SetDirectory(nullptr);
  TRandom3 rng(1);
  for (int i = 0; i < 2000; ++i) d.Fill(rng.Rndm());
  TBufferFile wbuf(TBuffer::kWrite);
  wbuf.WriteObject(&d);
  TList one;
  one.Add(&d);
  double t0 = cpu_s();
  long n = 0;
  double elapsed = 0;
  while (elapsed < budget) {
    for (int k = 0; k < 10; ++k) {
      if (what == 0) {
        a.Merge(&one);
      } else if (what == 1) {
        a.Add(&d);
      } else {
        TBufferFile rbuf(TBuffer::kRead, wbuf.Length(), wbuf.Buffer(), kFALSE);
        TH1D *h = (TH1D *)rbuf.ReadObject(TH1D::Class());
        TList l;
        l.Add(h);
        a.Merge(&l);
        l.Clear("nodelete");
        delete h;
      }
    }
    n += 10;
    elapsed = cpu_s() - t0;
  }
  return elapsed / n;
}
}
"""
#: ROOT columns of the merge table: (key, what argument of time_th1)
ROOT_KINDS = {"root_merge_ms": 0, "root_add_ms": 1, "root_read_merge_ms": 2}


def load_root() -> tuple[Any, str]:
    """(ROOT's timing function, version) or (None, why it is skipped)."""
    try:
        import ROOT  # type: ignore[import-not-found]

        if not ROOT.gInterpreter.Declare(_ROOT_CPP):
            return None, "cling could not compile the timing loop"
        return ROOT.evflow_bench.time_th1, f"ROOT {ROOT.gROOT.GetVersion()}"
    except Exception as exc:  # ImportError, or a ROOT that cannot compile or load
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:160]


def bench_merge(quick: bool) -> dict[str, Any]:
    budget = 1.0 if quick else 3.0
    root, root_info = load_root()
    if root is None:
        print(f"ROOT's TH1D::Merge skipped: import ROOT failed ({root_info})")
    rows = {}
    for label, bins in SIZES.items():
        single = filled_payload(1, bins)
        batched = filled_payload(BATCH[label], bins)
        row: dict[str, Any] = {
            "iadd_ms": 1e3 * time_iadd(bins, budget),
            "single_ms": 1e3 * time_merges(single, 1, budget),
            "batched_ms": 1e3 * time_merges(batched, BATCH[label], budget),
            "thesis_ms": THESIS_MS[label],
        }
        for key, what in ROOT_KINDS.items():
            row[key] = None if root is None else 1e3 * root(bins, what, budget / 2)
        rows[label] = row
    print(
        f"\n| histogram | thesis (ROOT, 2016) | {root_info}: TH1D::Merge | TH1D::Add "
        "| TBufferFile read + Merge | `h += d` | evflow, 1 per message | evflow, batched "
        "| batched merges/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def ms(v: float | None) -> str:
        return "skipped" if v is None else f"{v:.4f} ms"

    for label, r in rows.items():
        thesis = "-" if r["thesis_ms"] is None else f"{r['thesis_ms']} ms"
        print(
            f"| {label} | {thesis} | {ms(r['root_merge_ms'])} | {ms(r['root_add_ms'])} "
            f"| {ms(r['root_read_merge_ms'])} | {r['iadd_ms']:.4f} ms | {r['single_ms']:.4f} ms "
            f"| {r['batched_ms']:.4f} ms | {1e3 / r['batched_ms']:,.0f} |"
        )
    plot_merge(rows)
    return rows


def plot_merge(rows: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = list(rows)
    series = [
        ("thesis_ms", "thesis (ROOT, 2016)"),
        ("root_merge_ms", "ROOT TH1D::Merge"),
        ("iadd_ms", "h += d"),
        ("single_ms", "evflow, 1 per message"),
        ("batched_ms", "evflow, batched"),
    ]
    width = 0.16
    for k, (key, name) in enumerate(series):
        vals = [rows[lab][key] or 0 for lab in labels]
        ax.bar(np.arange(len(labels)) + (k - 2) * width, vals, width, label=name)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("CPU time per merge (ms)")
    ax.set_title("QC merge time per histogram (one process)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "qc_merge_time.png", dpi=110)
    plt.close(fig)


# --- processes --------------------------------------------------------------------------
def producer_process(sources: list[str], address: str, session: str, n_hists: int,
                     period_s: float, duration_s: float, hwm: int, window: int,
                     out: str) -> int:  # fmt: skip
    """Logical producers in one process: each publishes the same pre-encoded delta (100
    or 1000 filled 1 kB histograms) every ``period_s`` (0: as fast as its credits allow)."""
    payload = filled_payload(n_hists, SIZES["1 kB"])
    context = zmq.Context()
    pubs = [
        QcPublisher(context, address, source=s, task="bench", run=RUN, session=session,
                    max_unacked=window, resend_after_s=30.0, hwm=hwm)
        for s in sources
    ]  # fmt: skip
    start = time.monotonic()
    next_s = [start + period_s * i / max(len(pubs), 1) for i in range(len(pubs))]
    cycle = 0
    while time.monotonic() - start < duration_s:
        now = time.monotonic()
        busy = False
        for k, pub in enumerate(pubs):
            pub.service()
            if now >= next_s[k] and pub.has_credit():
                cycle += 1
                pub.publish(cycle, 1, payload)
                next_s[k] = max(next_s[k] + period_s, now) if period_s else now
                busy = True
        if not busy:
            time.sleep(0.002 if period_s else 0.0002)
    stats = {"sent": sum(p.stats["sent"] for p in pubs),
             "would_block": sum(p.stats["would_block"] for p in pubs)}  # fmt: skip
    Path(out).write_text(json.dumps(stats))
    for pub in pubs:
        pub.close()
    context.term()
    return 0


def metrics_of(controller: BusController, node: str) -> dict[str, Any]:
    for attempt in range(3):  # a loaded machine can starve a merger for seconds
        try:
            (reply,) = controller.request("get-metrics", node, timeout_s=10)
            return reply["data"]  # type: ignore[no-any-return]
        except TimeoutError_:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def run_setup(n_producers: int, n_mergers: int, *, n_hists: int, period_s: float,
              duration_s: float, hwm: int = 1000, window: int = 16, cycle_s: float = 1.0,
              processes: int = 2, tmp: Path) -> dict[str, Any]:  # fmt: skip
    """One measurement: producers -> (n_mergers ->) top merger; samples every 0.5 s."""
    producers = [f"p{i}" for i in range(n_producers)]
    layout = layer_layout(n_producers, [n_mergers, 1] if n_mergers > 1 else [1])
    specs, routes = build_layers(producers, layout)
    sup = Supervisor(bus=True).start()
    context: zmq.Context[Any] = zmq.Context()
    controller = BusController(context, sup.bus_endpoints)
    samples: list[dict[str, Any]] = []
    try:
        launch_layers(sup, specs, cycle_s=cycle_s, run_number=RUN, restart="never",
                      inputs=0)  # fmt: skip
        bottom = [s for s in specs if s.layer == 0]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sup.poll(0.05)
            replies = controller.request("check-state", "*", timeout_s=0.6)
            if sum(r["data"].get("node_state") == "RUNNING" for r in replies) >= len(specs):
                break
        groups = [producers[i::processes] for i in range(processes)]
        outs = [tmp / f"prod-{i}.json" for i in range(processes)]
        for i, group in enumerate(groups):
            by_addr: dict[str, list[str]] = {}
            for src in group:
                by_addr.setdefault(routes[src], []).append(src)
            for j, (addr, srcs) in enumerate(by_addr.items()):
                sup.add_function(f"producers-{i}-{j}", producer_process, srcs, addr, sup.session,
                                 n_hists, period_s, duration_s + WARMUP_S, hwm, window,
                                 str(tmp / f"prod-{i}-{j}.json"))  # fmt: skip
        warm = time.monotonic() + WARMUP_S  # every producer connected and publishing
        while time.monotonic() < warm:
            sup.poll(0.1)
        pids = {s.id: sup.processes[s.id].pid for s in specs}
        procs = {k: psutil.Process(p) for k, p in pids.items()}
        for p in procs.values():
            p.cpu_percent()
        first = {s.id: metrics_of(controller, s.id)["qc"]["merged_objects"] for s in bottom}
        t0 = time.monotonic()
        while time.monotonic() - t0 < duration_s or not samples:
            sup.poll(0.5)
            samples.append({
                "t": round(time.monotonic() - t0, 2),
                **{k: {"cpu": p.cpu_percent(), "rss_mb": p.memory_info().rss / 2**20}
                   for k, p in procs.items()},
            })  # fmt: skip
        elapsed = time.monotonic() - t0
        last = {s.id: metrics_of(controller, s.id) for s in bottom}
        merged = sum(last[k]["qc"]["merged_objects"] - first[k] for k in last)
        top = metrics_of(controller, specs[-1].id)
        while any(sup.processes[n].state == "running" for n in sup.processes
                  if n.startswith("producers-")):  # fmt: skip
            sup.poll(0.2)
        sent = 0
        blocked = 0
        for path in tmp.glob("prod-*.json"):
            data = json.loads(path.read_text())
            sent += data["sent"]
            blocked += data["would_block"]
            path.unlink()
        del outs
        return {
            "producers": n_producers, "mergers": n_mergers, "hwm": hwm,
            "merged_per_s": merged / elapsed, "samples": samples,
            "metrics": {k: {f: v[f] for f in ("average_merge_time", "merged_objects_per_second",
                                              "VmRSS", "cpu_clock")} for k, v in last.items()},
            "top_cycle": top["qc"]["cycle"], "messages_sent": sent, "would_block": blocked,
            "bottom": [s.id for s in bottom],
        }  # fmt: skip
    finally:
        controller.close()
        sup.shutdown()
        sup.close()
        context.term()


def summarize(res: dict[str, Any]) -> tuple[float, float, float]:
    """(mean CPU % of the busiest bottom merger, its RSS at start and at the end, MB)."""
    cpu = {k: statistics.mean(s[k]["cpu"] for s in res["samples"][1:] or res["samples"])
           for k in res["bottom"]}  # fmt: skip
    busiest = max(cpu, key=lambda k: cpu[k])
    rss = [s[busiest]["rss_mb"] for s in res["samples"]]
    return cpu[busiest], rss[0], rss[-1]


def bench_wire(quick: bool, tmp: Path) -> dict[str, Any]:
    res = run_setup(2, 1, n_hists=1000, period_s=0.0, duration_s=4 if quick else 10,
                    window=64, cycle_s=0.1, tmp=tmp)  # fmt: skip
    cpu, rss0, rss1 = summarize(res)
    m = res["metrics"][res["bottom"][0]]
    print(
        f"\nwire: one qc-merger process merged {res['merged_per_s']:,.0f} histograms of 1 kB/s "
        f"(batches of 1000, 2 producer processes); merger CPU {cpu:.0f} %, RSS "
        f"{rss0:.0f} -> {rss1:.0f} MB, average_merge_time {m['average_merge_time']:.5f} ms; "
        f"per merger CPU-second: {res['merged_per_s'] / max(cpu / 100, 1e-9):,.0f} merged"
    )
    return res


def bench_producers(quick: bool, tmp: Path, only_mergers: bool = False) -> dict[str, Any]:
    counts = [] if only_mergers else [2, 10, 50, 100, 250, 500] if not quick else [2, 50, 500]
    duration = 4 if quick else 10
    out: dict[str, Any] = {"by_producers": [], "by_mergers": []}
    print("\n| producers | objects/s offered | merged objects/s | merger CPU | RSS start -> end |")
    print("|---|---|---|---|---|")
    for n in counts:
        res = run_setup(n, 1, n_hists=100, period_s=1.0, duration_s=duration, tmp=tmp)
        cpu, r0, r1 = summarize(res)
        out["by_producers"].append(res)
        print(
            f"| {n} | {n * 100:,} | {res['merged_per_s']:,.0f} | {cpu:.1f} % "
            f"| {r0:.0f} -> {r1:.0f} MB |"
        )
    print(
        "\n| mergers (500 producers) | merged objects/s | busiest merger CPU | RSS start -> end |"
    )
    print("|---|---|---|---|")
    for m in (1, 2, 4):
        res = run_setup(500, m, n_hists=100, period_s=1.0, duration_s=duration, tmp=tmp)
        cpu, r0, r1 = summarize(res)
        out["by_mergers"].append(res)
        print(f"| {m} | {res['merged_per_s']:,.0f} | {cpu:.1f} % | {r0:.0f} -> {r1:.0f} MB |")
    plot_producers(out)
    return out


def plot_producers(out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if out["by_producers"]:
        plot_by_producers(out, plt)
    plot_by_mergers(out, plt)


def plot_by_producers(out: dict[str, Any], plt: Any) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for res in out["by_producers"]:
        k = res["bottom"][0]
        t = [s["t"] for s in res["samples"]]
        axes[0].plot(t, [s[k]["cpu"] for s in res["samples"]], label=f"{res['producers']}")
        axes[1].plot(t, [s[k]["rss_mb"] for s in res["samples"]], label=f"{res['producers']}")
    axes[0].set(title="merger CPU (1 merger)", xlabel="time (s)", ylabel="CPU (%)")
    axes[1].set(title="merger RSS (1 merger)", xlabel="time (s)", ylabel="RSS (MB)")
    axes[0].legend(title="producers", fontsize=7)
    axes[1].legend(title="producers", fontsize=7)
    n = [r["producers"] for r in out["by_producers"]]
    axes[2].plot(n, [r["merged_per_s"] for r in out["by_producers"]], "o-", label="merged")
    axes[2].plot(n, [100 * x for x in n], "k--", label="offered (100/s each)")
    axes[2].set(title="merged objects/s", xlabel="producers", ylabel="objects/s",
                xscale="log", yscale="log")  # fmt: skip
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "qc_producers.png", dpi=110)
    plt.close(fig)


def plot_by_mergers(out: dict[str, Any], plt: Any) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for res in out["by_mergers"]:
        k = max(res["bottom"], key=lambda b: statistics.mean(s[b]["cpu"] for s in res["samples"]))
        t = [s["t"] for s in res["samples"]]
        axes[0].plot(t, [s[k]["cpu"] for s in res["samples"]], label=f"{res['mergers']} merger(s)")
        axes[1].plot(t, [s[k]["rss_mb"] for s in res["samples"]], label=f"{res['mergers']}")
    axes[0].set(title="busiest merger CPU, 500 producers", xlabel="time (s)", ylabel="CPU (%)")
    axes[1].set(title="busiest merger RSS, 500 producers", xlabel="time (s)", ylabel="RSS (MB)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "qc_mergers.png", dpi=110)
    plt.close(fig)


def bench_hwm(quick: bool, tmp: Path) -> dict[str, Any]:
    out = []
    print("\n| HWM | merged objects/s | sends refused (queue full) | merger CPU | merger RSS end |")
    print("|---|---|---|---|---|")
    for hwm in (1, 4, 20, 100, 1000):
        res = run_setup(4, 1, n_hists=1, period_s=0.0, duration_s=3 if quick else 6, hwm=hwm,
                        window=2000, cycle_s=0.1, processes=4, tmp=tmp)  # fmt: skip
        cpu, _, r1 = summarize(res)
        out.append(res)
        print(
            f"| {hwm} | {res['merged_per_s']:,.0f} | {res['would_block']:,} | {cpu:.0f} % "
            f"| {r1:.0f} MB |"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["hwm"] for r in out], [r["merged_per_s"] for r in out], "o-")
    ax.set(xscale="log", xlabel="high-water mark (messages)", ylabel="merged objects/s",
           title="4 producers, one 1 kB delta per message")  # fmt: skip
    fig.tight_layout()
    fig.savefig(PLOTS / "qc_hwm.png", dpi=110)
    plt.close(fig)
    return {"hwm": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parts = ("merge", "wire", "producers", "mergers", "hwm", "all")
    parser.add_argument("what", nargs="?", default="all", choices=parts)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    args = parser.parse_args()
    PLOTS.mkdir(exist_ok=True)
    import tempfile

    if args.what == "all":  # each part in a fresh process: a forked merger must not
        # inherit (and report as its RSS) the memory of the parts before it
        for part in ("merge", "wire", "producers", "hwm"):
            argv = [sys.executable, __file__, part, *(["--quick"] if args.quick else [])]
            if args.json:
                argv += ["--json", str(args.json.with_suffix(f".{part}.json"))]
            subprocess.run(argv, check=True)
        return 0
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"{args.what}: {results['date']}, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="qcbench-") as tmpdir:
        tmp = Path(tmpdir)
        if args.what in ("merge", "all"):
            results["merge"] = bench_merge(args.quick)
        if args.what in ("wire", "all"):
            results["wire"] = bench_wire(args.quick, tmp)
        if args.what in ("producers", "mergers", "all"):
            results["producers"] = bench_producers(args.quick, tmp, args.what == "mergers")
        if args.what in ("hwm", "all"):
            results["hwm"] = bench_hwm(args.quick, tmp)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

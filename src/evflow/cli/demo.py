"""``evflow demo [-n N] [-p N] [-o DIR] [--quiet]``: the H->ZZ analysis on real data."""

from __future__ import annotations

import argparse
from typing import Any

from evflow.cli.run import non_negative_int, show_user_traceback
from evflow.errors import EvflowError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the demo analysis on real data (uproot-HZZ.root)",
        description="Select muons and electrons in uproot-HZZ.root (scikit-hep-testdata), "
        "build dimuon and four-lepton masses, fit every opposite-charge muon pair to the "
        "Z mass and line shape, refit the four-lepton mass, fill histograms, keep events "
        "with a dimuon candidate, write them to a ROOT file and plot; on all cores.",
    )
    parser.add_argument(
        "-n",
        "--max-events",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="process at most N events (default: all 2421)",
    )
    parser.add_argument(
        "-p",
        "--workers",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="worker processes (default: one per core; 0: run in this process)",
    )
    parser.add_argument(
        "-o",
        "--output-dir",
        default="demo-output",
        metavar="DIR",
        help="where to write selected.root, histograms.root and masses.png "
        "(default: ./demo-output)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    parser.add_argument(
        "--chaos",
        action="store_true",
        help="instead: a toy run on -p workers (default 4) while workers are SIGKILLed, "
        "hang, raise and segfault; checks every event is written exactly once",
    )
    hlt = parser.add_argument_group("trigger farm (--hlt)")
    hlt.add_argument(
        "--hlt",
        action="store_true",
        help="instead: HZZ events replayed as fragment streams -> event builder -> "
        "parallel path with an asynchronous Z-peak calibration -> output (docs/hlt.md)",
    )
    hlt.add_argument("--streams", type=int, default=6, help="fragment streams, 4-12 (default 6)")
    hlt.add_argument(
        "--rate", type=float, default=2000.0, help="replay rate in Hz, 0: as fast as possible"
    )
    hlt.add_argument("--passes", type=int, default=2, help="passes over the file (default 2)")
    parser.add_argument(
        "--qc",
        action="store_true",
        help="also run online QC: a QC task in every worker, a merger, checks against a "
        "reference, the repository DIR/qc.sqlite; prints each object's quality",
    )
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    if getattr(args, "hlt", False):
        from evflow.demo.hlt import run_hlt_demo

        result = run_hlt_demo(
            args.output_dir,
            streams=args.streams,
            rate_hz=args.rate,
            passes=args.passes,
            workers=2 if args.workers is None else args.workers,
            quiet=args.quiet,
        )
        if not args.quiet:
            print(result.report())
            print(f"selected events: {result.selected}")
        return 0
    if getattr(args, "chaos", False):
        from evflow.demo.chaos import run_chaos_demo

        chaos = run_chaos_demo(
            args.output_dir,
            n_events=args.max_events or 20_000,
            workers=args.workers or 4,
            quiet=args.quiet,
        )
        return 0 if chaos.ok else 1
    from evflow.demo import run_demo

    qc = None
    try:
        if getattr(args, "qc", False):
            from evflow.demo.qc import run_qc_demo

            qc = run_qc_demo(
                args.output_dir, max_events=args.max_events, workers=args.workers,
                quiet=args.quiet,
            )  # fmt: skip
            demo = qc.demo
        else:
            demo = run_demo(
                args.output_dir, max_events=args.max_events, workers=args.workers,
                quiet=args.quiet,
            )  # fmt: skip
    except EvflowError as exc:
        show_user_traceback(exc)
        raise
    if not args.quiet:
        print(demo.report())
        print(f"selected events: {demo.selected_root}")
        print(f"histograms:      {demo.histograms_root}")
        print(f"plot:            {demo.plot_png}")
        if qc is not None:
            print(qc.report())
    return 0

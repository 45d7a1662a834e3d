"""Parallel path processing: one input, N workers and one output over ZeroMQ.

``run_parallel(path, options)`` splits the path at its parallel modules, forks the
roles from a zygote and returns a ``RunSummary`` (see ``docs/parallel.md``).
"""

from __future__ import annotations

import sys

from evflow.processing.options import ProcessOptions
from evflow.processing.parallel.split import SplitPath, split_path
from evflow.processing.path import Path
from evflow.processing.summary import RunSummary

__all__ = ["SplitPath", "run_parallel", "split_path"]


def run_parallel(path: Path, options: ProcessOptions | None = None) -> RunSummary:
    """Run ``path`` with ``options.workers`` worker processes (at least 1).

    A path without a parallel module runs sequentially (a one-line note says so).
    Raises ConfigurationError for a path that cannot be split, ModuleError naming the
    module when user code fails in any process, PeerLostError when the input or the
    output process dies. After SIGINT the run drains, writes what is in flight, closes
    its files and raises KeyboardInterrupt (SIGTERM: SystemExit(143)).
    """
    options = options if options is not None else ProcessOptions(workers=1)
    split = split_path(path)
    if split is None:
        if not options.quiet:
            print(
                "evflow: no module of the path is parallel = True; running sequentially",
                file=sys.stderr,
            )
        from evflow.processing.sequential import run_sequential

        return run_sequential(path, options)
    from evflow.processing.parallel import tcpwire

    if tcpwire.CAPTURE:  # a host agent loads the steering file for its workers (farm.py)
        raise tcpwire.SplitCaptured(split)
    if options.hosts:
        from evflow.processing.parallel.run.farm import FarmParent

        return FarmParent(split, options).run()
    from evflow.processing.parallel.run.engine import Parent

    return Parent(split, options).run()

"""``evflow.process(path, **options)``: run a path, sequentially or on worker processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path as FsPath
from typing import Any

from evflow.errors import ConfigurationError, OutputError
from evflow.processing.filetypes import output_writer
from evflow.processing.options import ProcessOptions
from evflow.processing.path import Path
from evflow.processing.steering import current_context
from evflow.processing.summary import RunSummary


def process(path: Path, **options: Any) -> RunSummary:
    """Run ``path`` over its source's events and return a ``RunSummary``.

    Keywords are the fields of ``ProcessOptions`` (``max_events``, ``workers``,
    ``output``, ``quiet``, ...). Under ``evflow run`` the command line's ``-n``/``-o``/
    ``-p``/``--quiet`` override them. ``workers=0`` runs in this process; ``workers=N``
    runs the parallel part of the path on N worker processes. Unless ``quiet``, the
    summary and the module statistics table are printed at the end.
    """
    ctx = current_context()
    if not isinstance(path, Path):
        raise ConfigurationError(
            f"evflow.process() takes a Path as first argument, got {type(path).__name__} {path!r}"
        )
    opts = ProcessOptions.from_kwargs(options)
    if ctx is not None and ctx.overrides:
        opts = opts.replace(**ctx.overrides)  # the command line wins over the steering file
    try:
        run_path = with_output(path, opts.output) if opts.output else path
        summary = _dispatch(run_path, opts)
    except BaseException as exc:
        if ctx is not None:
            ctx.mark_run_error(exc)
        raise
    if not opts.quiet:
        summary.render()
    # failed events are never silent, even with quiet: a line per failing module
    summary.report_failures(sys.stderr)
    if ctx is not None:
        ctx.summaries.append(summary)
    if summary.interrupted and summary.counters.get("signal"):
        # the run stopped cleanly on SIGINT/SIGTERM; now stop the program as asked
        from evflow.processing.sequential import raise_for_signal

        try:
            raise_for_signal(int(summary.counters["signal"]))
        except BaseException as exc:
            if ctx is not None:
                ctx.mark_run_error(exc)  # e.g. SystemExit(143): not the steering file's exit
            raise
    return summary


def _dispatch(path: Path, options: ProcessOptions) -> RunSummary:
    if options.workers == 0:
        from evflow.processing.sequential import run_sequential

        return run_sequential(path, options)
    try:
        from evflow.processing.parallel import run_parallel
    except ImportError as exc:
        raise ConfigurationError(
            f"parallel processing (workers={options.workers}) is not available in this "
            f"installation ({exc}); run with workers=0 (no -p)"
        ) from exc
    return run_parallel(path, options)


def with_output(path: Path, output: str) -> Path:
    """A copy of ``path`` with a writer for ``output`` appended, chosen by extension.

    ``.root`` gets a ``RootOutput`` (TTree "events"); anything else a ``RecordOutput``
    (evflow's record file). The directory must exist and be writable.
    """
    check_writable(output)
    return Path([*path.modules, output_writer(output)])


def check_writable(output: str) -> None:
    """Raise OutputError naming the problem when ``output`` cannot be created."""
    target = FsPath(output)
    if target.is_dir():
        raise OutputError(f"output {output!r} is a directory; give a file name")
    parent = target.parent if str(target.parent) else FsPath(".")
    if not parent.is_dir():
        raise OutputError(
            f"cannot write output {output!r}: directory {str(parent)!r} does not exist"
        )
    if not os.access(parent, os.W_OK | os.X_OK) or (
        target.exists() and not os.access(target, os.W_OK)
    ):
        raise OutputError(f"cannot write output {output!r}: permission denied")

"""The input's HELLO check of a worker (processing/parallel/input/input.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from evflow.errors import ProtocolError
from evflow.processing.parallel.input.input import _Input as _RunInput
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message, hello_header


class _Input(_RunInput):
    """Just what the HELLO path reads (a run's input has much more)."""

    def __init__(self) -> None:  # (no sockets, no source: not the role's __init__)
        self.workers = {}
        self.remote_workers = False
        self.bad = BadMessageCounter("input")
        self.end_sent = False


def _hello(name: str, pid: int) -> list[bytes]:
    return [b"ident", *encode_message(MsgType.HELLO, hello_header(name=name, pid=pid))]


def test_hello_of_a_worker_that_ended_is_counted_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a run that aborts at start-up (an unwritable -o) kills its workers; a HELLO one of
    # them sent before still arrives: not an intruder, so no warning before the one
    # error line of the run
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    inp = _Input()
    with caplog.at_level(logging.DEBUG):
        inp._on_worker(_hello("worker-1", ended.pid))
    assert inp.workers == {}
    assert inp.bad.counts == {"hello-of-ended": 1}
    assert all(r.levelno < logging.WARNING for r in caplog.records)


def test_hello_of_a_live_process_outside_the_run_is_refused() -> None:
    inp = _Input()
    with pytest.raises(ProtocolError, match="is not a process of the run"):
        inp._on_worker(_hello("worker-1", os.getppid()))  # alive, not our sibling
    assert inp.workers == {}

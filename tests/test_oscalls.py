"""evflow.runtime.oscalls: the prctl calls and the exact read every forked process uses."""

from __future__ import annotations

import os
import signal
import socket
import time

import psutil
import pytest

from evflow.runtime.oscalls import (
    become_subreaper,
    die_with_parent,
    recv_exact,
    set_process_name,
)


def test_recv_exact_joins_pieces_and_names_a_short_read() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"abc")
        a.sendall(b"defg")
        assert recv_exact(b, 5) == b"abcde"
        assert recv_exact(b, 2) == b"fg"
        a.sendall(b"xy")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError, match="after 2 of 4 bytes"):
            recv_exact(b, 4)


def _wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def _scenario() -> int:
    """In a forked process of its own (the subreaper setting stays there): a middle
    process forks a grandchild that asks to die with it; SIGKILL of the middle one must
    kill the grandchild, which is re-parented to us (not to init) and reaped here.
    Returns an exit code: 0 passed, 1-4 the step that failed."""
    become_subreaper()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        if os.fork() == 0:
            die_with_parent(os.getppid())
            set_process_name("evf-oscalls-gc")
            os.write(w, os.getpid().to_bytes(4, "little"))
        while True:
            time.sleep(1)
    os.close(w)
    grandchild = int.from_bytes(os.read(r, 4), "little")
    if psutil.Process(grandchild).name() != "evf-oscalls-gc":
        return 1
    os.kill(middle, signal.SIGKILL)
    os.waitpid(middle, 0)
    if not _wait_gone(grandchild):
        return 2
    try:
        _, status = os.waitpid(grandchild, 0)  # ours to reap: we are its subreaper
    except ChildProcessError:
        return 3
    return 0 if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else 4


def test_a_child_dies_with_its_parent_and_the_subreaper_reaps_the_orphan() -> None:
    outer = os.fork()
    if outer == 0:
        code = 5
        try:
            code = _scenario()
        finally:
            os._exit(code)
    _, status = os.waitpid(outer, 0)
    assert os.waitstatus_to_exitcode(status) == 0, (
        "1: the name was not set, 2: the grandchild outlived its parent, "
        "3: the orphan was not re-parented to the subreaper, 4: it did not die by SIGKILL"
    )

"""Linux calls every process evflow forks needs: the zygote and its children, the
launch guard on a remote host, and the isolated children of async tasks.

One ``prctl`` wrapper, so each kernel option is spelled once: a child that must die
with its parent, a parent that must reap its orphaned grandchildren, and the name that
``ps -o comm`` shows. Plus ``recv_exact`` for the length-prefixed stream sockets
(socketpairs between a process and its own forked children).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket

__all__ = [
    "become_subreaper",
    "die_with_parent",
    "recv_exact",
    "set_parent_death_signal",
    "set_process_name",
]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36

_libc: ctypes.CDLL | None = None


def _prctl(option: int, arg: int | bytes) -> None:
    """Call prctl(2); raise OSError on failure."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}) failed: {os.strerror(err)}")


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def die_with_parent(expected_ppid: int, sig: int = signal.SIGKILL) -> None:
    """``set_parent_death_signal``, and exit now if the parent died before it took
    effect (then nobody would ever send the signal)."""
    set_parent_death_signal(sig)
    if os.getppid() != expected_ppid:
        os._exit(1)


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to us, not to init: nothing escapes our
    sweep. Best effort (a kernel without it leaves them to init)."""
    with contextlib.suppress(OSError):
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def set_process_name(name: str) -> None:
    """Kernel thread name (first 15 bytes; what ``ps -o comm`` and psutil ``name()`` show)."""
    with contextlib.suppress(OSError):
        _prctl(_PR_SET_NAME, name.encode()[:15])


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from a stream socket; EOFError if the peer closed first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"peer closed the socket after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)

"""Long-running tasks in an isolated process, fed through shared memory, never waited for.

:class:`AsyncTask` runs ``func(arrays) -> dict`` in a child process forked from the
caller (a module's process: the sequential run or a parallel worker). The caller
hands numpy arrays over with :meth:`~AsyncTask.submit`, which copies them into a
shared-memory buffer (an anonymous shared mapping made before the fork, so nothing
is ever left in ``/dev/shm``) and sends the layout (names, dtypes, shapes, offsets)
over a socket pair; it returns at once. :meth:`~AsyncTask.poll` (non-blocking)
returns the results that came back, decoded with evflow's safe codec (msgpack header
+ raw array buffers; never pickle).

Isolation: the child dies with its parent (``PR_SET_PDEATHSIG``); a crash (segfault,
an exception in ``func``, out of memory under ``memory_mb``) is reported as a
:class:`TaskFailure` and the next submit forks a new child; a call that runs longer
than ``timeout_s`` is killed (SIGKILL) and reported the same way. The failed call's
input is not retried. While a call runs, new input follows ``policy``:

- ``skip``: dropped (counted);
- ``queue``: kept, up to ``queue_size`` inputs (copies); beyond, dropped (counted);
- ``replace``: only the newest waits (the one it replaces is counted).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import mmap
import os
import signal
import socket
import struct
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from evflow.errors import CodecError, ConfigurationError
from evflow.event import DataStore, EventMeta
from evflow.runtime.oscalls import recv_exact, set_parent_death_signal
from evflow.wire.codec import decode_event, encode_event
from evflow.wire.raw import pack_frames, unpack_frames

__all__ = ["POLICIES", "AsyncTask", "TaskFailure", "TaskResult"]

log = logging.getLogger("evflow.hlt")

POLICIES = ("skip", "queue", "replace")
_HEAD = struct.Struct("<IQ")  # header length, body length
_MAX_HEADER_B = 1 << 20


@dataclass
class TaskResult:
    tag: int  # what the caller gave submit() (e.g. the event number of the input)
    call: int
    result: dict[str, Any]
    runtime_s: float


@dataclass
class TaskFailure:
    tag: int
    call: int
    reason: str  # "exception: ...", "killed by SIGSEGV", "timeout after 5.0 s", ...


@dataclass
class TaskStats:
    submitted: int = 0
    started: int = 0
    completed: int = 0
    failed: int = 0
    timeouts: int = 0
    restarts: int = 0
    skipped: int = 0
    replaced: int = 0
    failures: list[str] = field(default_factory=list)


# --- the child ----------------------------------------------------------------------------
def _send(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    head = msgpack.packb(header)
    sock.sendall(_HEAD.pack(len(head), len(body)) + head + body)


def _child(sock: socket.socket, shm: mmap.mmap, func: Callable[..., Any], memory_mb: int) -> None:
    faulthandler.disable()  # a crash is reported by the parent, once
    with contextlib.suppress(OSError):
        set_parent_death_signal(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run stops us; Ctrl-C is for the parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the handler of the process we came from
    if memory_mb:
        import resource

        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    view = memoryview(shm)
    while True:
        try:
            hlen, blen = _HEAD.unpack(recv_exact(sock, _HEAD.size))
            header = msgpack.unpackb(recv_exact(sock, hlen))
            if blen:
                recv_exact(sock, blen)
        except EOFError:
            return  # the parent closed: done
        arrays = {
            name: np.frombuffer(view, np.dtype(dt), int(np.prod(shape)), off).reshape(shape)
            for name, dt, shape, off in header["layout"]
        }
        t0 = time.monotonic()
        try:
            result = func(arrays)
            body = pack_frames(encode_event(DataStore(EventMeta(0), dict(result or {}))))
        except BaseException as exc:  # reported to the parent, then we exit
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            _send(sock, {"call": header["call"], "error": text[:2000]})
            return
        del arrays
        _send(sock, {"call": header["call"], "s": time.monotonic() - t0}, body)


# --- the parent ---------------------------------------------------------------------------
class AsyncTask:
    """See the module docstring. Call :meth:`poll` often (every event) and
    :meth:`close` at the end."""

    def __init__(
        self,
        func: Callable[[dict[str, np.ndarray]], dict[str, Any] | None],
        *,
        name: str = "task",
        policy: str = "replace",
        queue_size: int = 4,
        timeout_s: float = 60.0,
        buffer_bytes: int = 16 << 20,
        memory_mb: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigurationError(
                f"async task {name!r}: unknown policy {policy!r}; expected {' | '.join(POLICIES)}"
            )
        if queue_size < 1 or timeout_s <= 0 or buffer_bytes < 4096:
            raise ConfigurationError(
                f"async task {name!r}: queue_size >= 1, timeout_s > 0 and buffer_bytes >= 4096 "
                f"expected (got {queue_size}, {timeout_s}, {buffer_bytes})"
            )
        self.func = func
        self.name = name
        self.policy = policy
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._shm = mmap.mmap(-1, buffer_bytes)  # MAP_SHARED | MAP_ANONYMOUS: the child sees it
        self._view = memoryview(self._shm)
        self.pid: int | None = None
        self._sock: socket.socket | None = None
        self._inbuf = bytearray()
        self._busy: tuple[int, int, float] | None = None  # (call, tag, started at)
        self._waiting: deque[tuple[int, dict[str, np.ndarray]]] = deque()
        self._calls = 0
        self._results: list[TaskResult] = []
        self.failures: list[TaskFailure] = []
        self.stats = TaskStats()

    # --- process --------------------------------------------------------------------------
    def _start(self) -> None:
        parent, child = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the child: never returns, never touches the parent's sockets
            code = 0
            try:
                parent.close()
                _child(child, self._shm, self.func, self.memory_mb)
            except BaseException:  # the child never returns into the caller
                code = 1
            finally:
                os._exit(code)
        child.close()
        parent.setblocking(False)
        if self.pid is not None or self.stats.started:
            self.stats.restarts += 1
        self.pid, self._sock = pid, parent
        self._inbuf.clear()
        self.stats.started += 1

    def _stop_child(self, sig: int = signal.SIGKILL) -> int | None:
        """Kill (if alive) and reap the child; return its wait status code."""
        pid, self.pid = self.pid, None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if pid is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    def _failed(self, reason: str) -> None:
        call, tag, _ = self._busy or (-1, -1, 0.0)
        self._busy = None
        self.stats.failed += 1
        self.stats.failures.append(reason)
        self.failures.append(TaskFailure(tag, call, reason))
        log.warning("async task %s: call %d (tag %d) failed: %s", self.name, call, tag, reason)

    # --- input ----------------------------------------------------------------------------
    def submit(self, arrays: dict[str, np.ndarray], tag: int = 0) -> str:
        """Hand ``arrays`` over; returns "started", "queued", "replaced" or "skipped"."""
        self.stats.submitted += 1
        self._progress()
        if self._busy is None:
            self._dispatch(tag, arrays)
            return "started"
        if self.policy == "skip":
            self.stats.skipped += 1
            return "skipped"
        copy = {k: np.array(v) for k, v in arrays.items()}  # the caller may reuse its arrays
        if self.policy == "replace":
            if self._waiting:
                self._waiting.clear()
                self.stats.replaced += 1
                self._waiting.append((tag, copy))
                return "replaced"
            self._waiting.append((tag, copy))
            return "queued"
        if len(self._waiting) >= self.queue_size:
            self.stats.skipped += 1
            return "skipped"
        self._waiting.append((tag, copy))
        return "queued"

    def _dispatch(self, tag: int, arrays: dict[str, np.ndarray]) -> None:
        layout = []
        at = 0
        for name, arr in arrays.items():
            arr = np.ascontiguousarray(arr)
            if arr.dtype.hasobject:
                raise ConfigurationError(f"async task {self.name!r}: {name!r} is not numeric")
            end = at + arr.nbytes
            if end > len(self._view):
                raise ConfigurationError(
                    f"async task {self.name!r}: input of {end} bytes does not fit the "
                    f"{len(self._view)}-byte shared buffer (raise buffer_bytes)"
                )
            self._view[at:end] = arr.reshape(-1).view(np.uint8).data
            layout.append([name, arr.dtype.str, list(arr.shape), at])
            at = -(-end // 64) * 64
        if self.pid is None:
            self._start()
        call = self._calls
        self._calls += 1
        for attempt in (0, 1):
            assert self._sock is not None
            self._sock.setblocking(True)
            try:
                _send(self._sock, {"call": call, "layout": layout})
                break
            except OSError:  # the idle child died since its last answer: a new one
                self._busy = (call, tag, time.monotonic())
                self._dead()
                if attempt:
                    return
                self._start()
            finally:
                if self._sock is not None:
                    self._sock.setblocking(False)
        self._busy = (call, tag, time.monotonic())

    # --- output ---------------------------------------------------------------------------
    def poll(self) -> list[TaskResult]:
        """Results that came back since the last call (never blocks)."""
        self._progress()
        out, self._results = self._results, []
        return out

    def _progress(self) -> None:
        if self._busy is not None and self._sock is not None:
            self._read()
        if self._busy is not None and time.monotonic() - self._busy[2] > self.timeout_s:
            self._stop_child()
            self.stats.timeouts += 1
            self._failed(f"timeout after {self.timeout_s:g} s (killed)")
        if self._busy is None and self._waiting:
            tag, arrays = self._waiting.popleft()
            self._dispatch(tag, arrays)

    def _read(self) -> None:
        assert self._sock is not None
        gone = False  # the child closed its end (it exits after reporting an exception)
        try:
            while True:
                chunk = self._sock.recv(1 << 20)
                if not chunk:
                    gone = True
                    break
                self._inbuf += chunk
        except BlockingIOError:
            pass
        except OSError:
            gone = True
        # what it wrote before it went is read first: its last answer names the exception
        self._take_answer()
        if gone and self._sock is not None:
            self._dead()

    def _take_answer(self) -> None:
        buf = self._inbuf
        if self._busy is None or len(buf) < _HEAD.size:
            return
        hlen, blen = _HEAD.unpack_from(buf)
        if hlen > _MAX_HEADER_B or len(buf) < _HEAD.size + hlen + blen:
            if hlen > _MAX_HEADER_B:
                self._stop_child()
                self._failed("garbage from the task process (killed)")
            return
        head = bytes(buf[_HEAD.size : _HEAD.size + hlen])
        body = bytes(buf[_HEAD.size + hlen : _HEAD.size + hlen + blen])
        del buf[: _HEAD.size + hlen + blen]
        self._answer(head, body)

    def _answer(self, head: bytes, body: bytes) -> None:
        assert self._busy is not None
        call, tag, t0 = self._busy
        try:
            header = msgpack.unpackb(head)
            if header.get("call") != call:
                raise CodecError(f"answer for call {header.get('call')!r}, expected {call}")
            if "error" in header:
                self._stop_child(signal.SIGKILL)
                self._failed(f"exception: {header['error']}")
                return
            result = dict(decode_event(unpack_frames(body)).objects)
        except (CodecError, ValueError, TypeError, AttributeError) as exc:
            self._stop_child()
            self._failed(f"bad answer from the task process: {exc} (killed)")
            return
        self._busy = None
        self.stats.completed += 1
        self._results.append(TaskResult(tag, call, result, time.monotonic() - t0))

    def _dead(self) -> None:
        code = self._stop_child()
        if code is not None and code < 0:
            reason = f"killed by {signal.Signals(-code).name}"
        elif code == 1:
            reason = "exited with code 1 (out of memory or an error outside the task)"
        else:
            reason = f"exited with code {code}"
        self._failed(reason)

    @property
    def busy(self) -> bool:
        return self._busy is not None

    def wait(self, timeout_s: float) -> list[TaskResult]:
        """Poll until nothing is running or waiting, or ``timeout_s`` passed (tests, end)."""
        deadline = time.monotonic() + timeout_s
        out = self.poll()
        while (self._busy is not None or self._waiting) and time.monotonic() < deadline:
            time.sleep(0.002)
            out += self.poll()
        return out

    def close(self) -> None:
        """Stop the child (SIGKILL: whatever runs is abandoned) and free the buffer."""
        self._stop_child()
        self._waiting.clear()
        if self._view is not None:
            self._view.release()
            self._view = None  # type: ignore[assignment]
            self._shm.close()

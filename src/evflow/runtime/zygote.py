"""A zygote: one clean process that forks every worker and reaps them at once.

Process tree and why it has this shape::

    supervisor (your process: zmq context, signal handlers, terminal's process group)
      `- zygote        own process group, SIGINT ignored, PDEATHSIG=SIGKILL, subreaper
           |- child    forked function or exec'd argv, PDEATHSIG=SIGKILL
           `- child    ...

- ``start()`` forks the zygote *before* the caller creates a zmq context, so the zygote
  holds no context and no threads; every child is a copy-on-write fork of it and
  inherits whatever the caller imported before ``start()`` (user modules, a path in a
  module-level variable).
- Each child dies with its parent (``PR_SET_PDEATHSIG`` = SIGKILL): supervisor dies ->
  zygote dies -> children die. No orphan survives a ``kill -9`` of the supervisor.
- The zygote reaps its children on SIGCHLD (self-pipe via ``signal.set_wakeup_fd``) and
  writes ``(pid, returncode)`` records to a notice socket at once; ``fileno()`` is that
  socket, so a caller's ``zmq.Poller`` or selector wakes on a death without polling.
- The zygote is a child subreaper: grandchildren whose parent died reparent to it and
  are reaped there, and ``stop()`` kills the whole process group, grandchildren too.
- The zygote runs in its own process group: a terminal's Ctrl-C (SIGINT to the
  foreground process group) reaches only the supervisor, which drives an orderly
  shutdown. Forked function children also ignore SIGINT (they may install their own
  handler); exec'd children get SIGINT back at its default.

Commands travel over a local socketpair as pickles between our own processes (never
over a network socket). Call ``start()``, ``spawn()`` and ``stop()`` from one thread,
the one that lives as long as the zygote (PDEATHSIG follows the forking *thread*).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from evflow.errors import ConfigurationError, PeerLostError, TimeoutError_
from evflow.runtime._zygote_server import (
    EXIT_RECORD,
    ZygoteServer,
    die_with_parent,
    recv_obj,
    send_obj,
    set_process_name,
)

__all__ = ["Zygote", "die_with_parent", "set_process_name", "zmq_threads_running"]

log = logging.getLogger("evflow.zygote")

_REPLY_TIMEOUT_S = 30.0


class Zygote:
    """Fork-server for workers. See the module docstring for the process model.

    Typical use::

        zygote = Zygote().start()          # before zmq.Context()
        pid = zygote.spawn(worker_main, 3, name="worker-3")
        ...  # poll zygote.fileno() together with your sockets
        for pid, returncode in zygote.exits():
            ...
        zygote.stop()
    """

    def __init__(self) -> None:
        self.pid: int | None = None
        self._cmd: socket.socket | None = None
        self._notice: socket.socket | None = None
        self._notice_buf = b""
        self._pending: list[tuple[int, int]] = []
        self._live: dict[int, str] = {}
        self._lock = threading.Lock()
        self._lost = False

    def __repr__(self) -> str:
        state = "lost" if self._lost else ("running" if self.pid else "not started")
        return f"<Zygote pid={self.pid} {state} children={len(self._live)}>"

    # --- lifecycle ----------------------------------------------------------------
    def start(self, replacing: bool = False) -> Zygote:
        """Fork the zygote process. Returns self. Call before creating any zmq context.

        ``replacing``: this zygote replaces one that died, forked from a process that
        has a zmq context by now (no warning). Its children then hold copies of that
        context's socket descriptors, which they never use: harmless for ipc, while a
        tcp port the caller bound stays held until they exit."""
        if self.pid is not None:
            raise ConfigurationError("Zygote.start() called twice")
        if not replacing and zmq_threads_running():
            # children would inherit the context's sockets (a bound port stays held)
            log.warning(
                "Zygote.start() called after a zmq context was created in pid %d; "
                "start the zygote first so that workers inherit no zmq sockets",
                os.getpid(),
            )
        cmd_parent, cmd_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        note_parent, note_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent_pid = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # zygote
            code = 1
            try:
                cmd_parent.close()
                note_parent.close()
                code = ZygoteServer(cmd_child, note_child, parent_pid).serve()
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        cmd_child.close()
        note_child.close()
        note_parent.setblocking(False)
        cmd_parent.settimeout(_REPLY_TIMEOUT_S)
        self.pid, self._cmd, self._notice = pid, cmd_parent, note_parent
        return self

    def stop(self, grace_s: float = 1.0) -> list[tuple[int, int]]:
        """Stop every child (SIGTERM, SIGKILL after ``grace_s``) and the zygote.

        Returns the exits not yet collected by ``exits()``. Safe to call twice.
        """
        if self.pid is None or self._cmd is None:
            return self.exits()
        if not self._lost:
            try:
                with self._lock:
                    send_obj(self._cmd, ("stop", float(grace_s)))
                    self._cmd.settimeout(grace_s + 5.0)
                    recv_obj(self._cmd)
            except (OSError, EOFError):
                pass  # zygote already gone; children died with it
        self._drain_notices(block_until_eof_s=1.0)
        self._reap_zygote(timeout_s=2.0)
        # children the zygote could not report (it was lost): PDEATHSIG killed them
        for pid in list(self._live):
            self._pending.append((pid, -signal.SIGKILL))
        self._live.clear()
        self._cmd.close()
        if self._notice is not None:
            self._notice.close()
        self._cmd = self._notice = None
        self._lost = True
        out, self._pending = self._pending, []
        return out

    def __enter__(self) -> Zygote:
        return self if self.pid is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- spawning ------------------------------------------------------------------
    def spawn(self, func: Callable[..., int | None], *args: Any, name: str = "") -> int:
        """Run ``func(*args)`` in a fresh fork of the zygote; return the child's pid.

        ``func`` must be a module-level function; its return value is the exit code
        (None -> 0). An exception prints its traceback and exits with code 1.
        """
        try:
            pickle.dumps((func, args))
        except Exception as exc:
            raise ConfigurationError(
                f"cannot send {func!r} to the zygote: {exc} "
                "(use a module-level function and picklable arguments)"
            ) from exc
        label = name or getattr(func, "__name__", "child")
        return self._request(("spawn", func, args, label), label)

    def spawn_many(
        self, items: Sequence[tuple[Callable[..., int | None], tuple[Any, ...], str]]
    ) -> list[int | str]:
        """Like :meth:`spawn` for each ``(func, args, name)``, in one request: the
        zygote forks them all, then lets them run together. Returns, per item, the pid
        or the error string of a failed fork (the other items are not affected)."""
        if not items:
            return []
        request = ("spawn-many", [(f, tuple(a), n or f.__name__) for f, a, n in items])
        try:
            pickle.dumps(request)
        except Exception as exc:
            raise ConfigurationError(
                f"cannot send {len(items)} function(s) to the zygote: {exc} "
                "(use module-level functions and picklable arguments)"
            ) from exc
        results = self._request(request, f"{len(items)} process(es)", many=True)
        for (_f, _a, name), value in zip(request[1], results, strict=True):
            if isinstance(value, int):
                self._live[value] = name
        return results

    def spawn_exec(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        name: str = "",
    ) -> int:
        """Fork the zygote and exec ``argv`` (PATH lookup); return the pid.

        The child gets PDEATHSIG too. An exec failure (no such program) raises
        ``ConfigurationError`` here instead of surfacing as exit code 127.
        """
        if not argv:
            raise ConfigurationError("spawn_exec() needs a non-empty argv")
        label = name or os.path.basename(argv[0])
        return self._request(("exec", list(argv), env, cwd, label), label)

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> bool:
        """Send ``sig`` to child ``pid`` if it is still unreaped (no pid-reuse race).

        Returns False if the child already exited.
        """
        if self._cmd is None or self._lost:
            return False
        with self._lock:
            try:
                send_obj(self._cmd, ("kill", int(pid), int(sig)))
                status, value = recv_obj(self._cmd)
            except (OSError, EOFError) as exc:
                self._lost = True
                raise PeerLostError(f"zygote pid {self.pid} is gone: {exc}") from exc
        return bool(value) if status == "ok" else False

    def _request(self, command: tuple[Any, ...], label: str, many: bool = False) -> Any:
        if self._cmd is None:
            raise ConfigurationError("Zygote not started: call start() first")
        if self._lost:
            raise PeerLostError(f"zygote pid {self.pid} is gone; cannot spawn {label!r}")
        with self._lock:
            try:
                send_obj(self._cmd, command)
                status, value = recv_obj(self._cmd)
            except TimeoutError as exc:
                raise TimeoutError_(f"zygote did not answer spawn of {label!r}") from exc
            except (OSError, EOFError) as exc:
                self._lost = True
                raise PeerLostError(
                    f"zygote pid {self.pid} died; cannot spawn {label!r}: {exc}"
                ) from exc
        if status != "ok":
            raise ConfigurationError(f"cannot start {label!r}: {value}")
        if many:
            return list(value)
        self._live[int(value)] = label
        return int(value)

    # --- exits ---------------------------------------------------------------------
    def fileno(self) -> int:
        """A descriptor that is readable when exit notices are pending (or the zygote died)."""
        if self._notice is None:
            raise ConfigurationError("Zygote not started or already stopped")
        return self._notice.fileno()

    def exits(self) -> list[tuple[int, int]]:
        """Children that ended since the last call: ``[(pid, returncode)]``, never blocks.

        ``returncode`` is the exit code, or ``-signal`` if a signal killed the child.
        If the zygote itself died, every live child is reported as ``-SIGKILL`` (they
        died with it) and later ``spawn()`` raises ``PeerLostError``.
        """
        self._drain_notices()
        if self._lost and self._live:
            for pid in list(self._live):
                self._pending.append((pid, -signal.SIGKILL))
            self._live.clear()
        out, self._pending = self._pending, []
        return out

    @property
    def children(self) -> dict[int, str]:
        """Live children as ``{pid: name}`` (as far as collected exits tell)."""
        return dict(self._live)

    @property
    def alive(self) -> bool:
        """False once the zygote died or was stopped."""
        return self.pid is not None and not self._lost

    def _drain_notices(self, block_until_eof_s: float = 0.0) -> None:
        sock = self._notice
        if sock is None:
            return
        deadline = time.monotonic() + block_until_eof_s
        while True:
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                if block_until_eof_s <= 0 or time.monotonic() >= deadline:
                    break
                selectors_wait(sock.fileno(), max(0.0, deadline - time.monotonic()))
                continue
            except OSError:
                chunk = b""
            if not chunk:  # EOF: the zygote exited
                self._lost = True
                break
            self._notice_buf += chunk
        buf = self._notice_buf
        n = len(buf) // EXIT_RECORD.size
        for i in range(n):
            pid, code = EXIT_RECORD.unpack_from(buf, i * EXIT_RECORD.size)
            self._live.pop(pid, None)
            self._pending.append((pid, code))
        self._notice_buf = buf[n * EXIT_RECORD.size :]

    def _reap_zygote(self, timeout_s: float) -> None:
        assert self.pid is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if pid:
                return
            if time.monotonic() >= deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
                return
            time.sleep(0.005)


def zmq_threads_running() -> bool:
    """True if libzmq's background threads (``ZMQbg/...``) run in this process."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                if fh.read().startswith("ZMQbg"):
                    return True
        except OSError:
            continue
    return False


def selectors_wait(fd: int, timeout_s: float) -> None:
    """Wait until ``fd`` is readable or ``timeout_s`` passed."""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        sel.select(timeout_s)

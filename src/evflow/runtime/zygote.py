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
import ctypes
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from evflow.errors import ConfigurationError, PeerLostError, TimeoutError_

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36

_LEN = struct.Struct("!I")
_EXIT = struct.Struct("!ii")  # pid, returncode (negative = signal)
_REPLY_TIMEOUT_S = 30.0

_libc: ctypes.CDLL | None = None


def _prctl(option: int, arg: int | bytes) -> None:
    """Call prctl(2); raise OSError on failure (Linux only)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}) failed: {os.strerror(err)}")


def die_with_parent(expected_ppid: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when our parent dies; exit now if it already has."""
    _prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != expected_ppid:  # parent died before prctl took effect
        os._exit(1)


def set_process_name(name: str) -> None:
    """Kernel thread name (first 15 bytes; what ``ps -o comm`` and psutil ``name()`` show)."""
    with contextlib.suppress(OSError):
        _prctl(PR_SET_NAME, name.encode()[:15])


def _send_obj(sock: socket.socket, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed the zygote socket")
        buf += chunk
    return bytes(buf)


def _recv_obj(sock: socket.socket) -> Any:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    # pickle from our own forked process over a private socketpair, never a network peer
    return pickle.loads(_recv_exact(sock, size))


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
    def start(self) -> Zygote:
        """Fork the zygote process. Returns self. Call before creating any zmq context."""
        if self.pid is not None:
            raise ConfigurationError("Zygote.start() called twice")
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
                code = _ZygoteServer(cmd_child, note_child, parent_pid).serve()
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
                    _send_obj(self._cmd, ("stop", float(grace_s)))
                    self._cmd.settimeout(grace_s + 5.0)
                    _recv_obj(self._cmd)
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
                _send_obj(self._cmd, ("kill", int(pid), int(sig)))
                status, value = _recv_obj(self._cmd)
            except (OSError, EOFError) as exc:
                self._lost = True
                raise PeerLostError(f"zygote pid {self.pid} is gone: {exc}") from exc
        return bool(value) if status == "ok" else False

    def _request(self, command: tuple[Any, ...], label: str) -> int:
        if self._cmd is None:
            raise ConfigurationError("Zygote not started: call start() first")
        if self._lost:
            raise PeerLostError(f"zygote pid {self.pid} is gone; cannot spawn {label!r}")
        with self._lock:
            try:
                _send_obj(self._cmd, command)
                status, value = _recv_obj(self._cmd)
            except TimeoutError as exc:
                raise TimeoutError_(f"zygote did not answer spawn of {label!r}") from exc
            except (OSError, EOFError) as exc:
                self._lost = True
                raise PeerLostError(
                    f"zygote pid {self.pid} died; cannot spawn {label!r}: {exc}"
                ) from exc
        if status != "ok":
            raise ConfigurationError(f"cannot start {label!r}: {value}")
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
        n = len(buf) // _EXIT.size
        for i in range(n):
            pid, code = _EXIT.unpack_from(buf, i * _EXIT.size)
            self._live.pop(pid, None)
            self._pending.append((pid, code))
        self._notice_buf = buf[n * _EXIT.size :]

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


def selectors_wait(fd: int, timeout_s: float) -> None:
    """Wait until ``fd`` is readable or ``timeout_s`` passed."""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        sel.select(timeout_s)


class _ZygoteServer:
    """The loop inside the zygote process: fork on request, reap on SIGCHLD."""

    def __init__(self, cmd: socket.socket, notice: socket.socket, parent_pid: int) -> None:
        self.cmd = cmd
        self.notice = notice
        self.parent_pid = parent_pid
        self.my_pid = os.getpid()
        self.live: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        self.sel = selectors.DefaultSelector()

    def serve(self) -> int:
        die_with_parent(self.parent_pid)
        set_process_name("evflow-zygote")
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)  # out of the terminal's foreground group: Ctrl-C skips us
        with contextlib.suppress(OSError):
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd fires
        self.sel.register(self.cmd, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        self.cmd.setblocking(True)
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.cmd:
                    try:
                        request = _recv_obj(self.cmd)
                    except EOFError:  # the supervisor closed us: stop everything
                        self._kill_group_and_exit(self._shutdown(0.0))
                    except Exception as exc:  # unpicklable function: answer, keep serving
                        _send_obj(self.cmd, ("error", f"{type(exc).__name__}: {exc}"))
                        continue
                    if request[0] == "stop":
                        code = self._shutdown(float(request[1]))
                        with contextlib.suppress(OSError):
                            _send_obj(self.cmd, ("ok", None))
                        self._kill_group_and_exit(code)
                    try:
                        reply = self._handle(request)
                    except OSError as exc:  # fork failed (EAGAIN, ENOMEM): the caller decides
                        reply = ("error", f"fork failed: {exc}")
                    _send_obj(self.cmd, reply)
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
            self._reap()

    def _handle(self, request: tuple[Any, ...]) -> tuple[str, Any]:
        kind = request[0]
        if kind == "spawn":
            _, func, args, name = request
            return ("ok", self._fork_function(func, args, name))
        if kind == "exec":
            _, argv, env, cwd, name = request
            return self._fork_exec(argv, env, cwd, name)
        if kind == "kill":
            _, pid, sig = request
            if pid not in self.live:
                return ("ok", False)
            try:
                os.kill(pid, sig)  # unreaped child: its pid cannot have been reused
            except ProcessLookupError:
                return ("ok", False)
            return ("ok", True)
        return ("error", f"unknown zygote command {kind!r}")

    def _child_setup(self, name: str) -> None:
        """In a fresh child: drop the zygote's descriptors and handlers, die with it."""
        die_with_parent(self.my_pid)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.sel.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        self.cmd.close()
        self.notice.close()
        set_process_name(name)

    def _fork_function(self, func: Callable[..., Any], args: tuple[Any, ...], name: str) -> int:
        pid = os.fork()
        if pid:
            self.live.add(pid)
            return pid
        code = 1
        try:
            self._child_setup(name)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor drives shutdown
            result = func(*args)
            code = 0 if result is None else int(result)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code & 0xFF)

    def _fork_exec(
        self, argv: list[str], env: dict[str, str] | None, cwd: str | None, name: str
    ) -> tuple[str, Any]:
        err_r, err_w = os.pipe2(os.O_CLOEXEC)  # closes by itself on a successful exec
        pid = os.fork()
        if pid == 0:
            try:
                os.close(err_r)
                self._child_setup(name)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                if cwd is not None:
                    os.chdir(cwd)
                if env is None:
                    os.execvp(argv[0], argv)
                else:
                    os.execvpe(argv[0], argv, env)
            except BaseException as exc:
                with contextlib.suppress(OSError):
                    os.write(err_w, f"{type(exc).__name__}: {exc}".encode()[:1000])
            finally:
                os._exit(127)
        os.close(err_w)
        chunks = []
        while chunk := os.read(err_r, 1024):
            chunks.append(chunk)
        os.close(err_r)
        if chunks:  # exec failed: reap the child now and report the reason
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return ("error", f"cannot exec {argv[0]!r}: {b''.join(chunks).decode()}")
        self.live.add(pid)
        return ("ok", pid)

    def _reap(self) -> None:
        """Collect every dead child; report ours at once (strays from the subreaper too)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.live:  # grandchildren reparented to us are reaped silently
                self.live.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                self.notice.sendall(_EXIT.pack(pid, code))

    def _shutdown(self, grace_s: float) -> int:
        """SIGTERM every child, SIGKILL what remains after ``grace_s``, report all exits."""
        for pid in list(self.live):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.live and time.monotonic() < deadline:
            self._reap()
            if self.live:
                time.sleep(0.005)
        for pid in list(self.live):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while self.live:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid in self.live:
                self.live.discard(pid)
                with contextlib.suppress(OSError):
                    self.notice.sendall(_EXIT.pack(pid, os.waitstatus_to_exitcode(status)))
        return 0

    def _kill_group_and_exit(self, code: int) -> None:
        """Close our sockets, then SIGKILL the group: grandchildren that escaped, and us."""
        self.notice.close()
        self.cmd.close()
        if os.getpgrp() == os.getpid():  # never signal the supervisor's own group
            with contextlib.suppress(OSError):
                os.killpg(0, signal.SIGKILL)
        os._exit(code)

"""Inside the zygote process: the fork-on-request loop, and the helpers both sides share.

See :mod:`evflow.runtime.zygote` for the process model. Nothing here is public.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from evflow.runtime.oscalls import (
    become_subreaper,
    die_with_parent,
    recv_exact,
    set_process_name,
)

_LEN = struct.Struct("!I")
EXIT_RECORD = struct.Struct("!ii")  # pid, returncode (negative = signal)


def send_obj(sock: socket.socket, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_obj(sock: socket.socket) -> Any:
    (size,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    # pickle from our own forked process over a private socketpair, never a network peer
    return pickle.loads(recv_exact(sock, size))


class ZygoteServer:
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
        become_subreaper()
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
                        request = recv_obj(self.cmd)
                    except EOFError:  # the supervisor closed us: stop everything
                        self._kill_group_and_exit(self._shutdown(0.0))
                    except Exception as exc:  # unpicklable function: answer, keep serving
                        send_obj(self.cmd, ("error", f"{type(exc).__name__}: {exc}"))
                        continue
                    if request[0] == "stop":
                        code = self._shutdown(float(request[1]))
                        with contextlib.suppress(OSError):
                            send_obj(self.cmd, ("ok", None))
                        self._kill_group_and_exit(code)
                    try:
                        reply = self._handle(request)
                    except OSError as exc:  # fork failed (EAGAIN, ENOMEM): the caller decides
                        reply = ("error", f"fork failed: {exc}")
                    send_obj(self.cmd, reply)
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
            self._reap()

    def _handle(self, request: tuple[Any, ...]) -> tuple[str, Any]:
        kind = request[0]
        if kind == "spawn":
            _, func, args, name = request
            return ("ok", self._fork_function(func, args, name))
        if kind == "spawn-many":
            return ("ok", self._fork_many(request[1]))
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

    def _fork_many(self, items: list[tuple[Callable[..., Any], tuple[Any, ...], str]]
                   ) -> list[int | str]:  # fmt: skip
        """Fork every item; each child waits at a gate until the last one is forked, so
        that the forks are not slowed down by the first children's own start-up."""
        gate_r, gate_w = os.pipe()
        out: list[int | str] = []
        try:
            for func, args, name in items:
                try:
                    out.append(self._fork_function(func, args, name, gate=(gate_r, gate_w)))
                except OSError as exc:  # fork failed (EAGAIN, ENOMEM): that item only
                    out.append(f"fork failed: {exc}")
        finally:
            os.close(gate_w)  # the children's reads see EOF: they all go
            os.close(gate_r)
        return out

    def _fork_function(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        name: str,
        gate: tuple[int, int] | None = None,
    ) -> int:
        pid = os.fork()
        if pid:
            self.live.add(pid)
            return pid
        code = 1
        try:
            self._child_setup(name)
            if gate is not None:
                os.close(gate[1])
                with contextlib.suppress(OSError):
                    os.read(gate[0], 1)  # EOF once the batch is forked (or we die)
                os.close(gate[0])
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
                # what subprocess's restore_signals does: Python ignores these, programs don't
                for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
                    signal.signal(sig, signal.SIG_DFL)
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
                self.notice.sendall(EXIT_RECORD.pack(pid, code))

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
                    self.notice.sendall(EXIT_RECORD.pack(pid, os.waitstatus_to_exitcode(status)))
        return 0

    def _kill_group_and_exit(self, code: int) -> None:
        """Close our sockets, then SIGKILL the group: grandchildren that escaped, and us."""
        self.notice.close()
        self.cmd.close()
        if os.getpgrp() == os.getpid():  # never signal the supervisor's own group
            with contextlib.suppress(OSError):
                os.killpg(0, signal.SIGKILL)
        os._exit(code)

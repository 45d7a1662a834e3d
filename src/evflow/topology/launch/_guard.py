"""The remote end of the ssh and srun launchers: run a command, and end it with us.

``python -m evflow.topology.launch._guard [--detached] -- COMMAND...`` runs COMMAND in
a new session and stays beside it. Neither ssh (without a terminal) nor srun signals a
remote command when the controller side goes away: both only close its stdin. So the
guard watches its stdin, and when it reads EOF (the controller ended the launch, died,
or the ssh connection broke) or a ``term <grace_s>`` line, it ends the command's whole
process tree: SIGTERM, then SIGKILL after the grace.

The guard is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a grandchild orphaned by
a dying agent is re-parented to the guard, not to init, so nothing escapes the sweep.
The command gets ``PR_SET_PDEATHSIG`` (SIGTERM) should the guard itself be killed.

A ``stdin TEXT`` line is passed on to the command's stdin as ``TEXT`` (the ssh launcher
starts an agent before the controller's bus exists and sends it the bus address this
way: ``evflow agent --bus -``).

Before anything else it prints one line on stderr, ``evflow-guard: started pid=N``,
which tells the launcher that the host was reached and the command started. Exit code:
the command's (128 + signal number when a signal ended it).

``--detached`` (sbatch) ignores stdin: the run ends with the command or a signal.

A command ``<this interpreter> -m MODULE ...`` (the agent) is not exec'd: the guard
forks and runs MODULE in the child (``runpy``), which saves starting a second
interpreter on every host. The child is set up as an exec'd one would be: its own
session, PDEATHSIG, default signal handlers, stdin a pipe from the guard.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from types import FrameType
from typing import IO

import psutil

from evflow.runtime.oscalls import become_subreaper, set_parent_death_signal

READY_PREFIX = "evflow-guard: started pid="
DEFAULT_GRACE_S = 2.0


def _child_setup() -> None:
    with contextlib.suppress(OSError):  # best effort, as the guard's sweep still runs
        set_parent_death_signal(signal.SIGTERM)


class _Forked:
    """What the guard needs of a ``Popen`` for a command it forked itself."""

    def __init__(self, pid: int, stdin: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None


def _same_interpreter(path: str) -> bool:
    try:
        return os.path.samefile(path, sys.executable)
    except OSError:
        return False


def _fork_module(argv: list[str], detached: bool) -> _Forked:
    """Run ``argv`` (``<python> -m MODULE ARGS``) in a fork of this interpreter."""
    import runpy
    import traceback

    read_fd, write_fd = (-1, -1) if detached else os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        if detached:
            return _Forked(pid, None)
        os.close(read_fd)
        return _Forked(pid, os.fdopen(write_fd, "wb"))
    code = 1
    try:
        os.setsid()
        _child_setup()
        for sig in (signal.SIGTERM, signal.SIGHUP):  # as in a fresh interpreter
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if detached:
            read_fd = os.open(os.devnull, os.O_RDONLY)
        else:
            os.close(write_fd)
        os.dup2(read_fd, 0)
        os.close(read_fd)
        sys.argv = [argv[0], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code & 0xFF)


class Guard:
    def __init__(self, argv: list[str], detached: bool) -> None:
        self.argv = argv
        self.detached = detached
        self.child: subprocess.Popen[bytes] | _Forked | None = None
        self.returncode: int | None = None
        self.stop_grace_s: float | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_grace_s is None:
            self.stop_grace_s = DEFAULT_GRACE_S

    def run(self) -> int:
        become_subreaper()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        try:
            if len(self.argv) > 2 and self.argv[1] == "-m" and _same_interpreter(self.argv[0]):
                self.child = _fork_module(self.argv, self.detached)
            else:
                self.child = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL if self.detached else subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=_child_setup,
                )
        except OSError as exc:
            print(f"evflow-guard: cannot run {self.argv[0]!r}: {exc.strerror}", file=sys.stderr)
            return 127
        print(f"{READY_PREFIX}{self.child.pid}", file=sys.stderr, flush=True)
        self._watch()
        self._sweep(self.stop_grace_s if self.stop_grace_s is not None else DEFAULT_GRACE_S)
        if self.returncode is None:
            self.returncode = 1
        return self.returncode

    def _watch(self) -> None:
        """Until the command ends or we are told to stop (stdin EOF, a line, a signal)."""
        stdin_open = not self.detached
        buf = b""
        while self.stop_grace_s is None:
            if self._reap():
                return
            if not stdin_open:
                time.sleep(0.05)
                continue
            try:
                ready, _, _ = select.select([sys.stdin.buffer], [], [], 0.05)
            except InterruptedError:
                continue
            if not ready:
                continue
            data = os.read(sys.stdin.fileno(), 4096)
            if not data:
                self.stop_grace_s = DEFAULT_GRACE_S
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                words = line.decode(errors="replace").split()
                if words[:1] == ["term"]:
                    self.stop_grace_s = _grace(words[1:])
                elif line.startswith(b"stdin "):
                    self._pass_on(line[len(b"stdin ") :] + b"\n")

    def _pass_on(self, data: bytes) -> None:
        """Write ``data`` to the command's stdin (gone already: dropped)."""
        pipe = self.child.stdin if self.child is not None else None
        if pipe is None:
            return
        with contextlib.suppress(OSError, ValueError):
            pipe.write(data)
            pipe.flush()

    def _reap(self) -> bool:
        """Reap every exited child (orphans are ours too); True once the command ended."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return True
            if pid == 0:
                return self.returncode is not None
            if self.child is not None and pid == self.child.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                if self.returncode < 0:
                    self.returncode = 128 - self.returncode
                self.child.returncode = self.returncode

    def _sweep(self, grace_s: float) -> None:
        """SIGTERM the command's tree, wait up to ``grace_s``, SIGKILL what is left."""
        if self.child is not None and self.child.stdin is not None:
            with contextlib.suppress(OSError):
                self.child.stdin.close()
        me = psutil.Process()
        tree = me.children(recursive=True)
        if self.child is not None and self.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signal.SIGTERM)
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._reap()
            if not _alive(me.children(recursive=True)):
                return
            time.sleep(0.02)
        # SIGKILL until nothing is left (a process may fork while we look)
        for _ in range(50):
            left = _alive(me.children(recursive=True))
            if not left:
                break
            for p in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            time.sleep(0.02)
            self._reap()
        self._reap()


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _grace(words: list[str]) -> float:
    try:
        return max(0.0, float(words[0]))
    except (IndexError, ValueError):
        return DEFAULT_GRACE_S


def main(argv: list[str]) -> int:
    detached = False
    while argv and argv[0] != "--":
        if argv[0] == "--detached":
            detached = True
        else:
            print(f"evflow-guard: unknown option {argv[0]!r}", file=sys.stderr)
            return 2
        argv = argv[1:]
    if len(argv) < 2:
        print("usage: python -m evflow.topology.launch._guard [--detached] -- COMMAND...",
              file=sys.stderr)  # fmt: skip
        return 2
    return Guard(argv[1:], detached).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

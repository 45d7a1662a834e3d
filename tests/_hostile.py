"""A parallel run in a subprocess, and real zmq sockets aimed at its session's ipc files.

Shared by ``test_hostile_*.py`` and ``test_security.py``. :class:`HostileRun` starts
``evflow.process`` (toy events -> BusyWork -> RecordOutput, ``workers`` processes) in
its own process group, waits until the four sockets of the run exist in the session
directory (``events``, ``results``, ``back``, ``ctl``), hands out sockets connected to
them and, at the end, returns the exit code, the summary and what the file holds.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import zmq

from _wait import wait_until
from evflow import Module
from evflow.io.records import RecordReader, decode_record
from evflow.wire.messages import MsgType, encode_message

ENDPOINTS = ("events", "results", "back", "ctl")
HERE = Path(__file__).parent

_RUN = """
import json, sys
import evflow
from evflow.io.generators import BusyWork, ToyGenerator
from evflow.io.records import RecordOutput
out, n, work_ms, workers, extra = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), \\
    int(sys.argv[4]), json.loads(sys.argv[5])
modules = [ToyGenerator(n_events=n, payload_bytes=1000), BusyWork(work_ms=work_ms)]
if sys.argv[6] == "attacker":
    from _hostile import Attacker
    modules.append(Attacker())
path = evflow.Path([*modules, RecordOutput(file=out, fsync=False)])
try:
    s = evflow.process(path, workers=workers, quiet=True, extra=extra)
except evflow.EvflowError as exc:
    print("ERROR:", exc, file=sys.stderr)
    summary = getattr(exc, "summary", None)
    if summary is not None:
        print(json.dumps({"read": summary.events_read, "written": summary.events_written,
                          "counters": summary.counters}))
    sys.exit(1)
print(json.dumps({"read": s.events_read, "written": s.events_written, "counters": s.counters}))
"""

#: socket types a hostile process may try on any endpoint
ALL_TYPES = (zmq.PUSH, zmq.DEALER, zmq.ROUTER, zmq.PUB, zmq.REQ, zmq.PAIR, zmq.XPUB, zmq.SUB)


class HostileRun:
    """One parallel run to attack; use as a context manager (kills what is left)."""

    def __init__(
        self,
        tmp_path: Path,
        n: int = 2000,
        work_ms: float = 1.0,
        workers: int = 2,
        extra: dict[str, Any] | None = None,
        attacker: bool = False,
    ) -> None:
        self.out = tmp_path / "out.evr"
        self.n = n
        self.args = [str(self.out), str(n), str(work_ms), str(workers), json.dumps(extra or {})]
        self.args.append("attacker" if attacker else "-")
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket[Any]] = []
        self.proc: subprocess.Popen[str] | None = None
        self.session: Path | None = None

    def __enter__(self) -> HostileRun:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RUN, *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])},
        )
        self.session = self._wait_session()
        return self

    def __exit__(self, *exc: Any) -> None:
        for s in self.sockets:
            s.close(linger=0)
        self.ctx.term()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate(timeout=10)
        if self.session is not None:  # a killed run cannot remove its session directory
            shutil.rmtree(self.session, ignore_errors=True)

    def wait_flowing(self, timeout_s: float = 60.0) -> None:
        """Until the output wrote events: workers said HELLO, events flow (asked on the
        run's bus; the output file says nothing before its 4 MB buffer is full)."""
        from evflow.errors import TimeoutError_
        from evflow.runtime.bus import BusController
        from evflow.runtime.busclient import BusEndpoints

        assert self.session is not None
        ctl = BusController(self.ctx, BusEndpoints.for_session(self.session.name))

        def flowing() -> bool:
            try:
                reply = ctl.request("get-metrics", "output", timeout_s=1.0)[0]
            except TimeoutError_:
                return False
            return bool(reply.get("ok")) and reply["data"].get("written", 0) > 0

        try:
            wait_until(flowing, timeout_s, "events written by the run", proc=self.proc)
        finally:
            ctl.close()

    def _wait_session(self) -> Path:
        base = Path(os.environ["EVFLOW_RUNTIME_DIR"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended before its sockets were seen: {self.stderr()}")
            for d in base.iterdir() if base.exists() else ():
                if all((d / name).exists() for name in ENDPOINTS):
                    return d
            time.sleep(0.01)
        raise AssertionError("the run's sockets never appeared")

    def stderr(self) -> str:
        assert self.proc is not None and self.proc.stderr is not None
        return self.proc.stderr.read() if self.proc.poll() is not None else ""

    # --- attacking ----------------------------------------------------------------------
    def endpoint(self, name: str) -> str:
        assert self.session is not None
        return f"ipc://{self.session / name}"

    def secret(self) -> bytes | None:
        """The run's secret, read as its owner may (None if the run has none)."""
        assert self.session is not None
        key = self.session / "auth.key"
        return key.read_bytes().strip() if key.exists() else None

    def connect(
        self, kind: int, name: str, user: str | None = None, identity: bytes | None = None
    ) -> zmq.Socket[Any]:
        """A socket of type ``kind`` connected to endpoint ``name``; with ``user``, it
        presents the run's secret (PLAIN) under that user name."""
        s = self.ctx.socket(kind)
        self.sockets.append(s)  # (closed at the end, whatever happens)
        s.linger = 0
        s.sndtimeo = 200
        if identity is not None:
            s.identity = identity
        secret = self.secret() if user is not None else None
        if user is not None and secret is not None:
            s.plain_username = user.encode()
            s.plain_password = secret
        if kind in (zmq.SUB,):
            s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(self.endpoint(name))
        return s

    def workers(self) -> list[psutil.Process]:
        assert self.proc is not None
        kids = psutil.Process(self.proc.pid).children(recursive=True)
        return [p for p in kids if _name(p).startswith("worker-")]

    # --- the end ------------------------------------------------------------------------
    def finish(self, timeout_s: float = 60) -> tuple[int, dict[str, Any], str]:
        """Wait for the run: (exit code, summary dict or {}, stderr)."""
        assert self.proc is not None
        try:
            out, err = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"the run hung (killed after {timeout_s} s): {err}") from None
        summary = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        return self.proc.returncode, summary, err

    def uids_written(self) -> collections.Counter[int]:
        """uid -> how many times the output file holds it."""
        counts: collections.Counter[int] = collections.Counter()
        if not self.out.exists():
            return counts
        with RecordReader(str(self.out)) as reader:
            for record in reader:
                counts[decode_record(str(self.out), record).meta.uid] += 1
        return counts

    def assert_exactly_once(self) -> None:
        counts = self.uids_written()
        twice = sorted(u for u, k in counts.items() if k > 1)
        missing = sorted(set(range(self.n)) - set(counts))
        extra = sorted(set(counts) - set(range(self.n)))
        assert not twice, f"{len(twice)} uids written more than once, e.g. {twice[:5]}"
        assert not missing, f"{len(missing)} of {self.n} uids missing, e.g. {missing[:5]}"
        assert not extra, f"uids never read were written: {extra[:5]}"


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def send(sock: zmq.Socket[Any], frames: list[Any]) -> bool:
    """Send without blocking the test; False when nothing would take it."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
        return True
    except zmq.ZMQError:  # Again (no peer) or a REQ/REP state error
        return False


def msg(kind: MsgType, header: Any = None, payload: list[Any] | None = None) -> list[Any]:
    """Frames of one message; ``header`` may be anything msgpack takes (not only maps)."""
    import msgpack

    head = msgpack.packb(header if header is not None else {})
    return [bytes([int(kind)]), head, *(payload or [])]


def garbage_messages() -> list[list[Any]]:
    """A catalogue of malformed and forged messages: every type with odd headers."""
    odd_headers: list[Any] = [
        {},
        [],
        None,
        "text",
        {"protocol": 1, "name": "output", "pid": float("inf")},
        {"protocol": 1, "name": "worker-0", "pid": 2**64 - 1, "role": "output"},
        {"credit": float("nan"), "t": "x", "f": [{"uid": "a"}]},
        {"credit": 10**9, "t": 1e308},
        {"workers": [], "read": -1, "sent": "x"},
        {"workers": None},
        {"state": "ERROR", "name": "input", "error": "forged", "kind": "PeerLostError"},
        {"state": "TIMEOUT", "name": "input", "worker": "worker-0"},
        {"seq": float("inf"), "done": "x"},
        {"b": 1, "a": 1, "u": b"\x01" * 7, "s": b"", "k": b"\x01", "w": "worker-0", "p": True},
        {"name": "output", "reason": "timeout", "code": float("-inf"), "blame": "busy"},
    ]
    out: list[list[Any]] = [
        [b""],
        [b"\xff"],
        [b"\x01\x02", b"\x80"],
        [b"\x03", b"not msgpack \xc1"],
        [os.urandom(64), os.urandom(200), os.urandom(10)],
    ]
    for kind in MsgType:
        for header in odd_headers:
            out.append(msg(kind, header, [os.urandom(32)]))
    out.append(encode_message(MsgType.CONFIRM, {"n": 3}, [os.urandom(13)]))
    return out


#: the user name a member would claim on each endpoint (ZAP allows only these there)
MEMBER_USER = {"events": "worker-0", "results": "worker-0", "back": "output", "ctl": "input"}


def forged_messages(n_uids: int) -> dict[str, list[list[Any]]]:
    """What a compromised member of a run sends where it does most harm."""
    from evflow.processing.parallel.batching import u64

    uids = u64(range(n_uids))
    hello_output = {"protocol": 1, "role": "output", "name": "output", "pid": os.getpid()}
    return {
        "back": [
            encode_message(MsgType.CONFIRM, {"n": n_uids}, [uids]),
            msg(MsgType.HELLO, {}),
            msg(MsgType.HELLO, hello_output),
            msg(MsgType.GOODBYE, {"written": 0}),
        ],
        "results": [
            msg(MsgType.END, {}),
            msg(MsgType.END, {"workers": [], "read": 0, "dropped": 0, "sent": 0}),
            msg(MsgType.RESULT, {"w": "worker-0"}, [b"\x00garbage"]),
        ],
        "ctl": [
            msg(MsgType.STATE, {"state": "ERROR", "name": "input", "error": "forged"}),
            msg(MsgType.HELLO, {"role": "input", "name": "input", "pid": os.getpid()}),
            msg(MsgType.STATE, {"state": "TIMEOUT", "name": "input", "worker": "worker-0"}),
        ],
        "events": [
            msg(MsgType.HELLO, {"protocol": 1, "name": "worker-0", "pid": os.getpid()}),
            msg(MsgType.READY, {"credit": 10**6, "t": 0.0}),
            msg(MsgType.GOODBYE, {}),
        ],
    }


class Attacker(Module):
    """A compromised worker module: on its first event it opens sockets with the run's
    own credentials (``security.current()``) and sends forged and garbage messages to
    every socket of its session. Validation, not the connection check, must stop them."""

    parallel = True

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(name, **params)
        self.attacked = False

    def event(self, store: Any) -> bool | None:
        if not self.attacked:
            self.attacked = True
            attack_as_member(self_session(), int(store.meta.uid) + 2000)
        return None


def self_session() -> Path:
    base = Path(os.environ["EVFLOW_RUNTIME_DIR"])
    return next(d for d in base.iterdir() if (d / "events").exists())


def attack_as_member(session: Path, n_uids: int) -> None:
    from evflow.transport import security

    auth = security.current()
    assert auth is not None, "a role of a run without credentials"
    ctx = zmq.Context()
    sockets = []
    try:
        for name, frames_list in forged_messages(n_uids).items():
            for kind in (zmq.DEALER, zmq.PUSH):
                s = ctx.socket(kind)
                sockets.append(s)
                s.sndtimeo = 1000
                auth.client(s, MEMBER_USER[name])
                s.connect(f"ipc://{session / name}")
                for frames in [*frames_list, *garbage_messages()[:40]]:
                    try:
                        s.send_multipart(frames)
                    except zmq.ZMQError:
                        break
    finally:
        for s in sockets:  # what was queued leaves before ctx.term() returns (up to 5 s)
            s.close(linger=5000)
        ctx.term()

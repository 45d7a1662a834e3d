"""The ``qc-repository`` device: mergers' publications -> checks -> the SQLite repository.

``evflow device qc-repository --repo qc.sqlite --checks checks.toml`` binds ``qc-in``
(PULL: top mergers connect their ``qc-out`` PUSH to it; or ROUTER: mergers with a
DEALER ``qc-out`` get their END acknowledged), decodes every RESULT message with
:func:`~evflow.qc.publication.decode_publication`, and hands the object to one
:class:`~evflow.qc.storage.RepositoryWriter`, which runs the check suite and stores the
object, its quality and every check's result. Anything else on the socket (garbage, a
malformed publication, an unexpected message type) is counted per reason and dropped.

One writer per repository: the device holds an exclusive ``flock`` on the database file
while it runs (SQLite's own locks are POSIX record locks, independent of it), so a
second ``qc-repository`` on the same file is one clear error, not two interleaved
version histories.

It ends after ``inputs`` END messages (one per top merger; 0: when stopped). During a
storing gap (a full disk) it retries every ``retry_interval_s`` even when no
publication arrives, and at the end stores what is pending once more.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import time
from pathlib import Path
from typing import IO, Any

import zmq

from evflow.errors import CodecError, ConfigurationError, EvflowError, OutputError
from evflow.params import Param
from evflow.processing.parallel.histlimits import current_limits
from evflow.qc.publication import decode_publication
from evflow.qc.schema import write_problem
from evflow.qc.storage import RepositoryWriter
from evflow.runtime.device import Device
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message

log = logging.getLogger("evflow.qc")

IN = "qc-in"
#: (merger, path) -> identities of recent publications, to drop exact re-sends
_RECENT = 4


def lock_writer(path: Path) -> IO[bytes]:
    """An exclusive flock on the repository file (created if missing), or one clear error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    problem = write_problem(path)
    if problem is not None:
        raise OutputError(f"QC repository {path} cannot be opened read-write: {problem}")
    handle = open(path, "ab")  # noqa: SIM115 (held open as the lock for the run)
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ConfigurationError(
            f"QC repository {path} already has a writer (another qc-repository device or "
            "process holds its lock); give each writer its own file"
        ) from None
    return handle


class QcRepositoryDevice(Device):
    description = "QC repository: stores mergers' publications with their check results"

    repo = Param(str, "", "the SQLite repository file (created if missing)")
    checks = Param(str, "", "check suite: a TOML file (empty: store without checks)")
    inputs = Param(int, 0, "END messages (top mergers) to wait for; 0 = run until stopped")
    senders = Param(str, "", "ids whose END counts, comma-separated (empty: any named sender)")
    keep_last = Param(int, 0, "retention: versions kept per path (0 = all)")
    max_age_s = Param(float, 0.0, "retention: drop versions superseded longer ago (0 = never)")
    max_pending = Param(int, 1000, "objects kept in memory during a storing gap")
    retry_interval_s = Param(float, 1.0, "retry storing this often during a gap (s)")

    @classmethod
    def preflight(cls, params: dict[str, Any]) -> None:
        """A repository that already has a writer (a topology still running in this
        directory) is refused before anything starts, not at INIT_TASK."""
        repo = params.get("repo")
        if isinstance(repo, str) and repo and Path(repo).is_file():
            lock_writer(Path(repo)).close()  # raises if another process holds it

    def init_task(self) -> None:
        if not self.repo:
            raise ConfigurationError(f"device {self.id!r}: --repo PATH is required")
        current_limits()  # a bad EVFLOW_MAX_* setting: one clear error now, not per message
        self._in = self.channel_list(IN)
        for ch in self._in:
            if ch.type not in ("pull", "router", "sub", "pair"):
                raise ConfigurationError(
                    f"device {self.id!r}: channel {IN!r} must receive (pull or router), "
                    f"got {ch.type!r}"
                )
        self._bad = {
            ch.label: self.bad_messages.setdefault(
                ch.label, BadMessageCounter(f"{self.id}/{ch.label}", log)
            )
            for ch in self._in
        }
        self._poller = zmq.Poller()
        for ch in self._in:
            self._poller.register(ch.socket, zmq.POLLIN)
        self._by_socket = {ch.socket: ch for ch in self._in}
        retention: dict[str, Any] = {}
        if self.keep_last:
            retention["keep_last"] = self.keep_last
        if self.max_age_s:
            retention["max_age_s"] = self.max_age_s
        self._lock: IO[bytes] | None = lock_writer(Path(self.repo))
        try:
            self.writer = RepositoryWriter.open(
                self.repo,
                checks=self.checks or None,
                retention=retention or None,
                max_pending=self.max_pending,
                retry_interval_s=self.retry_interval_s,
            )
        except BaseException:
            self._unlock()
            raise
        self.received = 0
        self.duplicates = 0
        self.ends = 0
        self.ended: set[str] = set()  # senders whose END counted (once each)
        self._senders = {x.strip() for x in self.senders.split(",") if x.strip()}
        self.dropped: collections.Counter[str] = collections.Counter()
        self.mergers: dict[str, int] = {}
        self._recent: dict[tuple[str, str], collections.deque[tuple[int, float]]] = {}
        self._next_retry = 0.0

    # --- running -------------------------------------------------------------------------
    def conditional_run(self) -> bool:
        for sock, _ in self._poller.poll(100):
            ch = self._by_socket[sock]
            for _ in range(1000):
                try:
                    frames = ch.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(ch, frames)
        now = time.monotonic()
        stats = self.writer.statistics()
        if not stats.storing and stats.pending and now >= self._next_retry:
            self._next_retry = now + self.retry_interval_s
            self.writer.flush()
        return not (self.inputs and self.ends >= self.inputs)

    def _handle(self, ch: Any, frames: list[Any]) -> None:
        identity = None
        if ch.type == "router":
            if len(frames) < 2:
                self._bad[ch.label].record("short", "routed message without identity")
                return
            identity, frames = frames[0], frames[1:]
        msg = self._bad[ch.label].decode(frames)
        if msg is None:
            self.dropped["bad_message"] += 1
            return
        if msg.type is MsgType.RESULT:
            self._on_publication(msg)
        elif msg.type is MsgType.END:
            self._on_end(ch, identity, msg.header)
        else:
            self.dropped["unexpected"] += 1
            self._bad[ch.label].record("unexpected", f"{msg.type.name} on {IN}")

    def _on_publication(self, msg: Any) -> None:
        try:
            merger, pub = decode_publication(msg)
        except CodecError as exc:
            self.dropped["garbage"] += 1
            if self.dropped["garbage"] == 1:
                log.error("%s: undecodable QC publication dropped (%s); more are counted",
                          self.id, exc)  # fmt: skip
            return
        # the same message again (a merger re-sends its final publications until its
        # END is acknowledged): same merger, path, sequence and creation time
        key = (merger, pub.path)
        ident = (pub.sequence, pub.created)
        recent = self._recent.setdefault(key, collections.deque(maxlen=_RECENT))
        if ident in recent:
            self.duplicates += 1
            return
        recent.append(ident)
        self.received += 1
        self.mergers[merger] = self.mergers.get(merger, 0) + 1
        self.writer(pub)  # never raises: checks guarded, storing gaps queued

    def _on_end(self, ch: Any, identity: bytes | None, header: dict[str, Any]) -> None:
        src = header.get("from")
        if not isinstance(src, str) or not src or (self._senders and src not in self._senders):
            # a forged END must not stop the repository before the mergers' last objects
            self.dropped["end_unknown_sender"] += 1
            self._bad[ch.label].record("end", f"END from {src!r}, not a merger of this repository")
            return
        if src not in self.ended:  # a repeat (its sender missed our ACK) is answered again
            self.ended.add(src)
            self.ends += 1
            log.info("%s: END from %r (%d of %s)", self.id, src, self.ends, self.inputs or "-")
        if identity is not None:  # a DEALER merger waits for this before it stops
            ack = encode_message(MsgType.ACK, {"from": self.id, "to": src, "end": True})
            with contextlib.suppress(zmq.ZMQError):
                ch.send([identity, *ack], zmq.NOBLOCK)

    def post_run(self) -> None:
        stats = self.writer.statistics()
        if stats.pending:
            self.writer.flush()
        stats = self.writer.statistics()
        log.info(
            "%s: %d publications from %d mergers; stored %d, pending %d, lost %d, gaps %d, "
            "duplicates %d, dropped %s",
            self.id, self.received, len(self.mergers), stats.stored, stats.pending,
            stats.lost, stats.gaps, self.duplicates, dict(self.dropped) or "none",
        )  # fmt: skip

    def reset_task(self) -> None:
        writer = getattr(self, "writer", None)
        try:
            if writer is not None:
                self._final = self._repository_metrics()  # what --stats-file reports
                self.writer = None  # type: ignore[assignment]
                writer.close()
        except EvflowError as exc:
            log.error("%s: closing the repository: %s", self.id, exc)
        finally:
            self._unlock()  # whatever happened: the next writer may take the file

    def _unlock(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.close()  # releases the flock
            self._lock = None

    # --- metrics -------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        if getattr(self, "writer", None) is not None:
            out["qc_repository"] = self._repository_metrics()
        elif getattr(self, "_final", None) is not None:
            out["qc_repository"] = self._final
        return out

    def _repository_metrics(self) -> dict[str, Any]:
        writer = self.writer
        stats = writer.statistics()
        return {
            "repo": self.repo,
            "received": self.received,
            "stored": stats.stored,
            "pending": stats.pending,
            "lost": stats.lost,
            "unstorable": stats.unstorable,
            "gaps": stats.gaps,
            "storing": stats.storing,
            "duplicates": self.duplicates,
            "ends": self.ends,
            "dropped": dict(self.dropped),
            "mergers": dict(self.mergers),
            "qualities": writer.quality_counts(),
        }

    def summary(self) -> dict[str, Any]:
        return self.metrics()


def run_repository(
    device_id: str, channels: list[str], session: str, params: dict[str, Any], bus: str = ""
) -> int:
    """A zygote target: one ``qc-repository`` device until it ends (SIGTERM: orderly stop)."""
    from evflow.qc.layers import run_device

    return run_device(
        QcRepositoryDevice, device_id, channels, session, params, bus, error_exits_1=True
    )


def repository_channel(address: str, type: str = "pull") -> str:
    """The ``--channel-config`` text of the device's bound ``qc-in``."""
    return f"name={IN},type={type},method=bind,address={address}"


__all__ = ["QcRepositoryDevice", "lock_writer", "repository_channel", "run_repository"]

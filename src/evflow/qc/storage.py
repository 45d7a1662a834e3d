"""``RepositoryWriter``: the merger's subscriber that checks each object and stores it.

Call it with every ``PublishedObject``. It never raises into the merger: a full disk
(or any failed write) opens a *gap*: the writer logs it once, keeps what it could not
store in a bounded queue (the oldest are dropped first and counted as lost: a later
integral contains their entries), retries at most every ``retry_interval_s``, and
when a write succeeds again stores the queue in order, logs the end of the gap and
records it in the repository's ``gaps`` table.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evflow.errors import ClosedError, CodecError, EvflowError, OutputError
from evflow.qc.checksuite import CheckSuite, SuiteResult
from evflow.qc.publication import PublishedObject
from evflow.qc.repository import Repository
from evflow.qc.versions import Retention

log = logging.getLogger("evflow.qc.storage")


@dataclass(frozen=True)
class WriterStatistics:
    """Counts since the writer started; ``storing`` is False during a gap."""

    received: int
    stored: int
    pending: int
    lost: int
    unstorable: int
    gaps: int
    storing: bool


@dataclass
class _Pending:
    published: PublishedObject
    result: SuiteResult
    nbytes: int
    version_id: int | None = None
    qualities_done: int = 0
    received: float = field(default_factory=time.time)


class RepositoryWriter:
    """Runs ``checks`` on each published object and stores object and qualities."""

    def __init__(
        self,
        repository: Repository,
        checks: CheckSuite | None = None,
        *,
        max_pending: int = 1000,
        max_pending_bytes: int = 256 * 2**20,
        retry_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.repository = repository
        self.checks = checks or CheckSuite()
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._pending: deque[_Pending] = deque()
        self._gap_started: float | None = None  # wall time of the first failed write
        self._gap_reason = ""
        self._gap_lost = 0
        self._gap_stored = 0
        self._next_retry = 0.0
        self._unstorable_paths: set[str] = set()
        self._received = self._stored = self._lost = self._unstorable = self._gaps = 0
        self._qualities: dict[str, int] = {}

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        checks: CheckSuite | Mapping[str, Any] | str | Path | None = None,
        retention: Retention | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> RepositoryWriter:
        """Open (or create) the repository at ``path`` with checks from a suite, a dict
        or a TOML file; ``close()`` closes the repository again."""
        repo = Repository(path, retention=retention)
        suite: CheckSuite | None
        try:
            if isinstance(checks, str | Path):
                suite = CheckSuite.from_toml(checks, repository=repo)
            elif isinstance(checks, Mapping):
                suite = CheckSuite.from_config(checks, repository=repo)
            else:
                suite = checks
        except BaseException:
            repo.close()
            raise
        return cls(repo, suite, **kwargs)

    def close(self) -> None:
        """Try once more to store what is pending, then close the repository."""
        if self._pending:
            self.flush()
        if self._pending:
            log.warning("QC repository closed with %d objects not stored", len(self._pending))
        self.repository.close()

    def __call__(self, published: PublishedObject) -> None:
        """Check and store one object; never raises (the merger must go on)."""
        self._received += 1
        try:
            result = self.checks.run(published)
        except Exception as exc:  # the suite guards each check; this is a last resort
            log.error("checks on %s failed: %s: %s", published.path, type(exc).__name__, exc)
            result = SuiteResult()
        label = result.quality.quality.label if result.quality is not None else "unchecked"
        self._qualities[label] = self._qualities.get(label, 0) + 1
        item = _Pending(published, result, _approx_nbytes(published.obj))
        self._pending.append(item)
        self._pending_bytes += item.nbytes
        if self._gap_started is None or self._clock() >= self._next_retry:
            self.flush()
        # bounded in count and memory; the newest is always kept
        while len(self._pending) > 1 and (
            len(self._pending) > self.max_pending or self._pending_bytes > self.max_pending_bytes
        ):
            self._pop()
            self._lost += 1
            self._gap_lost += 1

    def flush(self) -> bool:
        """Store what is pending now; True when nothing is left pending."""
        while self._pending:
            item = self._pending[0]
            try:
                self._store(item)
            except (OutputError, ClosedError) as exc:  # the disk, not the object
                self._open_gap(exc)
                return False
            except Exception as exc:  # CodecError, or a bug: this object, not the next
                self._pop()
                self._unstorable += 1
                if item.published.path not in self._unstorable_paths:
                    self._unstorable_paths.add(item.published.path)
                    reason = str(exc) if isinstance(exc, CodecError) else repr(exc)
                    log.error("QC object %s cannot be stored: %s", item.published.path, reason)
                continue
            self._pop()
            self._stored += 1
            if self._gap_started is not None:
                self._gap_stored += 1
        if self._gap_started is not None:
            self._close_gap()
        return True

    def _pop(self) -> None:
        self._pending_bytes -= self._pending.popleft().nbytes

    def statistics(self) -> WriterStatistics:
        return WriterStatistics(
            received=self._received,
            stored=self._stored,
            pending=len(self._pending),
            lost=self._lost,
            unstorable=self._unstorable,
            gaps=self._gaps,
            storing=self._gap_started is None,
        )

    def quality_counts(self) -> dict[str, int]:
        """Objects received per quality (``Good`` ... ``Null``, ``unchecked``)."""
        return dict(self._qualities)

    def _store(self, item: _Pending) -> None:
        published, result = item.published, item.result
        if item.version_id is None:
            item.version_id = self.repository.store(published, result.quality)
        extra = result.checks + result.aggregates
        while item.qualities_done < len(extra):
            quality = extra[item.qualities_done]
            own = item.qualities_done < len(result.checks)
            self.repository.store_quality(
                quality,
                run=published.run,
                cycle=published.cycle,
                version_id=item.version_id if own else None,
                created=published.created or None,
            )
            item.qualities_done += 1

    def _open_gap(self, exc: EvflowError) -> None:
        self._next_retry = self._clock() + self.retry_interval_s
        if self._gap_started is not None:
            return
        self._gap_started = time.time()
        self._gap_reason = str(exc)
        self._gap_lost = self._gap_stored = 0
        self._gaps += 1
        log.warning(
            "QC storing paused: %s; keeping up to %d objects (%d MiB) pending, retrying every %g s",
            exc,
            self.max_pending,
            self.max_pending_bytes // 2**20,
            self.retry_interval_s,
        )

    def _close_gap(self) -> None:
        assert self._gap_started is not None
        ended = time.time()
        log.warning(
            "QC storing resumed after a gap of %.1f s: %d objects stored late, %d lost",
            ended - self._gap_started,
            self._gap_stored,
            self._gap_lost,
        )
        try:
            self.repository.record_gap(
                self._gap_started, ended, self._gap_stored, self._gap_lost, self._gap_reason
            )
        except OutputError as exc:
            log.warning("could not record the storing gap in the repository: %s", exc)
        self._gap_started = None


def _approx_nbytes(obj: object) -> int:
    """Memory an object holds while it waits: its arrays (a histogram's storage)."""
    view = getattr(obj, "view", None)
    if callable(view) and hasattr(obj, "axes"):
        try:
            return int(view(flow=True).nbytes)
        except (TypeError, ValueError):
            pass
    return int(getattr(obj, "nbytes", 64))

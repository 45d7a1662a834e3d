"""``allow_quarantine`` in a sequential run: an event a module raises on is written
flagged quarantined and the run goes on, as a parallel run does after ``max_attempts``.

Without it a sequential run stops at the first failing event (exit code 3, the code a
parallel run gives when it quarantines). With it both modes go on and exit 0, so the
same failure gives the same outcome. A sequential run has no encoded copy of the event
as it was read: the event is written as it stands when the module raised (with what
the modules before added), flagged ``FLAG_QUARANTINED``, its reason in the event
(``QUARANTINE_REASON``), to the writers after the failing module; a columnar writer
(ROOT) gets a record file beside it (``quarantine_file_for``), as in a parallel run.
"""

from __future__ import annotations

import contextlib
from typing import Any

from evflow.errors import ModuleError
from evflow.event import FLAG_QUARANTINED, QUARANTINE_REASON, DataStore
from evflow.processing.chain import ModuleChain, is_writer
from evflow.processing.failures import FailureLog
from evflow.processing.filetypes import quarantine_writer
from evflow.processing.writer import quarantine_file_for

#: more quarantined events stop the run (``extra={"max_quarantined": n}``, as parallel)
MAX_QUARANTINED = 1000


class SequentialQuarantine:
    """Where a sequential run with ``allow_quarantine`` puts the events that failed."""

    def __init__(self, chain: ModuleChain, max_quarantined: int = MAX_QUARANTINED) -> None:
        self.chain = chain
        self.max_quarantined = max_quarantined
        self.log = FailureLog()
        self.reasons: list[tuple[int, str]] = []
        self.beside: dict[int, Any] = {}  # writer position -> its quarantine record file
        self.position = {m.name: i for i, m in enumerate(chain.modules)}

    def put(self, store: DataStore, error: ModuleError) -> None:
        """Write ``store`` (its module raised ``error`` in event()) quarantined; raise
        ``error`` when the run has quarantined more than ``max_quarantined`` events."""
        uid = store.meta.uid
        cause = type(error.cause).__name__
        self.log.add(error.module, cause, str(error.cause), uid, error.traceback_text)
        if len(self.reasons) >= self.max_quarantined:
            raise error  # a path that fails on every event: stop as without the option
        reason = f"attempt 1: exception: {error}"
        self.reasons.append((uid, reason))
        store.meta.flags |= FLAG_QUARANTINED
        store[QUARANTINE_REASON] = reason
        after = self.position.get(error.module, -1)
        for i, module in enumerate(self.chain.modules):
            if i > after and is_writer(module):
                self._writer_for(i, module).write(store)

    def _writer_for(self, index: int, writer: Any) -> Any:
        beside = quarantine_file_for(writer)
        if beside is None:
            return writer
        if index not in self.beside:
            self.beside[index] = quarantine_writer(beside, f"{writer.name}.quarantine")
        return self.beside[index]

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(str(w.file) for w in self.beside.values())

    def close(self) -> None:
        """Close the quarantine record files at the end of the run."""
        for w in self.beside.values():
            w.close()

    def abort(self) -> None:
        """Close them after an error (they stay readable; the run's error is the one shown)."""
        for w in self.beside.values():
            with contextlib.suppress(Exception):
                w.close()

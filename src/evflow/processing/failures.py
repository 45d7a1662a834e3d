"""Failed events of a parallel run, grouped for the user: one group per module and
exception type, with the uids it failed on, its failed attempts and the first traceback.

The input keeps a ``FailureLog`` (every module exception a worker reports), sends it in
its RESULT as plain lists, and the run's summary shows it on stderr: one line per
group, the first traceback of each group once. ``EXIT_EVENTS_FAILED`` is the exit code
of ``evflow run`` when events failed (quarantined, or the sequential run stopped at one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Any

#: ``evflow run``: events failed in modules (parallel: quarantined; sequential: the run
#: stopped at the first); ``--allow-quarantine`` makes a parallel run exit 0 instead
EXIT_EVENTS_FAILED = 3
#: uids listed per line (the summary lists every quarantined uid)
SHOWN_UIDS = 10
#: a group keeps at most this many uids (a path failing on every event)
KEPT_UIDS = 1000


@dataclass(slots=True)
class FailureGroup:
    """The failures of one module with one exception type."""

    module: str
    cause: str
    text: str  # the first failure's message
    traceback: str  # the first failure's traceback
    attempts: int = 0  # failed attempts (one event may fail several times)
    uids: list[int] = field(default_factory=list)  # distinct, in order of failure

    def as_list(self) -> list[Any]:
        return [self.module, self.cause, self.text, self.traceback, self.attempts, self.uids]

    @classmethod
    def from_list(cls, item: Any) -> FailureGroup | None:
        """From ``as_list``; None for anything else (it came over a socket)."""
        if not isinstance(item, list | tuple) or len(item) != 6:
            return None
        module, cause, text, tb, attempts, uids = item
        if not isinstance(attempts, int) or not isinstance(uids, list | tuple):
            return None
        return cls(
            str(module),
            str(cause),
            str(text),
            str(tb),
            attempts,
            [u for u in uids if isinstance(u, int)],
        )

    def line(self, quarantined: set[int]) -> str:
        """``evflow: module 'm' failed: ValueError on 2 events (uids 3, 7; 6 attempts;
        2 quarantined): text``."""
        shown = ", ".join(str(u) for u in self.uids[:SHOWN_UIDS])
        if len(self.uids) > SHOWN_UIDS:
            shown += ", ..."
        n = len(self.uids)
        lost = sum(1 for u in self.uids if u in quarantined)
        fate = f"; {lost} quarantined" if lost else "; all retried successfully"
        return (
            f"evflow: module {self.module!r} failed: {self.cause} on {n} event"
            f"{'s' if n != 1 else ''} (uid{'s' if n != 1 else ''} {shown}; "
            f"{self.attempts} failed attempt{'s' if self.attempts != 1 else ''}{fate}): "
            f"{self.text}"
        )


class FailureLog:
    """The input's record of module exceptions, grouped by (module, exception type)."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], FailureGroup] = {}

    def add(self, module: str, cause: str, text: str, uid: int, traceback: str) -> None:
        group = self.groups.get((module, cause))
        if group is None:
            group = FailureGroup(module, cause, text, traceback)
            self.groups[(module, cause)] = group
        group.attempts += 1
        if uid not in group.uids and len(group.uids) < KEPT_UIDS:
            group.uids.append(uid)

    def as_list(self) -> list[list[Any]]:
        return [g.as_list() for g in self.groups.values()]


def groups_from(items: Any) -> tuple[FailureGroup, ...]:
    """The groups of a RESULT's ``failures`` list (malformed entries are skipped)."""
    if not isinstance(items, list | tuple):
        return ()
    found = (FailureGroup.from_list(item) for item in items)
    return tuple(g for g in found if g is not None)


def report_failures(
    groups: tuple[FailureGroup, ...],
    quarantined: tuple[tuple[int, str], ...],
    stream: IO[str],
) -> None:
    """Show what failed: each group's first traceback once, then one line per group,
    then one line for quarantined events no module exception explains (timeouts,
    crashed workers)."""
    uids = {u for u, _ in quarantined}
    for group in groups:
        if group.traceback:
            tb = group.traceback
            stream.write(tb if tb.endswith("\n") else tb + "\n")
    for group in groups:
        stream.write(group.line(uids) + "\n")
    explained = {u for g in groups for u in g.uids}
    other = [(u, r) for u, r in quarantined if u not in explained]
    if other:
        shown = ", ".join(str(u) for u, _ in other[:SHOWN_UIDS])
        if len(other) > SHOWN_UIDS:
            shown += ", ..."
        many = "s" if len(other) != 1 else ""
        stream.write(
            f"evflow: {len(other)} event{many} quarantined without a module exception "
            f"(uid{many} {shown}): {other[0][1]}\n"
        )
    stream.flush()

"""The input's account of workers coming and going, beyond the ones it serves now.

- *Coming*: replacements the parent forks (named in WORKER_LOST; a recycled worker's
  successor) that have not said HELLO yet. The run does not end before they did, or
  one would be orphaned: waiting for events nobody sends, then killed, missing from
  the statistics. Its HELLO may arrive before the WORKER_LOST that names it.
- *Leavers*: recycled workers (GOODBYE after a whole message). The results of the
  messages they finished left before the GOODBYE; their events go again only if they
  are still unconfirmed ``RESULTS_GRACE_S`` later.
"""

from __future__ import annotations

from collections.abc import Callable

from evflow.processing.parallel.scoreboard import successor_name

#: how long the results of a recycled worker's finished messages may take (s)
RESULTS_GRACE_S = 5.0


class Roster:
    """Worker names the input waits for, and recycled workers whose results are due."""

    __slots__ = ("coming", "greeted", "leavers")

    def __init__(self) -> None:
        self.coming: set[str] = set()
        self.greeted: set[str] = set()  # every worker that said HELLO
        self.leavers: dict[str, float] = {}  # name -> when its events go again

    def hello(self, name: str) -> None:
        self.greeted.add(name)
        self.coming.discard(name)

    def lost(self, name: str, replacement: str | None) -> None:
        """WORKER_LOST: ``name`` died (maybe before its HELLO); ``replacement`` is forked."""
        self.coming.discard(name)
        if replacement:
            self._expect(replacement)

    def recycled(self, name: str, now_s: float) -> None:
        """``name`` said GOODBYE to be recycled: the parent forks its successor."""
        self.leavers[name] = now_s + RESULTS_GRACE_S
        self._expect(successor_name(name))

    def overdue(self, now_s: float, in_flight: Callable[[str], int]) -> list[str]:
        """Leavers whose results did not all come in time (their events must go again);
        forgets those and the leavers that hold nothing any more."""
        due = []
        for name, deadline in list(self.leavers.items()):
            if not in_flight(name):
                del self.leavers[name]  # all its results came
            elif now_s >= deadline:
                del self.leavers[name]
                due.append(name)
        return due

    def _expect(self, name: str) -> None:
        if name not in self.greeted:
            self.coming.add(name)

"""The summary of a parallel run: what the roles reported, as one RunSummary.

A mixin of ``engine.Parent``: it reads the RESULTs the roles sent on ctl
(``self.results``), the workers' rows of the stats board for workers killed before
theirs, and the parent's own counts (restarts, timeouts, recycled workers).
"""

from __future__ import annotations

from typing import Any

from evflow.processing.chain import output_files
from evflow.processing.failures import groups_from
from evflow.processing.options import ProcessOptions
from evflow.processing.parallel.persist import decode_persistent
from evflow.processing.parallel.run.restarts import RestartPolicy
from evflow.processing.parallel.split import SplitPath
from evflow.processing.statistics import ModuleStatistics
from evflow.processing.summary import RunSummary
from evflow.wire.messages import BadMessageCounter

#: the summary's counter of events read and never written (see ``_lost_label``)
LOST = "events lost"
RESUMABLE = "events not written (--resume completes them)"
NOT_WRITTEN = "events not written (interrupted)"


class RunSummaryMixin:
    """``_summary(wall_s)`` of ``engine.Parent`` (the attributes are the parent's)."""

    split: SplitPath
    options: ProcessOptions
    n_workers: int
    role_options: dict[str, Any]
    results: dict[str, tuple[dict[str, Any], list[Any]]]
    slot_stats: dict[str, list[ModuleStatistics]]
    timed_out: set[int]
    output_restarts: int
    input_restarts: int
    recycled: int
    restarts: int
    restarts_cancelled: int
    lost: list[str]
    backoff: RestartPolicy
    started_at: float
    all_ready_at: float
    bad: BadMessageCounter
    refused: int
    signals: list[int]

    def _unwritten(self, inp: dict[str, Any]) -> int | None:
        """Events the input sent that the output never accounted for (its own count).

        The ledger's figure trusts CONFIRMs; this one checks it against what the
        output reports written, dropped or quarantined (every event read, if the
        output never reported). Only for one input and one output over the whole run
        (restarts and resumes split the counts): else None.
        """
        out = self.results.get("output", ({}, []))[0]
        if self.input_restarts or self.output_restarts or self.role_options.get("start_position"):
            return None
        if out.get("already_written"):
            return None
        expected = int(inp.get("read", 0)) - int(inp.get("dropped", 0))
        fates = sum(int(out.get(k, 0)) for k in ("written", "dropped", "quarantined"))
        return max(0, expected - fates)

    def _lost_label(self) -> str:
        """What the events read and never written are: lost, unless the run was stopped
        (Ctrl-C, SIGTERM), when its checkpoint keeps them for ``--resume``."""
        if not self.signals:
            return LOST
        return RESUMABLE if self.role_options.get("checkpoint") else NOT_WRITTEN

    def _summary(self, wall_s: float) -> RunSummary:
        inp = self.results.get("input", ({}, []))[0]
        out_header, out_payload = self.results.get("output", ({}, []))
        rows: list[ModuleStatistics] = []
        # workers killed before their RESULT: their rows from the stats board
        killed = {n: r for n, r in self.slot_stats.items() if n not in self.results and r}
        for role in sorted([*self.results, *killed], key=role_order):
            if role in killed:
                rows.extend(killed[role])
                continue
            for d in self.results[role][0].get("stats", []):
                rows.append(ModuleStatistics.from_dict(d))
        persistent: dict[str, Any] = {}
        if out_payload:
            persistent = decode_persistent(out_payload[0], out_payload[1:])
        counters: dict[str, int | float] = {
            "duplicates dropped": int(out_header.get("duplicates", 0)),
            "timeouts": len(self.timed_out),
            "output restarts": self.output_restarts,
            "input restarts": self.input_restarts,
            "workers recycled": self.recycled,
            "workers lost": len(self.lost),
            "workers restarted": self.restarts,
        }
        if self.lost:  # backoff: forks delayed because workers died before finishing events
            stats = self.backoff.stats()
            counters["restarts delayed"] = stats.delayed
            counters["restart backoff (s)"] = round(stats.total_delay_s, 3)
            counters["restarts not needed (run ended)"] = self.restarts_cancelled
        ledger = inp.get("ledger")
        if ledger:  # reliability: what the input's ledger saw
            counters["retries"] = int(ledger["retries"])
            counters["event failures"] = int(ledger["failures"])
            # every event read was dropped by the input path or confirmed by the output
            lost = int(inp.get("read", 0)) - int(inp.get("dropped", 0)) - int(ledger["confirmed"])
            exact = self._unwritten(inp)
            if exact is not None and self.signals and "output" in self.results:
                # a run stopped at once: CONFIRMs of events the output wrote may still
                # have been on their way, so the output's own count is the figure
                lost = exact
            else:
                lost = max(lost, int(ledger["unconfirmed"]), exact or 0)
            counters[self._lost_label()] = lost
        if out_header.get("already_written"):
            counters["already in the output (resumed)"] = int(out_header["already_written"])
        counters.update(out_header.get("fills", {}))  # persistent deltas: fills.py
        skipped = sorted(set(out_header.get("skipped", [])))
        if skipped:
            counters["persistent objects not merged"] = len(skipped)
        firsts = [
            float(h.get("first_event_at", 0))
            for role, (h, _) in self.results.items()
            if role.startswith("worker") and h.get("first_event_at")
        ]
        if out_header.get("first_result_at"):  # dead workers report nothing: bound it
            firsts.append(float(out_header["first_result_at"]))
        if firsts:
            counters["start-up to first event (s)"] = round(min(firsts) - self.started_at, 4)
        if self.all_ready_at:
            counters["start-up of all workers (s)"] = round(self.all_ready_at - self.started_at, 4)
        for role, head in (("input", inp), ("output", out_header)):
            if "cpu_s" in head:
                counters[f"{role} CPU (s)"] = round(float(head["cpu_s"]), 4)
        worker_cpu = [
            float(h["cpu_s"])
            for role, (h, _) in self.results.items()
            if role.startswith("worker") and "cpu_s" in h
        ]
        if worker_cpu:  # workers that ended normally (a killed one reports nothing)
            counters["workers CPU (s)"] = round(sum(worker_cpu), 4)
        if self.options.transport == "shm":  # how many events the arena carried
            counters["events through shared memory"] = int(inp.get("shm_events", 0))
            counters["re-sent events found confirmed (shm)"] = sum(
                int(h.get("obsolete", 0)) for role, (h, _) in self.results.items()
                if role.startswith("worker")
            )  # fmt: skip
        if inp.get("shm_full"):  # transport shm: batches that went over the socket instead
            counters["batches not in shared memory (arena full)"] = int(inp["shm_full"])
        bad = int(inp.get("bad", 0)) + int(out_header.get("bad", 0)) + self.bad.total
        if bad:
            counters["malformed messages"] = bad
        refused = int(inp.get("refused", 0)) + int(out_header.get("refused", 0)) + self.refused
        if refused:  # security: connections without the run's secret, or from outside it
            counters["connections refused"] = refused
        return RunSummary(
            events_read=int(inp.get("read", 0)),
            events_written=int(out_header.get("written", 0)),
            events_dropped=int(inp.get("dropped", 0)) + int(out_header.get("dropped", 0)),
            events_quarantined=int(out_header.get("quarantined", 0)),
            wall_s=wall_s,
            workers=self.n_workers,
            modules=tuple(rows),
            persistent=persistent,
            counters=counters,
            outputs=tuple(output_files(self.split.output))
            + tuple(str(f) for f in out_header.get("quarantine_files", [])),
            interrupted=bool(self.signals),
            killed_workers=tuple(sorted(killed, key=role_order)),
            quarantined=tuple(
                (int(u), str(r)) for u, r in out_header.get("quarantine_reasons", [])
            ),
            failures=groups_from(inp.get("failures")),
            quarantine_files=tuple(str(f) for f in out_header.get("quarantine_files", [])),
            allow_quarantine=self.options.allow_quarantine,
        )


def role_order(name: str) -> tuple[int, str]:
    if name == "input":
        return (0, "")
    if name == "output":
        return (2, "")
    return (1, f"{name:>20}")

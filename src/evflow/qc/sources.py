"""Per-source bookkeeping of a QC merger: dedup records, completeness, header checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from evflow.errors import CodecError
from evflow.processing.parallel.histlimits import current_limits

if TYPE_CHECKING:
    from evflow.qc.mergestate import MergeState

MAX_ID_LEN = 200


@dataclass(slots=True)
class SourceState:
    task: str
    upto: int = 0  # every seq <= upto was merged
    extra: set[int] = field(default_factory=set)  # merged seqs above upto
    events: int = 0
    last_cycle: int = -1  # highest producer cycle merged
    published_cycle: int = -1  # highest producer cycle already in a publication
    ended: bool = False
    upstream: dict[str, Any] | None = None  # a lower merger's completeness record

    def merged(self, seq: int) -> bool:
        return seq <= self.upto or seq in self.extra

    def mark(self, seq: int) -> None:
        self.extra.add(seq)
        while self.upto + 1 in self.extra:
            self.upto += 1
            self.extra.discard(self.upto)

    def ack(self) -> dict[str, Any]:
        return {"upto": self.upto, "seqs": sorted(self.extra), "ended": self.ended}


def completeness_record(self: MergeState) -> dict[str, Any]:
    ended = {s for s, st in self.sources.items() if st.ended}
    known = set(self.sources)
    if isinstance(self.expected, list):
        expected: list[str] | int = sorted(self.expected)
        n_expected = len(self.expected)
        known |= set(self.expected)
    else:
        expected = self.expected
        n_expected = self.expected
    missing = known - self.seen_this_cycle - ended
    record: dict[str, Any] = {
        "seen": sorted(self.seen_this_cycle),
        "expected": expected,
        "missing": sorted(missing),
        "ended": sorted(ended),
        "events_by_source": {s: st.events for s, st in self.sources.items() if st.events},
    }
    upstream = [st.upstream for st in self.sources.values() if st.upstream]
    if upstream:  # a merger of mergers: the producers' record, merged
        record["mergers"] = {k: record[k] for k in ("seen", "expected", "missing", "ended")}
        for key in ("seen", "missing", "ended"):
            record[key] = sorted({s for up in upstream for s in up.get(key, [])})
        record["missing"] = sorted(set(record["missing"]) | missing)
        exp: list[Any] = [up.get("expected") for up in upstream]
        if all(isinstance(e, list) for e in exp):
            expected = sorted({s for e in exp for s in e})
            n_expected = len(expected)
        else:
            n_expected = sum(e if isinstance(e, int) else len(e) for e in exp)
            expected = n_expected
        record["expected"] = expected
        record["events_by_source"] = {
            s: n for up in upstream for s, n in up.get("events_by_source", {}).items()
        }
    n_missing = len(record["missing"])
    everyone = set(record["seen"]) | set(record["missing"]) | set(record["ended"])
    total = max(n_expected, len(everyone))
    record["fraction"] = 1.0 if total == 0 else round((total - n_missing) / total, 4)
    return record


def split_payload(header: dict[Any, Any], payload: list[Any]) -> list[Any]:
    """The frames of a payload whose bin arrays travel joined (header ``sizes``)."""
    sizes = header.get("sizes")
    if sizes is None:
        return payload
    if (
        type(sizes) is not list
        or len(payload) != 3
        or len(sizes) > current_limits().max_objects
        or not all(type(n) is int and n >= 0 for n in sizes)
    ):
        raise CodecError("QC payload with a bad 'sizes' list or frame count")
    blob = memoryview(payload[2])
    if sum(sizes) != blob.nbytes:
        raise CodecError(f"QC payload of {blob.nbytes} bytes where 'sizes' add up to {sum(sizes)}")
    out = [payload[0], payload[1]]
    offset = 0
    for n in sizes:
        out.append(blob[offset : offset + n])
        offset += n
    return out


def check_header(h: dict[Any, Any]) -> tuple[str, str, int, int, int, int, str]:
    def get(key: str, kind: type) -> Any:
        v = h.get(key)
        if type(v) is not kind:
            raise CodecError(f"QC delta header field {key!r} is {v!r:.40}")
        return v

    src, task = get("src", str), get("task", str)
    if not src or len(src) > MAX_ID_LEN or not task or len(task) > MAX_ID_LEN:
        raise CodecError(f"QC delta header: bad source {src!r:.60} or task {task!r:.60}")
    run, cycle, seq, events = (
        get("run", int),
        get("cycle", int),
        get("seq", int),
        get("events", int),
    )
    mode = get("mode", str)
    if seq < 1 or cycle < 0 or events < 0 or mode not in ("delta", "full"):
        raise CodecError(
            f"QC delta header from {src!r}: seq {seq}, cycle {cycle}, events {events}, "
            f"mode {mode!r} out of range"
        )
    return src, task, run, cycle, seq, events, mode

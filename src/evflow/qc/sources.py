"""Per-source bookkeeping of a QC merger: dedup records, completeness, header checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evflow.errors import CodecError
from evflow.processing.parallel.histlimits import current_limits

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

"""What a merger publishes: one ``PublishedObject`` per object and cycle.

Two ways to receive them:

- on the wire: the merger's ``qc-out`` channel carries one RESULT message per object and
  cycle, header ``{"qc": 1, "src", "path", "task", "name", "run", "cycle", "seq",
  "events", "completeness", "created", "metadata"}`` and one payload frame, the object
  encoded with :func:`evflow.qc.objects.encode_object`. :func:`decode_publication`
  turns such a message back into a ``PublishedObject`` (and raises ``CodecError`` for
  anything else);
- in process: ``QcMerger(on_publish=callback)`` (or ``merger.on_publish.append(cb)``)
  calls ``callback(PublishedObject)`` for each one, before it goes on the wire.

The completeness record is ``{"seen": [...], "expected": [...] | n, "missing": [...],
"ended": [...], "fraction": float, "events_by_source": {source: events}}``: the
sources that contributed in this cycle, those expected, those expected (or seen
before) that sent nothing this cycle and did not end, those that ended cleanly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evflow.errors import CodecError
from evflow.qc.objects import decode_object, encode_object
from evflow.wire.messages import Message, MsgType, encode_message

__all__ = ["PublishedObject", "decode_publication", "encode_publication", "qc_path"]

QC_PROTOCOL = 1


def qc_path(task: str, name: str) -> str:
    """The repository path of an object: ``qc/<task>/<name>``."""
    return f"qc/{task}/{name}"


@dataclass(frozen=True, slots=True)
class PublishedObject:
    """One merged object of one cycle, as a merger publishes it."""

    path: str
    task: str
    name: str
    run: int
    cycle: int
    obj: Any
    completeness: dict[str, Any]
    #: wall-clock time of the publication (epoch seconds)
    created: float
    #: the merger's publication counter (one per cycle, monotonic across restarts)
    sequence: int
    #: events merged into ``obj``
    event_count: int
    #: ``view`` (integral | window | latest), ``merger``, ``final``, ``late_deltas``, ...
    metadata: dict[str, Any] = field(default_factory=dict)


def encode_publication(pub: PublishedObject, source: str) -> list[bytes]:
    """The RESULT message frames of ``pub`` sent by merger ``source``."""
    header = {
        "qc": QC_PROTOCOL,
        "src": source,
        "path": pub.path,
        "task": pub.task,
        "name": pub.name,
        "run": pub.run,
        "cycle": pub.cycle,
        "seq": pub.sequence,
        "events": pub.event_count,
        "completeness": pub.completeness,
        "created": pub.created,
        "metadata": pub.metadata,
    }
    return encode_message(MsgType.RESULT, header, [encode_object(pub.obj)])


def _field(header: dict[Any, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = header.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise CodecError(f"QC publication field {key!r} is {value!r:.40}")
    return value


def decode_publication(msg: Message) -> tuple[str, PublishedObject]:
    """(sending merger, object) of a RESULT message; CodecError for anything else."""
    if msg.type is not MsgType.RESULT or msg.header.get("qc") != QC_PROTOCOL:
        raise CodecError(f"not a QC publication: {msg.type.name} {msg.header!r:.60}")
    h = msg.header
    if len(msg.payload) != 1:
        raise CodecError(f"QC publication with {len(msg.payload)} payload frames, expected 1")
    pub = PublishedObject(
        path=_field(h, "path", str),
        task=_field(h, "task", str),
        name=_field(h, "name", str),
        run=_field(h, "run", int),
        cycle=_field(h, "cycle", int),
        obj=decode_object(bytes(msg.payload[0])),
        completeness=_field(h, "completeness", dict),
        created=float(_field(h, "created", (int, float))),
        sequence=_field(h, "seq", int),
        event_count=_field(h, "events", int),
        metadata=_field(h, "metadata", dict),
    )
    return _field(h, "src", str), pub

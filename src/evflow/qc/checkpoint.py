"""The checkpoint of a QC merger: everything a restarted merger resumes from.

Written by the merger after each publication and before its acknowledgements (so what
a producer was told is merged is in it); msgpack with every object as
``encode_object`` bytes, versioned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgpack

from evflow.errors import CodecError
from evflow.qc.objects import decode_object, encode_object
from evflow.qc.sources import SourceState

if TYPE_CHECKING:
    from evflow.qc.mergestate import Latest, MergeState

STATE_VERSION = 1


def state_to_bytes(self: MergeState) -> bytes:
    """Everything a restarted merger needs to go on exactly where this one published."""

    def enc(objs: dict[str, Any]) -> dict[str, bytes]:
        return {n: encode_object(o) for n, o in objs.items()}

    def enc_latest(latest: Latest) -> dict[str, list[Any]]:
        return {s: [n, enc(objs)] for s, (n, objs) in latest.items()}

    tasks = {}
    for name, st in self.tasks.items():
        st.flush()
        tasks[name] = {
            "integral": enc(st.integral.merged),
            "events": st.integral_events,
            "window": [[enc(objs), n] for objs, n in st.window],
            "latest": enc_latest(st.latest),
            "latest_seq": st.latest_seq,
            "snapshots": [enc_latest(snap) for snap in st.snapshots],
            "reset_base": enc_latest(st.reset_base),
        }
    sources = {
        s: [
            st.task,
            st.upto,
            sorted(st.extra),
            st.events,
            st.last_cycle,
            st.published_cycle,
            st.ended,
            st.upstream,
        ]
        for s, st in self.sources.items()
    }
    return msgpack.packb(
        {
            "v": STATE_VERSION,
            "id": self.merger_id,
            "run": self.run,
            "cycle": self.cycle,
            "sequence": self.sequence,
            "resets": self.resets,
            "tasks": tasks,
            "sources": sources,
            "counters": self.counters,
            "dropped": self.dropped,
        }
    )


def dec_latest(data: dict[str, Any]) -> Latest:
    return {
        s: (int(n), {str(k): decode_object(b) for k, b in objs.items()})
        for s, (n, objs) in data.items()
    }


def restore_state(self: MergeState, data: bytes) -> None:
    """Load a checkpoint of ``to_bytes`` (CodecError if it is not one)."""
    try:
        d = msgpack.unpackb(data, strict_map_key=False)
        if d.get("v") != STATE_VERSION:
            raise CodecError(f"merger checkpoint of version {d.get('v')!r}")
        self.run, self.cycle, self.sequence = d["run"], d["cycle"], d["sequence"]
        self.resets = d["resets"]
        self.counters.update(d["counters"])
        self.dropped.update(d["dropped"])
        for name, t in d["tasks"].items():
            st = self._task(name)
            st.integral.merged.update({n: decode_object(b) for n, b in t["integral"].items()})
            st.integral_events = t["events"]
            for objs, n in t["window"]:
                st.window.append(({k: decode_object(b) for k, b in objs.items()}, n))
            st.latest = dec_latest(t["latest"])
            # (checkpoints written before the window held across layers lack these)
            st.snapshots.extend(dec_latest(snap) for snap in t.get("snapshots", []))
            st.reset_base = dec_latest(t.get("reset_base", {}))
            st.latest_seq = dict(t["latest_seq"])
        for s, (task, upto, extra, events, last, pub, ended, up) in d["sources"].items():
            self.sources[s] = SourceState(task, upto, set(extra), events, last, pub, ended, up)
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"not a merger checkpoint: {type(exc).__name__}: {exc}") from None

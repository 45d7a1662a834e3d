"""The ``qc-merger`` device: merges QC deltas as they arrive and publishes every cycle.

Channels: ``qc-in`` (ROUTER, bound: producers and lower-layer mergers connect DEALERs)
and, optionally, ``qc-out`` (any sending type; every sub-channel gets every
publication: a repository writer, an upper-layer merger). In process,
``QcMerger(on_publish=[callback])`` hands each :class:`PublishedObject` to the callbacks.

Every ``cycle_s`` the merger publishes (one RESULT message per object, see
:mod:`evflow.qc.publication`), then writes its checkpoint (``state_file``, atomic
replace), then acknowledges to each source what it merged. A source re-sends what is
not acknowledged, so a merger killed with SIGKILL and restarted on the same
``state_file`` resumes from its last publication and gets every later delta again,
exactly once (dedup by source and sequence number). It ends after ``inputs`` sources
said END (0: when stopped), with a final publication; then it sends END on ``qc-out``.

Bounded memory: producers hold at most ``max_unacked`` publications each (credits) and
the ROUTER's high-water mark bounds what waits in the socket; the merger holds one
integral per object (plus the window's k cycles). It reads at most ``drain_max``
messages before it looks at the clock, so publications stay on time; when it cannot
keep up, ``receive_buffer_overloaded`` is set and the producers' credits run out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import zmq

from evflow.errors import CodecError, ConfigurationError, IncompleteStreamError
from evflow.params import Param
from evflow.processing.parallel.histlimits import current_limits
from evflow.qc.mergestate import MergeState
from evflow.qc.publication import PublishedObject, decode_publication, encode_publication
from evflow.runtime.device import BIDIRECTIONAL, Device
from evflow.wire.messages import BadMessageCounter, Message, MsgType, encode_message

log = logging.getLogger("evflow.qc")

IN, OUT = "qc-in", "qc-out"


class QcMerger(Device):
    description = "QC merger: merges deltas from producers, publishes every cycle"

    cycle_s = Param(float, 10.0, "publication cycle (s)")
    run_number = Param(int, -1, "run to merge (-1: the first producer's)")
    expected = Param(str, "", "expected source ids, comma-separated (completeness)")
    expected_count = Param(int, 0, "expected number of sources, if not named")
    inputs = Param(int, 0, "END messages (sources) to wait for; 0 = run until stopped")
    window_cycles = Param(int, 0, "also publish the sum of the last k cycles (0 = off)")
    reset_every = Param(int, 0, "reset the integral every n cycles (0 = never)")
    state_file = Param(str, "", "checkpoint file (resume after a crash); empty = none")
    max_sources = Param(int, 10_000, "sources accepted at most")
    drain_max = Param(int, 2000, "messages read before the clock is checked")
    ack_timeout_s = Param(float, 10.0, "how long to wait for the END ACK downstream (s)")
    source_timeout_s = Param(
        float, 0.0, "a source silent this long counts as gone for `inputs` (0 = never)"
    )

    _next_pub: float  # when the next publication is due (monotonic)

    def __init__(
        self,
        *args: Any,
        on_publish: list[Callable[[PublishedObject], Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.on_publish: list[Callable[[PublishedObject], Any]] = list(on_publish or [])
        self.qc = MergeState(self.id)
        self.published = 0
        self.publications_dropped = 0
        self._identities: dict[str, bytes] = {}
        self._touched: set[str] = set()
        self._final_done = False
        self._merge_s = 0.0
        self._window = (time.monotonic(), 0, 0.0)  # (t, merged objects, merge seconds)
        self._qc_rates = {"average_merge_time": 0.0, "merged_objects_per_second": 0.0}
        self._backlog = 0
        self._overloaded = False
        self._late_publications = 0
        self._final_frames: list[list[bytes]] = []
        self._last_seen: dict[str, float] = {}
        self._gone: set[str] = set()

    # --- set-up --------------------------------------------------------------------------
    def init_task(self) -> None:
        current_limits()  # a bad EVFLOW_MAX_* setting: one clear error now, not per message
        names = [s.strip() for s in self.expected.split(",") if s.strip()]
        expected: list[str] | int = names or self.expected_count
        self.qc = MergeState(
            self.id,
            self.run_number,
            expected,
            self.window_cycles,
            self.reset_every,
            self.max_sources,
        )
        self._cycle_s = self.cycle_s
        if self._cycle_s <= 0:
            raise ConfigurationError(f"device {self.id!r}: cycle_s must be > 0, got {self.cycle_s}")
        self._in = self.channel(IN)
        if self._in.type != "router":
            raise ConfigurationError(
                f"device {self.id!r}: channel {IN!r} must be a router (producers connect "
                f"dealers to it), got {self._in.type!r}"
            )
        self._outs = self.channels.get(OUT, [])
        self._bad = self.bad_messages.setdefault(
            self._in.label, BadMessageCounter(f"{self.id}/{self._in.label}", log)
        )
        self._load_checkpoint()
        if self._bus is not None:
            self._bus.handle("qc-set-cycle", self._set_cycle_command)

    def _set_cycle_command(self, args: dict[str, Any]) -> dict[str, Any]:
        seconds = args.get("seconds")
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds <= 0:
            raise ConfigurationError(f"qc-set-cycle: seconds must be > 0, got {seconds!r}")
        self.set_cycle_s(float(seconds))
        return {"cycle_s": self._cycle_s}

    def set_cycle_s(self, seconds: float) -> None:
        """Change the publication cycle during the run (from the next cycle on)."""
        self._cycle_s = seconds
        self._next_pub = min(self._next_pub, time.monotonic() + seconds)

    def _load_checkpoint(self) -> None:
        path = Path(self.state_file) if self.state_file else None
        if path is None or not path.exists():
            return
        try:
            self.qc.restore(path.read_bytes())
        except (CodecError, OSError) as exc:
            raise ConfigurationError(
                f"device {self.id!r}: checkpoint {path} cannot be read ({exc}); "
                "remove it to start afresh"
            ) from None
        log.warning(
            "%s: resumed from checkpoint %s (run %d, cycle %d, %d sources)",
            self.id,
            path,
            self.qc.run,
            self.qc.cycle,
            len(self.qc.sources),
        )

    def _save_checkpoint(self) -> None:
        if not self.state_file:
            return
        path = Path(self.state_file)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(self.qc.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    # --- running -------------------------------------------------------------------------
    def pre_run(self) -> None:
        self._next_pub = time.monotonic() + self._cycle_s

    def conditional_run(self) -> bool:
        now = time.monotonic()
        if now >= self._next_pub:
            if now - self._next_pub > self._cycle_s / 2:
                self._late_publications += 1
            self._next_pub = now + self._cycle_s
            self._publish()
        if now - self._window[0] >= 1.0:
            self._update_rates(now)
        wait_ms = max(0, min(100, int((self._next_pub - time.monotonic()) * 1000)))
        taken = 0
        if self._in.poll(wait_ms):
            while taken < self.drain_max and self._in.poll(0):
                self._handle(self._in.recv())
                taken += 1
        self._backlog = taken
        self._overloaded = taken >= self.drain_max
        if self.inputs and self._ended() >= self.inputs:
            self._publish(final=True)
            return False
        return True

    def _ended(self) -> int:
        """Sources that said END, plus those silent for ``source_timeout_s`` (gone)."""
        ended = sum(1 for s in self.qc.sources.values() if s.ended)
        if self.source_timeout_s > 0:
            limit = time.monotonic() - self.source_timeout_s
            gone = [
                src
                for src, seen in self._last_seen.items()
                if seen < limit and not self.qc.sources[src].ended
            ]
            for src in gone:
                if src not in self._gone:
                    self._gone.add(src)
                    log.error(
                        "%s: source %r silent for %.1f s: counted as gone (it stays 'missing')",
                        self.id, src, self.source_timeout_s,
                    )  # fmt: skip
            ended += len(gone)
        return ended

    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._bad.record("short", "a message without identity")
            return
        identity, msg = frames[0], self._bad.decode(frames[1:])
        if msg is None:
            return
        if msg.type is MsgType.EVENTS:
            self._on_delta(identity, msg)
        elif msg.type is MsgType.RESULT:
            self._on_publication(identity, msg)
        elif msg.type is MsgType.END:
            src = msg.header.get("from")
            if isinstance(src, str) and src in self.qc.sources:
                self.qc.end_source(src)
                self._identities[src] = identity
                self._touched.add(src)
            elif isinstance(src, str):  # a source that sent nothing: done at once
                self._ack(identity, {"to": src, "upto": 0, "seqs": [], "end": True})
        elif msg.type is not MsgType.ACK:
            self._bad.record("unexpected", f"{msg.type.name} on {IN}")

    def _on_delta(self, identity: bytes, msg: Message) -> None:
        t0 = time.perf_counter()
        outcome = self.qc.accept(msg.header, list(msg.payload))
        self._merge_s += time.perf_counter() - t0
        src = msg.header.get("src")
        if not isinstance(src, str):
            return
        if outcome == "dropped" and src not in self.qc.sources:
            seq = msg.header.get("seq")
            reason = "; ".join(self.qc.problems[-1:]) or "refused"
            self._ack(
                identity,
                {"to": src, "upto": seq if type(seq) is int else 0, "seqs": [], "refused": reason},
            )
        elif src in self.qc.sources:
            self._identities[src] = identity
            self._touched.add(src)
            self._last_seen[src] = time.monotonic()
        self._report()

    def _on_publication(self, identity: bytes, msg: Message) -> None:
        try:
            src, pub = decode_publication(msg)
        except CodecError as exc:
            self.qc._drop("garbage", "publication", f"undecodable QC publication: {exc}")
            self._report()
            return
        t0 = time.perf_counter()
        if self.qc.accept_publication(src, pub) != "dropped":
            self._last_seen[src] = time.monotonic()
        self._merge_s += time.perf_counter() - t0
        self._identities[src] = identity
        self._report()

    def _report(self) -> None:
        for text in self.qc.take_problems():
            log.error("%s: %s", self.id, text)

    def _ack(self, identity: bytes, header: dict[str, Any]) -> None:
        frames = [identity, *encode_message(MsgType.ACK, {"from": self.id, **header})]
        # a peer gone or with a full queue re-sends, and is acknowledged again then
        with contextlib.suppress(zmq.ZMQError):
            self._in.send(frames, zmq.NOBLOCK)

    def _publish(self, final: bool = False) -> None:
        if self._final_done:
            return
        self._final_done = final
        pubs = self.qc.publish(final=final)
        for pub in pubs:
            for callback in self.on_publish:
                try:
                    callback(pub)
                except Exception:
                    log.exception("%s: on_publish callback %r failed", self.id, callback)
            if self._outs:
                frames = encode_publication(pub, self.id)
                if final:
                    self._final_frames.append(frames)
                for ch in self._outs:
                    try:
                        ch.send(frames, zmq.NOBLOCK)
                    except zmq.Again:
                        self.publications_dropped += 1
        self.published += len(pubs)
        if self.publications_dropped:
            log.debug(
                "%s: %d publications dropped (qc-out full)", self.id, self.publications_dropped
            )
        self._save_checkpoint()  # before the acks: what is acknowledged is durable
        for src in self._touched:
            identity = self._identities.get(src)
            source = self.qc.sources.get(src)
            if identity is not None and source is not None:
                self._ack(identity, {"to": src, **source.ack(), "end": source.ended})
        self._touched = set()

    def post_run(self) -> None:
        self._publish(final=True)
        end = encode_message(MsgType.END, {"from": self.id, "count": self.qc.sequence, "qc": 1})
        for ch in self._outs:
            if ch.type in BIDIRECTIONAL:  # an upper merger: END until it is acknowledged
                if not self._end_upstream(ch, end):
                    # the final objects may never have been stored: not a clean end
                    raise IncompleteStreamError(
                        f"qc-merger {self.id!r}: END on {ch.label} not acknowledged within "
                        f"{self.ack_timeout_s:g} s: its final objects may not have arrived"
                    )
                continue
            try:
                ch.send(end, zmq.NOBLOCK)
            except zmq.Again:
                log.error("%s: END on %s not sent (queue full)", self.id, ch.label)

    def _end_upstream(self, ch: Any, end: list[bytes]) -> bool:
        """Send END, and again with the final publications every second, until an ACK.

        An upper merger killed and restarted meanwhile resumes from a checkpoint that may
        predate our final publications; re-sending them is harmless (it keeps the
        latest per source), losing them would not be.
        """
        deadline = time.monotonic() + self.ack_timeout_s
        next_send = 0.0
        first = True
        while time.monotonic() < deadline:
            if time.monotonic() >= next_send:
                frames = [] if first else self._final_frames
                for msg in [*frames, end]:
                    with contextlib.suppress(zmq.Again):
                        ch.send(msg, zmq.NOBLOCK)
                first = False
                next_send = time.monotonic() + 1.0
            if ch.poll(50):
                ack = self._bad.decode(ch.recv())
                if ack is not None and ack.type is MsgType.ACK and ack.header.get("end"):
                    return True
        return False

    # --- metrics -------------------------------------------------------------------------
    def _update_rates(self, now: float) -> None:
        t0, n0, s0 = self._window
        n, s = (
            self.qc.counters["merged_objects"] + self.qc.counters["full_objects"],
            self._merge_s,
        )
        dt = now - t0
        if dt > 0:
            self._qc_rates = {
                "average_merge_time": round(1000 * (s - s0) / (n - n0), 6) if n > n0 else 0.0,
                "merged_objects_per_second": round((n - n0) / dt, 1),
            }
        self._window = (now, n, s)
        if self._bus is not None:
            self._bus.metrics.set_queue("receive", self._backlog, self.drain_max)

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        proc = psutil.Process()
        cpu = proc.cpu_times()
        st = self.qc
        out.update(
            self._qc_rates,
            VmRSS=proc.memory_info().rss // 1024,
            cpu_clock=round(cpu.user + cpu.system, 3),
            receive_buffer_size=self._backlog,
            receive_buffer_overloaded=self._overloaded,
            send_buffer_overloaded=bool(self.publications_dropped),
            qc={
                "cycle": st.cycle,
                "cycle_s": getattr(self, "_cycle_s", self.cycle_s),
                "run": st.run,
                "sources": len(st.sources),
                "ended": self._ended(),
                "published": self.published,
                "publications_dropped": self.publications_dropped,
                "late_publications": self._late_publications,
                **st.counters,
                "dropped": dict(st.dropped),
                "objects": sum(len(t.integral.merged) for t in st.tasks.values()),
            },
        )
        return out

"""The output role: collect results, run the output path, flush, confirm, merge.

Sockets: PULL ``results`` (worker PUSHes: EVENTS batches and each worker's final
RESULT), DEALER ``back`` to the input (HELLO, CONFIRM, GOODBYE out; END in) and a
DEALER to the parent's ``ctl`` (HELLO, RESULT, STATE out; KILL in).

Every uid's fate is known here: written, dropped by a module, or a duplicate (a uid
already seen: a late result after a re-send), which is counted and skipped. A batch
is CONFIRMed to the input only after its events went through the output path and
every writer's ``flush()`` returned; confirms are batched by count and by time.
The persistent-object delta a batch carries is merged when the batch is accepted,
and kept on disk for a restarted output (fills.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from typing import Any

import numpy as np
import zmq

from evflow.errors import CodecError, ProtocolError
from evflow.event import FLAG_QUARANTINED, QUARANTINE_REASON, DataStore
from evflow.processing.chain import ModuleChain
from evflow.processing.console import ConsoleProgress
from evflow.processing.filetypes import quarantine_writer
from evflow.processing.parallel.batching import from_u64, unpack_batch
from evflow.processing.parallel.common import (
    RoleBus,
    channel,
    current_split,
    run_of,
    run_role,
)
from evflow.processing.parallel.input.checkpoint import open_writers_for_append
from evflow.processing.parallel.output.dedup import WrittenUids
from evflow.processing.parallel.output.fills import Fills
from evflow.processing.parallel.output.reorder import SKIP, ReorderBuffer
from evflow.processing.parallel.persist import decode_persistent, encode_persistent, merge_into
from evflow.processing.parallel.rolebus import wait_ms
from evflow.processing.parallel.worker.lazystore import LazyEvent
from evflow.processing.writer import quarantine_file_for
from evflow.transport import security
from evflow.transport.paths import session_dir
from evflow.transport.shm import ShmViews
from evflow.wire.codec import decode_event, peek_meta, with_meta, with_value
from evflow.wire.messages import (
    BadMessageCounter,
    MsgType,
    encode_message,
    field_bytes,
    field_int,
    field_list,
    field_str,
    refuse,
)

#: confirm once this many events wait, or at most once per this interval: a result
#: arriving after a quiet interval is confirmed at once (one wake-up, and no delay at
#: the end of a run), results of a fast stream share one flush per interval
CONFIRM_EVENTS = 4096
CONFIRM_INTERVAL_S = 0.02
#: a flush (fsync, a ROOT basket write) may cost milliseconds: the interval grows to
#: this many times the last flush's cost so flushing stays a small share of the output's
#: time, up to a cap that bounds how long the input's ledger holds written events
FLUSH_COST_FACTOR = 20.0
CONFIRM_INTERVAL_MAX_S = 0.25
#: how long to wait for the final RESULT of workers that said GOODBYE
RESULT_WAIT_S = 10.0


def output_main(session: str, options: dict[str, Any]) -> int:
    """Entry point in the forked output process; returns the exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent relays interrupts
    roles: list[_Output] = []

    def body(ctx: zmq.Context[Any], channels: list[Any], bus: RoleBus) -> int:
        roles.append(_Output(ctx, session, options, channels))
        signal.signal(signal.SIGTERM, roles[0].on_term)
        bus.counters = roles[0].bus_counters
        return roles[0].run(bus)

    def close_writers() -> None:
        for role in roles:
            role.close_files()

    return run_role("output", session, body, close_writers, auth=options.get("auth"))


def quarantine_writers(writers: list[Any], file: str | None) -> tuple[list[Any], list[Any]]:
    """The writers quarantined events go to, and those of them to add to the output.

    ``file`` (option ``quarantine_file``): one record file for all of them. Otherwise
    every writer that can hold a raw event takes it, and a columnar writer (a ROOT
    TTree, whose entries need every branch of the first event) gets a record file
    beside its own (``quarantine_file_for``): a quarantined event never breaks a writer.
    The record files open on their first event: a run without any leaves none.
    """
    if file:
        quarantine = quarantine_writer(str(file), "quarantine")
        return [quarantine], [quarantine]
    raw: list[Any] = []
    extra: list[Any] = []
    for w in writers:
        beside = quarantine_file_for(w)
        if beside is None:
            raw.append(w)
            continue
        quarantine = quarantine_writer(beside, f"{w.name}.quarantine")
        raw.append(quarantine)
        extra.append(quarantine)
    return raw, extra


class _Output:
    def __init__(
        self, ctx: zmq.Context[Any], session: str, options: dict[str, Any], channels: list[Any]
    ) -> None:
        channels.append(channel(ctx, session, "ctl", "dealer", "connect", user="output"))
        self.ctl = channels[0].socket
        self.hello = {"role": "output", "name": "output", "pid": os.getpid()}
        self.ctl.send_multipart(encode_message(MsgType.HELLO, self.hello))
        channels.append(channel(ctx, session, "results", "pull", "bind"))
        channels.append(channel(ctx, session, "back", "dealer", "connect", user="output"))
        self.pull = channels[1].socket
        self.back = channels[2].socket
        self.ordered = bool(options.get("ordered"))
        self.chain = ModuleChain(current_split().output, process="output")
        self.writers: list[Any] = self.chain.writers()  # (each has flush())
        self.no_modules = not self.chain.modules
        # where quarantined events go (raw): see quarantine_writers()
        self.raw_writers, extra = quarantine_writers(self.writers, options.get("quarantine_file"))
        self.writers = [*self.writers, *extra]  # flushed before every confirm
        self.quarantine_files = [w.file for w in extra]
        self.seen = WrittenUids()
        self.shm = ShmViews(session)  # transport shm: the input's arena, mapped on first use
        in_file: set[int] | None = None
        if options.get("resume") or options.get("restart"):
            # reliability: continue the files; drop what they already hold
            in_file = open_writers_for_append(self.writers)
            self.seen = WrittenUids(in_file)
        # persistent-object deltas merged per batch; a restart reloads the saved state
        self.fills = Fills(
            session_dir(session), self.ordered, in_file if options.get("restart") else None
        )
        del in_file
        self.pending: list[Any] = []  # uid arrays written, not yet flushed and confirmed
        self.pending_n = 0
        self.confirmed_at = 0.0  # monotonic time of the last CONFIRM
        # the input read its source out (DRAIN): it waits for the last CONFIRMs, so
        # they go at once, not once per interval
        self.draining = False
        self.confirm_interval_s = CONFIRM_INTERVAL_S
        # --ordered: a restarted output learns where its order goes on from the input
        self.order: ReorderBuffer | None = None
        if self.ordered:
            start = None if options.get("restart") else int(options.get("start_seq") or 0)
            self.order = ReorderBuffer(start)
        self.written = 0
        self.dropped = 0
        self.quarantined = 0
        self.quarantine_reasons: dict[int, str] = {}
        # wall clock (s) of the first result: the start-up figure even when every
        # original worker died before it could report its own first event
        self.first_result_at = 0.0
        self.results: dict[str, dict[str, Any]] = {}  # worker -> its persistent objects
        self.end: dict[str, Any] | None = None
        self.end_payload: list[Any] = []
        # the output knows every uid's fate, so it draws the run's progress bar
        self.progress = ConsoleProgress(
            options.get("progress_total"), bool(options.get("progress"))
        )
        self.end_at = 0.0
        self.abort = False
        self.bad = BadMessageCounter("output")
        # messages on the data sockets (the dashboard's msg/s): results in, CONFIRMs out
        self.messages_in = 0
        self.messages_out = 0
        # what each socket may carry: anything else there is dropped and counted
        # (a results socket any worker reaches must not end the run, say)
        self.accepts = {
            self.pull: (MsgType.EVENTS, MsgType.RESULT),
            self.back: (MsgType.EVENTS, MsgType.END, MsgType.ORDER, MsgType.DRAIN),
            self.ctl: (MsgType.KILL, MsgType.HELLO),
        }

    def on_term(self, signum: int, frame: Any) -> None:
        self.abort = True

    def close_files(self) -> None:
        """Terminate the writers and close the quarantine files: what was written stays
        readable (an aborted run)."""
        self.chain.abort()
        for w in self.raw_writers:
            if w not in self.chain.modules:
                with contextlib.suppress(Exception):
                    w.close()

    # --- main loop ----------------------------------------------------------------------
    def run(self, bus: RoleBus) -> int:
        self.chain.initialize()
        bus.running()
        self.back.send_multipart(encode_message(MsgType.HELLO, self.hello))
        poller = zmq.Poller()
        for s in (self.pull, self.back, self.ctl):
            poller.register(s, zmq.POLLIN)
        if bus.socket is not None:  # commands wake the loop (it may sleep 250 ms)
            poller.register(bus.socket, zmq.POLLIN)
        self.progress.start()
        while True:
            for sock, _ in poller.poll(self._wait_ms()):
                if sock is bus.socket:
                    bus.serve_now()
                else:
                    self._drain(sock)
            now = time.monotonic()
            if self.progress.due(now):
                self.progress.update(self.events_done, now)
            bus.tick(now)  # time-gated: the control bus (rolebus.py)
            if self.abort:
                self.progress.stop(self.events_done)
                self.close_files()
                self._report(aborted=True)
                return 0
            if self.pending and (self.pending_n >= CONFIRM_EVENTS or self._confirm_wait_ms() == 0):
                self._confirm()
            if self.end is not None and self._results_complete():
                self._finish()
                return 0

    def bus_counters(self) -> dict[str, Any]:
        """The output's counters for the control bus (rolebus.py), at most per tick."""
        return {
            "events_in": self.events_done,
            "events_out": self.written,
            "messages_in": self.messages_in,
            "messages_out": self.messages_out,
            "written": self.written,
            "dropped": self.dropped,
            "quarantined": self.quarantined,
            "duplicates": self.seen.duplicates_dropped,
            "written_not_confirmed": self.pending_n,
            # held until a CONFIRM, which goes at the latest when this many wait
            "receive_queue": (self.pending_n, CONFIRM_EVENTS),
            "worker_results": len(self.results),
            "end_received": self.end is not None,
            "bad_messages": self.bad.total,
        }

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = self.bad.decode(frames)
            if msg is None:
                continue
            self.messages_in += 1
            if msg.type not in self.accepts[sock]:
                self.bad.record("wrong-socket", f"{msg.type.name} where it is never sent")
                continue
            try:
                if msg.type == MsgType.EVENTS:
                    self._on_events(msg.header, [f.buffer for f in msg.payload], sock)
                elif msg.type == MsgType.RESULT:
                    name = field_str(msg.header, "w", 32)
                    objects = _persistent_or_none([f.buffer for f in msg.payload])
                    if objects is None:
                        raise refuse("bad-result", f"RESULT of {name!r}: not persistent objects")
                    self.results[name] = objects
                elif msg.type == MsgType.END:
                    self._on_end(msg.header, [f.buffer for f in msg.payload])
                elif msg.type == MsgType.KILL:
                    self.abort = True
                elif msg.type == MsgType.ORDER and self.order is not None:
                    done = field_list(msg.header, "done")
                    if not all(type(d) is int and 0 <= d < 2**63 for d in done):
                        raise refuse("bad-field", "ORDER: 'done' holds a non-seq")
                    self.order.start_at(field_int(msg.header, "seq"), done)
                    self._emit_in_order()
                elif msg.type == MsgType.DRAIN:
                    self.draining = True
                elif msg.type == MsgType.HELLO:  # from the parent: a new input started
                    self.draining = False  # (it reads again from its checkpoint)
                    self.back.send_multipart(encode_message(MsgType.HELLO, self.hello))
            except ProtocolError as exc:
                self.bad.record_error(exc)
            except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
                self.bad.record("bad-header", f"{type(exc).__name__}: {exc}")

    def _on_end(self, header: dict[str, Any], payload: list[Any]) -> None:
        """The input's END: counts, the workers whose RESULT to wait for, its objects."""
        workers = field_list(header, "workers")
        if not all(type(w) is str for w in workers):
            raise refuse("bad-end", "END: 'workers' holds a non-name")
        for key in ("read", "dropped", "sent"):
            field_int(header, key)
        run = header.get("run")
        if run is not None and not (
            type(run) is list and len(run) == 2 and all(type(x) is int for x in run)
        ):
            raise refuse("bad-end", f"END: run {run!r} is not [experiment, run]")
        self.end = header
        self.end_payload = payload
        self.end_at = time.monotonic()

    def _on_events(self, header: dict[str, Any], payload: list[Any], sock: Any) -> None:
        # validated as a whole before any uid is taken as seen: a bad batch leaves no trace
        raw_uids = field_bytes(header, "u", 8)
        kept = field_bytes(header, "k")
        if len(kept) * 8 != len(raw_uids):
            raise refuse("bad-batch", f"{len(kept)} kept flags for {len(raw_uids) // 8} uids")
        sender = field_str(header, "w", 32)
        if (sender == "input") != (sock is self.back):
            raise refuse("bad-batch", f"EVENTS from {sender!r} on the wrong socket")
        if not self.first_result_at:
            self.first_result_at = time.time()
        uid_array = from_u64(raw_uids)
        uids = uid_array.tolist()
        if "d" in header:  # the batch's persistent-object delta rides at the end
            payload = self._take_delta(header, payload, uids)
        order = self.order
        if (
            self.no_modules
            and order is None
            and "q" not in header
            and len(kept) == len(uids)
            and self.seen.add_if_all_new(uids)
        ):
            # nothing reads the events and none is a duplicate: count, never split
            n_kept = kept.count(1)
            self.written += n_kept
            self.dropped += len(uids) - n_kept
            self._written(uid_array)
            return
        if "x" in header:  # transport shm: the frames are in the input's arena
            payload = self.shm.frames(header)
            if not self.shm.current(header):
                # freed, so every event of it was confirmed: nothing here to write
                self.bad.record("stale-shm", f"batch {header['b']} of a freed extent")
                return
        events = unpack_batch(header, payload)
        if len(events) != kept.count(1):
            raise refuse("bad-batch", f"{len(events)} events for {kept.count(1)} kept flags")
        seqs: list[int] = []
        if order is not None:
            seqs = from_u64(field_bytes(header, "s", 8)).tolist()
            if len(seqs) != len(uids):
                raise refuse("bad-batch", f"{len(seqs)} seqs for {len(uids)} uids")
        reasons = header.get("q")  # from the input: events to write raw, quarantined
        if reasons is not None and (type(reasons) is not list or len(reasons) != len(uids)):
            raise refuse("bad-batch", "quarantine reasons do not match the uids")
        check_and_add = self.seen.check_and_add
        decode = reasons is None and not self.no_modules
        j = 0
        for i, uid in enumerate(uids):
            frames: Any = None
            if kept[i]:
                frames = events[j]
                j += 1
                if decode:  # decoded before its uid counts as seen: garbage leaves no trace
                    frames = self._decode(frames, uid)
                    if frames is None:
                        continue
            if not check_and_add(uid):
                # a duplicate (late result after a re-send): counted, not written;
                # --ordered: it still holds its seq, or the order would stall there
                if order is not None:
                    order.skip(seqs[i], uid)
                continue
            if reasons is not None:
                self.quarantine_reasons[uid] = str(reasons[i])
            if order is not None:
                order.put(seqs[i], uid, frames, reasons is not None)
            elif frames is None:
                self.dropped += 1
            elif reasons is not None:
                self._write_raw(frames, str(reasons[i]))
            elif self.no_modules:
                self.written += 1  # nothing in the output path reads it: no decoding
            else:
                self._write(frames)
        if order is None:
            self._written(uid_array)
        else:
            self._emit_in_order()

    def _take_delta(self, header: dict[str, Any], payload: list[Any], uids: list[int]) -> list[Any]:
        """Merge or drop a batch's persistent delta (see fills.py); the events' payload."""
        n = header["d"]
        if type(n) is not int or not 0 < n <= len(payload):
            self.bad.record("bad-delta", f"delta of {n!r} frames in {len(payload)}")
            return payload
        failed = header.get("fx", 0)
        failed = failed if type(failed) is int else 0
        bad = self.fills.accept(payload[-n:], header["u"], uids, self.seen, failed)
        if bad is not None:
            self.bad.record("bad-delta", bad)  # dropped; the events are still written
        return payload[:-n]

    def _decode(self, frames: Any, uid: int) -> DataStore | None:
        """The event in ``frames`` if it decodes and is event ``uid``; else None, counted."""
        try:
            # checked now (decoded if need be); a writer may write the frames as received
            store = LazyEvent.checked(frames)
        except CodecError as exc:
            self.bad.record("bad-event", f"uid {uid}: {exc}")
            return None
        if store.meta.uid != uid:
            self.bad.record("bad-event", f"batch says uid {uid}, the event is {store.meta.uid}")
            return None
        return store

    def _write(self, frames: Any) -> None:
        if self.no_modules:
            self.written += 1
            return
        store = frames if isinstance(frames, DataStore) else decode_event(frames)
        meta, current = store.meta, self.chain.run
        if current is None or current.run != meta.run or current.experiment != meta.experiment:
            self.chain.switch_run(meta.experiment, meta.run)
        if self.chain.event(store):
            self.written += 1
        else:
            self.dropped += 1

    def _write_raw(self, frames: Any, reason: str) -> None:
        meta = peek_meta(frames)
        meta.flags |= FLAG_QUARANTINED
        # the reason travels with the event, so the file alone says why it is raw
        frames = with_value(with_meta(frames, meta), QUARANTINE_REASON, reason)
        for w in self.raw_writers:
            w.write_raw(meta, frames)
        self.quarantined += 1

    def _emit_in_order(self) -> None:
        assert self.order is not None
        done = self.order.take_late()  # released before (maybe by an earlier output)
        for frames, raw, uid in self.order.release():
            if frames is SKIP:
                pass  # a duplicate: already in the file, confirmed again below
            elif frames is None:
                self.dropped += 1
            elif raw:
                self._write_raw(frames, self.quarantine_reasons.get(uid, "unknown"))
            else:
                self._write(frames)
            done.append(uid)
        if done:  # confirmed only once written, i.e. in input order
            self._written(np.array(done, dtype=np.uint64))

    def _wait_ms(self) -> int:
        """How long the loop may sleep: until a CONFIRM or a redraw of the progress bar
        is due, at most IDLE_WAIT_MS (every wake-up costs the busy workers CPU)."""
        wait = wait_ms(self.progress.next_due - time.monotonic())
        return min(wait, self._confirm_wait_ms()) if self.pending else wait

    def _confirm_wait_ms(self) -> int:
        """Milliseconds until the next CONFIRM may go (0: now)."""
        if self.draining:
            return 0
        due_s = self.confirmed_at + self.confirm_interval_s - time.monotonic()
        return wait_ms(due_s, cap_ms=math.ceil(self.confirm_interval_s * 1000))

    def _written(self, uid_array: Any) -> None:
        self.pending.append(uid_array)
        self.pending_n += len(uid_array)

    def _confirm(self) -> None:
        t0 = time.monotonic()
        for w in self.writers:
            w.flush()
        flush_s = time.monotonic() - t0
        self.confirm_interval_s = min(
            CONFIRM_INTERVAL_MAX_S, max(CONFIRM_INTERVAL_S, FLUSH_COST_FACTOR * flush_s)
        )
        uids = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.fills.confirmed(uids)  # flushed: the saved merged state may follow
        message = encode_message(MsgType.CONFIRM, {"n": len(uids)}, [uids.tobytes()])
        self.back.send_multipart(message)
        self.messages_out += 1
        self.confirmed_at = time.monotonic()
        self.pending = []
        self.pending_n = 0

    # --- the end ------------------------------------------------------------------------
    def _results_complete(self) -> bool:
        assert self.end is not None
        expected = self.end["workers"]  # (validated by _on_end)
        if all(name in self.results for name in expected):
            return True
        return time.monotonic() - self.end_at > RESULT_WAIT_S

    @property
    def events_done(self) -> int:
        """Events whose fate is known: written, dropped by a module or quarantined."""
        return self.written + self.dropped + self.quarantined

    def _finish(self) -> None:
        assert self.end is not None
        self.progress.stop(self.events_done)
        if self.pending:
            self._confirm()
        merged = self.fills.merged  # the deltas; RESULTs hold what is left since
        if self.end_payload:
            objects = _persistent_or_none(self.end_payload)
            if objects is None:
                self.bad.record("bad-end", "END: its payload is not persistent objects")
            else:
                merge_into(merged, objects, "input")
        missing = []
        for name in self.end["workers"]:
            if name not in self.results:
                missing.append(name)
                continue
            merge_into(merged, self.results[name], f"worker {name}")
        merge_into(self.chain.persistent, merged, "workers")
        run = run_of(self.end.get("run"))
        if self.chain.run is None and run is not None:
            self.chain.switch_run(run.experiment, run.run)
        # the output path's end_run and terminate see the merged objects
        self.chain.end_run()
        for w in self.writers:
            w.flush()
        self.chain.terminate()
        for w in self.raw_writers:
            w.close()  # a separate quarantine file (closing twice is fine)
        self._report(aborted=False, missing=missing)
        self.fills.remove_files()
        self.back.send_multipart(encode_message(MsgType.GOODBYE, {"written": self.written}))
        self.back.linger = 2000
        self.ctl.linger = 2000

    def _report(self, aborted: bool, missing: list[str] | None = None) -> None:
        head, frames, skipped = encode_persistent(self.chain.persistent)
        header = {
            "role": "output",
            "name": "output",
            "stats": [s.as_dict() for s in self.chain.statistics()],
            "written": self.written,
            "dropped": self.dropped,
            "duplicates": self.seen.duplicates_dropped,
            "already_written": self.seen.already_written,
            "quarantined": self.quarantined,
            "quarantine_reasons": [[u, r] for u, r in self.quarantine_reasons.items()],
            "quarantine_files": self.quarantine_files if self.quarantined else [],
            "aborted": aborted,
            "missing_results": missing or [],
            "skipped": [*skipped, *self.fills.not_merged()],
            "fills": self.fills.counters(),
            "bad": self.bad.total,
            "refused": security.refused_total(),  # connections the ZAP handler refused
            "input": self.end or {},
            "cpu_s": time.process_time(),
            "first_result_at": self.first_result_at,
        }
        self.ctl.send_multipart(encode_message(MsgType.RESULT, header, [head, *frames]))
        self.ctl.linger = 2000


def _persistent_or_none(payload: list[Any]) -> dict[str, Any] | None:
    """Decoded persistent objects of a RESULT or END payload; None if they do not decode."""
    if not payload:
        return None
    try:
        return decode_persistent(payload[0], payload[1:])
    except Exception:  # untrusted bytes: whatever the decoders raise, it is a bad message
        return None

"""The worker role: receive batches from the input, run the worker path, push results.

Protocol (DEALER to the input's ROUTER ``events``): HELLO {protocol, pid, name}, then
READY {credit}. For every EVENTS batch: one results message to the output (PUSH
``results``) and one READY {credit: events done, t: seconds per event} back to the
input, which returns the credit and is the speed measurement the batch size adapts
to. A module that raises in ``event()`` fails that event only (reliability): the
event is left out of the results and reported in the READY (``f``: module, uid,
exception), the input retries or quarantines it, and the worker goes on. On END the
worker ends the run, pushes its RESULT (persistent objects, module
statistics) to the output, reports to the parent and says GOODBYE to the input.
Persistent objects travel as per-batch deltas on the results message (deltas.py), so
a worker that dies loses only the batch it was on; its RESULT holds what is left.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import zmq

from evflow.errors import ModuleError
from evflow.processing.chain import ModuleChain
from evflow.processing.parallel.batching import (
    ZERO_COPY_MIN_B,
    frames_nbytes,
    from_u64,
    pack_batch,
)
from evflow.processing.parallel.common import (
    RoleBus,
    channel,
    current_split,
    run_of,
    run_role,
)
from evflow.processing.parallel.deltas import DeltaEncoder
from evflow.processing.parallel.input.fastpath import fastpath_enabled
from evflow.processing.parallel.persist import encode_persistent
from evflow.processing.parallel.scoreboard import current as current_scoreboard
from evflow.processing.parallel.scoreboard import slot_of
from evflow.processing.parallel.statsboard import StatsBoard
from evflow.processing.parallel.statsboard import current as current_stats_board
from evflow.processing.parallel.worker.lazystore import ReceivedBatch
from evflow.transport.security import RunAuth
from evflow.transport.shm import ShmViews
from evflow.wire.codec import encode_event
from evflow.wire.messages import BadMessageCounter, MsgType, encode_message, hello_header

#: exit code of a worker that ended early because its RSS passed the memory limit
EXIT_RECYCLE = 75


def worker_main(
    session: str,
    name: str,
    event_buffer: int,
    memory_limit_mb: float = 0.0,
    auth: RunAuth | None = None,
) -> int:
    """Entry point in a forked worker process; returns the exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent drives the shutdown
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # "stop at once" means exactly that

    def body(ctx: zmq.Context[Any], channels: list[Any], bus: RoleBus) -> int:
        ctl = channel(ctx, session, "ctl", "dealer", "connect", user=name)
        channels.append(ctl)
        ctl.socket.send_multipart(
            encode_message(MsgType.HELLO, {"role": "worker", "name": name, "pid": os.getpid()})
        )
        worker = _Worker(ctx, session, name, event_buffer, ctl.socket, channels)
        worker.memory_limit_b = int(memory_limit_mb * 1024 * 1024)
        bus.counters = worker.bus_counters
        return worker.run(bus)

    return run_role(name, session, body, auth=auth)


class _Worker:
    #: module statistics per batch in shared memory (statsboard.py); None: not kept
    stats_board: StatsBoard | None = None

    def __init__(
        self,
        ctx: zmq.Context[Any],
        session: str,
        name: str,
        event_buffer: int,
        ctl: zmq.Socket[Any],
        channels: list[Any],
    ) -> None:
        self.name = name
        self.chain = ModuleChain(current_split().worker, process=name)
        self.chain.initialize()
        dealer = channel(ctx, session, "events", "dealer", "connect", user=name)
        push = channel(ctx, session, "results", "push", "connect", user=name)
        channels += [dealer, push]
        self.dealer = dealer.socket
        self.push = push.socket
        self.ctl = ctl
        self.event_buffer = event_buffer
        self.events_in = 0
        self.events_kept = 0
        # messages on the data sockets (the dashboard's msg/s): batches in, results
        # and READYs out
        self.messages_in = 0
        self.messages_out = 0
        self.first_event_at = 0.0  # wall clock (s) when the first batch arrived
        self.bad = BadMessageCounter(f"worker {name}")
        self.deltas = DeltaEncoder()  # persistent objects travel as per-batch deltas
        self.shm = ShmViews(session)  # transport shm: segments mapped on first use
        self.obsolete = 0  # events of shm messages whose extent was freed before use
        self.memory_limit_b = 0  # reliability: recycle the worker above this RSS (0: never)
        self.eager = not fastpath_enabled()  # EVFLOW_NO_FASTPATH: decode every event
        # exact blame: the event in the modules is written to this worker's scoreboard
        # slot, so the parent knows which one it died on (a fresh worker starts idle)
        self.board = current_scoreboard()
        try:
            self.slot = slot_of(name)
        except (IndexError, ValueError):  # not named by the engine: no slot, READY blame
            self.board, self.slot = None, -1
        if self.board is not None and not 0 <= self.slot < self.board.n_slots:
            self.board = None
        if self.board is not None:
            self.board.clear(self.slot)
        # module statistics per batch in shared memory: a killed worker's calls count
        self.stats_board = current_stats_board() if self.board is not None else None
        if self.stats_board is not None:
            self.stats_board.clear(self.slot)

    def run(self, bus: RoleBus) -> int:
        hello = hello_header(pid=os.getpid(), name=self.name)
        self.dealer.send_multipart(encode_message(MsgType.HELLO, hello))
        self.dealer.send_multipart(encode_message(MsgType.READY, {"credit": self.event_buffer}))
        bus.running()
        dealer = self.dealer
        while True:
            # one poll per message over the dealer and the bus (~3 us, measured cheaper
            # than a NOBLOCK recv whose zmq.Again costs ~6 us when idle): an idle worker
            # answers the bus, a busy one looks at it at most every rolebus.TICK_S
            if not bus.wait(dealer):
                continue
            msg = self.bad.decode(dealer.recv_multipart(copy=False))
            if msg is None:
                continue  # counted and dropped: bad bytes never crash a worker
            self.messages_in += 1
            if msg.type == MsgType.EVENTS:
                try:
                    self._process(msg.header, msg.payload)
                except Exception as exc:
                    if self._obsolete(msg.header):
                        pass  # its shm extent was reused under us: bytes were not events
                    elif isinstance(exc, KeyError | TypeError | ValueError | IndexError):
                        self.bad.record("bad-batch", str(exc))
                    else:
                        raise
                if self.memory_limit_b and self._over_memory():
                    # recycle: end like at END (results, statistics, GOODBYE); the input
                    # sends what this worker still held elsewhere; the parent forks anew
                    self._finish(None, recycled=True)
                    return EXIT_RECYCLE
            elif msg.type == MsgType.END:
                self._finish(msg.header.get("run"))
                return 0

    def _obsolete(self, header: dict[str, Any]) -> bool:
        """Transport shm: if the message's extent was freed (every event of it is
        confirmed already, see shm.py), return its credit and say so."""
        try:
            if "x" not in header or self.shm.current(header):
                return False
            n = len(header["u"]) // 8
        except (KeyError, TypeError, ValueError):
            return False
        self.obsolete += n
        self.dealer.send_multipart(encode_message(MsgType.READY, {"credit": n, "t": None}))
        return True

    def _process(self, header: dict[str, Any], payload: Any) -> None:
        if "x" in header:  # transport shm: the frames are in the input's arena
            received = self.shm.frames(header)
            if self._obsolete(header):
                return
        else:
            received = [f.buffer for f in payload]
        # frames and metas are made per event only when someone asks (lazystore.py)
        attempt = header["a"]
        batch = ReceivedBatch(header, received, attempt)
        n = batch.n
        if len(header["u"]) != 8 * n:
            raise ValueError(f"batch has {n} events and {len(header['u'])} uid bytes")
        kept_mask = bytearray(n)
        chain = self.chain
        board, slot = self.board, self.slot
        bid = header["b"] if type(header["b"]) is int and -(2**63) <= header["b"] < 2**63 else -1
        # the scoreboard gets the batch's uids once; per event only a cursor is stored
        cursor: Any = None
        if board is not None and board.begin_batch(slot, header["u"], bid):
            cursor = board.cursor(slot)
        stores = batch.stores()
        t0 = time.perf_counter()
        if self.eager:  # EVFLOW_NO_FASTPATH: decode every event, as before the fast path
            for store in stores:
                store.load()
        errors: list[tuple[int, ModuleError]] = []
        for first, stop, experiment, run in batch.runs():
            chain.switch_run(experiment, run)  # nothing when the run is the current one
            if cursor is not None or board is None:
                errors += chain.event_batch(stores, kept_mask, first, stop, cursor)
                continue
            uids = from_u64(header["u"]).tolist()
            for i in range(first, stop):  # a batch larger than a scoreboard slot
                board.begin(slot, uids[i], bid)
                try:
                    errors += chain.event_batch(stores, kept_mask, i, i + 1)
                finally:
                    board.clear(slot)
        if self.stats_board is not None:
            self.stats_board.store(slot, chain.stats)
        failed = [_failure(i, exc) for i, exc in errors]  # these failed, not the worker
        changed = batch.changed(stores, kept_mask)
        n_kept = kept_mask.count(1)
        # every event kept and forwarded unchanged: resend the payload as received
        as_received = n_kept == n and not changed
        kept: list[Any] = []
        if not as_received or not (header["p"] or "x" in header):  # to pack or send one by one
            for i in range(n):
                if kept_mask[i]:
                    kept.append(encode_event(stores[i]) if i in changed else batch.frames(i))
        if not self.first_event_at:
            self.first_event_at = time.time()
        per_event_s = (time.perf_counter() - t0) / max(n, 1)
        out = {"b": header["b"], "a": attempt, "u": header["u"], "s": header["s"]}
        if failed:  # failed events are not results: leave them out
            as_received = False
            gone = {f.pop("i") for f in failed}
            rest = [i for i in range(n) if i not in gone]
            out["u"] = from_u64(header["u"])[rest].tobytes()
            out["s"] = from_u64(header["s"])[rest].tobytes()
            kept_mask = bytearray(kept_mask[i] for i in rest)
        out["k"] = bytes(kept_mask)
        out["w"] = self.name
        if kept_mask and as_received and "x" in header:
            out["n"], out["p"] = header["n"], False  # the output reads the same arena
            for key in ("x", "xo", "xl", "xh", "xg"):  # where (and which generation)
                out[key] = header[key]
            body, large = [], False
        elif kept_mask and as_received and header["p"]:
            out["n"], out["p"], out["l"] = header["n"], True, header["l"]
            # the packed payload as it came, as the received zmq frame: sent by
            # reference, no copy (workers' CPU per 1 kB event 3.03 -> 2.77 us)
            body, large = list(payload), True
        elif kept_mask:
            body = pack_batch(kept, out, packed=header["p"])
            large = (
                not header["p"]
                and len(body) > 0
                and frames_nbytes(body) >= ZERO_COPY_MIN_B * len(kept)
            )
        # what this batch filled in store.persistent goes with its results (deltas.py);
        # a batch with no result left (every event failed) drops it: failed events'
        # fills must not count
        delta = self.deltas.take(chain.persistent) if chain.persistent else None
        if "x" in header and self._obsolete(header):
            return  # freed while we worked: results and fills of reused bytes go nowhere
        if kept_mask:
            if delta is not None:
                out["d"] = len(delta)
                if failed:
                    out["fx"] = len(failed)  # their partial fills are in the delta
                body = [*body, *delta]
            self.push.send_multipart(encode_message(MsgType.EVENTS, out, body), copy=not large)
            self.messages_out += 1
        ready: dict[str, Any] = {"credit": n, "t": per_event_s}
        if failed:
            ready["f"] = failed
        self.dealer.send_multipart(encode_message(MsgType.READY, ready))
        self.messages_out += 1
        self.events_in += n
        self.events_kept += n_kept

    def bus_counters(self) -> dict[str, Any]:
        """This worker's counters for the control bus (rolebus.py), at most per tick."""
        return {
            "events_in": self.events_in,
            "events_out": self.events_kept,
            "messages_in": self.messages_in,
            "messages_out": self.messages_out,
            "first_event_at": self.first_event_at,
            "bad_messages": self.bad.total,
            # per-module wall time, for the dashboard's module plot (a few modules)
            "module_time_s": {s.module: round(s.time_s, 6) for s in self.chain.statistics()},
        }

    def _over_memory(self) -> bool:
        """RSS above ``memory_limit_b``? Checked after every message (~10 us, /proc)."""
        with open("/proc/self/statm", "rb") as f:
            rss_b = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return rss_b > self.memory_limit_b

    def _finish(self, last_run: Any, recycled: bool = False) -> None:
        chain = self.chain
        run = run_of(last_run)
        if chain.run is None and run is not None:
            chain.switch_run(run.experiment, run.run)  # a worker without events books too
        chain.end_run()
        chain.terminate()
        head, frames, skipped = encode_persistent(chain.persistent)
        stats = [s.as_dict() for s in chain.statistics()]
        result = {"w": self.name, "skipped": skipped, "bad": self.bad.total}
        self.push.send_multipart(encode_message(MsgType.RESULT, result, [head, *frames]))
        self.ctl.send_multipart(
            encode_message(
                MsgType.RESULT,
                {
                    "role": "worker",
                    "name": self.name,
                    "stats": stats,
                    "in": self.events_in,
                    "obsolete": self.obsolete,
                    "first_event_at": self.first_event_at,
                    "cpu_s": time.process_time(),
                },
            )
        )
        self.dealer.send_multipart(
            encode_message(
                MsgType.GOODBYE,
                {"in": self.events_in, "kept": self.events_kept, "recycled": recycled},
            )
        )
        # RESULT and GOODBYE must leave before the sockets close
        for sock in (self.push, self.dealer, self.ctl):
            sock.linger = 5000


def _failure(index: int, exc: ModuleError) -> dict[str, Any]:
    """What the input needs to retry, quarantine or report a failed event."""
    return {
        "i": index,
        "uid": exc.uid,
        "module": exc.module,
        "cause": type(exc.cause).__name__,
        "text": str(exc.cause),
        "tb": exc.traceback_text[-4000:],
    }

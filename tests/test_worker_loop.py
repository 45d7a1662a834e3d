"""The worker's batch loop: ModuleChain.event_batch, ReceivedBatch/BatchEvent, _process.

In-process (no sockets): the worker's ``_process`` runs on packed batches built as the
input builds them, with stand-in sockets that keep what was sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zmq

from evflow import DataStore, Module
from evflow.errors import CodecError, ModuleError, OutputError
from evflow.event import FLAG_DROPPED, EventMeta
from evflow.io import BusyWork, ToyGenerator
from evflow.io._encoded_toy import ToyEncoder
from evflow.processing import chain as chain_module
from evflow.processing.chain import ModuleChain
from evflow.processing.parallel.batching import (
    BatchSizer,
    PackedEvents,
    from_u64,
    pack_batch,
    u64,
    unpack_batch,
)
from evflow.processing.parallel.deltas import DeltaEncoder
from evflow.processing.parallel.input.fastpath import encoded_source, read_encoded
from evflow.processing.parallel.input.ledger import Ledger
from evflow.processing.parallel.scoreboard import Scoreboard
from evflow.processing.parallel.worker import worker as worker_role
from evflow.processing.parallel.worker.lazystore import ReceivedBatch
from evflow.wire.codec import decode_event, encode_event
from evflow.wire.messages import BadMessageCounter, MsgType, decode_message, encode_message


class Recorder(Module):
    """Notes (name, uid, attempt, scoreboard cursor) per call; drops or raises on cue."""

    parallel = True

    def __init__(self, name: str, log: list[Any], drop: set[int] = frozenset(), **kw: Any):
        super().__init__(name)
        self.log = log
        self.drop = set(drop)
        self.fail = set(kw.get("fail", ()))
        self.cursor: Any = kw.get("cursor")

    def event(self, store: DataStore) -> bool | None:
        uid = store.meta.uid
        seen = self.cursor[0][self.cursor[1]] if self.cursor else None
        self.log.append((self.name, uid, store.meta.attempt, seen))
        if uid in self.fail:
            raise RuntimeError(f"bad event {uid}")
        return False if uid in self.drop else None


def stores(n: int, first_uid: int = 100) -> list[DataStore]:
    return [DataStore(EventMeta(first_uid + i)) for i in range(n)]


# --- ModuleChain.event_batch --------------------------------------------------------
def run_chain(n_modules: int, batch: bool) -> tuple[list[Any], list[int], Any, list[int]]:
    """(calls, kept, statistics, flags) of 8 stores, by event_batch or event by event."""
    log: list[Any] = []
    mods = [Recorder(f"m{j}", log, drop={103} if j == 0 else {105}) for j in range(n_modules)]
    chain = ModuleChain(mods, process="w")
    items = stores(8)
    if batch:
        kept = bytearray(8)
        assert chain.event_batch(items, kept) == []
        keeps = list(kept)
    else:
        keeps = [int(chain.event(s)) for s in items]
    stats = [(s.calls, s.dropped) for s in chain.statistics()]
    return log, keeps, stats, [s.meta.flags for s in items]


@pytest.mark.parametrize("n_modules", [1, 3])
def test_event_batch_calls_like_event_one_store_after_the_other(n_modules: int) -> None:
    by_event = run_chain(n_modules, batch=False)
    log, keeps, stats, flags = run_chain(n_modules, batch=True)
    # same calls in the same order (every module on store 0, then store 1, ...), same
    # kept stores, statistics and flags
    assert (log, keeps, stats, flags) == by_event
    assert keeps[3] == 0 and flags[3] & FLAG_DROPPED
    assert stats[0] == (8, 1)
    if n_modules == 3:
        assert stats[1:] == [(7, 1), (6, 0)]  # 103 never reaches m1; 105 stops at m1


@pytest.mark.parametrize("n_modules", [1, 2])
def test_event_batch_a_module_raising_on_one_store_fails_only_that_store(n_modules: int) -> None:
    log: list[Any] = []
    mods = [
        Recorder(f"m{j}", log, fail={102} if j == n_modules - 1 else ()) for j in range(n_modules)
    ]
    chain = ModuleChain(mods, process="w")
    kept = bytearray(5)
    failures = chain.event_batch(stores(5), kept)
    assert [i for i, _ in failures] == [2]
    error = failures[0][1]
    assert isinstance(error, ModuleError)
    assert (error.module, error.uid, str(error.cause)) == (
        f"m{n_modules - 1}",
        102,
        "bad event 102",
    )
    assert "bad event 102" in error.traceback_text and "chain.py" not in error.traceback_text
    assert list(kept) == [1, 1, 0, 1, 1]
    assert [uid for name, uid, _, _ in log if name == "m0"] == [100, 101, 102, 103, 104]
    assert chain.statistics()[-1].calls == 4  # the failed call is not counted


def test_event_batch_sets_the_cursor_around_each_store_and_only_its_range() -> None:
    words = [7, 0]
    log: list[Any] = []
    chain = ModuleChain([Recorder("m", log, cursor=(words, 1))], process="w")
    kept = bytearray(6)
    assert chain.event_batch(stores(6), kept, 2, 5, (words, 1)) == []
    assert [(uid, seen) for _, uid, _, seen in log] == [(102, 3), (103, 4), (104, 5)]
    assert words == [7, 0] and list(kept) == [0, 0, 1, 1, 1, 0]


def test_event_batch_lets_evflow_errors_through_and_clears_the_cursor() -> None:
    class Broken(Module):
        parallel = True

        def event(self, store: DataStore) -> bool | None:
            if store.meta.uid == 101:
                raise OutputError("disk full")
            return None

    for mods in ([Broken()], [BusyWork(work_ms=0), Broken()]):
        words = [0]
        with pytest.raises(OutputError, match="disk full"):
            ModuleChain(mods).event_batch(stores(3), bytearray(3), cursor=(words, 0))
        assert words == [0]


def test_event_batch_times_a_one_module_chain_once_per_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readings: list[float] = []

    def clock() -> float:  # the chain's clock, injected: 1.0, 2.5, 4.0, ...
        readings.append(1.0 + 1.5 * len(readings))
        return readings[-1]

    monkeypatch.setattr(chain_module, "_clock", clock)
    chain = ModuleChain([BusyWork(work_ms=0.2)], process="w")
    chain.event_batch(stores(10), bytearray(10))
    (row,) = chain.statistics()
    assert readings == [1.0, 2.5]  # read once before the batch and once after it
    assert row.calls == 10 and row.time_s == 1.5
    assert chain.event_batch([], bytearray()) == []


def test_event_batch_gives_every_store_the_chain_persistent() -> None:
    class Fill(Module):
        parallel = True

        def event(self, store: DataStore) -> bool | None:
            store.persistent["n"] = store.persistent.get("n", 0) + 1
            return None

    chain = ModuleChain([Fill()])
    chain.event_batch(stores(4), bytearray(4))
    assert chain.persistent == {"n": 4}


# --- ReceivedBatch / BatchEvent ---------------------------------------------------------
def packed(metas: list[EventMeta], packed: bool = True) -> tuple[dict[str, Any], list[Any]]:
    """A batch header and payload as the worker receives them."""
    events = [DataStore(m, {"x": np.arange(3) + m.uid, "d": {"k": 1}}) for m in metas]
    header: dict[str, Any] = {"u": u64([m.uid for m in metas])}
    payload = pack_batch([encode_event(s) for s in events], header, packed=packed)
    return header, [memoryview(bytes(f)) for f in payload]


def test_received_batch_metas_carry_the_batch_attempt_and_runs_split_it() -> None:
    metas = [EventMeta(10 + i, experiment=-1, run=5 if i < 3 else 6, event=i) for i in range(5)]
    metas[1].attempt = 2
    header, payload = packed(metas)
    batch = ReceivedBatch(header, payload, attempt=2)
    assert batch.n == 5
    assert batch.runs() == [(0, 3, -1, 5), (3, 5, -1, 6)]
    assert batch.stale == [0, 2, 3, 4]  # their frames say attempt 1
    meta = batch.meta(4)
    assert meta.as_dict() == {**metas[4].as_dict(), "attempt": 2}
    assert [bytes(f) for f in batch.frames(2)] == [
        bytes(f) for f in unpack_batch({**header, "p": True}, payload)[2]
    ]


@pytest.mark.parametrize("is_packed", [True, False])
def test_batch_events_open_lazily_and_changed_names_only_what_must_be_re_encoded(
    is_packed: bool,
) -> None:
    header, payload = packed([EventMeta(i) for i in range(6)], packed=is_packed)
    batch = ReceivedBatch(header, payload, attempt=1)
    items = batch.stores()
    assert batch.touched == [] and not any(s.loaded for s in items)
    assert items[0].meta.uid == 0  # read only: still as received
    assert items[1].meta.uid == 1
    items[1].meta.flags |= 4  # changed meta
    assert list(items[2]["x"]) == [2, 3, 4]  # opened: holds a dict, may have changed
    items[3].meta = EventMeta(3, flags=8)  # replaced
    assert decode_event(batch.frames(4)).meta.uid == 4
    kept = bytearray([1, 1, 1, 1, 1, 0])
    assert batch.changed(items, kept) == {1, 2, 3}
    assert batch.changed(items, bytearray(6)) == set()
    assert not items[5].loaded and items[5]._meta is None


def test_received_batch_refuses_bad_headers_and_counts() -> None:
    header, payload = packed([EventMeta(1), EventMeta(2)])
    broken = bytearray(payload[0])
    broken[0] ^= 0xFF
    with pytest.raises(CodecError, match="event 0 of the batch"):
        ReceivedBatch(header, [memoryview(bytes(broken))], 1)
    with pytest.raises(ValueError, match="frames"):
        ReceivedBatch({**header, "n": header["n"] + header["n"]}, payload, 1)
    with pytest.raises(ValueError, match="bytes"):
        ReceivedBatch(header, [payload[0][:-5]], 1)


# --- the worker's _process --------------------------------------------------------------
class Sent:
    def __init__(self) -> None:
        self.messages: list[Any] = []

    def send_multipart(self, frames: list[Any], copy: bool = True) -> None:
        self.messages.append(decode_message([bytes(f) for f in frames]))


def make_worker(modules: list[Module], board: Scoreboard | None = None) -> Any:
    w = object.__new__(worker_role._Worker)
    w.name = "worker-0"
    w.chain = ModuleChain(modules, process=w.name)
    w.chain.initialize()
    w.dealer, w.push, w.ctl = Sent(), Sent(), Sent()
    w.event_buffer, w.events_in, w.events_kept, w.first_event_at = 10, 0, 0, 0.0
    w.bad, w.deltas, w.memory_limit_b, w.eager = BadMessageCounter("t"), DeltaEncoder(), 0, False
    w.messages_in = w.messages_out = 0  # the dashboard's msg/s counters
    w.board, w.slot = (board, 0) if board is not None else (None, -1)
    return w


def events_message(uids: list[int], attempt: int = 1, frames_attempt: int = 1) -> Any:
    metas = [EventMeta(u, run=1, event=u, attempt=frames_attempt) for u in uids]
    header, payload = packed(metas)
    header.update({"b": 7, "a": attempt, "s": u64(range(len(uids)))})
    msg = encode_message(MsgType.EVENTS, header, payload)
    return decode_message(msg)


def process(worker: Any, msg: Any) -> tuple[Any, Any]:
    # what recv_multipart(copy=False) gives: zmq frames
    worker._process(msg.header, [zmq.Frame(bytes(f)) for f in msg.payload])
    return worker.push.messages[-1], worker.dealer.messages[-1]


def test_process_fails_only_the_raising_event_and_forwards_the_rest() -> None:
    log: list[Any] = []
    board = Scoreboard(1)
    words, at = board.cursor(0)
    worker = make_worker([Recorder("m", log, fail={12}, cursor=(words, at))], board)
    result, ready = process(worker, events_message([10, 11, 12, 13]))
    assert [(uid, seen) for _, uid, _, seen in log] == [(10, 1), (11, 2), (12, 3), (13, 4)]
    assert board.read(0).state == "idle"
    assert from_u64(result.header["u"]).tolist() == [10, 11, 13]
    assert result.header["k"] == b"\x01\x01\x01"
    assert [decode_event(f).meta.uid for f in unpack_batch(result.header, result.payload)] == [
        10,
        11,
        13,
    ]
    assert ready.header["credit"] == 4
    (failure,) = ready.header["f"]
    assert (failure["uid"], failure["module"], failure["text"]) == (12, "m", "bad event 12")
    assert worker.chain.statistics()[0].calls == 3 and worker.events_kept == 3


def test_process_gives_modules_the_batch_attempt_and_re_encodes_stale_frames() -> None:
    log: list[Any] = []
    worker = make_worker([Recorder("m", log, drop={21})])
    msg = events_message([20, 21, 22], attempt=3, frames_attempt=1)
    result, _ = process(worker, msg)
    assert [attempt for _, _, attempt, _ in log] == [3, 3, 3]
    assert result.header["k"] == b"\x01\x00\x01"
    metas = [decode_event(f).meta for f in unpack_batch(result.header, result.payload)]
    assert [(m.uid, m.attempt) for m in metas] == [(20, 3), (22, 3)]


def test_process_forwards_an_untouched_batch_as_received_and_a_changed_one_re_encoded() -> None:
    class Flag(Module):
        parallel = True

        def event(self, store: DataStore) -> bool | None:
            if store.meta.uid == 31:
                store.meta.flags |= 16
            return None

    msg = events_message([30, 31, 32])
    result, _ = process(make_worker([BusyWork(work_ms=0)]), msg)
    assert [bytes(f) for f in result.payload] == [bytes(f) for f in msg.payload]
    result, _ = process(make_worker([Flag()]), msg)
    metas = [decode_event(f).meta for f in unpack_batch(result.header, result.payload)]
    assert [m.flags for m in metas] == [0, 16, 0]


# --- the input's side: contiguous toy rows, packed once --------------------------------
class Role:
    def __init__(self, n_events: int) -> None:
        self.chain = ModuleChain([ToyGenerator(n_events=n_events, payload_bytes=1024)])
        self.source = self.chain.modules[0]
        self.sizer = BatchSizer()
        self.read = self.max_events = self.start_position = 0
        self.exhausted = False


def test_read_encoded_packs_contiguous_rows_into_the_same_batch_bytes() -> None:
    role = Role(10_000)
    reader = encoded_source(role.chain, 0)
    assert reader is not None
    gen = ToyGenerator(n_events=10_000, payload_bytes=1024)
    seen = 0
    for n in (4, 300, 1000, 4000, 1000):  # across chunk ends and msgpack int widths
        enc, uids, _ = read_encoded(role, reader, n)
        assert isinstance(enc, PackedEvents) and uids == list(range(seen, seen + len(uids)))
        header: dict[str, Any] = {}
        payload = pack_batch(enc, header, packed=True)
        expected: dict[str, Any] = {}
        reference = [encode_event(gen.make_event(u)) for u in uids]
        assert bytes(payload[0]) == bytes(pack_batch(reference, expected, packed=True)[0])
        assert (header["n"], header["l"]) == (expected["n"], expected["l"])
        seen += len(uids)


def test_toy_chunk_buffers_are_reused_only_when_nothing_refers_to_them() -> None:
    gen = ToyGenerator(n_events=100_000, payload_bytes=1024)
    encoder = ToyEncoder(gen, 4096)
    kept = encoder.chunk(300, 400)[7][0]  # one frame of an otherwise dropped chunk
    before = bytes(kept)
    ledger = Ledger()
    enc = PackedEvents(encoder.chunk(400, 500).contiguous[0], b"\x01\x00" * 100, b"")
    sent = bytes(enc.blob)
    ledger.add_lists(list(range(400, 500)), list(range(100)), enc, "w")
    del enc
    for start in range(500, 5000, 100):
        encoder.chunk(start, start + 100)
    assert bytes(kept) == before  # still referenced: never overwritten
    assert bytes(ledger._order[0].frames.blob) == sent  # the ledger's batch too
    assert len(encoder._pool) <= 4
    ledger.confirm(list(range(400, 500)))  # confirmed: the ledger lets the buffer go
    assert len(ledger._order) == 0
    free = [i for i in range(len(encoder._pool)) if encoder._refs(i) == encoder._free_refs]
    assert len(free) == len(encoder._pool) - 1  # all free but the one ``kept`` holds

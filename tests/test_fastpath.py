"""The encoded-event fast path: the codec's bytes, the same events written, used when allowed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path as FsPath
from typing import Any

import numpy as np
import pytest

import evflow
from evflow import DataStore, Module, Path
from evflow.errors import CodecError, ParameterError
from evflow.event import FLAG_QUARANTINED, EventMeta, RunMeta
from evflow.io import (
    BusyWork,
    RecordInput,
    RecordOutput,
    RecordReader,
    RecordWriter,
    ToyGenerator,
    _encoded_toy,
)
from evflow.io.records import decode_record
from evflow.processing.chain import ModuleChain
from evflow.processing.module import Param, Source
from evflow.processing.parallel.batching import BatchSizer
from evflow.processing.parallel.input.fastpath import (
    ENV_DISABLE,
    encoded_source,
    fastpath_allowed,
    read_encoded,
)
from evflow.processing.parallel.worker.lazystore import LazyEvent, untouched
from evflow.wire.codec import decode_event, encode_event


def as_bytes(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


# --- ToyGenerator.encoded_events -------------------------------------------------------
@pytest.mark.parametrize("payload", [0, 1, 1024, 16 * 1024, 16 * 1024 + 1, 100_000])
def test_toy_encoded_events_are_the_encoded_events_byte_for_byte(payload: int) -> None:
    gen = ToyGenerator(n_events=600, payload_bytes=payload, seed=7, experiment=-3, run=12)
    encoded = list(gen.encoded_events(0))
    stores = list(gen.events(0))
    assert len(encoded) == len(stores) == 600
    for (uid, experiment, run, frames), store in zip(encoded, stores, strict=True):
        assert (uid, experiment, run) == (store.meta.uid, -3, 12)
        assert as_bytes(frames) == as_bytes(encode_event(store)), f"uid {uid}"


@pytest.mark.parametrize("start", [120, 127, 250, 65_530, 2**32 - 3])
def test_toy_encoded_events_match_across_msgpack_int_widths(start: int) -> None:
    gen = ToyGenerator(n_events=start + 300, payload_bytes=64, seed=1)
    encoded = gen.encoded_events(start)
    for k, (uid, _, _, frames) in zip(range(300), encoded, strict=False):
        assert uid == start + k
        assert as_bytes(frames) == as_bytes(encode_event(gen.make_event(start + k)))


def test_toy_encoded_batches_are_the_encoded_events_in_chunks() -> None:
    gen = ToyGenerator(n_events=700, payload_bytes=50, seed=9, run=4)
    flat = [
        (uid, experiment, run, as_bytes(frames))
        for uids, experiment, run, chunk in gen.encoded_batches(100)
        for uid, frames in zip(uids, chunk, strict=True)
    ]
    assert flat == [(u, e, r, as_bytes(f)) for u, e, r, f in gen.encoded_events(100)]
    assert [u for u, _, _, _ in flat] == list(range(100, 700))


def test_toy_encoded_events_start_and_end_like_events() -> None:
    gen = ToyGenerator(n_events=10)
    assert [e[0] for e in gen.encoded_events(7)] == [7, 8, 9]
    assert list(gen.encoded_events(10)) == list(gen.encoded_events(99)) == []
    with pytest.raises(ParameterError, match="start must be >= 0"):
        gen.encoded_events(-1)


def test_toy_encoder_falls_back_to_the_codec_when_its_bytes_differ(monkeypatch) -> None:
    # a codec change the pre-packed pieces do not know of must cost speed, not events
    def wrong_chunk(self: Any, start: int, stop: int) -> list[list[Any]]:
        return [[b"\x00" * 10] for _ in range(start, stop)]

    monkeypatch.setattr(_encoded_toy.ToyEncoder, "chunk", wrong_chunk)
    gen = ToyGenerator(n_events=50, payload_bytes=100)
    for uid, _, _, frames in gen.encoded_events(3):
        assert as_bytes(frames) == as_bytes(encode_event(gen.make_event(uid)))


# --- when the input may use it ------------------------------------------------------------
class Tagger(Module):
    """A serial module: it needs a DataStore in the input process."""

    def event(self, store: DataStore) -> bool | None:
        store["tagged"] = 1
        return None


class PlainSource(Source):
    n_events = Param(int, 5, "events")

    def events(self, start: int = 0) -> Iterator[DataStore]:
        for k in range(start, self.n_events):
            yield DataStore(EventMeta(k), {"k": k})


def test_fastpath_allowed_only_for_a_source_alone_with_encoded_events(monkeypatch) -> None:
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    assert fastpath_allowed(ModuleChain([ToyGenerator()]))
    assert not fastpath_allowed(ModuleChain([ToyGenerator(), Tagger()]))
    assert not fastpath_allowed(ModuleChain([PlainSource()]))
    monkeypatch.setenv(ENV_DISABLE, "1")
    assert not fastpath_allowed(ModuleChain([ToyGenerator()]))


class MarkedToy(ToyGenerator):
    """A ToyGenerator that leaves a file behind when the fast path reads it."""

    marker = Param(str, "", "file created when encoded_events() is called")

    def encoded_events(self, start: int = 0) -> Any:
        FsPath(self.marker).touch()
        return super().encoded_events(start)

    def encoded_batches(self, start: int = 0) -> Any:
        FsPath(self.marker).touch()
        return super().encoded_batches(start)


def read_events(file: FsPath) -> dict[int, tuple[Any, ...]]:
    out = {}
    with RecordReader(str(file)) as reader:
        for record in reader:
            s = decode_record(str(file), record)
            out[s.meta.uid] = (
                s.meta.event,
                s.meta.flags,
                bytes(s["payload"]),
                s["position"],
                s["value"],
                s["tag"],
                s.get("tagged"),
            )
    return out


def toy_path(out: FsPath, marker: FsPath, serial: bool = False, n: int = 700) -> Path:
    modules: list[Module] = [MarkedToy(n_events=n, payload_bytes=300, seed=4, marker=str(marker))]
    if serial:
        modules.append(Tagger())
    modules += [BusyWork(work_ms=0.0), RecordOutput(file=str(out), fsync=False)]
    return Path(modules)


def test_parallel_run_through_the_fast_path_writes_what_sequential_writes(
    tmp_path: FsPath, monkeypatch
) -> None:
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    seq_marker, par_marker = tmp_path / "seq.used", tmp_path / "par.used"
    evflow.process(toy_path(tmp_path / "seq.evr", seq_marker), quiet=True)
    summary = evflow.process(toy_path(tmp_path / "par.evr", par_marker), workers=2, quiet=True)
    assert not seq_marker.exists()  # sequential runs build stores
    assert par_marker.exists()  # the parallel input took the fast path
    expected = read_events(tmp_path / "seq.evr")
    assert len(expected) == 700
    assert read_events(tmp_path / "par.evr") == expected
    assert summary.events_read == summary.events_written == 700
    source_stats = [m for m in summary.modules if m.module == "MarkedToy" and m.process == "input"]
    assert sum(m.calls for m in source_stats) == 700


def test_serial_module_or_env_var_keeps_the_input_on_the_store_path(
    tmp_path: FsPath, monkeypatch
) -> None:
    marker = tmp_path / "used"
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    evflow.process(toy_path(tmp_path / "a.evr", marker, serial=True), workers=2, quiet=True)
    assert not marker.exists()
    tagged = read_events(tmp_path / "a.evr")
    assert len(tagged) == 700 and {v[-1] for v in tagged.values()} == {1}
    monkeypatch.setenv(ENV_DISABLE, "1")
    evflow.process(toy_path(tmp_path / "b.evr", marker), workers=2, quiet=True)
    assert not marker.exists()
    assert len(read_events(tmp_path / "b.evr")) == 700


def test_fast_path_respects_max_events(tmp_path: FsPath, monkeypatch) -> None:
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    marker = tmp_path / "used"
    path = toy_path(tmp_path / "m.evr", marker, n=500)
    summary = evflow.process(path, workers=2, quiet=True, max_events=123)
    assert marker.exists()
    assert summary.events_read == summary.events_written == 123
    assert sorted(read_events(tmp_path / "m.evr")) == list(range(123))


# --- read_encoded: counters and run boundaries -----------------------------------------------
class RunSource(Source):
    """Encoded events in two runs; records the run hooks it sees."""

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(name, **params)
        self.runs: list[tuple[str, int]] = []

    def begin_run(self, run: RunMeta) -> None:
        self.runs.append(("begin", run.run))

    def end_run(self, run: RunMeta) -> None:
        self.runs.append(("end", run.run))

    def encoded_events(self, start: int = 0) -> Iterator[tuple[int, int, int, list[Any]]]:
        for k in range(start, 10):
            store = DataStore(EventMeta(k, 0, 1 if k < 6 else 2, k), {"k": k})
            yield (k, 0, store.meta.run, encode_event(store))


class Role:
    def __init__(self, source: Source, max_events: int = 0) -> None:
        self.chain = ModuleChain([source])
        self.source = source
        self.sizer = BatchSizer()
        self.read = 0
        self.max_events = max_events
        self.start_position = 0
        self.exhausted = False


def test_read_encoded_counts_switches_runs_and_ends() -> None:
    source = RunSource()
    role = Role(source)
    it = encoded_source(role.chain, 0)
    assert it is not None
    enc, uids, positions = read_encoded(role, it, 4)
    assert uids == positions == [0, 1, 2, 3] and len(enc) == 4 and not role.exhausted
    assert source.runs == [("begin", 1)]
    uids, positions = [], []
    while not role.exhausted:  # batches of at most sizer.size() events, as for stores
        _, more_uids, more_positions = read_encoded(role, it, 100)
        uids += more_uids
        positions += more_positions
    assert uids == positions == list(range(4, 10))
    assert source.runs == [("begin", 1), ("end", 1), ("begin", 2)]
    assert role.exhausted and role.read == 10
    assert role.chain.stats.calls[0] == 10


def test_read_encoded_stops_at_max_events() -> None:
    role = Role(RunSource(), max_events=3)
    reader = encoded_source(role.chain, 0)
    assert reader is not None
    uids: list[int] = []
    while not role.exhausted:
        uids += read_encoded(role, reader, 100)[1]
    assert uids == [0, 1, 2]


class StreamSource(Source):
    """Chunks as they would arrive from a network: 3, 5, then 2 events."""

    streaming = True

    def encoded_batches(self, start: int = 0) -> Iterator[tuple[list[int], int, int, list[Any]]]:
        k = 0
        for n in (3, 5, 2):
            stores = [DataStore(EventMeta(k + i, 0, 1, k + i), {"k": k + i}) for i in range(n)]
            yield [s.meta.uid for s in stores], 0, 1, [encode_event(s) for s in stores]
            k += n


def test_a_stream_batch_ends_with_its_chunk() -> None:
    """The input never waits for a stream's next chunk to fill a batch (those events
    may not have been sent yet); a chunk larger than the batch is cut as usual."""
    role = Role(StreamSource())
    role.sizer.stream = True
    reader = encoded_source(role.chain, 0)
    assert reader is not None
    got = [read_encoded(role, reader, 100)[1]]
    got.append(read_encoded(role, reader, 4)[1])
    while not role.exhausted:
        got.append(read_encoded(role, reader, 100)[1])
    assert got[:4] == [[0, 1, 2], [3, 4, 5, 6], [7], [8, 9]]


# --- LazyEvent (workers) ---------------------------------------------------------------
def test_lazy_event_reads_meta_without_decoding_and_decodes_on_first_use() -> None:
    frames = encode_event(
        DataStore(EventMeta(42, 1, 2, 3, 0, 1), {"a": np.arange(4), "d": {"x": 1}})
    )
    store = LazyEvent(frames)
    assert store.meta == EventMeta(42, 1, 2, 3, 0, 1)
    assert not store.loaded and untouched(store)
    assert list(store["a"]) == [0, 1, 2, 3] and store.loaded
    assert not untouched(store)  # it holds a dict, which a module may have changed
    plain = LazyEvent(encode_event(DataStore(EventMeta(1), {"a": np.arange(3)})))
    assert "a" in plain and untouched(plain)
    plain["b"] = 5
    assert not untouched(plain)
    assert as_bytes(encode_event(plain)) == as_bytes(
        encode_event(DataStore(EventMeta(1), {"a": np.arange(3), "b": 5}))
    )


def test_lazy_event_rejects_bad_frames_with_codec_error() -> None:
    with pytest.raises(CodecError):
        LazyEvent([b"not an event"])
    good = encode_event(DataStore(EventMeta(1), {"a": 1}))
    broken = LazyEvent([bytes(good[0])[:-2]])  # the meta is intact, the entries are not
    with pytest.raises(CodecError):
        broken["a"]


def test_a_writer_writes_an_unchanged_lazy_event_as_received(tmp_path: FsPath) -> None:
    """RecordOutput writes the received frames of an event nobody changed (as they
    are, even in a msgpack form the encoder would not write) and encodes any other."""
    meta = EventMeta(7, 1, 2, 3)
    frames = encode_event(DataStore(meta, {"a": np.arange(3), "v": 5}))
    odd = [bytes(frames[0]).replace(b"\xa1v\x00\x05", b"\xa1v\x00\xcc\x05")]  # uint8 5
    assert decode_event(odd)["v"] == 5 and encode_event(decode_event(odd)) != odd

    def opened(s: LazyEvent) -> None:
        s["a"]

    def added(s: LazyEvent) -> None:
        s["b"] = 1

    def flagged(s: LazyEvent) -> None:
        s.meta.flags |= 4

    cases = [(None, True), (opened, True), (added, False), (flagged, False)]
    out = RecordOutput(file=str(tmp_path / "o.evr"), fsync=False)
    out.initialize()
    stores = []
    for change, same in cases:
        for make in (LazyEvent, LazyEvent.decoded):
            store = make(odd)
            if change is not None:
                change(store)
            assert (store.as_received() is odd) is same
            out.write(store)
            stores.append((store, same))
    out.close()
    records = list(RecordInput(file=str(tmp_path / "o.evr")).encoded_events(0))
    for (_, _, _, got), (store, same) in zip(records, stores, strict=True):
        assert as_bytes(got) == (as_bytes(odd) if same else as_bytes(encode_event(store)))


# --- RecordInput.encoded_events ----------------------------------------------------------
def test_record_encoded_events_decode_to_what_events_yields(tmp_path: FsPath) -> None:
    file = tmp_path / "r.evr"
    gen = ToyGenerator(n_events=40, payload_bytes=20_000, seed=2)
    with RecordWriter(str(file), fsync=False) as writer:
        for store in gen.events():
            # record-header flags are OR-ed into the meta by both paths
            writer.write_frames(store.meta.uid, FLAG_QUARANTINED * (store.meta.uid % 3 == 0),
                                encode_event(store))  # fmt: skip
    source = RecordInput(file=str(file))
    expected = list(source.events(5))
    encoded = list(source.encoded_events(5))
    assert len(encoded) == len(expected) == 35
    for (uid, experiment, run, frames), store in zip(encoded, expected, strict=True):
        got = decode_event(frames)
        assert (uid, experiment, run) == (store.meta.uid, store.meta.experiment, store.meta.run)
        assert got.meta == store.meta
        assert got.meta.flags == (FLAG_QUARANTINED if uid % 3 == 0 else 0)
        assert sorted(got.objects) == sorted(store.objects)
        assert bytes(got["payload"]) == bytes(store["payload"])
        assert (got["position"], got["value"], got["tag"]) == (
            store["position"], store["value"], store["tag"]
        )  # fmt: skip


def test_record_input_through_the_fast_path_writes_what_sequential_writes(
    tmp_path: FsPath, monkeypatch
) -> None:
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    src = tmp_path / "in.evr"
    evflow.process(Path([ToyGenerator(n_events=300, payload_bytes=500, seed=8),
                         RecordOutput(file=str(src), fsync=False)]), quiet=True)  # fmt: skip

    def path(out: FsPath) -> Path:
        return Path([RecordInput(file=str(src)), BusyWork(work_ms=0.0),
                     RecordOutput(file=str(out), fsync=False)])  # fmt: skip

    evflow.process(path(tmp_path / "seq.evr"), quiet=True)
    evflow.process(path(tmp_path / "par.evr"), workers=2, quiet=True)
    expected = read_events(tmp_path / "seq.evr")
    assert len(expected) == 300 and read_events(tmp_path / "par.evr") == expected

"""Persistent-object deltas: histograms merged per accepted batch, exact under failures.

Unit level: the delta codec (round trip, reset, malformed input) and the output's
account of which deltas to merge (duplicates, mixed batches, a saved state reloaded
after a restart). Real processes: workers killed mid-run (SIGKILL, ``os._exit``), the
output SIGKILLed; the merged histogram must equal one computed from the events in the
output file, bin by bin.
"""

from __future__ import annotations

from pathlib import Path as FsPath
from typing import Any

import boost_histogram as bh
import hist
import msgpack
import numpy as np
import pytest

import evflow
from evflow import DataStore, Module, Path
from evflow.errors import CodecError
from evflow.io.generators import BusyWork, ToyGenerator
from evflow.io.records import RecordOutput, RecordReader, decode_record
from evflow.processing.faults import FaultInjector
from evflow.processing.parallel.deltas import DeltaEncoder, DeltaMerger
from evflow.processing.parallel.output import fills as fills_module
from evflow.processing.parallel.output.dedup import WrittenUids
from evflow.processing.parallel.output.fills import COUNTER_NAMES, Fills
from test_chaos import _kill_role_when


# --- modules (forked into workers, never pickled) -----------------------------------------
def new_value_hist() -> Any:
    return hist.Hist.new.Reg(100, 0, 1, name="value").Double()


class Filler(Module):
    """Fills a 100-bin histogram, a weighted 2-d one, an array and a counter per event."""

    parallel = True

    def initialize(self) -> None:
        self.booked: dict[str, Any] | None = None

    def event(self, store: DataStore) -> bool | None:
        p = store.persistent
        if "h_value" not in p:
            p["h_value"] = new_value_hist()
            p["h_2d"] = hist.Hist.new.Reg(8, 0, 1).Integer(0, 16).Weight()
            p["tags"] = np.zeros(16, dtype=np.int64)
            p["n"] = 0
        p["h_value"].fill(store["value"])
        p["h_2d"].fill(store["value"], store["tag"], weight=0.5)
        p["tags"][store["tag"]] += 1
        p["n"] += 1
        return None


def expected_from_file(file: FsPath) -> tuple[Any, np.ndarray, set[int]]:
    """The histogram and tag counts of exactly the events in ``file``, and their uids."""
    h = new_value_hist()
    tags = np.zeros(16, dtype=np.int64)
    uids: list[int] = []
    with RecordReader(str(file)) as reader:
        for record in reader:
            store = decode_record(str(file), record)
            uids.append(store.meta.uid)
            h.fill(store["value"])
            tags[store["tag"]] += 1
    assert len(uids) == len(set(uids)), "a uid written twice"
    return h, tags, set(uids)


def fill_path(out: FsPath, n: int, *faults: Module, work_ms: float = 0.0) -> Path:
    modules: list[Module] = [ToyGenerator(n_events=n, payload_bytes=200, seed=4), Filler()]
    modules += faults
    if work_ms:
        modules.append(BusyWork(work_ms=work_ms))
    modules.append(RecordOutput(file=str(out), fsync=False))
    return Path(modules)


# --- the codec ----------------------------------------------------------------------------
def test_deltas_add_up_to_the_whole_and_reset_the_objects() -> None:
    rng = np.random.default_rng(1)
    objects: dict[str, Any] = {
        "h": new_value_hist(),
        "w": bh.Histogram(bh.axis.Variable([0, 1, 3, 7]), storage=bh.storage.Weight()),
        "mean": bh.Histogram(bh.axis.Regular(4, 0, 1), storage=bh.storage.Mean()),
        "cat": hist.Hist.new.StrCat([], growth=True).Int64(),
        "a": np.zeros(5),
        "n": 0,
        "label": "not mergeable",
    }
    whole = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in objects.items()}
    encoder, merger = DeltaEncoder(), DeltaMerger()
    for batch in range(12):
        x = rng.random(40)
        for target in (objects, whole):
            target["h"].fill(x)
            target["w"].fill(x * 7, weight=x)
            target["mean"].fill(x, sample=2 * x)
            target["cat"].fill([str(int(v * (batch + 1))) for v in x[:3]])
            target["a"][:] += x[:5]
            target["n"] += 40
        merger.merge(encoder.take(objects))
        assert objects["h"].sum() == 0 and objects["n"] == 0 and not objects["a"].any()
    m = merger.merged
    assert m["h"] == whole["h"] and isinstance(m["h"], hist.Hist)
    np.testing.assert_allclose(m["w"].values(flow=True), whole["w"].values(flow=True))
    np.testing.assert_allclose(m["w"].variances(flow=True), whole["w"].variances(flow=True))
    np.testing.assert_allclose(m["mean"].values(), whole["mean"].values())
    assert m["cat"].sum() == whole["cat"].sum() == 36
    np.testing.assert_allclose(m["a"], whole["a"])
    assert m["n"] == 480
    assert "label" not in m
    assert encoder.take(objects) is None  # nothing filled since: nothing sent


def test_no_persistent_objects_cost_no_frames() -> None:
    assert DeltaEncoder().take({}) is None


@pytest.mark.parametrize(
    "frames",
    [
        [b"\xc1garbage"],
        [msgpack.packb({"v": 99, "items": []})],
        [msgpack.packb({"v": 1, "items": [["h", "h", b"not a spec", 1]]}), b"\0" * 8],
        [msgpack.packb({"v": 1, "items": [["a", "nd", "<f8", [4], 1]]}), b"\0" * 7],
        [msgpack.packb({"v": 1, "items": [["a", "nd", "<f8", [4], 5]]})],
        [msgpack.packb({"v": 1, "items": [["n", "num", "seven"]]})],
        [msgpack.packb({"v": 1, "items": [["n", "what", 1]]})],
        [msgpack.packb(["not", "a", "map"])],
    ],
)
def test_a_malformed_delta_raises_codec_error_and_merges_nothing(frames: list[bytes]) -> None:
    merger = DeltaMerger()
    merger.merge(DeltaEncoder().take({"n": 3}) or [])
    with pytest.raises(CodecError):
        merger.merge(frames)
    assert merger.merged == {"n": 3}


def test_a_histogram_delta_with_wrong_bin_bytes_is_refused() -> None:
    h = new_value_hist()
    h.fill([0.5])
    frames = DeltaEncoder().take({"h": h})
    assert frames is not None
    with pytest.raises(CodecError):
        DeltaMerger().merge([frames[0], frames[1][:-8]])


def test_the_spec_of_a_large_histogram_carries_no_bins_and_merges_the_same() -> None:
    h = hist.Hist.new.Reg(62_498, 0, 1).Weight()  # 1 MB of bins
    h.fill(np.linspace(0, 1, 1000), weight=2.0)
    expected = h.copy()
    frames = DeltaEncoder().take({"h": h})
    assert frames is not None
    assert len(frames[0]) < 2000  # the spec: axes and storage, its zero bins as a length
    merger = DeltaMerger()
    merger.merge(frames)
    merger.merge(frames)
    assert np.array_equal(merger.merged["h"].values(flow=True), 2 * expected.values(flow=True))
    assert np.array_equal(
        merger.merged["h"].variances(flow=True), 2 * expected.variances(flow=True)
    )


def _with_zero_length(frames: list[bytes], length: int) -> list[bytes]:
    head = msgpack.unpackb(frames[0])
    spec_head, *spec_frames = msgpack.unpackb(head["items"][0][2])
    assert all(type(f) is int for f in spec_frames)
    head["items"][0][2] = msgpack.packb([spec_head, *([length] * len(spec_frames))])
    return [msgpack.packb(head), *frames[1:]]


@pytest.mark.parametrize("length", [-1, 2**40, 8])
def test_a_spec_asking_for_a_wrong_number_of_zero_bytes_is_refused(length: int) -> None:
    h = new_value_hist()
    h.fill([0.5])
    frames = DeltaEncoder().take({"h": h})
    assert frames is not None
    merger = DeltaMerger()
    with pytest.raises(CodecError):
        merger.merge(_with_zero_length(frames, length))
    assert merger.merged == {}


def test_a_small_delta_cannot_make_the_merger_allocate_more_than_it_sent() -> None:
    """A hostile head: 1 GiB of zero bins asked for by a message of a few hundred bytes
    is refused before anything is allocated (it would stay in the template cache)."""
    import resource

    h = new_value_hist()
    h.fill([0.5])
    frames = DeltaEncoder().take({"h": h})
    assert frames is not None
    merger = DeltaMerger()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CodecError, match="zero bytes"):
        merger.merge(_with_zero_length(frames, 1 << 30))
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kb < 100_000  # not the 1 GiB asked for
    assert merger.merged == {}
    merger.merge(frames)  # the same objects, honest, still merge
    assert merger.merged["h"].sum() == 1


# --- which deltas the output merges -------------------------------------------------------
def delta_of(n_fills: int) -> list[bytes]:
    h = new_value_hist()
    h.fill(np.full(n_fills, 0.25))
    frames = DeltaEncoder().take({"h": h})
    assert frames is not None
    return frames


def accept(fills: Fills, n_fills: int, uids: list[int], seen: WrittenUids) -> str | None:
    raw = np.array(uids, dtype=np.uint64).tobytes()
    return fills.accept(delta_of(n_fills), raw, uids, seen, 0)


def test_output_drops_the_delta_of_an_all_duplicate_batch_and_counts_a_mixed_one() -> None:
    fills, seen = Fills(None, ordered=False), WrittenUids()
    assert accept(fills, 2, [1, 2], seen) is None
    seen.add(1), seen.add(2)
    accept(fills, 2, [1, 2], seen)  # late results of both: dropped
    assert fills.merged["h"].sum() == 2
    accept(fills, 2, [2, 3], seen)  # mixed: merged, counted
    assert fills.merged["h"].sum() == 4
    counters = fills.counters()
    assert counters[COUNTER_NAMES["mixed"]] == 1
    assert counters[COUNTER_NAMES["dup"]] == 1


def test_output_counts_and_drops_a_malformed_delta_without_raising() -> None:
    fills = Fills(None, ordered=False)
    raw = np.array([7], dtype=np.uint64).tobytes()
    assert fills.accept([b"\xc1junk"], raw, [7], WrittenUids(), 0) is not None
    assert fills.merged == {}
    assert fills.counters() == {COUNTER_NAMES["bad"]: 1}


def test_restarted_output_takes_over_snapshot_and_journal_exactly(
    tmp_path: FsPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fills_module, "SNAPSHOT_INTERVAL_S", 0.0)
    # the first output: {1, 2} confirmed with a snapshot; then {3, 4} written and 5
    # accepted (journaled) but not yet in the file when the output is SIGKILLed
    first, seen = Fills(tmp_path, ordered=False), WrittenUids()
    accept(first, 2, [1, 2], seen)
    first.confirmed(np.array([1, 2], dtype=np.uint64))
    accept(first, 2, [3, 4], seen)
    accept(first, 1, [5], seen)
    journal = next(tmp_path.glob("*.journal"))
    with open(journal, "ab") as f:
        f.write(b"\x40\x00\x00\x00torn")  # a crash in the middle of an append
    del first  # SIGKILL: nothing else runs
    in_file = {1, 2, 3, 4}
    second = Fills(tmp_path, ordered=False, in_file=in_file)
    assert second.merged["h"].sum() == 5  # snapshot + journal
    seen = WrittenUids(in_file)
    for uid in (3, 5, 1):  # re-sent (3, 5: unconfirmed) or late (1): all in the state
        accept(second, 1, [uid], seen)
    accept(second, 1, [6], seen)  # new
    assert second.merged["h"].sum() == 6
    assert COUNTER_NAMES["lost"] not in second.counters()
    second.confirmed(np.array([3, 5, 6], dtype=np.uint64))
    third = Fills(tmp_path, ordered=False, in_file={1, 2, 3, 4, 5, 6})  # killed again
    assert third.merged["h"].sum() == 6
    third.remove_files()
    assert not list(tmp_path.iterdir())


def test_an_unreadable_snapshot_counts_every_event_of_the_file_as_lost(
    tmp_path: FsPath,
) -> None:
    (tmp_path / fills_module.STATE_NAME).write_bytes(b"\x00not msgpack state")
    fills = Fills(tmp_path, ordered=False, in_file={1, 2, 3})
    assert fills.counters()[COUNTER_NAMES["lost"]] == 3
    assert fills.merged == {}
    fills.remove_files()


# --- real processes -----------------------------------------------------------------------
def test_killed_workers_lose_no_histogram_fills_and_count_none_twice(tmp_path: FsPath) -> None:
    n = 1500
    out = tmp_path / "o.evr"
    path = fill_path(
        out,
        n,
        # once each, whatever the batches: an event queued behind one that killed its
        # worker comes again with attempt 2 before any process got to it
        FaultInjector(name="kill", mode="segfault", uids=[100, 700, 1300], once_dir=str(tmp_path)),
        FaultInjector(name="exit", mode="exit", uids=[400, 1000], once_dir=str(tmp_path)),
    )
    summary = evflow.process(path, workers=3, quiet=True, max_attempts=3)
    assert summary.counters["workers lost"] == 5
    h, tags, uids = expected_from_file(out)
    assert uids == set(range(n)) and summary.events_quarantined == 0
    merged = summary.persistent
    np.testing.assert_array_equal(merged["h_value"].view(flow=True), h.view(flow=True))
    np.testing.assert_array_equal(merged["tags"], tags)
    assert merged["h_value"].sum(flow=True) == merged["n"] == summary.events_written == n
    assert merged["h_2d"].sum(flow=True).value == 0.5 * n
    # re-sent events whose first result had arrived: their deltas were dropped, none mixed
    for kind in ("mixed", "failed", "bad", "lost"):
        assert COUNTER_NAMES[kind] not in summary.counters, summary.counters


@pytest.mark.parametrize(("workers", "ordered"), [(1, False), (2, False), (4, False), (2, True)])
def test_without_failures_merged_equals_sequential(
    tmp_path: FsPath, workers: int, ordered: bool
) -> None:
    seq = evflow.process(fill_path(tmp_path / "s.evr", 800), quiet=True).persistent
    par = evflow.process(
        fill_path(tmp_path / "p.evr", 800), workers=workers, ordered=ordered, quiet=True
    )
    for name in ("h_value", "h_2d"):
        assert par.persistent[name] == seq[name]
    np.testing.assert_array_equal(par.persistent["tags"], seq["tags"])
    assert par.persistent["n"] == seq["n"] == 800


def test_raised_events_partial_fills_are_counted_not_hidden(tmp_path: FsPath) -> None:
    out = tmp_path / "o.evr"
    path = fill_path(out, 400, FaultInjector(name="flaky", mode="raise", uids=[10, 20]))
    summary = evflow.process(path, workers=2, quiet=True)
    # Filler runs before the failing module: those two fills stay in, and the summary says so
    assert summary.counters[COUNTER_NAMES["failed"]] == 2
    assert summary.persistent["n"] == 402


def test_sigkill_of_the_output_keeps_the_merged_histogram_exact(tmp_path: FsPath) -> None:
    n = 3000
    out = tmp_path / "o.evr"
    killer = _kill_role_when("output", lambda: out.exists() and out.stat().st_size > 200_000)
    summary = evflow.process(fill_path(out, n, work_ms=0.5), workers=2, quiet=True)
    killer.finish()
    assert summary.counters["output restarts"] == 1
    h, _, uids = expected_from_file(out)
    assert uids == set(range(n))
    merged = summary.persistent
    assert COUNTER_NAMES["lost"] not in summary.counters, summary.counters
    # a batch in flight when the output died races the re-sends of its own events: if
    # some re-sends arrive first it is mixed, and those fills count twice; counted
    twice = summary.counters.get(COUNTER_NAMES["mixed"], 0)
    extra = merged["h_value"].view(flow=True) - h.view(flow=True)
    assert extra.min() >= 0 and extra.sum() == twice
    assert merged["n"] == n + twice
    assert twice <= 20  # rare: the in-flight batches of 2 workers at most


def test_after_an_input_restart_every_fill_counted_twice_is_in_the_summary(
    tmp_path: FsPath,
) -> None:
    # the restarted input re-reads from its checkpoint: events already written come
    # again in fresh batches, mixed with new ones, whose deltas cannot be split
    n = 3000
    out = tmp_path / "o.evr"
    ckpt = FsPath(str(out) + ".ckpt")
    ready = lambda: ckpt.exists() and out.exists() and out.stat().st_size > 200_000  # noqa: E731
    killer = _kill_role_when("input", ready)
    summary = evflow.process(
        fill_path(out, n, work_ms=0.5),
        workers=2,
        quiet=True,
        extra={"checkpoint_interval_s": 0.1},
    )
    killer.finish()
    assert summary.counters["input restarts"] == 1
    h, _, uids = expected_from_file(out)
    assert uids == set(range(n))
    twice = summary.counters.get(COUNTER_NAMES["mixed"], 0)
    extra = summary.persistent["h_value"].view(flow=True) - h.view(flow=True)
    assert extra.min() >= 0 and extra.sum() == twice
    assert summary.persistent["n"] == n + twice

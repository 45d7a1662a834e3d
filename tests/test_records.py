"""Record files: round trips, torn tails after SIGKILL, reopening, corruption, bad input."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import awkward as ak
import numpy as np
import pytest

from evflow.errors import ClosedError, CorruptRecordError, InputError, OutputError
from evflow.event import FLAG_QUARANTINED, DataStore, EventMeta
from evflow.io._recformat import FILE_HEADER_SIZE, RECORD_HEADER_SIZE, file_header
from evflow.io.generators import ToyGenerator
from evflow.io.records import RecordInput, RecordOutput, RecordReader, RecordWriter
from evflow.wire.codec import encode_event, pack_frames

DATA = Path(__file__).parent / "data"


def _same(a: DataStore, b: DataStore) -> None:
    assert a.meta == b.meta
    assert sorted(a) == sorted(b)
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), key
        elif isinstance(x, ak.Array):
            assert ak.to_list(x) == ak.to_list(y), key
        else:
            assert x == y, key


def _write_toy(path: Path, n: int, payload_bytes: int, **params: object) -> ToyGenerator:
    gen = ToyGenerator(n_events=n, payload_bytes=payload_bytes, seed=3)
    out = RecordOutput(file=str(path), **params)
    out.initialize()
    for store in gen.events():
        out.event(store)
    out.terminate()
    return gen


# --- round trips ---------------------------------------------------------------------
@pytest.mark.parametrize("payload_bytes", [0, 1000, 100_000, 1_000_000])
def test_record_round_trip_gives_back_every_event(tmp_path: Path, payload_bytes: int) -> None:
    path = tmp_path / "toy.evr"
    gen = _write_toy(path, 12, payload_bytes)
    source = RecordInput(file=str(path))
    assert source.total() == 12
    got = list(source.events())
    assert len(got) == 12
    for a, b in zip(gen.events(), got, strict=True):
        _same(a, b)


def test_round_trip_of_mixed_objects_and_sizes(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    stores = []
    for k, size in enumerate([1, 70_000, 3, 300_000, 10, 65_536, 0]):
        stores.append(
            DataStore(
                EventMeta(uid=1000 + k, experiment=2, run=5, event=k),
                {
                    "x": rng.normal(size=size),
                    "jag": ak.Array([[1, 2], [], [k]]),
                    "label": f"event {k}",
                    "n": k,
                    "d": {"a": [1, 2.5]},
                },
            )
        )
    out = RecordOutput(file=str(tmp_path / "mixed.evr"), buffer_bytes=100_000)
    for s in stores:
        out.event(s)
    out.close()
    for a, b in zip(stores, RecordInput(file=str(tmp_path / "mixed.evr")).events(), strict=True):
        _same(a, b)


def test_record_payload_is_exactly_pack_frames_of_encode_event(tmp_path: Path) -> None:
    gen = ToyGenerator(n_events=3, payload_bytes=200_000)
    with RecordWriter(tmp_path / "f.evr") as writer:
        for s in gen.events():
            writer.write_frames(s.meta.uid, s.meta.flags, encode_event(s))
    with RecordReader(tmp_path / "f.evr") as reader:
        for s, rec in zip(gen.events(), reader, strict=True):
            assert rec.payload.tobytes() == pack_frames(encode_event(s))
            assert rec.uid == s.meta.uid


def test_events_from_a_start_position_are_the_tail(tmp_path: Path) -> None:
    path = tmp_path / "toy.evr"
    _write_toy(path, 20, 500)
    source = RecordInput(file=str(path))
    full = list(source.events(0))
    for start in (0, 1, 7, 19, 20, 25):
        tail = list(source.events(start))
        assert [s.meta.uid for s in tail] == [s.meta.uid for s in full[start:]]


def test_write_raw_keeps_frames_and_marks_the_record_quarantined(tmp_path: Path) -> None:
    store = ToyGenerator(n_events=1, payload_bytes=2000).make_event(0)
    meta = EventMeta(uid=0, flags=FLAG_QUARANTINED, attempt=3)
    out = RecordOutput(file=str(tmp_path / "q.evr"))
    out.write_raw(meta, encode_event(store))
    out.close()
    with RecordReader(tmp_path / "q.evr") as reader:
        (rec,) = list(reader)
        assert rec.flags == FLAG_QUARANTINED and rec.uid == 0
    (back,) = list(RecordInput(file=str(tmp_path / "q.evr")).events())
    assert back.meta.flags & FLAG_QUARANTINED
    assert np.array_equal(back["payload"], store["payload"])


def test_old_version_1_fixture_still_loads() -> None:
    events = list(RecordInput(file=str(DATA / "records_v1.evr")).events())
    assert [s.meta.uid for s in events] == [100, 101, 102]
    assert [s["name"] for s in events] == ["ev0", "ev1", "ev2"]
    assert np.array_equal(events[2]["x"], np.arange(3, dtype=np.float32))
    assert events[1].meta.run == 7


# --- torn tails ------------------------------------------------------------------------
def test_every_cut_inside_the_last_record_is_a_reported_torn_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "full.evr"
    _write_toy(path, 4, 100)
    data = path.read_bytes()
    with RecordReader(path) as reader:
        last = list(reader)[-1].offset
    cut_path = tmp_path / "cut.evr"
    for cut in range(last + 1, len(data)):
        cut_path.write_bytes(data[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING), RecordReader(cut_path) as reader:
            assert [r.uid for r in reader] == [0, 1, 2]
            assert reader.torn_tail is not None
            assert reader.torn_tail.offset == last
            assert reader.end_offset == last
        assert f"torn tail at offset {last}" in caplog.text
        assert str(cut_path) in caplog.text


def test_a_flipped_byte_in_the_last_payload_is_a_torn_tail_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "f.evr"
    _write_toy(path, 3, 100)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with RecordReader(path) as reader:
        assert [r.uid for r in reader] == [0, 1]
        assert reader.torn_tail is not None and "CRC" in reader.torn_tail.reason


_CHILD = textwrap.dedent(
    """
    import sys
    from evflow.io.generators import ToyGenerator
    from evflow.io.records import RecordOutput

    out = RecordOutput(file=sys.argv[1], buffer_bytes=4 << 20, fsync=False)
    out.initialize()
    print("writing", flush=True)
    for store in ToyGenerator(n_events=10**7, payload_bytes=200_000, seed=3).events():
        out.event(store)
    """
)


def _record_ends(n: int) -> set[int]:
    """File sizes at which the child's first ``n`` records are complete."""
    gen = ToyGenerator(n_events=n, payload_bytes=200_000, seed=3)
    ends, size = set(), FILE_HEADER_SIZE
    for store in gen.events():
        size += RECORD_HEADER_SIZE + len(pack_frames(encode_event(store)))
        ends.add(size)
    return ends


def _kill_writer_mid_write(path: Path, ends: set[int]) -> None:
    """SIGKILL the child as soon as the file size shows a write in progress."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "writing"
        limit = max(ends)
        deadline = time.monotonic() + 30
        while True:
            size = os.path.getsize(path)
            # mid-write: the size is not at a record end (a 4 MB writev is under way)
            # after the first 4 MB buffer, so that complete records exist
            if (size > 5 << 20 and size not in ends) or size >= limit:
                break
            assert time.monotonic() < deadline, "writer made no progress"
            assert child.poll() is None, "writer exited early"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()
    assert child.returncode == -signal.SIGKILL


def test_reader_recovers_every_complete_record_after_sigkill_and_writer_appends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gen = ToyGenerator(n_events=10**7, payload_bytes=200_000, seed=3)
    ends = _record_ends(300)
    # The kill follows a size seen mid-write within microseconds, so it lands inside
    # the 4 MB writev almost always; retry a few times so that the torn case is
    # certainly exercised even on a loaded machine.
    for attempt in range(5):
        path = tmp_path / f"killed{attempt}.evr"
        _kill_writer_mid_write(path, ends)
        with caplog.at_level(logging.WARNING), RecordReader(path) as reader:
            uids = [r.uid for r in reader]
            torn = reader.torn_tail
        # every complete record is there, in order
        assert uids == list(range(len(uids)))
        assert len(uids) >= 20  # the first 4 MB buffer at least
        if torn is not None:
            break
        path.unlink()
    assert torn is not None, "five SIGKILLs mid-write never left a torn record"
    assert f"torn tail at offset {torn.offset}" in caplog.text and str(path) in caplog.text
    assert torn.offset + torn.nbytes == os.path.getsize(path)
    # the complete records decode to the original events
    source = RecordInput(file=str(path))
    assert source.total() == len(uids)
    for expected, got in zip(gen.events(0), source.events(0), strict=False):
        _same(expected, got)

    # reopen for append: the torn tail is cut off and new records follow the last good one
    out = RecordOutput(file=str(path), append=True)
    out.initialize()
    assert out.written_uids() == set(uids)
    for store in gen.events(len(uids)):
        if store.meta.uid >= len(uids) + 5:
            break
        out.event(store)
    out.flush()
    assert out.written_uids() == set(range(len(uids) + 5))
    out.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING), RecordReader(path) as reader:
        assert [r.uid for r in reader] == list(range(len(uids) + 5))
        assert reader.torn_tail is None
    assert "torn" not in caplog.text
    tail = list(RecordInput(file=str(path)).events(len(uids) - 1))
    assert len(tail) == 6
    for expected, got in zip(gen.events(len(uids) - 1), tail, strict=False):
        _same(expected, got)


def test_append_to_a_missing_or_empty_file_creates_it(tmp_path: Path) -> None:
    path = tmp_path / "new.evr"
    _write_toy(path, 2, 10, append=True)
    path2 = tmp_path / "empty.evr"
    path2.write_bytes(b"")
    _write_toy(path2, 2, 10, append=True)
    for p in (path, path2):
        assert [s.meta.uid for s in RecordInput(file=str(p)).events()] == [0, 1]


def test_append_mode_keeps_existing_records(tmp_path: Path) -> None:
    path = tmp_path / "a.evr"
    _write_toy(path, 3, 10)
    with RecordWriter(path, append=True) as w:
        assert w.written_uids() == {0, 1, 2}
        w.write_record(77, 0, b"raw")
    with RecordReader(path) as reader:
        assert [r.uid for r in reader] == [0, 1, 2, 77]


# --- corruption in the middle ----------------------------------------------------------
def _corrupt_second_record(path: Path, where: str) -> tuple[int, int]:
    with RecordReader(path) as reader:
        offsets = [r.offset for r in reader]
    data = bytearray(path.read_bytes())
    if where == "payload":
        data[offsets[1] + RECORD_HEADER_SIZE + 5] ^= 0x01
    else:
        data[offsets[1] + 10] ^= 0x01  # inside the length field
    path.write_bytes(bytes(data))
    return offsets[1], offsets[2]


@pytest.mark.parametrize("where", ["payload", "header"])
def test_damage_in_the_middle_raises_naming_file_and_offset(tmp_path: Path, where: str) -> None:
    path = tmp_path / "f.evr"
    _write_toy(path, 5, 300)
    bad, _ = _corrupt_second_record(path, where)
    with RecordReader(path) as reader, pytest.raises(CorruptRecordError) as info:
        list(reader)
    msg = str(info.value)
    assert str(path) in msg and f"at offset {bad}" in msg and "on_corrupt='skip'" in msg
    assert ("CRC mismatch (uid 1)" if where == "payload" else "damaged record header") in msg
    with pytest.raises(CorruptRecordError):
        list(RecordInput(file=str(path)).events())


@pytest.mark.parametrize("where", ["payload", "header"])
def test_skip_mode_skips_exactly_the_damaged_record(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "f.evr"
    _write_toy(path, 5, 300)
    bad, _ = _corrupt_second_record(path, where)
    with caplog.at_level(logging.WARNING), RecordReader(path, on_corrupt="skip") as reader:
        assert [r.uid for r in reader] == [0, 2, 3, 4]
        assert len(reader.problems) == 1 and f"at offset {bad}" in reader.problems[0]
        assert reader.torn_tail is None
    assert "record skipped" in caplog.text
    source = RecordInput(file=str(path), on_corrupt="skip")
    assert [s.meta.uid for s in source.events()] == [0, 2, 3, 4]


def test_reopening_a_file_damaged_in_the_middle_refuses_to_append(tmp_path: Path) -> None:
    path = tmp_path / "f.evr"
    _write_toy(path, 4, 100)
    _corrupt_second_record(path, "payload")
    with pytest.raises(OutputError, match=r"cannot append to .*payload CRC mismatch"):
        RecordWriter(path, append=True)


# --- bad input and output --------------------------------------------------------------
def test_missing_record_file_is_a_clear_input_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.evr"
    with pytest.raises(InputError, match=r"record file '.*nope\.evr' does not exist"):
        RecordInput(file=str(missing))
    with pytest.raises(InputError, match="does not exist"):
        RecordReader(missing)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is not an evflow record file: 0 bytes, no file header"),
        (b"EVFLOW", "is truncated: 6 bytes"),
        (b"root\x00\x00\x00\x00" + b"x" * 100, r"is not an evflow record file: starts with b'root"),
        (b"EVFLOWRF\x01\x00\x00\x00\x00\x00\x00\x00", r"damaged file header \(header CRC"),
    ],
)
def test_a_file_that_is_not_a_record_file_is_refused(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "bad.evr"
    path.write_bytes(content)
    with pytest.raises(CorruptRecordError, match=message):
        RecordInput(file=str(path))


def test_an_unknown_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v9.evr"
    path.write_bytes(file_header(version=9))
    with pytest.raises(InputError, match=r"format version 9; this evflow reads version\(s\) 1"):
        RecordReader(path)
    with pytest.raises(OutputError, match=r"cannot append to .*format version 9"):
        RecordWriter(path, append=True)


def test_unwritable_output_path_is_a_clear_output_error(tmp_path: Path) -> None:
    with pytest.raises(OutputError, match="no directory"):
        RecordOutput(file=str(tmp_path / "missing_dir" / "out.evr"))
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    with pytest.raises(OutputError, match="no directory"):
        RecordOutput(file=str(a_file / "out.evr"))
    with pytest.raises(OutputError, match=r"cannot open record output .* for writing"):
        RecordWriter(tmp_path)  # a directory


def test_appending_to_a_foreign_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "foreign.txt"
    path.write_text("hello world, this is not a record file")
    with pytest.raises(OutputError, match=r"cannot append to .*not an evflow record file"):
        RecordWriter(path, append=True)
    assert path.read_text().startswith("hello")  # untouched


def test_writing_after_close_raises_closed_error(tmp_path: Path) -> None:
    out = RecordOutput(file=str(tmp_path / "c.evr"))
    out.initialize()
    out.close()
    out.close()  # twice is fine
    with pytest.raises(ClosedError, match="is closed"):
        out.event(ToyGenerator(n_events=1).make_event(0))


def test_flush_makes_records_readable_while_the_writer_stays_open(tmp_path: Path) -> None:
    path = tmp_path / "live.evr"
    gen = ToyGenerator(n_events=5, payload_bytes=100)
    out = RecordOutput(file=str(path))
    out.initialize()
    for s in gen.events():
        out.event(s)
    assert os.path.getsize(path) == FILE_HEADER_SIZE  # still in the buffer
    out.flush()
    with RecordReader(path) as reader:
        assert [r.uid for r in reader] == [0, 1, 2, 3, 4]
    out.close()


def test_small_records_framed_in_groups_keep_order_bytes_and_uids(tmp_path: Path) -> None:
    """One-frame records of immutable bytes are framed in groups (after 64, or at the
    next other record, or at flush); the file is what one record at a time gives:
    every record in write order, byte for byte, and the uids known at once."""
    path = tmp_path / "mixed.evr"
    w = RecordWriter(path, fsync=False)
    arena = bytearray(b"w" * 50)  # a writable view (shared memory): copied at once
    want: list[tuple[int, int, bytes]] = []
    for uid in range(300):
        if uid % 97 == 5:
            frames: list[Any] = [memoryview(arena)]
        elif uid % 89 == 7:
            frames = [bytes(100_000)]  # large: referenced, never queued
        elif uid % 61 == 3:
            frames = [b"two", b"frames"]
        else:
            frames = [bytes([uid % 256]) * (uid % 40)]
        w.write_frames(uid, uid % 3, frames)
        want.append((uid, uid % 3, pack_frames([bytes(f) for f in frames])))
        assert uid in w.written_uids() and w.records_written == uid + 1
    arena[:] = b"x" * 50  # changed after its write: the file keeps what was written
    w.flush()
    with RecordReader(path) as reader:
        got = [(r.uid, r.flags, bytes(r.payload)) for r in reader]
    assert got == want
    with pytest.raises(ValueError, match="64 bits"):
        w.write_frames(-1, 0, [b"bad uid"])  # refused at the write, not at the flush
    w.close()
    with pytest.raises(ClosedError, match="is closed"):
        w.write_frames(1, 0, [b"late"])

"""QC objects: the codec round-trips every kind, merging follows ``+=`` and names both sides."""

from __future__ import annotations

import boost_histogram as bh
import hist
import msgpack
import numpy as np
import pytest

from evflow.errors import CodecError, IncompatibleObjectsError, NotMergeableError
from evflow.qc.objects import decode_object, encode_object, merge
from evflow.qc.recordbatch import ConcatArray, RecordBatch

rng = np.random.default_rng(7)


def _hists() -> list[object]:
    x, y, z, w = rng.random((4, 200))
    h1 = hist.Hist.new.Reg(10, 0, 1).Double()
    h1.fill(x)
    h2 = hist.Hist.new.Reg(5, 0, 1).Var([0, 0.3, 1]).Weight()
    h2.fill(x, y, weight=w)
    h3 = hist.Hist.new.Reg(4, 0, 1).Reg(3, 0, 1).Integer(0, 4).Int64()
    h3.fill(x, y, (z * 4).astype(int))
    hn = bh.Histogram(*(bh.axis.Regular(3, 0, 1) for _ in range(5)), storage=bh.storage.Double())
    hn.fill(x, y, z, w, x)
    mean = hist.Hist.new.Reg(4, 0, 1).Mean()
    mean.fill(x, sample=y)
    cat = hist.Hist.new.StrCat(["a", "b"]).Double()
    cat.fill(["a", "b", "a"])
    return [h1, h2, h3, hn, mean, cat]


@pytest.mark.parametrize("h", _hists(), ids=["1d", "2d-weight", "3d-int", "5d", "mean", "strcat"])
def test_histograms_round_trip_any_dimension_and_storage(h: object) -> None:
    back = decode_object(encode_object(h))
    assert type(back) is type(h)
    assert back == h


def test_numbers_arrays_and_record_batches_round_trip() -> None:
    assert decode_object(encode_object(42)) == 42
    assert decode_object(encode_object(2.5)) == 2.5
    arr = np.arange(12, dtype="i4").reshape(3, 4)
    assert np.array_equal(decode_object(encode_object(arr)), arr)
    rb = RecordBatch({"x": "f8", "n": "i8", "tag": "S4"}, max_rows=3)
    rb.fill(x=1.5, n=1, tag=b"a")
    rb.extend({"x": [2.0, 3.0, 4.0], "n": [2, 3, 4], "tag": [b"b", b"c", b"d"]})
    back = decode_object(encode_object(rb))
    assert back == rb and len(back) == 3 and back.dropped == 1
    cat = ConcatArray("i2", max_rows=10)
    cat.append([1, 2])
    cat.append(3)
    back = decode_object(encode_object(cat))
    assert isinstance(back, ConcatArray) and back.values.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\x01garbage",
        msgpack.packb({"qv": 99}),
        msgpack.packb({"qv": 1, "k": "zz"}),
        msgpack.packb({"qv": 1, "k": "rb", "cap": 1, "dropped": 0, "cols": [["x", "|O", b""]]}),
        msgpack.packb(
            {"qv": 1, "k": "rb", "cap": 1, "dropped": 0, "cols": [["x", "<f8", b"\x00" * 16]]}
        ),
    ],
    ids=["empty", "garbage", "version", "kind", "object-dtype", "over-cap"],
)
def test_bad_bytes_raise_codec_error_only(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode_object(data)


def test_unencodable_object_raises_codec_error() -> None:
    with pytest.raises(CodecError, match="dict"):
        encode_object({"a": 1})


def test_merge_is_iadd_for_every_kind() -> None:
    for h in _hists():
        a, b = h.copy(), h.copy()  # type: ignore[attr-defined]
        merged = merge(a, b, "h")
        assert merged is a
        assert merged == h + h  # type: ignore[operator]
    assert merge(3, 4) == 7
    arr = np.ones(3)
    assert merge(arr, np.ones(3)) is arr and arr.tolist() == [2, 2, 2]
    rb = RecordBatch({"x": "f8"})
    rb.fill(x=1.0)
    other = RecordBatch({"x": "f8"})
    other.extend({"x": [2.0, 3.0]})
    assert merge(rb, other).column("x").tolist() == [1.0, 2.0, 3.0]


def test_record_batch_cap_bounds_merged_rows_and_counts_the_rest() -> None:
    merged = RecordBatch({"x": "f8"}, max_rows=5)
    for _ in range(4):
        part = RecordBatch({"x": "f8"}, max_rows=5)
        part.extend({"x": np.arange(3.0)})
        merge(merged, part)
    assert len(merged) == 5 and merged.dropped == 7


def test_incompatible_merges_name_both_sides() -> None:
    a = hist.Hist.new.Reg(10, 0, 1, name="pt").Double()
    b = hist.Hist.new.Reg(20, 0, 1, name="pt").Double()
    with pytest.raises(IncompatibleObjectsError) as info:
        merge(a, b, "pt", ("merged", "source 'p1'"))
    text = str(info.value)
    assert "'pt'" in text and "Regular(10" in text and "Regular(20" in text
    assert "source 'p1'" in text and "other binning" in text
    with pytest.raises(IncompatibleObjectsError, match="storage"):
        merge(a, hist.Hist.new.Reg(10, 0, 1, name="pt").Weight())
    with pytest.raises(IncompatibleObjectsError, match="not both histograms"):
        merge(a, np.zeros(12))
    with pytest.raises(IncompatibleObjectsError, match="shape"):
        merge(np.zeros(3), np.zeros(4))
    with pytest.raises(IncompatibleObjectsError, match="columns"):
        merge(RecordBatch({"x": "f8"}), RecordBatch({"y": "f8"}))
    with pytest.raises(NotMergeableError, match="str"):
        merge("text", "more", "label")

"""The default event codec: round trips, zero-copy, batches, packing and hostile input."""

from __future__ import annotations

import collections
import contextlib
import enum
import math
import pickle
import random
import struct
import time
from pathlib import Path
from typing import Any

import awkward as ak
import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from evflow.errors import CodecError, ConfigurationError
from evflow.event import DataStore, EventMeta
from evflow.wire import codec
from evflow.wire.codec import (
    INLINE_MAX_BYTES,
    PickleCodec,
    decode_batch,
    decode_event,
    encode_batch,
    encode_event,
    get_codec,
    join_events,
    pack_frames,
    peek_meta,
    peek_metas,
    peek_metas_at,
    split_batch,
    unpack_frames,
    with_meta,
    with_value,
)

U64 = 2**64 - 1
I64 = 2**63

# --- strategies ------------------------------------------------------------------------
ENDIAN = "?"  # either byte order
DTYPES = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness=ENDIAN),
    hnp.unsigned_integer_dtypes(endianness=ENDIAN),
    hnp.floating_dtypes(endianness=ENDIAN),
    hnp.complex_number_dtypes(endianness=ENDIAN),
    hnp.datetime64_dtypes(endianness=ENDIAN),
    hnp.timedelta64_dtypes(endianness=ENDIAN),
    hnp.byte_string_dtypes(max_len=8),
    hnp.unicode_string_dtypes(max_len=8),
    st.just(np.dtype([("x", "<f4"), ("n", ">i2"), ("s", "S3")])),
)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)
ARRAYS = DTYPES.flatmap(lambda dt: hnp.arrays(dt, SHAPES))

metas = st.builds(
    EventMeta,
    uid=st.integers(0, U64),
    experiment=st.integers(-I64, I64 - 1),
    run=st.integers(-I64, I64 - 1),
    event=st.integers(-I64, I64 - 1),
    flags=st.integers(0, U64),
    attempt=st.integers(-I64, I64 - 1),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-I64, U64),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
jagged = st.lists(st.lists(st.floats(allow_nan=False, width=64), max_size=5), max_size=6)
names = st.text(min_size=1, max_size=12)


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (NaN-safe) including dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def frames_roundtrip(frames: list[Any]) -> list[bytes]:
    """What a receiver gets: every frame as its own bytes object."""
    return [bytes(f) for f in frames]


# --- round trips -----------------------------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(meta=metas, arr=ARRAYS, noncontig=st.booleans())
def test_numpy_arrays_of_any_dtype_and_shape_round_trip(
    meta: EventMeta, arr: np.ndarray, noncontig: bool
) -> None:
    if noncontig and arr.ndim >= 1:
        arr = arr[::-2] if arr.ndim == 1 else arr.T
    store = DataStore(meta, {"a": arr})
    out = decode_event(frames_roundtrip(encode_event(store)))
    assert out.meta == meta
    assert same_array(out["a"], arr.copy(order="C"))


@settings(max_examples=150, deadline=None)
@given(meta=metas, objs=st.dictionaries(names, values, max_size=5))
def test_plain_values_round_trip(meta: EventMeta, objs: dict[str, Any]) -> None:
    out = decode_event(frames_roundtrip(encode_event(DataStore(meta, dict(objs)))))
    assert out.meta == meta
    assert out.objects == objs


@settings(max_examples=60, deadline=None)
@given(data=jagged)
def test_awkward_jagged_arrays_round_trip(data: list[list[float]]) -> None:
    arr = ak.Array(data)
    store = DataStore(EventMeta(1), {"jets": arr, "n": len(data)})
    out = decode_event(frames_roundtrip(encode_event(store)))
    assert out["jets"].to_list() == data
    assert str(out["jets"].type) == str(arr.type)
    assert out["n"] == len(data)


def test_awkward_records_with_large_buffers_round_trip() -> None:
    n = 20000  # > INLINE_MAX_BYTES, so the buffers travel as their own frames
    arr = ak.zip({"pt": np.arange(n, dtype=np.float32), "q": np.ones(n, dtype=np.int8)})
    arr = ak.unflatten(arr, [n // 2, 0, n // 2])
    frames = encode_event(DataStore(EventMeta(9), {"mu": arr}))
    assert len(frames) == 3  # header (with the small offsets inline), pt, q
    out = decode_event(frames_roundtrip(frames))["mu"]
    assert ak.all(out.pt == arr.pt) and out.fields == ["pt", "q"]


def test_numpy_scalars_and_nested_arrays_keep_their_types() -> None:
    objs: dict[str, Any] = {
        "s": np.float32(1.5),
        "d": {"a": np.arange(3, dtype=">u2"), "b": [np.int8(-1)]},
    }
    out = decode_event(encode_event(DataStore(EventMeta(1), objs)))
    assert type(out["s"]) is np.float32 and out["s"] == np.float32(1.5)
    assert same_array(out["d"]["a"], objs["d"]["a"])
    assert type(out["d"]["b"][0]) is np.int8


def test_subclasses_of_plain_types_travel_as_their_base_type() -> None:
    class Level(enum.IntEnum):
        HIGH = 2

    objs = {"lvl": Level.HIGH, "od": collections.OrderedDict(a=1), "f": np.float64(0.5)}
    out = decode_event(encode_event(DataStore(EventMeta(1), objs)))
    assert out["lvl"] == 2 and type(out["lvl"]) is int
    assert out["od"] == {"a": 1} and out["f"] == 0.5


def test_tuples_come_back_as_lists() -> None:
    out = decode_event(encode_event(DataStore(EventMeta(1), {"t": (1, (2, 3))})))
    assert out["t"] == [1, [2, 3]]


def test_large_array_is_sent_zero_copy_and_decoded_as_read_only_view() -> None:
    arr = np.arange(INLINE_MAX_BYTES, dtype=np.float64)  # 8x the threshold
    frames = encode_event(DataStore(EventMeta(1), {"x": arr, "small": np.arange(3)}))
    assert len(frames) == 2
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), arr)  # no copy on encode
    assert np.shares_memory(decode_event(frames)["x"], arr)  # no copy on decode either
    received = frames_roundtrip(frames)
    out = decode_event(received)
    assert np.shares_memory(out["x"], np.frombuffer(received[1], np.uint8))
    assert not out["x"].flags.writeable  # a view on immutable received bytes
    with pytest.raises(ValueError, match="read-only"):
        out["x"][0] = 1.0


def test_writable_decode_copies_only_read_only_arrays() -> None:
    store = DataStore(EventMeta(1), {"small": np.arange(4.0), "big": np.arange(4000.0)})
    frames = encode_event(store)
    received = frames_roundtrip(frames)
    out = decode_event(received, writable=True)
    out["small"] += 1  # like a module in a sequential run
    out["big"] *= 2
    assert out["small"][0] == 1.0 and out["big"][1] == 2.0
    assert received == frames_roundtrip(frames)  # the received bytes stay untouched
    writable_frames = [frames[0], bytearray(frames[1])]
    out = decode_event(writable_frames, writable=True)
    assert np.shares_memory(out["big"], np.frombuffer(writable_frames[1], np.uint8))
    batch = decode_batch(frames_roundtrip(encode_batch([store, store])), writable=True)
    assert all(s["small"].flags.writeable and s["big"].flags.writeable for s in batch)


def test_small_arrays_travel_inline_in_one_frame() -> None:
    objs = {f"a{i}": np.arange(10 * i, dtype=np.int32) for i in range(10)}
    frames = encode_event(DataStore(EventMeta(3), objs))
    assert len(frames) == 1
    out = decode_event(frames)
    assert all(same_array(out[k], v) for k, v in objs.items())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(metas, st.integers(0, 3 * INLINE_MAX_BYTES // 8)), min_size=0, max_size=8)
)
def test_batch_round_trip_and_split_join(items: list[tuple[EventMeta, int]]) -> None:
    stores = [
        DataStore(m, {"x": np.arange(n, dtype=np.float64), "k": i})
        for i, (m, n) in enumerate(items)
    ]
    frames = encode_batch(stores)
    out = decode_batch(frames_roundtrip(frames))
    assert [s.meta for s in out] == [s.meta for s in stores]
    assert all(
        same_array(a["x"], b["x"]) and a["k"] == b["k"] for a, b in zip(out, stores, strict=True)
    )
    assert peek_metas(frames) == [s.meta for s in stores]
    singles = split_batch(frames)
    assert [decode_event(ev).meta for ev in singles] == [s.meta for s in stores]
    rejoined = decode_batch(join_events([encode_event(s) for s in stores]))
    assert [s.meta for s in rejoined] == [s.meta for s in stores]
    # events kept as packed buffers (ledger, record files) join without copies to bytes
    packed = [unpack_frames(pack_frames(encode_event(s))) for s in stores]
    assert [s.meta for s in decode_batch(join_events(packed))] == [s.meta for s in stores]


def test_batch_of_small_events_is_one_frame() -> None:
    stores = [DataStore(EventMeta(i), {"x": np.zeros(128)}) for i in range(100)]
    frames = encode_batch(stores)
    assert len(frames) == 1
    assert [s.meta.uid for s in decode_batch(frames)] == list(range(100))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=50), max_size=6))
def test_pack_unpack_frames_round_trip(frames: list[bytes]) -> None:
    assert [bytes(f) for f in unpack_frames(pack_frames(frames))] == frames


def test_packed_event_decodes_and_peeks() -> None:
    store = DataStore(EventMeta(77, run=3), {"x": np.arange(5000.0), "y": "hi"})
    buf = pack_frames(encode_event(store))
    assert peek_meta(unpack_frames(buf)) == store.meta
    assert same_array(decode_event(unpack_frames(buf))["x"], store["x"])


def test_events_decode_from_zmq_frames_received_without_copy() -> None:
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        for sock in (tx, rx):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
        tx.bind("inproc://codec-test")
        rx.connect("inproc://codec-test")
        store = DataStore(EventMeta(11), {"big": np.arange(50000.0), "s": np.arange(3)})
        tx.send_multipart(encode_event(store), copy=False)
        frames = rx.recv_multipart(copy=False)
        assert isinstance(frames[0], zmq.Frame)
        assert peek_meta(frames) == store.meta and peek_metas(frames) == [store.meta]
        out = decode_event(frames)
        assert same_array(out["big"], store["big"]) and same_array(out["s"], store["s"])
        assert same_array(decode_event(with_meta(frames, EventMeta(12)))["big"], store["big"])
        tx.send_multipart(PickleCodec().encode_event(store), copy=False)
        pickled = rx.recv_multipart(copy=False)
        for decoder in (decode_event, decode_batch, peek_meta, split_batch):
            with pytest.raises(CodecError, match="encoded by the pickle codec"):
                decoder(pickled)
    finally:
        tx.close(0)
        rx.close(0)
        ctx.term()


@pytest.mark.parametrize("frames", [[None], [1], None, 5, [object()]])
def test_non_buffer_frames_raise_codec_error(frames: Any) -> None:
    for decoder in (decode_event, decode_batch, peek_meta, peek_metas, split_batch):
        with pytest.raises(CodecError):
            decoder(frames)


def test_with_meta_rewrites_only_the_header() -> None:
    store = DataStore(EventMeta(5, run=2), {"x": np.arange(5000.0), "s": "a"})
    frames = encode_event(store)
    new = with_meta(frames, EventMeta(5, run=2, flags=1, attempt=3))
    assert new[1] is frames[1]
    out = decode_event(new)
    assert out.meta == EventMeta(5, run=2, flags=1, attempt=3)
    assert out["s"] == "a" and same_array(out["x"], store["x"])


def test_pickle_codec_round_trips_any_object_and_default_codec_refuses_it() -> None:
    pc = PickleCodec()
    store = DataStore(EventMeta(4), {"obj": {1, 2, 3}, "x": np.arange(100000)})
    frames = pc.encode_event(store)
    out = pc.decode_event(frames)
    assert out["obj"] == {1, 2, 3} and same_array(out["x"], store["x"])
    with pytest.raises(CodecError, match="pickle codec; the default codec never unpickles"):
        decode_event(frames)


def test_get_codec_chooses_by_name_and_refuses_unknown_names() -> None:
    store = DataStore(EventMeta(8), {"x": np.arange(3)})
    for name in ("msgpack", "pickle"):
        chosen = get_codec(name)
        assert chosen.name == name
        assert same_array(chosen.decode_event(chosen.encode_event(store))["x"], store["x"])
        assert len(chosen.decode_batch(chosen.encode_batch([store, store]))) == 2
    with pytest.raises(ConfigurationError, match="unknown codec 'json'"):
        get_codec("json")


# --- bad input to the encoder ----------------------------------------------------------
@pytest.mark.parametrize(
    ("obj", "match"),
    [
        (np.array([object()]), "Python objects"),
        ({1, 2}, "cannot encode object 'bad' of type builtins.set"),
        (2**64, "cannot encode integer 18446744073709551616: out of the range"),
        ([1, object()], "cannot encode a builtins.object"),
        (np.ma.masked_array([1, 2]), "cannot encode object 'bad'"),
        (np.arange(2).view(np.recarray), "cannot encode object 'bad' of type numpy.rec.recarray"),
    ],
)
def test_unencodable_objects_raise_codec_error_naming_the_problem(obj: Any, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        encode_event(DataStore(EventMeta(1), {"bad": obj}))


@pytest.mark.parametrize(
    "meta", [EventMeta(2**64), EventMeta(-1), EventMeta(1, run=2**63), EventMeta(1, flags=-1)]
)
def test_meta_out_of_range_raises_codec_error(meta: EventMeta) -> None:
    with pytest.raises(CodecError, match=r"cannot encode event meta.*unsigned 64-bit"):
        encode_event(DataStore(meta))


# --- hostile frames --------------------------------------------------------------------
def header(*fields: Any) -> bytes:
    packed: bytes = msgpack.packb(list(fields))
    return packed


META = struct.pack("<QqqqQq", 1, 0, 0, 0, 0, 1)
FLOAT_FORM = '{"class": "NumpyArray", "primitive": "float64", "form_key": "n"}'
EMPTY_RECORDS = '{"class": "RecordArray", "fields": [], "contents": []}'


def ev(*entries: Any) -> bytes:
    """A version-1 single-event header with ``entries``."""
    return header(1, 0, META, list(entries))


def ext(code: int, *fields: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(list(fields)))


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "no frames"),
        ([b"\xc1"], "not valid msgpack"),
        ([b"\x01"], "not a codec header"),
        ([header(2, 0, META, [])], "unknown codec format version 2"),
        ([header(True, 0, META, [])], "unknown codec format version"),
        ([header(1, 1, [], [])], "batch of events; use decode_batch"),
        ([header(1, 7, META, [])], "bad event header: kind 7"),
        ([header(1, 0, [1, 2], [])], "bad event meta"),
        ([header(1, 0, META[:-1], [])], "expected 48 bytes"),
        ([header(1, 0, [1, 0, 0, 0, 0, 1.5], [])], "bad event meta"),
        ([header(1, 0, META, {})], "entries are not a list"),
        ([header(1, 0, META, [[1, 0, 2]])], "bad object entry"),
        ([header(1, 0, META, [["x", 9, 2]])], "bad object entry"),
        ([header(1, 0, META, [["x", 1, "O", [1], b"\0" * 8]])], "Python objects"),
        ([header(1, 0, META, [["x", 1, "<f8,O", [1], b"\0" * 16]])], "Python objects"),
        ([header(1, 0, META, [["x", 1, "[('a', '|O')]", [1], b"\0" * 8]])], "Python objects"),
        ([header(1, 0, META, [["x", 1, "nonsense", [1], b"\0"]])], "bad dtype"),
        ([header(1, 0, META, [["x", 1, 5, [1], b"\0"]])], "bad dtype"),
        ([header(1, 0, META, [["x", 1, "<f8", [2], b"\0" * 8]])], "needs 16 bytes"),
        ([header(1, 0, META, [["x", 1, "<f8", [2**62, 2**62], b""]])], "size mismatch"),
        ([header(1, 0, META, [["x", 1, "<f8", [-1], b""]])], "bad shape"),
        ([header(1, 0, META, [["x", 1, "<f8", [1] * 65, b"\0" * 8]])], "bad shape"),
        ([header(1, 0, META, [["x", 1, "<f8", "ab", b"\0" * 8]])], "bad shape"),
        ([header(1, 0, META, [["x", 1, "V0", [2**40], b""]])], "zero-size dtype"),
        ([header(1, 0, META, [["x", 1, "<f8", [1], 1]])], "expected frame 1 of 0"),
        ([header(1, 0, META, [["x", 1, "<f8", [1], 2]]), b"\0" * 8], "expected frame 1 of 1"),
        ([header(1, 0, META, []), b"extra"], "1 buffer frames but its header uses 0"),
        ([header(1, 0, META, [["x", 1, "<f8", [1], None]])], "bad buffer reference"),
        ([header(1, 0, META, [["j", 2, "{", 1, []]])], "does not decode"),
        ([header(1, 0, META, [["j", 2, "{}", -1, []]])], "length -1"),
        (
            [
                header(
                    1,
                    0,
                    META,
                    [
                        [
                            "j",
                            2,
                            '{"class": "NumpyArray", "primitive": "float64", "form_key": "n"}',
                            10,
                            [["n-data", b"\0" * 8]],
                        ]
                    ],
                )
            ],
            "does not decode",
        ),
        ([header(1, 0, META, [])[:-1] + msgpack.packb(msgpack.ExtType(1, b"\x01"))], "extension"),
        ([header(1, 0, META, [["v", 0, msgpack.ExtType(9, b"")]])], "unknown msgpack extension"),
        (
            [
                header(
                    1,
                    0,
                    META,
                    [["v", 0, msgpack.ExtType(1, msgpack.packb(["|O", [1], b"\0" * 8]))]],
                )
            ],
            "Python objects",
        ),
        (
            [header(1, 0, META, [["v", 0, msgpack.ExtType(2, msgpack.packb(["<f8", b"\0"]))]])],
            "needs 8 bytes",
        ),
        ([pickle.dumps({"a": 1})], "not valid msgpack"),
    ],
)
def test_malformed_event_frames_raise_codec_error(frames: list[Any], match: str) -> None:
    with pytest.raises(CodecError, match=match):
        decode_event(frames)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([header(1, 0, META, [])], "single event, not a batch"),
        ([header(1, 1, [b"x"], [])], "do not match"),
        ([header(1, 1, [b"x"], [-1])], "frame count -1"),
        ([header(1, 1, [b"x"], [1])], "lists 1 buffer frames, message has 0"),
        ([header(1, 1, [5], [0])], "event header is not bytes"),
        ([header(1, 1, [header(1, 1, [], [])], [0])], "batch of events"),
    ],
)
def test_malformed_batches_raise_codec_error(frames: list[Any], match: str) -> None:
    with pytest.raises(CodecError, match=match):
        decode_batch(frames)


@pytest.mark.parametrize(
    ("buf", "match"),
    [
        (b"", "too short"),
        (b"\xff\xff\xff\xff", "claim 4294967295 frames"),
        (b"\x01\0\0\0" + (5).to_bytes(8, "little") + b"abc", "add up to 5 bytes, buffer has 3"),
        (b"\x00\0\0\0extra", "add up to 0 bytes, buffer has 5"),
        (12, "cannot read packed frames from int"),
    ],
)
def test_malformed_packed_frames_raise_codec_error(buf: Any, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        unpack_frames(buf)


def test_peek_meta_and_with_meta_refuse_batches() -> None:
    frames = encode_batch([DataStore(EventMeta(1))])
    with pytest.raises(CodecError, match=r"use peek_metas for batches.*these are a batch"):
        peek_meta(frames)
    with pytest.raises(CodecError, match="with_meta needs a single event's frames"):
        with_meta(frames, EventMeta(2))
    with pytest.raises(CodecError, match="unknown codec format version 3"):
        peek_meta([header(3, 0, META, [])])
    with pytest.raises(CodecError, match="bad event meta"):
        peek_meta([header(1, 0, [-5, 0, 0, 0, 0, 1], [])])


# --- fuzzing ---------------------------------------------------------------------------
def _corpus() -> list[list[bytes]]:
    stores = [
        DataStore(EventMeta(1), {}),
        DataStore(EventMeta(2, 1, 2, 3), {"x": np.arange(4, dtype="<f4"), "s": "txt", "n": 3}),
        DataStore(EventMeta(3), {"m": np.arange(6, dtype=">i2").reshape(2, 3), "d": {"a": [1]}}),
        DataStore(EventMeta(4), {"j": ak.Array([[1.0], [], [2.0, 3.0]]), "b": b"\x00\x01"}),
        DataStore(EventMeta(5), {"big": np.arange(INLINE_MAX_BYTES // 4 + 8, dtype=np.int32)}),
        DataStore(EventMeta(6), {"sc": np.float64(2.5), "nd": {"a": np.arange(3)}}),
    ]
    corpus = [frames_roundtrip(encode_event(s)) for s in stores]
    corpus.append(frames_roundtrip(encode_batch(stores[:3])))
    return corpus


def mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """A random structural or byte-level mutation of a valid message."""
    frames = list(frames)
    op = rng.randrange(8)
    if op == 0 and frames:  # drop a frame
        del frames[rng.randrange(len(frames))]
    elif op == 1:  # duplicate or add a random frame
        frames.insert(rng.randrange(len(frames) + 1), rng.randbytes(rng.randrange(20)))
    elif op == 2 and frames:  # truncate a frame
        i = rng.randrange(len(frames))
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    else:  # flip, set or insert bytes inside a frame (mostly the header)
        i = 0 if rng.random() < 0.8 or len(frames) < 2 else rng.randrange(len(frames))
        if not frames:
            return [rng.randbytes(8)]
        b = bytearray(frames[i])
        for _ in range(rng.randrange(1, 4)):
            if not b:
                b.append(rng.randrange(256))
            pos = rng.randrange(len(b))
            kind = rng.randrange(3)
            if kind == 0:
                b[pos] ^= 1 << rng.randrange(8)
            elif kind == 1:
                b[pos] = rng.choice((0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xCF, 0xD3, 0xDC, 0xFF))
            else:
                b[pos:pos] = rng.randbytes(rng.randrange(1, 4))
        frames[i] = bytes(b)
    return frames


def test_fuzz_decode_event_raises_only_codec_error() -> None:
    """10^5 random and mutated inputs: nothing but CodecError may escape the decoders."""
    rng = random.Random(20261122)
    corpus = _corpus()
    n_inputs = 100_000
    decoded = 0
    cpu0_s = time.process_time()  # CPU time: what the machine's load does not stretch
    for i in range(n_inputs):
        if i % 4 == 0:
            frames = [rng.randbytes(rng.randrange(40)) for _ in range(rng.randrange(4))]
        else:
            frames = mutate(rng, rng.choice(corpus))
            if rng.random() < 0.3:
                frames = mutate(rng, frames)
            if i % 5 == 0:  # what recv_multipart(copy=False) + .buffer would give
                frames = [memoryview(f) for f in frames]  # type: ignore[misc]
        for decoder in (decode_event, decode_batch, peek_meta):
            try:
                decoder(frames)
                decoded += 1
            except CodecError:
                pass
        if i % 8 == 0:
            with contextlib.suppress(CodecError):
                unpack_frames(rng.choice((pack_frames(frames), rng.randbytes(30))))
    cpu_s = time.process_time() - cpu0_s
    assert decoded > 0  # the mutations do not only produce garbage
    assert cpu_s < 60, f"fuzzing {n_inputs} inputs took {cpu_s:.1f} s of CPU"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_frames_never_raise_anything_but_codec_error(frames: list[bytes]) -> None:
    for decoder in (decode_event, decode_batch, peek_meta, peek_metas):
        with contextlib.suppress(CodecError):
            decoder(frames)


def test_non_string_object_names_are_refused_when_encoding() -> None:
    store = DataStore(EventMeta(1))
    store.objects[3] = 1  # type: ignore[index]  # bypasses DataStore's own check
    with pytest.raises(CodecError, match="cannot encode object name 3: names are strings"):
        encode_event(store)


def test_module_exports_the_interface_names() -> None:
    for name in ("encode_event", "decode_event", "encode_batch", "decode_batch"):
        assert callable(getattr(codec, name))
    for name in ("pack_frames", "unpack_frames", "peek_meta"):
        assert callable(getattr(codec, name))
    assert not math.isnan(codec.CODEC_VERSION)


# --- old formats keep loading ----------------------------------------------------------
DATA = Path(__file__).parent / "data"


def fixture_store(uid: int) -> DataStore:
    """The store that tests/data/codec_v1_*.bin were written from (never change it)."""
    meta = EventMeta(uid, experiment=1, run=42, event=7, flags=1, attempt=2)
    objects = {
        "small": np.arange(6, dtype="<i4").reshape(2, 3),
        "large": np.linspace(0, 1, 3000, dtype=">f8"),
        "jets": ak.Array([[1.5, 2.5], [], [3.5]]),
        "n": 3,
        "name": "muon",
        "cfg": {"cut": 0.5, "ids": [1, 2]},
        "sc": np.float32(2.5),
    }
    return DataStore(meta, objects)


def assert_same_store(got: DataStore, want: DataStore) -> None:
    assert got.meta == want.meta
    assert list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert same_array(got[key], value)
        elif isinstance(value, ak.Array):
            assert got[key].to_list() == value.to_list()
        else:
            assert got[key] == value and type(got[key]) is type(value)


def test_codec_version_1_fixture_files_still_decode() -> None:
    event = decode_event(unpack_frames((DATA / "codec_v1_event.bin").read_bytes()))
    assert_same_store(event, fixture_store(2**64 - 1))
    batch = decode_batch(unpack_frames((DATA / "codec_v1_batch.bin").read_bytes()))
    assert len(batch) == 2
    for got, uid in zip(batch, (1, 2), strict=True):
        assert_same_store(got, fixture_store(uid))


def test_with_value_adds_a_plain_object_and_keeps_the_buffers() -> None:
    store = DataStore(EventMeta(5), {"big": np.arange(100_000.0), "n": 3})
    frames = encode_event(store)
    noted = with_value(frames, "why", "signal 11")
    back = decode_event(noted)
    assert back["why"] == "signal 11" and back["n"] == 3
    assert same_array(back["big"], store["big"]) and noted[1] is frames[1]
    again = decode_event(with_value(noted, "why", "timeout"))
    assert again["why"] == "timeout" and list(again) == ["big", "n", "why"]


def test_with_value_refuses_arrays_and_batches() -> None:
    frames = encode_event(DataStore(EventMeta(5), {"n": 3}))
    with pytest.raises(CodecError, match="number, string or bytes"):
        with_value(frames, "a", [1, 2])
    batch = encode_batch([DataStore(EventMeta(1)), DataStore(EventMeta(2))])
    with pytest.raises(CodecError):
        with_value(batch, "why", "x")


def test_peek_metas_at_reads_the_metas_of_packed_headers() -> None:
    metas = [
        EventMeta(uid=2**64 - 1 - i, experiment=3, run=-4, event=i, attempt=2) for i in range(5)
    ]
    heads = [bytes(encode_event(DataStore(m, {"x": i}))[0]) for i, m in enumerate(metas)]
    filler = b"\x00" * 7  # headers need not be adjacent
    blob = b"".join(h + filler for h in heads)
    lengths = np.array([len(h) for h in heads])
    offsets = np.cumsum(lengths + len(filler)) - lengths - len(filler)
    assert peek_metas_at(memoryview(blob), offsets, lengths) == metas
    assert peek_metas_at(blob, offsets[:0], lengths[:0]) == []


def test_peek_metas_at_names_the_first_bad_header() -> None:
    head = bytes(encode_event(DataStore(EventMeta(1)))[0])
    blob = head + b"\x95" + head[1:] + head
    n = len(head)
    with pytest.raises(CodecError, match="event 1 of the batch: not a single-event header"):
        peek_metas_at(blob, np.array([0, n, 2 * n]), np.array([n, n, n]))
    with pytest.raises(CodecError, match="too short or out of range"):
        peek_metas_at(blob, np.array([0, 3 * n]), np.array([n, n]))
    with pytest.raises(CodecError, match="event 1 of the batch: header frame too short"):
        peek_metas_at(blob, np.array([0, n]), np.array([n, 10]))

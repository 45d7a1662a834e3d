"""numpy arrays <-> raw bytes for the codec, with the checks that make decoding safe.

Private helper of :mod:`evflow.wire.codec`. Every function that reads untrusted input
raises :class:`CodecError` on anything unexpected: object dtypes are refused, shapes
must be lists of non-negative ints, and the byte count must match dtype and shape
exactly (so a header cannot make us allocate more than the bytes we received).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from evflow.errors import CodecError

# numpy allows at most 64 dimensions; more is a malformed header.
MAX_NDIM = 64
# Element-count ceiling for zero-itemsize dtypes (the only case where bytes received
# do not bound the allocation).
MAX_ELEMENTS = 1 << 32
# msgpack ext type codes for numpy objects nested inside plain values (dicts, lists).
EXT_NDARRAY = 1
EXT_NPSCALAR = 2

# Decoding: dtype string -> dtype. Only valid, object-free dtypes are cached, and the
# cache is bounded so that a peer sending endless distinct strings cannot grow it.
_DTYPES: dict[str, np.dtype[Any]] = {}
_DTYPE_CACHE_MAX = 512
# Encoding: dtype -> its string (dtype.str costs ~0.5 µs; a dict hit ~50 ns).
_DTYPE_STRS: dict[np.dtype[Any], str] = {}


def dtype_str(dt: np.dtype[Any]) -> str:
    """The header string of a dtype (``dtype.str``, or ``descr`` for structured ones)."""
    s = _DTYPE_STRS.get(dt)
    if s is None:
        if dt.hasobject:
            raise CodecError(
                f"cannot encode an array of dtype {dt} (Python objects); the safe codec "
                "carries only numeric, string and plain structured dtypes"
            )
        # dtype.str loses field names of structured dtypes; descr keeps them.
        s = dt.str if dt.fields is None else repr(dt.descr)
        if len(_DTYPE_STRS) < _DTYPE_CACHE_MAX:
            _DTYPE_STRS[dt] = s
    return s


def parse_dtype(s: object) -> np.dtype[Any]:
    """The dtype named by a header string; refuses object dtypes and garbage."""
    dt = _DTYPES.get(s) if type(s) is str else None
    if dt is not None:
        return dt
    if type(s) is not str or len(s) > 4096:
        raise CodecError(f"bad dtype in header: expected a dtype string, got {s!r:.80}")
    try:
        dt = np.dtype(_parse_descr(s)) if s.startswith("[") else np.dtype(s)
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"bad dtype in header: {s!r:.80} ({exc})") from None
    if dt.hasobject:
        raise CodecError(f"refusing dtype {s!r:.80} from the wire: it holds Python objects")
    if len(_DTYPES) < _DTYPE_CACHE_MAX:
        _DTYPES[s] = dt
    return dt


def _parse_descr(s: str) -> list[Any]:
    """A structured dtype's ``repr(descr)``, parsed without eval (literals only)."""
    import ast

    try:
        descr = ast.literal_eval(s)
    except Exception as exc:
        raise CodecError(f"bad structured dtype in header: {s!r:.80} ({exc})") from None
    if not isinstance(descr, list):
        raise CodecError(f"bad structured dtype in header: {s!r:.80}")
    return descr


def check_shape(shape: object) -> tuple[int, int]:
    """Validate a header shape; return (element count, ndim)."""
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise CodecError(f"bad shape in header: expected a list of <= 64 ints, got {shape!r:.80}")
    count = 1
    for n in shape:
        if type(n) is not int or n < 0:
            raise CodecError(f"bad shape in header: {shape!r:.80} (dimensions are ints >= 0)")
        count *= n
    return count, len(shape)


def array_from_buffer(dt: np.dtype[Any], shape: Any, buf: Any) -> np.ndarray:
    """A (possibly read-only) array viewing ``buf``; the size must match exactly."""
    if type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0:
        count, ndim = shape[0], 1  # the common case, checked inline
    else:
        count, ndim = check_shape(shape)
    itemsize = dt.itemsize
    nbytes = len(buf) if type(buf) is bytes else memoryview(buf).nbytes
    if itemsize == 0:
        if nbytes != 0 or count > MAX_ELEMENTS:
            raise CodecError(f"bad array: {count} elements of zero-size dtype {dt}")
        return np.zeros(shape, dt)
    if count * itemsize != nbytes:
        raise CodecError(
            f"array size mismatch: shape {shape} of {dt} needs {count * itemsize} bytes, "
            f"the frame has {nbytes}"
        )
    try:
        arr = np.frombuffer(buf, dt, count)
    except Exception as exc:
        raise CodecError(f"cannot view {nbytes} bytes as {dt}: {exc}") from None
    return arr if ndim == 1 else arr.reshape(shape)


def as_bytes_view(arr: np.ndarray) -> memoryview:
    """A flat, zero-copy byte view of a C-contiguous array (copies if it is not)."""
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8).data


def ext_default(obj: Any) -> Any:
    """msgpack ``default`` hook: numpy arrays and scalars nested inside plain values."""
    if type(obj) is np.ndarray:
        packed = msgpack.packb([dtype_str(obj.dtype), list(obj.shape), obj.tobytes()])
        return msgpack.ExtType(EXT_NDARRAY, packed)
    if isinstance(obj, np.generic):
        packed = msgpack.packb([dtype_str(obj.dtype), obj.tobytes()])
        return msgpack.ExtType(EXT_NPSCALAR, packed)
    if isinstance(obj, int):
        raise CodecError(f"cannot encode integer {obj}: out of the range [-2**63, 2**64-1]")
    raise CodecError(
        f"cannot encode a {type(obj).__module__}.{type(obj).__qualname__}; the codec carries "
        "numpy arrays, awkward arrays, scalars, strings, bytes and dicts/lists of those"
    )


def ext_hook(code: int, data: bytes) -> Any:
    """msgpack ``ext_hook``: the inverse of :func:`ext_default`, validating everything."""
    if code not in (EXT_NDARRAY, EXT_NPSCALAR):
        raise CodecError(f"unknown msgpack extension type {code} in event header")
    try:
        fields = msgpack.unpackb(data)
    except Exception as exc:
        raise CodecError(f"bad numpy extension value: {exc}") from None
    if code == EXT_NDARRAY and type(fields) is list and len(fields) == 3:
        dt = parse_dtype(fields[0])
        raw = fields[2]
        if type(raw) is not bytes:
            raise CodecError("bad numpy extension value: data is not bytes")
        return array_from_buffer(dt, fields[1], raw)
    if code == EXT_NPSCALAR and type(fields) is list and len(fields) == 2:
        dt = parse_dtype(fields[0])
        raw = fields[1]
        if type(raw) is not bytes or len(raw) != dt.itemsize:
            raise CodecError(f"bad numpy scalar: {dt} needs {dt.itemsize} bytes")
        if dt.itemsize == 0:
            return np.zeros((), dt)[()]
        return np.frombuffer(raw, dt, 1)[0]
    raise CodecError(f"unknown msgpack extension type {code} in event header")

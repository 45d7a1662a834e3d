"""QC objects on the wire and in the repository: a safe, versioned codec (no pickle).

``encode_object(obj) -> bytes`` and ``decode_object(data) -> obj`` are the contract
the producers, mergers, repository and viewer share. Histograms (hist and
boost-histogram, any dimension and storage) travel as their UHI description with the
arrays as raw buffers; numpy arrays and plain numbers as themselves.
"""

from __future__ import annotations

from typing import Any

import msgpack

from evflow.errors import CodecError, ConfigurationError
from evflow.processing.parallel.persist import decode_persistent, encode_persistent

OBJECT_FORMAT_VERSION = 1
_NAME = "o"


def encode_object(obj: Any) -> bytes:
    """One QC object as bytes; raises CodecError for a type that cannot travel safely."""
    header, frames, skipped = encode_persistent({_NAME: obj})
    if skipped:
        raise CodecError(f"QC object of type {type(obj).__name__} cannot be encoded")
    blobs = [bytes(f) for f in frames]
    return msgpack.packb({"qv": OBJECT_FORMAT_VERSION, "h": header, "f": blobs})


def decode_object(data: bytes | memoryview) -> Any:
    """Inverse of ``encode_object``; raises CodecError for bytes that are not one."""
    try:
        outer = msgpack.unpackb(data)
        if not isinstance(outer, dict) or outer.get("qv") != OBJECT_FORMAT_VERSION:
            version = outer.get("qv") if isinstance(outer, dict) else None
            raise CodecError(
                f"QC object in format version {version!r}, "
                f"this evflow reads version {OBJECT_FORMAT_VERSION}"
            )
        return decode_persistent(outer["h"], list(outer["f"]))[_NAME]
    except CodecError:
        raise
    except (ValueError, KeyError, TypeError, ConfigurationError, msgpack.UnpackException) as exc:
        raise CodecError(f"not a QC object: {exc}") from None

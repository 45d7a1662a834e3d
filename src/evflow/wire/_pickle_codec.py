"""The opt-in pickle codec: any picklable object, for runs on ONE host only.

Unpickling runs arbitrary code chosen by whoever wrote the bytes, so this codec must
never decode data that came over a network socket from another host. Use it only when
every process of the run is a fork of the same zygote on the same machine (ipc or
inproc transports) and modules put objects into the store that the default codec
cannot carry. Frames: ``[PICKLE_MAGIC, pickle (protocol 5), *out-of-band buffers]``.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Sequence
from typing import Any

from evflow.errors import CodecError
from evflow.event import DataStore, EventMeta

# 0xc1 is never used by msgpack, so the default codec recognises (and refuses) these.
PICKLE_MAGIC = b"\xc1EVFLOW-PICKLE-1"


class PickleCodec:
    """Same-host codec with the default codec's interface; never use it across hosts."""

    name = "pickle"

    def encode_event(self, store: DataStore) -> list[Any]:
        return self.encode_batch([store])

    def decode_event(self, frames: Sequence[Any]) -> DataStore:
        stores = self.decode_batch(frames)
        if len(stores) != 1:
            raise CodecError(f"expected one event, the frames hold {len(stores)}")
        return stores[0]

    def encode_batch(self, stores: Iterable[DataStore]) -> list[Any]:
        buffers: list[Any] = []
        items = [(tuple(s.meta.as_dict().values()), s.objects) for s in stores]
        try:
            body = pickle.dumps(items, protocol=5, buffer_callback=buffers.append)
        except Exception as exc:
            raise CodecError(f"cannot pickle event: {exc}") from None
        return [PICKLE_MAGIC, body, *(b.raw() for b in buffers)]

    def decode_batch(self, frames: Sequence[Any]) -> list[DataStore]:
        if len(frames) < 2 or bytes(frames[0]) != PICKLE_MAGIC:
            raise CodecError("frames were not encoded by the pickle codec")
        try:
            items = pickle.loads(frames[1], buffers=frames[2:])
            return [DataStore(EventMeta(*meta), objects) for meta, objects in items]
        except Exception as exc:
            raise CodecError(f"pickled event does not load: {exc}") from None

"""A worker's event: meta read at once, objects decoded only when a module asks.

Decoding a 1 kB event costs a worker ~5 µs; a module that looks only at the meta (or
at nothing: filters on counters, no-op or pure-CPU modules) never needs it. A
:class:`LazyEvent` reads the meta from the fixed-offset header bytes (``peek_meta``,
< 1 µs) and decodes the rest on the first access to any object. An event no module
opened is forwarded as the frames it arrived in (:func:`untouched`).

Decoding still validates every byte it uses (``CodecError`` on bad frames, from the
module's first access instead of before the path); frames nobody opens are passed on
unread, as the worker already did for events the modules left unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from evflow.processing.datastore import DataStore, EventMeta
from evflow.wire.codec import decode_event, peek_meta


class LazyEvent(DataStore):
    """A ``DataStore`` over encoded frames; the objects are decoded on first use."""

    __slots__ = ("_before", "_frames")

    def __init__(self, frames: Sequence[Any], meta: EventMeta | None = None) -> None:
        # the worker passes the meta it read for the whole batch at once
        self.meta = peek_meta(frames) if meta is None else meta
        self.persistent = {}
        self._frames: Sequence[Any] | None = frames
        self._objects = None  # type: ignore[assignment]
        self._before: list[tuple[str, Any]] = []

    def load(self) -> None:
        """Decode the objects now (``EVFLOW_NO_FASTPATH``: workers decode every event)."""
        self._load()

    def _load(self) -> dict[str, Any]:
        objects = self._objects
        if objects is None:
            assert self._frames is not None
            objects = self._objects = decode_event(self._frames).objects
            self._before = list(objects.items())  # what untouched() compares against
            self._frames = None
        return objects

    @property
    def loaded(self) -> bool:
        """Whether a module asked for the objects (they were decoded)."""
        return self._objects is not None

    def __getitem__(self, key: str) -> Any:
        self._load()
        return DataStore.__getitem__(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        self._load()
        DataStore.__setitem__(self, key, value)

    def __delitem__(self, key: str) -> None:
        self._load()
        DataStore.__delitem__(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def __contains__(self, key: object) -> bool:
        return key in self._load()

    @property
    def objects(self) -> dict[str, Any]:
        return self._load()

    def __repr__(self) -> str:
        return f"<DataStore uid={self.meta.uid} objects={sorted(self._load())}>"


def untouched(store: LazyEvent) -> bool:
    """True when the modules left the objects as received (never opened, or unchanged).

    Decoded arrays are read-only views, so identity is enough for them; dicts and
    lists could have been changed in place, so a store holding one counts as changed.
    """
    objects = store._objects
    if objects is None:
        return True
    before = store._before
    if len(objects) != len(before):
        return False
    get = objects.get
    for key, value in before:
        if get(key) is not value or isinstance(value, dict | list):
            return False
    return True

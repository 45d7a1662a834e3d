"""Record batches: columns appended like a TTree's branches, with a size cap.

``RecordBatch`` holds named numpy columns of one length; merging appends the other's
rows. ``max_rows`` bounds memory: rows beyond it are not kept but counted in
``dropped``, so a merger that collects them from 500 producers stays bounded and says
how much it left out. ``ConcatArray`` is the one-column case (a numpy array that
grows by concatenation instead of being added element-wise).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from evflow.errors import ConfigurationError, IncompatibleObjectsError

#: dtype kinds a column may have: numbers, booleans, fixed-size bytes and text
COLUMN_KINDS = "biufcSU"


def _dtype(name: str, spec: Any) -> np.dtype[Any]:
    try:
        dt = np.dtype(spec)
    except TypeError as exc:
        raise ConfigurationError(f"record-batch column {name!r}: bad dtype {spec!r}") from exc
    if dt.kind not in COLUMN_KINDS or dt.fields is not None:
        raise ConfigurationError(
            f"record-batch column {name!r}: dtype {dt} is not a plain number, bool or string"
        )
    return dt


class RecordBatch:
    """Columns of equal length, appended to up to ``max_rows`` rows (the rest is counted)."""

    __slots__ = ("_columns", "_pending", "dropped", "max_rows", "schema")

    def __init__(self, schema: Mapping[str, Any], max_rows: int = 100_000) -> None:
        if max_rows < 0:
            raise ConfigurationError(f"record batch: max_rows must be >= 0, got {max_rows}")
        if not schema:
            raise ConfigurationError("record batch: needs at least one column")
        self.schema: dict[str, np.dtype[Any]] = {str(k): _dtype(k, v) for k, v in schema.items()}
        self.max_rows = int(max_rows)
        self.dropped = 0
        self._columns: dict[str, np.ndarray] = {
            k: np.empty(0, dtype=dt) for k, dt in self.schema.items()
        }
        # rows filled one by one wait here as Python lists (a numpy append per row is slow)
        self._pending: dict[str, list[Any]] = {k: [] for k in self.schema}

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}:{dt}" for k, dt in self.schema.items())
        return f"<{type(self).__name__} [{cols}] rows={len(self)} dropped={self.dropped}>"

    def __len__(self) -> int:
        first = next(iter(self.schema))
        return len(self._columns[first]) + len(self._pending[first])

    # --- filling -------------------------------------------------------------------------
    def fill(self, **row: Any) -> None:
        """Append one row (every column by name)."""
        if row.keys() != self.schema.keys():
            raise ConfigurationError(
                f"record batch: row has columns {sorted(row)}, expected {sorted(self.schema)}"
            )
        if len(self) >= self.max_rows:
            self.dropped += 1
            return
        for k, v in row.items():
            self._pending[k].append(v)

    def extend(self, columns: Mapping[str, Any], dropped: int = 0) -> None:
        """Append many rows given as arrays of equal length (beyond the cap: counted)."""
        if columns.keys() != self.schema.keys():
            raise IncompatibleObjectsError(
                f"record batch: columns {sorted(columns)} cannot be appended to "
                f"columns {sorted(self.schema)}"
            )
        arrays = {k: np.asarray(v) for k, v in columns.items()}
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) > 1:
            raise IncompatibleObjectsError(f"record batch: columns of unequal lengths {lengths}")
        n = lengths.pop() if lengths else 0
        room = max(0, self.max_rows - len(self))
        take = min(n, room)
        self.dropped += int(dropped) + (n - take)
        if take == 0:
            return
        self._flush()
        for k, a in arrays.items():
            if a.dtype != self.schema[k] and not np.can_cast(a.dtype, self.schema[k], "same_kind"):
                raise IncompatibleObjectsError(
                    f"record batch column {k!r}: {a.dtype} cannot be appended to {self.schema[k]}"
                )
            self._columns[k] = np.concatenate([self._columns[k], a[:take].astype(self.schema[k])])

    def _flush(self) -> None:
        if not self._pending[next(iter(self.schema))]:
            return
        for k, dt in self.schema.items():
            new = np.asarray(self._pending[k], dtype=dt)
            self._columns[k] = np.concatenate([self._columns[k], new])
            self._pending[k] = []

    def column(self, name: str) -> np.ndarray:
        """One column as an array (all rows kept so far)."""
        self._flush()
        return self._columns[name]

    def columns(self) -> dict[str, np.ndarray]:
        self._flush()
        return dict(self._columns)

    # --- merging -------------------------------------------------------------------------
    def compatible(self, other: Any) -> bool:
        return type(other) is type(self) and other.schema == self.schema

    def __iadd__(self, other: Any) -> RecordBatch:
        if not self.compatible(other):
            raise IncompatibleObjectsError(
                f"cannot append {other!r} to {self!r} (other type or columns)"
            )
        self.extend(other.columns(), dropped=other.dropped)
        return self

    def __add__(self, other: Any) -> RecordBatch:
        out = self.copy()
        out += other
        return out

    def __radd__(self, other: Any) -> RecordBatch:
        if isinstance(other, int) and other == 0:  # sum() starts from 0
            return self.copy()
        return NotImplemented

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RecordBatch) or not self.compatible(other):
            return False
        mine, theirs = self.columns(), other.columns()
        return self.dropped == other.dropped and all(
            np.array_equal(mine[k], theirs[k]) for k in mine
        )

    __hash__ = None  # type: ignore[assignment]

    def empty_like(self) -> RecordBatch:
        out = object.__new__(type(self))
        out.schema = dict(self.schema)
        out.max_rows = self.max_rows
        out.dropped = 0
        out._columns = {k: np.empty(0, dtype=dt) for k, dt in self.schema.items()}
        out._pending = {k: [] for k in self.schema}
        return out

    def copy(self) -> RecordBatch:
        out = self.empty_like()
        out._columns = {k: v.copy() for k, v in self.columns().items()}
        out.dropped = self.dropped
        return out

    def reset(self) -> None:
        """Forget every row (after its delta was taken)."""
        self._columns = {k: np.empty(0, dtype=dt) for k, dt in self.schema.items()}
        self._pending = {k: [] for k in self.schema}
        self.dropped = 0

    def sorted_by(self, *keys: str) -> dict[str, np.ndarray]:
        """The columns with rows in a canonical order (merged rows come in any order)."""
        cols = self.columns()
        order = np.lexsort([cols[k] for k in reversed(keys)]) if keys else slice(None)
        return {k: v[order] for k, v in cols.items()}


class ConcatArray(RecordBatch):
    """A 1-D numpy array that grows by concatenation (``values``), up to ``max_rows``."""

    __slots__ = ()

    def __init__(self, dtype: Any = "f8", max_rows: int = 100_000) -> None:
        super().__init__({"values": dtype}, max_rows)

    def append(self, values: Iterable[Any] | Any) -> None:
        """Append one value or an array of values."""
        arr = np.atleast_1d(np.asarray(values, dtype=self.schema["values"]))
        self.extend({"values": arr})

    @property
    def values(self) -> np.ndarray:
        return self.column("values")

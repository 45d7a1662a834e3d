"""ROOT TTrees through uproot: ``RootInput`` reads one event per entry, ``RootOutput`` writes.

Reading goes chunk by chunk (``tree.iterate``); within a chunk each entry becomes a
``DataStore``: flat branches as numpy scalars, jagged (``var * number``) branches as
numpy arrays (views into the chunk), fixed-size branches as numpy sub-arrays, and
anything else (strings, nested vectors) as Python objects.

Writing buffers ``chunk_events`` events and writes each chunk with ``mktree`` +
``extend`` as a TTree (uproot's ``f[name] = dict`` would write an RNTuple). Measured
with uproot 5.7: every ``extend`` leaves a file that other processes can read, and
that survives a SIGKILL of the writer, so ``flush()`` (write the buffered chunk, then
fsync) is a real durability point. uproot cannot extend a TTree of an existing file:
``RootOutput`` always creates the file; use ``RecordOutput`` for resumable runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from evflow.errors import ClosedError, InputError, OutputError
from evflow.event import DataStore, EventMeta
from evflow.processing.module import Param, Source
from evflow.processing.writer import Writer

log = logging.getLogger(__name__)

META_BRANCHES: dict[str, np.dtype[Any]] = {
    "evflow_uid": np.dtype(np.uint64),
    "evflow_experiment": np.dtype(np.int64),
    "evflow_run": np.dtype(np.int64),
    "evflow_event": np.dtype(np.int64),
    "evflow_flags": np.dtype(np.uint32),
}


def resolve_input_file(name: str) -> str:
    """``name`` if it exists (or is a path); else the scikit-hep-testdata file of that
    name when the package ships it; else ``name`` (the reader then says it is missing)."""
    if os.path.exists(name) or os.sep in name:
        return name
    try:
        from importlib import resources

        shipped = resources.files("skhep_testdata.data") / name
        if shipped.is_file():
            return str(shipped)
    except (ImportError, OSError, TypeError):
        pass
    return name


def _open_tree(file: str, tree: str) -> tuple[Any, Any]:
    """``(file, tree)`` opened with uproot, or an ``InputError`` naming what is wrong.
    A bare name that is not here is looked up among scikit-hep-testdata's files."""
    file = resolve_input_file(file)
    import uproot

    if not os.path.exists(file):
        raise InputError(f"ROOT input file {file!r} does not exist")
    try:
        f = uproot.open(file)
    except Exception as err:  # uproot raises OSError, ValueError, ... for foreign bytes
        raise InputError(f"{file!r} is not a readable ROOT file: {err}") from err
    try:
        obj = f[tree]
    except KeyError:
        trees = sorted({k.split(";")[0] for k, c in f.classnames().items() if c == "TTree"})
        f.close()
        raise InputError(
            f"ROOT file {file!r} has no tree {tree!r} (trees in it: {', '.join(trees) or 'none'})"
        ) from None
    except Exception as err:
        f.close()
        raise InputError(f"ROOT file {file!r}: cannot read {tree!r}: {err}") from err
    if not isinstance(obj, uproot.TTree):
        f.close()
        raise InputError(f"ROOT file {file!r}: {tree!r} is a {type(obj).__name__}, not a TTree")
    return f, obj


def _readable_leaves(tree: Any) -> list[str]:
    import uproot

    unknown = uproot.interpretation.identify.UnknownInterpretation
    return [
        b.name
        for b in tree.branches
        if not b.branches and not isinstance(b.interpretation, unknown)
    ]


def _split_column(a: Any) -> Sequence[Any]:
    """One chunk column (an ``ak.Array``) as a per-entry sequence.

    Numpy scalars or views into the chunk when possible, Python objects otherwise.
    """
    import awkward as ak

    try:
        return list(ak.to_numpy(a))  # flat -> numpy scalars; regular -> sub-arrays
    except (ValueError, TypeError):
        pass
    if a.ndim == 2:
        try:
            flat = ak.to_numpy(ak.flatten(a, axis=1))
        except (ValueError, TypeError):
            flat = None
        if flat is not None and flat.dtype.kind in "biufc":
            ends = np.cumsum(ak.to_numpy(ak.num(a, axis=1))).tolist()
            starts = [0, *ends[:-1]]
            return [flat[i:j] for i, j in zip(starts, ends, strict=True)]
    values: list[Any] = a.to_list()
    return values


class RootInput(Source):
    """One event per entry of a TTree; uid and event number = entry index.

    ``branches=None`` reads every readable leaf branch. Missing file, foreign file,
    missing tree and missing branch each raise ``InputError`` at construction.
    """

    file = Param(str, doc="ROOT file to read")
    tree = Param(str, "events", "name of the TTree")
    branches = Param((list, tuple, type(None)), None, "branch names; None = all")
    step_size = Param(int, 10_000, "entries read per chunk")
    experiment = Param(int, 0, "experiment number in every event's meta")
    run = Param(int, 0, "run number in every event's meta")

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(name, **params)
        f, tree = _open_tree(self.file, self.tree)
        try:
            have = _readable_leaves(tree)
            if self.branches is None:
                self._branches = have
            else:
                known = set(tree.keys())
                for b in self.branches:
                    if b not in known:
                        shown = ", ".join(have[:20]) + (", ..." if len(have) > 20 else "")
                        raise InputError(
                            f"tree {self.tree!r} in {self.file!r} has no branch {b!r} "
                            f"(it has: {shown})"
                        )
                self._branches = list(self.branches)
            self._total = int(tree.num_entries)
        finally:
            f.close()

    def total(self) -> int:
        return self._total

    def events(self, start: int = 0) -> Iterator[DataStore]:
        f, tree = _open_tree(self.file, self.tree)
        exp, run = self.experiment, self.run
        names = self._branches
        try:
            if start >= self._total:
                return
            chunks = tree.iterate(
                names, step_size=self.step_size, entry_start=start, library="ak", report=True
            )
            while True:
                try:
                    chunk, report = next(chunks)
                except StopIteration:
                    break
                except Exception as err:  # damaged baskets, unreadable types
                    raise InputError(
                        f"cannot read tree {self.tree!r} in {self.file!r}: {err}"
                    ) from err
                columns = [_split_column(chunk[n]) for n in names]
                entry = report.tree_entry_start
                for row in zip(*columns, strict=True):
                    meta = EventMeta(entry, exp, run, entry)
                    yield DataStore(meta, dict(zip(names, row, strict=True)))
                    entry += 1
        finally:
            f.close()


class _Column:
    """A buffered output branch: scalars or 1-d arrays (jagged) of one dtype."""

    __slots__ = ("dtype", "jagged", "values")

    def __init__(self, dtype: np.dtype[Any], jagged: bool) -> None:
        self.dtype = dtype
        self.jagged = jagged
        self.values: list[Any] = []

    def type_spec(self) -> str | np.dtype[Any]:
        return f"var * {self.dtype.name}" if self.jagged else self.dtype

    def chunk(self) -> Any:
        import awkward as ak

        if not self.jagged:
            return np.asarray(self.values, dtype=self.dtype)
        counts = np.fromiter((len(v) for v in self.values), np.int64, len(self.values))
        flat = (
            np.concatenate(self.values).astype(self.dtype, copy=False)
            if self.values
            else np.zeros(0, self.dtype)
        )
        return ak.unflatten(flat, counts)


def _classify(value: Any) -> _Column | None:
    """The column kind ``value`` would go to, or None if a TTree cannot hold it."""
    if isinstance(value, bool | int | float | np.generic):
        dt = np.asarray(value).dtype
        return _Column(dt, False) if dt.kind in "biuf" else None
    if type(value).__module__.startswith("awkward"):
        import awkward as ak

        try:
            value = ak.to_numpy(value)
        except (ValueError, TypeError):
            return None
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "biuf":
        return _Column(value.dtype, True)
    return None


class RootOutput(Writer):
    """Writes events to a TTree: numbers as flat branches, 1-d numeric arrays as jagged.

    ``branches=None`` writes every object of the first event that a TTree can hold
    (others are skipped); a listed branch that cannot be written raises
    ``OutputError``. With ``meta_branches`` the event meta goes to ``evflow_uid``,
    ``evflow_experiment``, ``evflow_run``, ``evflow_event`` and ``evflow_flags``.
    Jagged branch ``x`` gets a counter branch ``nx``. A run without events leaves a
    ROOT file without the tree. Parallel runs write quarantined events (raw, without
    the objects later modules add) to ``<file>.quarantine.evr`` instead (``columnar``).
    """

    columnar = True
    file = Param(str, doc="ROOT file to create (overwritten if it exists)")
    tree = Param(str, "events", "name of the TTree")
    branches = Param((list, tuple, type(None)), None, "objects to write; None = all numeric")
    chunk_events = Param(int, 10_000, "events buffered before a chunk (basket) is written")
    meta_branches = Param(bool, True, "write the evflow_* meta branches")

    def __init__(self, name: str | None = None, **params: Any) -> None:
        super().__init__(name, **params)
        parent = os.path.dirname(os.path.abspath(self.file))
        if not os.path.isdir(parent):
            raise OutputError(f"cannot write ROOT output {self.file!r}: no directory {parent!r}")
        if not os.access(parent, os.W_OK):
            raise OutputError(
                f"cannot write ROOT output {self.file!r}: directory {parent!r} is not writable"
            )
        self._file: Any = None
        self._tree: Any = None
        self._closed = False
        self._columns: dict[str, _Column] | None = None
        self._uids: list[int] = []
        self._written: set[int] = set()

    def _open(self) -> None:
        if self._closed:
            raise ClosedError(f"ROOT output {self.file!r} is closed")
        if self._file is None:
            import uproot

            try:
                self._file = uproot.recreate(self.file)
            except OSError as err:
                raise OutputError(
                    f"cannot open ROOT output {self.file!r} for writing: {err.strerror or err}"
                ) from err

    def initialize(self) -> None:
        self._open()

    def _make_columns(self, store: DataStore) -> dict[str, _Column]:
        columns: dict[str, _Column] = {}
        explicit = self.branches is not None
        names: list[str] = list(self.branches) if self.branches is not None else list(store)
        for key in names:
            if key not in store:
                raise OutputError(
                    f"ROOT output {self.file!r}: branch {key!r} is not in event "
                    f"uid={store.meta.uid} (it has: {', '.join(sorted(store))})"
                )
            column = _classify(store[key])
            if column is None:
                if explicit:
                    raise OutputError(
                        f"ROOT output {self.file!r}: object {key!r} "
                        f"({type(store[key]).__name__}) cannot be a TTree branch; "
                        "numbers and 1-d numeric arrays can"
                    )
                log.debug("ROOT output %r: skipping object %r", self.file, key)
                continue
            columns[key] = column
        for key, column in list(columns.items()):
            counter = f"n{key}"
            if column.jagged and counter in columns:
                if explicit:
                    raise OutputError(
                        f"ROOT output {self.file!r}: branch {counter!r} collides with the "
                        f"counter branch of jagged branch {key!r}"
                    )
                del columns[counter]  # the counter holds the same numbers
        if self.meta_branches:
            for key, dt in META_BRANCHES.items():
                columns[key] = _Column(dt, False)
        return columns

    def write(self, store: DataStore) -> None:
        self._open()
        if self._columns is None:
            self._columns = self._make_columns(store)
        meta = store.meta
        objects = store.objects
        row: list[tuple[_Column, Any]] = []  # check the whole event before buffering any of it
        for key, column in self._columns.items():
            if key in META_BRANCHES and self.meta_branches:
                continue
            try:
                value = objects[key]
            except KeyError:
                raise OutputError(
                    f"ROOT output {self.file!r}: event uid={meta.uid} has no object {key!r}, "
                    "which the first event had (every entry of a TTree has every branch)"
                ) from None
            if column.jagged:
                value = np.asarray(value)
                if value.ndim != 1:
                    raise OutputError(
                        f"ROOT output {self.file!r}: event uid={meta.uid}: {key!r} has shape "
                        f"{value.shape}, the branch holds 1-d arrays"
                    )
            elif isinstance(value, np.ndarray | list):
                raise OutputError(
                    f"ROOT output {self.file!r}: event uid={meta.uid}: {key!r} is an array, "
                    "the branch holds numbers"
                )
            row.append((column, value))
        for column, value in row:
            column.values.append(value)
        if self.meta_branches:
            c = self._columns
            c["evflow_uid"].values.append(meta.uid)
            c["evflow_experiment"].values.append(meta.experiment)
            c["evflow_run"].values.append(meta.run)
            c["evflow_event"].values.append(meta.event)
            c["evflow_flags"].values.append(meta.flags)
        self._uids.append(meta.uid)
        if len(self._uids) >= self.chunk_events:
            self._write_chunk()

    def write_raw(self, meta: EventMeta, frames: Sequence[bytes | memoryview]) -> None:
        """Decode ``frames`` (the codec never unpickles) and write with ``meta``."""
        from evflow.wire.codec import decode_event

        store = decode_event(frames)
        store.meta = meta
        self.write(store)

    def _write_chunk(self) -> None:
        if not self._uids or self._columns is None:
            return
        chunk = {key: column.chunk() for key, column in self._columns.items()}
        try:
            if self._tree is None:
                types = {key: column.type_spec() for key, column in self._columns.items()}
                self._tree = self._file.mktree(
                    self.tree, types, counter_name=lambda counted: f"n{counted}"
                )
            self._tree.extend(chunk)
        except OSError as err:
            raise OutputError(f"cannot write ROOT output {self.file!r}: {err}") from err
        for column in self._columns.values():
            column.values = []
        self._written.update(self._uids)
        self._uids = []

    def flush(self) -> None:
        """Write the buffered events as one chunk and fsync the file."""
        if self._file is None:
            return
        self._write_chunk()
        sink = self._file.file.sink
        sink.flush()
        raw = getattr(sink, "_file", None)  # uproot keeps the file object private
        if raw is not None and hasattr(raw, "fileno"):
            os.fsync(raw.fileno())

    def close(self) -> None:
        """Write what is buffered and close the file; closing twice is fine."""
        if self._closed:
            return
        try:
            if self._file is not None:
                self._write_chunk()
                self._file.close()
        finally:
            self._closed = True
            self._file = None

    def written_uids(self) -> set[int]:
        """Uids in chunks written to the file so far (this run; no append)."""
        return set(self._written)

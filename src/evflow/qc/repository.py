"""The QC repository: every published object and quality in one SQLite file.

WAL mode: one writer, any number of readers (other processes too) that never block it
nor see a half-written version. Each path has versions with validity intervals: a new
version is valid from its creation time and closes the previous one's interval, like
CCDB. Object bytes are stored once per content hash (a histogram that did not change
between cycles costs one row, not one more copy).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from evflow.errors import ClosedError, InputError, NotFoundError, OutputError, StorageFullError
from evflow.qc.objects import decode_object, encode_object
from evflow.qc.publication import PublishedObject
from evflow.qc.quality import Quality, QualityObject
from evflow.qc.schema import close_connection, open_connection
from evflow.qc.versions import (
    Gap,
    Retention,
    StoredObject,
    StoredQuality,
    VersionInfo,
    dumps,
    flags_from_json,
    flags_json,
)

_VERSION_COLUMNS = (
    "id, path, run, cycle, valid_from, valid_until, created, hash, size, quality, flags, "
    "metadata, completeness, task, name, sequence, event_count"
)
_QUALITY_COLUMNS = (
    "id, check_name, quality, paths, flags, metadata, run, cycle, created, version_id"
)


class Repository:
    """``Repository(path)`` writes (creating the file); ``readonly=True`` only reads."""

    def __init__(
        self,
        path: str | Path,
        *,
        readonly: bool = False,
        retention: Retention | dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.retention = Retention.from_config(retention)
        # one connection shared by the threads of a web server: calls take turns
        self._lock = threading.RLock()
        self._conn = open_connection(self.path, readonly=readonly)
        self._closed = False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            close_connection(self._conn, writer=not self.readonly)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"QC repository {self.path} is closed")

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else "writer"
        return f"Repository({str(self.path)!r}, {mode})"

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        if self.readonly:
            raise OutputError(f"QC repository {self.path} is open read-only")
        conn = self._conn
        with self._lock:
            self._check_open()
            yield from self._transaction(conn)

    def _transaction(self, conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.rollback()
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL:
                raise StorageFullError(f"QC repository {self.path}: disk full ({exc})") from None
            raise OutputError(f"QC repository {self.path}: cannot write ({exc})") from None
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise

    # --- writing -------------------------------------------------------------------------
    def store(
        self, published: PublishedObject, quality: QualityObject | Quality | None = None
    ) -> int:
        """Store one published object (and its overall quality); returns the version id."""
        data = encode_object(published.obj)
        digest = hashlib.sha256(data).hexdigest()
        valid_from = published.created if published.created > 0 else time.time()
        label, flags = _quality_columns(quality)
        with self._write() as conn:
            conn.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?)", (digest, data))
            prev = conn.execute(
                "SELECT id FROM versions WHERE path = ? AND valid_from <= ? "
                "ORDER BY valid_from DESC, id DESC LIMIT 1",
                (published.path, valid_from),
            ).fetchone()
            nxt = conn.execute(
                "SELECT valid_from FROM versions WHERE path = ? AND valid_from > ? "
                "ORDER BY valid_from, id LIMIT 1",
                (published.path, valid_from),
            ).fetchone()
            cursor = conn.execute(
                f"INSERT INTO versions ({_VERSION_COLUMNS}) "
                "VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    published.path,
                    published.run,
                    published.cycle,
                    valid_from,
                    None if nxt is None else nxt[0],
                    valid_from,
                    digest,
                    len(data),
                    label,
                    flags,
                    dumps(published.metadata),
                    dumps(published.completeness),
                    published.task,
                    published.name,
                    published.sequence,
                    published.event_count,
                ),
            )
            if prev is not None:
                conn.execute(
                    "UPDATE versions SET valid_until = ? WHERE id = ?", (valid_from, prev[0])
                )
            version_id = int(cursor.lastrowid or 0)
            if self.retention is not None:
                self._apply_retention(conn, published.path)
        return version_id

    def store_quality(
        self,
        quality: QualityObject,
        *,
        run: int | None = None,
        cycle: int | None = None,
        version_id: int | None = None,
        created: float | None = None,
    ) -> int:
        """Store one check or aggregator result; ``version_id`` ties it to a version."""
        with self._write() as conn:
            cursor = conn.execute(
                f"INSERT INTO qualities ({_QUALITY_COLUMNS}) "
                "VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    quality.check,
                    quality.quality.label,
                    json.dumps(list(quality.paths)),
                    flags_json(quality.flags),
                    dumps(quality.metadata),
                    run,
                    cycle,
                    time.time() if created is None else created,
                    version_id,
                ),
            )
            return int(cursor.lastrowid or 0)

    def record_gap(
        self, started: float, ended: float, stored_late: int, lost: int, reason: str
    ) -> int:
        """Note a time the writer could not store (what came late, what was lost)."""
        with self._write() as conn:
            cursor = conn.execute(
                "INSERT INTO gaps VALUES (NULL, ?, ?, ?, ?, ?)",
                (started, ended, stored_late, lost, reason),
            )
            return int(cursor.lastrowid or 0)

    def prune(self) -> int:
        """Apply the retention to every path now; returns the number of versions deleted."""
        if self.retention is None:
            return 0
        with self._write() as conn:
            before = conn.total_changes
            for (path,) in conn.execute("SELECT DISTINCT path FROM versions").fetchall():
                self._apply_retention(conn, path)
            return conn.total_changes - before

    def _apply_retention(self, conn: sqlite3.Connection, path: str) -> None:
        assert self.retention is not None
        doomed: list[int] = []
        if self.retention.keep_last is not None:
            rows = conn.execute(
                "SELECT id FROM versions WHERE path = ? ORDER BY valid_from DESC, id DESC "
                "LIMIT -1 OFFSET ?",
                (path, self.retention.keep_last),
            ).fetchall()
            doomed += [r[0] for r in rows]
        if self.retention.max_age_s is not None:
            rows = conn.execute(
                "SELECT id FROM versions WHERE path = ? AND valid_until IS NOT NULL "
                "AND valid_until < ?",
                (path, time.time() - self.retention.max_age_s),
            ).fetchall()
            doomed += [r[0] for r in rows]
        if not doomed:
            return
        ids = sorted(set(doomed))
        marks = ",".join("?" * len(ids))
        hashes = [
            r[0]
            for r in conn.execute(f"SELECT DISTINCT hash FROM versions WHERE id IN ({marks})", ids)
        ]
        conn.execute(f"DELETE FROM versions WHERE id IN ({marks})", ids)
        conn.execute(f"DELETE FROM qualities WHERE version_id IN ({marks})", ids)
        for digest in hashes:
            conn.execute(
                "DELETE FROM blobs WHERE hash = ? AND NOT EXISTS "
                "(SELECT 1 FROM versions WHERE hash = ?)",
                (digest, digest),
            )

    # --- reading -------------------------------------------------------------------------
    def paths(self, prefix: str = "") -> list[str]:
        """Every stored path that starts with ``prefix``, sorted."""
        rows = self._read(
            "SELECT DISTINCT path FROM versions WHERE substr(path, 1, ?) = ? ORDER BY path",
            (len(prefix), prefix),
        )
        return [r[0] for r in rows]

    def latest(
        self, path: str, *, at: float | None = None, run: int | None = None
    ) -> StoredObject | None:
        """The newest version of ``path``; with ``at`` the one valid at that unix time;
        with ``run`` the newest of that run (created at or before ``at`` if given)."""
        with self._snapshot():
            info = self._latest_info(path, at=at, run=run)
            return None if info is None else self._load(info)

    def latest_info(
        self, path: str, *, at: float | None = None, run: int | None = None
    ) -> VersionInfo | None:
        """Like ``latest`` without reading the object."""
        return self._latest_info(path, at=at, run=run)

    def _latest_info(self, path: str, *, at: float | None, run: int | None) -> VersionInfo | None:
        where, args = ["path = ?"], list[Any]([path])
        if run is not None:
            where.append("run = ?")
            args.append(int(run))
            if at is not None:
                where.append("valid_from <= ?")
                args.append(float(at))
        elif at is not None:
            where.append("valid_from <= ? AND (valid_until IS NULL OR valid_until > ?)")
            args += [float(at), float(at)]
        rows = self._read(
            f"SELECT {_VERSION_COLUMNS} FROM versions WHERE {' AND '.join(where)} "
            "ORDER BY valid_from DESC, id DESC LIMIT 1",
            args,
        )
        return _version(rows[0]) if rows else None

    def versions(self, path: str) -> list[VersionInfo]:
        """Every kept version of ``path``, newest first."""
        rows = self._read(
            f"SELECT {_VERSION_COLUMNS} FROM versions WHERE path = ? "
            "ORDER BY valid_from DESC, id DESC",
            (path,),
        )
        return [_version(r) for r in rows]

    def get(self, version_id: int) -> StoredObject:
        """One version by id with its object; NotFoundError if there is none."""
        with self._snapshot():
            rows = self._read(
                f"SELECT {_VERSION_COLUMNS} FROM versions WHERE id = ?", (int(version_id),)
            )
            if not rows:
                raise NotFoundError(f"no version {version_id} in QC repository {self.path}")
            return self._load(_version(rows[0]))

    def raw(self, version_id: int) -> bytes:
        """The encoded object of one version (``evflow.qc.objects.decode_object`` reads it)."""
        rows = self._read(
            "SELECT data FROM versions JOIN blobs USING (hash) WHERE versions.id = ?",
            (int(version_id),),
        )
        if not rows:
            raise NotFoundError(f"no version {version_id} in QC repository {self.path}")
        return bytes(rows[0][0])

    def qualities(self, check: str | None = None, *, run: int | None = None) -> list[StoredQuality]:
        """Stored check and aggregator results (of one check, one run), newest first."""
        where: list[str] = ["1"]
        args: list[Any] = []
        if check is not None:
            where.append("check_name = ?")
            args.append(check)
        if run is not None:
            where.append("run = ?")
            args.append(int(run))
        rows = self._read(
            f"SELECT {_QUALITY_COLUMNS} FROM qualities WHERE {' AND '.join(where)} "
            "ORDER BY created DESC, id DESC",
            args,
        )
        return [_quality(r) for r in rows]

    def checks(self) -> list[str]:
        """Names of the checks and aggregators with stored results."""
        return [
            r[0] for r in self._read("SELECT DISTINCT check_name FROM qualities ORDER BY 1", ())
        ]

    def gaps(self) -> list[Gap]:
        return [Gap(*r) for r in self._read("SELECT * FROM gaps ORDER BY started", ())]

    @contextmanager
    def _snapshot(self) -> Iterator[None]:
        """One read transaction: the version row and its bytes come from one state of
        the file even while the writer deletes old versions."""
        with self._lock:
            self._check_open()
            if self._conn.in_transaction:
                yield
                return
            self._conn.execute("BEGIN")
            try:
                yield
            finally:
                self._conn.execute("COMMIT")

    def _read(self, sql: str, args: Any) -> list[tuple[Any, ...]]:
        try:
            with self._lock:
                self._check_open()
                return self._conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise InputError(f"cannot read QC repository {self.path}: {exc}") from None

    def _load(self, info: VersionInfo) -> StoredObject:
        data = self.raw(info.id)
        if hashlib.sha256(data).hexdigest() != info.hash:
            raise InputError(f"QC repository {self.path}: version {info.id} fails its hash check")
        fields = {k: getattr(info, k) for k in VersionInfo.__dataclass_fields__}
        return StoredObject(**fields, obj=decode_object(data))


def _quality_columns(quality: QualityObject | Quality | None) -> tuple[str | None, str]:
    if quality is None:
        return None, "[]"
    if isinstance(quality, Quality):
        return quality.label, "[]"
    return quality.quality.label, flags_json(quality.flags)


def _version(row: tuple[Any, ...]) -> VersionInfo:
    head, (flags, meta, comp), tail = row[:10], row[10:13], row[13:]
    parsed = (flags_from_json(flags), json.loads(meta), json.loads(comp))
    fields: list[Any] = [*head, *parsed, *tail]
    return VersionInfo(*fields)


def _quality(row: tuple[Any, ...]) -> StoredQuality:
    qid, check, quality, paths, flags, meta, *rest = row
    parsed = (tuple(json.loads(paths)), flags_from_json(flags), json.loads(meta))
    return StoredQuality(qid, check, quality, *parsed, *rest)

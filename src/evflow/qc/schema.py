"""The repository's SQLite schema, and opening a connection on it (WAL, checked)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
from pathlib import Path

from evflow.errors import InputError, OutputError

SCHEMA_VERSION = 1
APP = "evflow-qc-repository"
BUSY_TIMEOUT_MS = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blobs (hash TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS versions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    path TEXT NOT NULL, run INTEGER, cycle INTEGER,
    valid_from REAL NOT NULL, valid_until REAL, created REAL NOT NULL,
    hash TEXT NOT NULL, size INTEGER NOT NULL,
    quality TEXT, flags TEXT NOT NULL DEFAULT '[]',
    metadata TEXT NOT NULL DEFAULT '{}', completeness TEXT NOT NULL DEFAULT '{}',
    task TEXT, name TEXT, sequence INTEGER, event_count INTEGER);
CREATE INDEX IF NOT EXISTS versions_path_from ON versions (path, valid_from, id);
CREATE INDEX IF NOT EXISTS versions_path_run ON versions (path, run, valid_from);
CREATE TABLE IF NOT EXISTS qualities (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    check_name TEXT NOT NULL, quality TEXT NOT NULL, paths TEXT NOT NULL,
    flags TEXT NOT NULL, metadata TEXT NOT NULL,
    run INTEGER, cycle INTEGER, created REAL NOT NULL, version_id INTEGER);
CREATE INDEX IF NOT EXISTS qualities_check ON qualities (check_name, created, id);
CREATE TABLE IF NOT EXISTS gaps (
    id INTEGER PRIMARY KEY AUTOINCREMENT, started REAL NOT NULL, ended REAL NOT NULL,
    stored_late INTEGER NOT NULL, lost INTEGER NOT NULL, reason TEXT NOT NULL);
"""


def write_problem(path: Path) -> str | None:
    """Why the repository at ``path`` cannot be written (None: it can): SQLite's WAL
    needs to write the file and to create ``<file>-wal`` and ``<file>-shm`` beside it."""
    directory = path.parent
    if path.exists() and not os.access(path, os.W_OK):
        return f"the file is not writable ({_os_reason(path, directory)})"
    if not os.access(directory, os.W_OK):
        return (
            f"its directory {directory} is not writable ({_os_reason(None, directory)}; "
            f"a writer creates {path.name}-wal and {path.name}-shm there)"
        )
    return None


def _os_reason(path: Path | None, directory: Path) -> str:
    """The system's words for why ``path`` (or a new file in ``directory``) cannot be
    written; ``os.access`` only says that."""
    try:
        if path is not None:
            os.close(os.open(path, os.O_WRONLY))
        else:
            fd, name = tempfile.mkstemp(dir=directory, prefix=".evflow-probe-")
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        return exc.strerror or str(exc)
    return "permission denied"


def open_connection(path: Path, *, readonly: bool) -> sqlite3.Connection:
    """A connection on the repository at ``path``; a writer creates the file and schema.

    Refuses (with the file named) a missing file for a reader, a file that is not
    SQLite, an SQLite file of something else and a schema of another version; a
    writer, a repository it cannot write (with the reason). A reader opens the file
    read-only (``mode=ro``), or, in a directory nobody can write and with no WAL beside
    the file, as immutable: no ``-wal`` or ``-shm`` file is then needed.
    """
    if readonly and not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise InputError(f"no QC repository at {path} (the file {what})")
    if not readonly and not path.parent.is_dir():
        raise OutputError(
            f"cannot create QC repository {path}: directory {path.parent} does not exist"
        )
    if not readonly:
        problem = write_problem(path)
        if problem is not None:
            raise OutputError(f"QC repository {path} cannot be opened read-write: {problem}")
    # readers and the writer may be used from a web server's threads (the Repository
    # serialises calls with a lock)
    if readonly:
        frozen = not os.access(path.parent, os.W_OK) and not Path(f"{path}-wal").exists()
        target, uri = f"{path.absolute().as_uri()}?{'immutable=1' if frozen else 'mode=ro'}", True
    else:
        target, uri = str(path), False
    conn = sqlite3.connect(target, uri=uri, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
    try:
        conn.isolation_level = None  # explicit BEGIN/COMMIT in the Repository
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables:
            _check_meta(conn, path)
        elif readonly:
            raise InputError(f"{path} is an empty SQLite file, not a QC repository")
        if not readonly:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.executescript(_SCHEMA)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('app', ?)", (APP,))
            conn.execute(
                "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise _open_error(path, exc, readonly) from None
    except BaseException:
        conn.close()
        raise
    return conn


def _open_error(path: Path, exc: sqlite3.DatabaseError, readonly: bool) -> Exception:
    """The error for an SQLite failure while opening: only bytes that are not a
    database make the file "not a QC repository"."""
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return InputError(f"{path} is not a QC repository ({exc})")
    if readonly:
        return InputError(f"QC repository {path} cannot be read ({exc})")
    return OutputError(f"QC repository {path} cannot be opened read-write ({exc})")


def close_connection(conn: sqlite3.Connection, *, writer: bool) -> None:
    """Close ``conn``; a writer first leaves WAL mode if no one else has the file open,
    so that readers later need no ``-wal``/``-shm`` files (a reader cannot remove the
    ones it would make; the next writer turns WAL on again)."""
    try:
        if writer:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("PRAGMA busy_timeout = 0")  # a reader is there: stay in WAL
                conn.execute("PRAGMA journal_mode = DELETE")
    finally:
        conn.close()


def _check_meta(conn: sqlite3.Connection, path: Path) -> None:
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.OperationalError:  # no meta table: somebody else's database
        meta = {}
    if meta.get("app") != APP:
        raise InputError(f"{path} is an SQLite file but not a QC repository")
    if meta.get("schema_version") != str(SCHEMA_VERSION):
        raise InputError(
            f"QC repository {path} has schema version {meta.get('schema_version')}; "
            f"this evflow reads version {SCHEMA_VERSION}"
        )

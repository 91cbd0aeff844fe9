"""The run ledger's durable store: a SQLite database (stdlib ``sqlite3``, WAL, ``synchronous=FULL``) holding
the open runs' accumulated state and every finished run's row (``core.runs_db`` has the schema).

``Store.open`` checks the directory and the files before it reads anything (``ledger.trust``: the exporter's
user's own, writable by no one else; a refusal is ``StoreRefused`` with what to do), creates the database
0600, and migrates its schema forward (``PRAGMA user_version``; a database of a newer release is refused,
never written). ``commit`` writes one ``Batch`` in one transaction: the rows of runs that closed, the open
runs' states (a run is never both), the export marks and the ledger's counters; a crash keeps the
transaction before it whole. ``StoreWriter`` is the store's own thread: callers ask for a batch and never
wait on the disk (a stalled or full file system shows as a backlog and a metric, not as frozen sampling).

Nothing here knows what a run is: states arrive as JSON text (``ledger.codec``), rows as summaries and
documents (``ledger.restart`` makes both). Never unpickles, never runs on the sampler thread.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from gpu_energy_exporter.core import runs_db
from gpu_energy_exporter.core.runs_schema import COLUMN_NAMES
from gpu_energy_exporter.core.textfmt import json_safe
from gpu_energy_exporter.ledger import trust
from gpu_energy_exporter.ledger.files import utc_stamp

log = logging.getLogger(__name__)

#: How long a write waits for another connection's lock (``runs --db`` only reads, so rarely anyone).
BUSY_TIMEOUT_MS = 5000
#: The WAL file is cut back to this after a checkpoint (it grows to the largest transaction).
WAL_LIMIT_BYTES = 16 << 20


class StoreRefused(Exception):
    """The store's directory or database may not be read or written (the message says why and what to do)."""


@dataclass(slots=True)
class StoredRow:
    """A finished run's row as the store writes it."""

    seq: int
    run_id: str
    start: float
    summary: dict[str, Any]
    doc: dict[str, Any]
    exported: bool = False
    summary_name: str | None = None


@dataclass(slots=True)
class Loss:
    """Something the ledger could not restore (``losses`` table)."""

    reason: str
    run_id: str | None
    lost_from: float | None
    lost_to: float | None
    detail: str


@dataclass
class Batch:
    """One transaction: ``rows`` to add, the open runs' states (``open_runs``: run id -> (start, saved, state
    JSON, timeline JSON or None to keep the one stored), written over those stored; with ``full`` they are every
    open run and the others leave), the ``closed`` runs' states to remove, export marks (seq, JSON summary's
    file name), ``meta`` (key -> text) and ``losses``."""

    full: bool = False
    open_runs: dict[str, tuple[float, float, str, str | None]] = field(default_factory=dict)
    closed: list[str] = field(default_factory=list)
    rows: list[StoredRow] = field(default_factory=list)
    exported: list[tuple[int, str | None]] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)
    losses: list[Loss] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.full or self.open_runs or self.closed or self.rows or self.exported or self.meta
                    or self.losses)


@dataclass
class Saved:
    """What the database holds at start: ``meta``, the open runs (run id, start, saved, crc, state, timeline's
    saved, crc and JSON) and the rows not exported yet (their columns by name)."""

    meta: dict[str, str]
    open_runs: list[tuple[Any, ...]]
    rows: list[dict[str, Any]]
    max_seq: int
    more_rows: int = 0


def crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def _scalar(value: Any) -> Any:
    if value is None or isinstance(value, (int, float, str)):
        return value
    return json.dumps(json_safe(value), allow_nan=False)


class Store:
    """The database at ``path`` (see the module docstring). One thread at a time uses it."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self.directory = os.path.dirname(self.path)
        self._conn: sqlite3.Connection | None = None
        self._warned = False
        self.readonly = False  # opened read-only: its file system is (``_connect_readonly``)

    @classmethod
    def open(cls, path: str) -> Store:
        """Check, create if needed, open and migrate; StoreRefused (with what to do) or sqlite3.DatabaseError
        (a damaged file: ``salvage`` and ``move_aside``)."""
        store = cls(path)
        store._connect(create=True)
        return store

    # -- opening ---------------------------------------------------------------------------------------

    def check(self) -> None:
        """The directory, the database and its WAL files pass ``ledger.trust`` (StoreRefused otherwise)."""
        problem = trust.directory_problem(self.directory)
        for suffix in ("", "-wal", "-shm"):
            problem = problem or trust.file_problem(self.path + suffix)
        if problem:
            raise StoreRefused(problem)

    def _connect(self, create: bool = False, writable: bool = False) -> sqlite3.Connection:
        if self._conn is not None and not (writable and self.readonly):
            return self._conn
        self.close(checkpoint=False)
        if create and not os.path.isdir(self.directory):
            try:
                os.makedirs(self.directory, mode=0o700)
            except OSError as exc:
                raise StoreRefused(f"cannot create {self.directory} ({exc.strerror or exc})") from None
        self.check()
        above = trust.ancestor_warning(self.directory)
        if above and not self._warned:
            self._warned = True
            log.warning("run ledger: %s", above)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.close(fd)
        except FileExistsError:
            pass
        if _read_only_fs(self.directory):
            if writable:
                raise OSError(errno.EROFS, f"{self.directory} is on a read-only file system")
            return self._connect_readonly()
        before = os.lstat(self.path)
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL").fetchone()
            after = os.lstat(self.path)
            if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
                raise StoreRefused(f"{self.path} was replaced while it was opened: not used")
            self.check()  # the WAL files it made or found
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self.readonly = False
        return conn

    def _connect_readonly(self) -> sqlite3.Connection:
        """The database on a read-only file system (a disk remounted read-only after errors): read as it is
        (immutable: nobody can change it), so that the runs are restored; written once it is writable."""
        conn = sqlite3.connect(f"file:{quote(self.path)}?mode=ro&immutable=1", uri=True, check_same_thread=False)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version != runs_db.SCHEMA_VERSION:
                raise StoreRefused(f"{self.path} is on a read-only file system and has schema version {version}, "
                                   f"not {runs_db.SCHEMA_VERSION}: it cannot be migrated now")
        except BaseException:
            conn.close()
            raise
        if not self.readonly:
            log.warning("run ledger: %s is on a read-only file system: its runs are read and go on in memory; "
                        "new state is written once it is writable again", self.path)
        self.readonly = True
        self._conn = conn
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > runs_db.SCHEMA_VERSION:
            raise StoreRefused(f"{self.path} has schema version {version}, newer than this release's "
                               f"{runs_db.SCHEMA_VERSION} (written by a newer gpu-energy-exporter): not written. "
                               "Run the newer release, or point --runs.db at another file")
        todo = [v for v in sorted(runs_db.MIGRATIONS) if v > version]
        have = [r[1] for r in conn.execute("PRAGMA table_info(runs)")] if version else []
        add = runs_db.missing_columns(have) if version else []
        if not todo and not add:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            for v in todo:
                for statement in runs_db.MIGRATIONS[v]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version={v}")
            for statement in runs_db.missing_columns([r[1] for r in conn.execute("PRAGMA table_info(runs)")]):
                conn.execute(statement)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if todo:
            log.info("run ledger: database %s migrated from schema version %d to %d", self.path, version, todo[-1])

    # -- reading ---------------------------------------------------------------------------------------

    def meta(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self._connect().execute("SELECT key, value FROM ledger_state")}

    def max_seq(self) -> int:
        return int(self._connect().execute("SELECT coalesce(max(seq), 0) FROM runs").fetchone()[0])

    def load(self, max_rows: int = 1000) -> Saved:
        """The saved state: meta, every open run, and the oldest ``max_rows`` rows not exported (``more_rows``:
        how many others wait)."""
        conn = self._connect()
        meta = self.meta()
        open_runs = [tuple(r) for r in conn.execute(
            "SELECT run_id, start_unix, saved_unix, crc, state, timeline_saved_unix, timeline_crc, timeline "
            "FROM open_runs ORDER BY start_unix")]
        names = runs_db.insert_columns()
        cols = ", ".join(f'"{c}"' for c in names)
        rows = [dict(zip(names, r, strict=True))
                for r in conn.execute(f"SELECT {cols} FROM runs WHERE exported = 0 ORDER BY seq LIMIT ?", (max_rows,))]
        waiting = conn.execute("SELECT count(*) FROM runs WHERE exported = 0").fetchone()[0]
        return Saved(meta, open_runs, rows, self.max_seq(), max(0, int(waiting) - len(rows)))

    # -- writing ---------------------------------------------------------------------------------------

    def commit(self, batch: Batch) -> None:
        """Write ``batch`` in one transaction (OSError or sqlite3.Error: nothing of it is written, and the
        connection is opened again at the next commit)."""
        try:
            conn = self._connect(writable=True)
            conn.execute("BEGIN IMMEDIATE")
            try:
                self._write(conn, batch)
                conn.execute("COMMIT")
            except BaseException:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                raise
        except (sqlite3.Error, StoreRefused) as exc:
            self.close(checkpoint=False)
            raise OSError(errno.EIO, f"{self.path}: {exc}") from exc

    def _write(self, conn: sqlite3.Connection, batch: Batch) -> None:
        now = time.time()
        insert = runs_db.insert_sql()
        for row in batch.rows:
            conn.execute(insert, self._values(row, now))
        for run_id in batch.closed:
            if run_id not in batch.open_runs:
                conn.execute("DELETE FROM open_runs WHERE run_id = ?", (run_id,))
        if batch.full:
            stored = {r[0] for r in conn.execute("SELECT run_id FROM open_runs")}
            for run_id in stored - set(batch.open_runs):
                conn.execute("DELETE FROM open_runs WHERE run_id = ?", (run_id,))
        if batch.open_runs:
            conn.executemany(
                "INSERT INTO open_runs (run_id, start_unix, saved_unix, crc, state, timeline_saved_unix, timeline_crc, "
                "timeline) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET "
                "start_unix = excluded.start_unix, saved_unix = excluded.saved_unix, crc = excluded.crc, "
                "state = excluded.state, timeline_saved_unix = coalesce(excluded.timeline_saved_unix, "
                "timeline_saved_unix), timeline_crc = coalesce(excluded.timeline_crc, timeline_crc), "
                "timeline = coalesce(excluded.timeline, timeline)",
                [(k, s, saved, crc(text), text, saved if tl is not None else None,
                  crc(tl) if tl is not None else None, tl) for k, (s, saved, text, tl) in batch.open_runs.items()])
        for seq, name in batch.exported:
            conn.execute("UPDATE runs SET exported = 1, summary_name = coalesce(?, summary_name) WHERE seq = ?",
                         (name, seq))
        conn.executemany("INSERT OR REPLACE INTO ledger_state (key, value) VALUES (?, ?)", list(batch.meta.items()))
        conn.executemany("INSERT INTO losses (at_unix, reason, run_id, lost_from_unix, lost_to_unix, detail) "
                         "VALUES (?, ?, ?, ?, ?, ?)",
                         [(now, x.reason, x.run_id, x.lost_from, x.lost_to, x.detail) for x in batch.losses])

    @staticmethod
    def _values(row: StoredRow, now: float) -> list[Any]:
        s = row.summary
        found = row.doc.get("metadata")
        meta: dict[str, Any] = found if isinstance(found, dict) else {}
        extra: dict[str, Any] = {
            "start_unix": row.doc.get("start_unix", row.start), "end_unix": row.doc.get("end_unix"),
            **{c: meta.get(c) or None for c in runs_db.SLURM_COLUMNS},
            "metadata": json.dumps(json_safe(meta), allow_nan=False),
            "summary": json.dumps(json_safe(s), allow_nan=False),
            "document": json.dumps(json_safe(row.doc), allow_nan=False),
            "summary_name": row.summary_name, "exported": 1 if row.exported else 0, "recorded_unix": now,
        }
        return [row.seq, *(_scalar(s.get(c)) for c in COLUMN_NAMES),
                *(_scalar(extra[c]) for c, _ in runs_db.EXTRA_COLUMNS),
                *(_scalar(s.get(c) or runs_db.V2_DEFAULTS[c]) for c, _ in runs_db.V2_COLUMNS)]

    def close(self, checkpoint: bool = True) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if checkpoint:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            log.debug("run ledger: WAL checkpoint at close failed (%s)", exc)
        finally:
            conn.close()


def _read_only_fs(directory: str) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def damaged(exc: BaseException) -> bool:
    """Whether a SQLite error says the file is damaged (corrupt, or not a database), not merely unavailable
    (locked, read-only, an I/O error, a full disk)."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
    text = str(exc)
    return "malformed" in text or "not a database" in text


def salvage(path: str) -> tuple[list[tuple[str, Any, Any]], list[str]]:
    """What a damaged database still names: its open runs (run id, start, saved) and unexported rows' run ids,
    as far as they can be read."""
    runs: list[tuple[str, Any, Any]] = []
    rows: list[str] = []
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return runs, rows
    try:
        for query, out in (("SELECT run_id, start_unix, saved_unix FROM open_runs", runs),
                           ("SELECT run_id FROM runs WHERE exported = 0", rows)):
            try:
                for r in conn.execute(query):
                    out.append(tuple(r) if out is runs else str(r[0]))  # type: ignore[arg-type]
            except sqlite3.Error:
                continue
    finally:
        conn.close()
    return runs, rows


def move_aside(path: str) -> str:
    """Rename a damaged database (and its WAL files) to ``<path>.<time>.damaged``; the new name."""
    aside = f"{path}.{utc_stamp(time.time())}.damaged"
    for suffix in ("", "-wal", "-shm"):
        try:
            os.replace(path + suffix, aside + suffix)
        except FileNotFoundError:
            pass
    return aside


class StoreWriter:
    """The store's thread: whenever ``kick`` was called, ``build()`` makes a batch (on this thread; it takes
    the ledger's lock only to copy state) and the store commits it; ``done(batch)`` then runs (on this thread).
    A failed commit calls ``on_error`` and is retried after ``retry_s`` with a new batch (``build`` gives back
    what was not written)."""

    def __init__(self, store: Store, build: Callable[[bool], Batch | None], done: Callable[[Batch], None],
                 on_error: Callable[[OSError], None], retry_s: float = 1.0) -> None:
        self._store = store
        self._build = build
        self._done_cb = done
        self._on_error = on_error
        self._retry_s = retry_s
        self._cond = threading.Condition()
        self._wanted = 0
        self._done = 0
        self._full = False
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ledger-store", daemon=True)
        self._thread.start()

    def kick(self, full: bool = False) -> int:
        """Ask for a batch (``full``: with every open run's state); its ticket for ``wait``."""
        with self._cond:
            self._wanted += 1
            self._full = self._full or full
            self._cond.notify_all()
            return self._wanted

    def wait(self, ticket: int, timeout: float) -> bool:
        """Whether the batch ``ticket`` (or a later one) is committed within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._done < ticket:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float = 0.5) -> None:
        """Stop once the batches asked for are written (at most ``timeout`` s: a stalled disk keeps the thread,
        a daemon, and the process exits anyway)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            self._run()
        finally:
            self._store.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._done >= self._wanted and not self._stop:
                    self._cond.wait()
                if self._done >= self._wanted:
                    return
                ticket, full, self._full = self._wanted, self._full, False
            try:
                batch = self._build(full)
                if batch is not None and not batch.empty():
                    self._store.commit(batch)
                    self._done_cb(batch)
            except OSError as exc:
                self._on_error(exc)
                with self._cond:
                    if self._stop:
                        return  # shutting down: what is not written is logged by the ledger
                    self._full = self._full or full
                    self._cond.wait(self._retry_s)  # a failing disk: again later, not in a tight loop
                continue
            except Exception:  # noqa: BLE001 - the thread must outlive a bug in one batch
                log.exception("run ledger: writing the database failed")
            with self._cond:
                self._done = max(self._done, ticket)
                self._cond.notify_all()

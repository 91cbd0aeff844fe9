"""The run ledger's database (``--runs.db``, SQLite): its schema, its forward migrations, and the read-only
queries the ``runs --db`` command makes. Shared by the ledger that writes it (``ledger.store``) and the
workstation command that reads it, as ``runs_schema`` is for the CSV; docs/ledger.md shows the schema.

Tables (schema version in ``PRAGMA user_version``):

- ``runs``: one row per finished run or serving session (``kind``: ``training`` or ``serving``, schema
  version 2), in the order the runs closed (``seq``): every CSV column
  (``runs_schema.COLUMNS``, numbers as REAL, text as TEXT), the run's start and end as Unix seconds, its
  Slurm job, user, account and partition (when it was a Slurm job), its metadata, summary and JSON summary
  document as JSON, and whether the CSV row and JSON summary were written (``exported``).
- ``open_runs``: the accumulated state of each run still going (the exporter's own JSON, with a CRC), what a
  restart continues from; its timeline (the bulk of it) apart, written less often.
- ``ledger_state``: key/value: the steady clock, the last snapshot, counters.
- ``losses``: what the ledger could not restore, and why (damaged records, a refused directory, a failed
  migration), one row per loss.

A column added to ``runs_schema.COLUMNS`` is added to an existing database's ``runs`` table when the ledger
opens it (``missing_columns``), without a new version; anything else changes ``SCHEMA_VERSION`` and appends
its statements to ``MIGRATIONS``, applied in order in one transaction (a database is only ever migrated
forward; one newer than this release is not written).

This module never writes: ``read_runs`` opens the file read-only.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from gpu_energy_exporter.core.runs_schema import COLUMN_NAMES, NUMERIC_COLUMNS

#: The database's file name in the state directory (``--runs.db`` default).
DB_NAME = "runs.db"

SLURM_COLUMNS: tuple[str, ...] = ("slurm_job_id", "slurm_user", "slurm_account", "slurm_partition")

#: ``runs`` columns besides the CSV's, with their SQL types.
EXTRA_COLUMNS: tuple[tuple[str, str], ...] = (
    ("start_unix", "REAL"), ("end_unix", "REAL"),
    *((name, "TEXT") for name in SLURM_COLUMNS),
    ("metadata", "TEXT"),  # JSON object: the run's training_run_info labels (and a Slurm job's identity)
    ("summary", "TEXT"),  # JSON object: the summary the CSV row is made of
    ("document", "TEXT"),  # JSON object: the JSON summary (timeline included)
    ("summary_name", "TEXT"),  # its file name under runs/ beside the CSV, once written
    ("exported", "INTEGER NOT NULL DEFAULT 0"),  # 1 once the CSV row and JSON summary are written
    ("recorded_unix", "REAL"),  # when the row entered the database
)


def column_type(name: str) -> str:
    return "REAL" if name in NUMERIC_COLUMNS else "TEXT"


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


#: Columns that schema version 2 added (with their SQL, default included), filled from the summary (not CSV
#: columns: the CSV's header stays the previous release's, so an upgrade appends to the same file).
V2_COLUMNS: tuple[tuple[str, str], ...] = (("kind", "TEXT DEFAULT 'training'"),)
#: The value of a V2 column for a summary that has none (a row of the previous release's journal).
V2_DEFAULTS: dict[str, str] = {"kind": "training"}


def _runs_table() -> str:
    cols = ["seq INTEGER PRIMARY KEY", *(f"{_q(c)} {column_type(c)}" for c in COLUMN_NAMES),
            *(f"{_q(c)} {t}" for c, t in EXTRA_COLUMNS)]
    return "CREATE TABLE runs (\n  " + ",\n  ".join(cols) + "\n)"


SCHEMA_VERSION = 2

#: version -> the statements that take a database from the version before to it.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        _runs_table(),
        "CREATE INDEX runs_run_id ON runs (run_id)",
        "CREATE INDEX runs_start_time ON runs (start_time)",
        "CREATE INDEX runs_unexported ON runs (exported) WHERE exported = 0",
        "CREATE TABLE open_runs (run_id TEXT PRIMARY KEY, start_unix REAL, saved_unix REAL, crc INTEGER, "
        "state TEXT, timeline_saved_unix REAL, timeline_crc INTEGER, timeline TEXT)",
        "CREATE TABLE ledger_state (key TEXT PRIMARY KEY, value TEXT)",
        "CREATE TABLE losses (id INTEGER PRIMARY KEY, at_unix REAL, reason TEXT, run_id TEXT, "
        "lost_from_unix REAL, lost_to_unix REAL, detail TEXT)",
    ),
    # Serving sessions (--collector.inference) beside training runs: every row says which it is; the rows
    # written before are training runs.
    2: (
        *(f"ALTER TABLE runs ADD COLUMN {_q(c)} {sql}" for c, sql in V2_COLUMNS),
        "CREATE INDEX runs_kind ON runs (kind)",
    ),
}


def missing_columns(existing: Sequence[str]) -> list[str]:
    """``ALTER TABLE`` statements adding the CSV and extra columns an older ``runs`` table lacks."""
    have = set(existing)
    out = [f"ALTER TABLE runs ADD COLUMN {_q(c)} {column_type(c)}" for c in COLUMN_NAMES if c not in have]
    out += [f"ALTER TABLE runs ADD COLUMN {_q(c)} {t}" for c, t in EXTRA_COLUMNS if c not in have]
    return out


def insert_columns() -> tuple[str, ...]:
    """The ``runs`` columns a new row fills, in order (``insert_sql``)."""
    return ("seq", *COLUMN_NAMES, *(c for c, _ in EXTRA_COLUMNS), *(c for c, _ in V2_COLUMNS))


def insert_sql() -> str:
    cols = insert_columns()
    return f"INSERT OR REPLACE INTO runs ({', '.join(_q(c) for c in cols)}) VALUES ({', '.join('?' * len(cols))})"


# ----------------------------------------------------------------------------------------------------
# reading (the ``runs --db`` command)


class DatabaseUnreadable(Exception):
    """The file is not a run ledger database this release can read (the message says why)."""


def connect_readonly(path: str) -> sqlite3.Connection:
    """The database at ``path``, opened read-only (never created, never changed). A WAL database whose
    ``-shm`` file is gone (the exporter stopped) is opened as immutable."""
    from urllib.parse import quote

    uri = "file:" + quote(path)
    try:
        conn = sqlite3.connect(uri + "?mode=ro", uri=True)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError:
        conn = sqlite3.connect(uri + "?mode=ro&immutable=1", uri=True)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn


def read_runs(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Every finished run (the CSV's columns, oldest first), then the open runs (run id, start time and
    status ``running``: their figures are the exporter's, not in the file until they finish)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version < 1:
        raise DatabaseUnreadable("it has no run ledger schema (user_version 0): not a gpu-energy-exporter database")
    have = {r[1] for r in conn.execute("PRAGMA table_info(runs)")}
    cols = [c for c in (*COLUMN_NAMES, *(c for c, _ in V2_COLUMNS)) if c in have]
    out = []
    for values in conn.execute(f"SELECT {', '.join(_q(c) for c in cols)} FROM runs ORDER BY seq"):
        row: dict[str, Any] = dict.fromkeys(COLUMN_NAMES)
        row.update(V2_DEFAULTS)
        row.update((c, v) for c, v in zip(cols, values, strict=True) if v is not None or c not in V2_DEFAULTS)
        out.append(row)
    finished_ids = {r["run_id"] for r in out}
    for run_id, start in conn.execute("SELECT run_id, start_unix FROM open_runs ORDER BY start_unix"):
        row = dict.fromkeys(COLUMN_NAMES)
        row.update(run_id=run_id, status="running", start_time=_iso(start))
        if run_id in finished_ids:
            row["ledger_notes"] = "resumed after it had finished"
        out.append(row)
    return out


def _iso(t: Any) -> str | None:
    from datetime import datetime, timezone

    if not isinstance(t, (int, float)):
        return None
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")

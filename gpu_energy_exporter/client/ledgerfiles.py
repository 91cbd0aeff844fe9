"""Reading the run ledger's files for ``gpu-energy-exporter runs``: the runs CSV, record by record, and the
database (``--runs.db``), read-only.

A CSV line that is not a row of the ledger's (torn by a crash, another tool's, not UTF-8, a quote left open,
a line of a megabyte) is described and skipped, and reading goes on at the next line: one bad line never
costs the file. Only a line feed ends a line (a bare carriage return is data: the ledger quotes it); a cell
may span lines when quoted, as RFC 4180 allows, up to ``MAX_RECORD_LINES``.

This module only reads: it never writes a file and never imports anything of the package but ``core``.
"""

from __future__ import annotations

import csv
import os
import sqlite3
from typing import Any

from gpu_energy_exporter.core import runs_db
from gpu_energy_exporter.core.errors import ExporterError
from gpu_energy_exporter.core.runs_schema import NUMERIC_COLUMNS

#: Columns whose presence marks a CSV as the ledger's (older ledger versions may lack newer columns).
_REQUIRED = ("run_id", "start_time", "duration_s", "tokens", "energy_j", "j_per_token")


class RunsError(ExporterError):
    """The ledger cannot be read: the message says which file or URL and what to do."""


#: A CSV record spans at most this many lines (a cell may hold line breaks, quoted); a quote left open longer
#: is a torn or foreign line, reported, and reading goes on at the next line.
MAX_RECORD_LINES = 64
#: Bad rows ``runs`` names one by one on stderr; the rest are counted.
MAX_REPORTED = 10


def load_csv(path: str, bad: list[str] | None = None) -> list[dict[str, Any]]:
    """The rows of a ledger CSV, numbers parsed (empty cells are None). A line that is not a row (torn by a
    crash, another tool's, not UTF-8, a quote left open) is skipped and described in ``bad``; the rows around
    it are read: one bad line never costs the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise RunsError(
            f"runs CSV {path!r} does not exist: the exporter writes it when started with --runs.csv={path} "
            "and a run finishes") from None
    except IsADirectoryError:
        raise RunsError(f"{path!r} is a directory, not a runs CSV") from None
    except OSError as exc:
        raise RunsError(f"cannot read runs CSV {path!r}: {exc.strerror or exc}") from None
    lines = _lines(data.decode("utf-8", errors="replace"))
    header, used, _ = _record(lines, 0)
    lacking = [c for c in _REQUIRED if c not in (header or [])]
    if lacking:
        if data[:4096].count(b"\0") or "\ufffd" in "".join(lines[:1]):
            raise RunsError(f"{path!r} is not a runs CSV written by gpu-energy-exporter (not UTF-8 text)")
        raise RunsError(
            f"{path!r} is not a runs CSV written by gpu-energy-exporter: its header lacks "
            f"{', '.join(lacking)} (expected the columns listed in docs/ledger.md)")
    assert header is not None
    out: list[dict[str, Any]] = []
    i = used
    while i < len(lines):
        cells, used, why = _record(lines, i)
        skip = 1  # a line that is no record: the next one may be
        if cells == []:
            i += used  # an empty line
            continue
        if cells is not None and len(cells) != len(header):
            why = f"{len(cells)} cells where the header has {len(header)}"
        elif cells is not None and any("\ufffd" in c for c in cells):
            why, skip = "not UTF-8 text", used  # a whole record, unreadable
        if why is not None or cells is None:
            if bad is not None:
                bad.append(f"line {i + 1}: {why}")
            i += skip
            continue
        out.append(_typed(dict(zip(header, cells, strict=True))))
        i += used
    return out


def _lines(text: str) -> list[str]:
    """``text``'s lines, each with its ``\n`` (only LF ends a line: a bare CR is data, quoted by the ledger)."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _record(lines: list[str], i: int) -> tuple[list[str] | None, int, str | None]:
    """The CSV record starting at ``lines[i]``: (cells, lines it took, why it is no record or None)."""
    taken = 0

    def feed() -> Any:
        nonlocal taken
        for line in lines[i:i + MAX_RECORD_LINES]:
            taken += 1
            yield line

    reader = csv.reader(feed())
    try:
        cells = next(reader)
    except StopIteration:
        return None, max(1, taken), "a quote left open" if taken else "nothing"
    except csv.Error as exc:
        return None, 1, f"not a CSV row ({exc})"
    if taken > 1 and taken >= MAX_RECORD_LINES:
        return None, 1, "a quote left open"
    return cells, taken, None


def _typed(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in row.items():
        if key is None:  # a row with more cells than the header
            continue
        if raw is None or raw == "":
            out[key] = None
        elif key in NUMERIC_COLUMNS:
            try:
                out[key] = float(raw)
            except ValueError:
                out[key] = None
        else:
            out[key] = raw
    return out


def load_db(path: str) -> list[dict[str, Any]]:
    """The runs in the ledger's database (``--runs.db``), read-only: every finished run's row, then the open
    ones (run id, start and status only)."""
    if not os.path.exists(path):
        raise RunsError(f"run ledger database {path!r} does not exist: the exporter makes it (runs.db in its "
                        "--runs.state-dir, or --runs.db) when started with --runs.csv, --runs.state-dir or --runs.db")
    if os.path.isdir(path):
        raise RunsError(f"{path!r} is a directory: give the database file (runs.db in the exporter's state directory)")
    try:
        conn = runs_db.connect_readonly(path)
        try:
            rows = runs_db.read_runs(conn)
        finally:
            conn.close()
    except runs_db.DatabaseUnreadable as exc:
        raise RunsError(f"{path!r}: {exc}") from None
    except sqlite3.Error as exc:
        raise RunsError(f"{path!r} is not a run ledger database this release can read ({exc})") from None
    return [{k: (_number(k, v)) for k, v in r.items()} for r in rows]


def _number(key: str, value: Any) -> Any:
    if key in NUMERIC_COLUMNS and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value

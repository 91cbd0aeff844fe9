"""Opening the run ledger's store at start, and saying what could not be restored.

``open_store`` opens the database (``ledger.store``) the ledger keeps its runs in, and deals with what can go
wrong before any run is restored:

- **A refused directory or database** (``ledger.trust``: not the exporter's user's own, or writable by
  others; a database of a newer release): nothing in it is read; the ledger keeps its runs in memory (they do
  not survive a restart), and the log says how to fix it.
- **A damaged database** (SQLite cannot read it): the run ids it still names are logged as lost, the file is
  renamed ``*.damaged`` beside it, and a new database is started.
- **A previous release's journal** (a pickle, up to 450c1b4) in the state directory: migrated once into the
  database (``ledger.migrate``) when the directory and the journal files pass the same checks, then renamed
  ``*.migrated``; a journal that cannot be migrated is logged with what it held, and left as it is.

``Losses`` is what was lost, everywhere it must show: the log (which runs, how many seconds), the
``gpuenergy_ledger_state_lost_total`` counter, the ``losses`` table, and a note on the row of each affected
run that pushes again (a run whose record was lost, or any run that starts within ``--runs.stale-after`` of a
start that lost runs it cannot name). Callers hold the ledger's lock around ``note``; nothing here touches a run
otherwise.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from typing import Any

from gpu_energy_exporter.ledger import codec, migrate, trust
from gpu_energy_exporter.ledger.files import iso_utc
from gpu_energy_exporter.ledger.journal import legacy_journal
from gpu_energy_exporter.ledger.store import (
    Batch,
    Loss,
    Store,
    StoredRow,
    StoreRefused,
    damaged,
    move_aside,
    salvage,
)

log = logging.getLogger(__name__)

#: A run's timeline is saved apart from the rest of its state (``open_runs.timeline``).
TIMELINE = frozenset({"timeline"})

DAMAGED_RECORD = "damaged_record"
DAMAGED_DATABASE = "damaged_database"
MIGRATION_FAILED = "migration_failed"
REFUSED = "refused"
#: ``gpuenergy_ledger_state_lost_total``'s reasons, every one from zero.
REASONS = (DAMAGED_RECORD, DAMAGED_DATABASE, MIGRATION_FAILED, REFUSED)

class Losses:
    """What the ledger lost at start (see the module docstring). ``window_s``: how long after the start a new
    run may be one that was going before it (``--runs.stale-after``)."""

    def __init__(self, window_s: float) -> None:
        self.counts: dict[str, float] = dict.fromkeys(REASONS, 0.0)
        self.unsaved: list[Loss] = []  # not in the losses table yet
        self.by_run: dict[str, str] = {}  # run id -> the note its row gets if it pushes again
        self.window: tuple[float, str] | None = None  # (until, note) for runs that cannot be named
        self._window_s = window_s

    def run(self, reason: str, run_id: str, start: float | None, saved: float | None, why: str) -> None:
        """A run whose state is lost: logged, counted, stored, and noted if it comes back."""
        self.counts[reason] += 1
        span = ""
        if start is not None and saved is not None and saved >= start:
            span = f" from {iso_utc(start)} to {iso_utc(saved)} ({saved - start:.0f} s, and until it pushes again)"
        log.error("run ledger: run %r lost its accumulated state (%s): its energy and tokens%s are not counted; if "
                  "it pushes again it goes on as a new run, its row noting the loss", run_id, why,
                  span or " up to now")
        self.unsaved.append(Loss(reason, run_id, start, saved, why))
        self.by_run[run_id] = (f"the exporter lost this run's state at a restart ({why}): its energy and tokens "
                               f"before {iso_utc(saved) if saved is not None else 'the restart'} are not counted")

    def unknown(self, reason: str, why: str, now: float, *, store: bool = True) -> None:
        """State lost without the runs it held being known (a refused directory, a journal that does not
        load): logged, counted, and a note on runs that start soon after ``now``."""
        self.counts[reason] += 1
        if store:
            self.unsaved.append(Loss(reason, None, None, now, why))
        self.window = (now + self._window_s, (
            f"the exporter started at {iso_utc(now)} without the state of the runs going before ({why}): had "
            "this run begun before then, its energy and tokens up to then are not counted"))

    def note(self, run: Any) -> str | None:
        """The note ``run`` (a ``runs.Run``) gets, once; None when it lost nothing (ledger lock held)."""
        if getattr(run, "restored", None) is not None:
            return None  # restored: it lost nothing
        text = self.by_run.pop(run.run_id, None)
        if text is None and self.window is not None and run.s <= self.window[0]:
            text = self.window[1]
        if text is None or text in run.notes:
            return None
        run.notes.append(text)
        return text


def open_store(path: str, state_dir: str | None, losses: Losses, now: float) -> Store | None:
    """The ledger's store at ``path``, the previous release's journal in ``state_dir`` migrated into it;
    None when it is refused (the runs are kept in memory)."""
    try:
        store = Store.open(path)
    except StoreRefused as exc:
        _refused(str(exc), losses, now)
        return None
    except sqlite3.Error as exc:
        if not damaged(exc):  # unavailable (an I/O error, locked...), not damaged: left as it is
            _refused(f"cannot open {path} ({exc})", losses, now)
            return None
        replaced = replace_damaged(path, exc, losses, now)
        if replaced is None:
            return None
        store = replaced
    except OSError as exc:
        _refused(f"cannot open {path} ({exc.strerror or exc})", losses, now)
        return None
    if state_dir is not None:
        _migrate_journal(store, state_dir, losses, now)
    return store


def _refused(why: str, losses: Losses, now: float) -> None:
    log.error("run ledger: refusing its state: %s. Nothing there is read or written: runs are kept in memory only "
              "and do not survive a restart (rows are still written to --runs.csv). Or point --runs.state-dir / "
              "--runs.db at a directory of the exporter's user's own.", why)
    losses.unknown(REFUSED, f"state refused: {why}", now, store=False)


def replace_damaged(path: str, exc: Exception, losses: Losses, now: float) -> Store | None:
    runs, rows = salvage(path)
    aside = move_aside(path)
    log.error("run ledger: the database %s is damaged (%s): moved to %s and a new one started. Lost with it: %s",
              path, exc, aside, ", ".join([f"open run {r[0]!r}" for r in runs] + [f"the unwritten row of run {r!r}"
                                                                                     for r in rows]) or
              "whatever it held (no run id could be read)")
    for run_id, start, saved in runs:
        losses.run(DAMAGED_DATABASE, str(run_id), _num(start), _num(saved), f"the database was damaged: {exc}")
    for run_id in rows:
        losses.unsaved.append(Loss(DAMAGED_DATABASE, run_id, None, None, "its finished row was in a damaged database"))
    if not runs:
        losses.unknown(DAMAGED_DATABASE, f"the database was damaged: {exc}", now)
    try:
        return Store.open(path)
    except (StoreRefused, sqlite3.Error, OSError) as again:
        _refused(f"cannot start a new database at {path} ({again})", losses, now)
        return None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _migrate_journal(store: Store, state_dir: str, losses: Losses, now: float) -> None:
    files = legacy_journal(state_dir)
    if not files:
        return
    done = store.meta()
    problem = trust.directory_problem(state_dir)
    for path in files:
        problem = problem or trust.file_problem(path)
    if problem:
        log.error("run ledger: not migrating the previous release's journal in %s: %s. Its open runs are lost.",
                  state_dir, problem)
        losses.unknown(MIGRATION_FAILED, f"the previous release's journal was refused: {problem}", now)
        return
    newest = files[0]
    if "migrated:" + os.path.basename(newest) in done:
        _rename_migrated(files)
        return
    try:
        legacy = migrate.read(newest)
    except migrate.MigrationError as exc:
        log.error("run ledger: cannot migrate the previous release's journal (%s): the runs it held open and its "
                  "unwritten rows are lost; the file is left as it is", exc)
        losses.unknown(MIGRATION_FAILED, f"the previous release's journal could not be migrated: {exc}", now)
        return
    batch = Batch(meta={"migrated:" + os.path.basename(newest): iso_utc(now) or ""})
    saved = legacy.saved_wall if legacy.saved_wall is not None else now
    for run in legacy.active:
        if isinstance(getattr(run, "run_id", None), str):
            batch.open_runs[run.run_id] = (float(run.s), saved, codec.dumps(codec.encode(run, TIMELINE)),
                                           codec.dumps(codec.encode(run.timeline)))
    base = store.max_seq()  # the rows follow those already in the database, in their order
    for i, row in enumerate(sorted(legacy.pending, key=lambda r: r["seq"]), base + 1):
        batch.rows.append(StoredRow(i, row["run_id"], row["start"], row["summary"], row["doc"],
                                    summary_name=row["json_name"]))
    for name in ("frame", "clock"):
        value = getattr(legacy, name)
        if value is not None:
            batch.meta[name] = codec.dumps(codec.encode(value))
    batch.meta["seq"] = str(max(legacy.seq, base + len(batch.rows), int(done.get("seq", "0") or 0)))
    if legacy.finished_counts:
        batch.meta["finished_counts"] = codec.dumps(legacy.finished_counts)
    for run_id, what in legacy.lost:
        if run_id is not None:
            losses.run(MIGRATION_FAILED, run_id, None, saved, f"the previous release's journal: {what}")
        else:
            losses.counts[MIGRATION_FAILED] += 1
            losses.unsaved.append(Loss(MIGRATION_FAILED, None, None, saved, what))
            log.error("run ledger: the previous release's journal %s: a record of an unknown run: %s", newest, what)
    try:
        store.commit(batch)
    except OSError as exc:
        log.error("run ledger: cannot write the migrated journal into %s (%s): the previous release's runs are "
                  "not restored now (migrated at the next start)", store.path, exc)
        losses.unknown(MIGRATION_FAILED, f"the migrated journal could not be written: {exc}", now, store=False)
        return
    log.info("run ledger: migrated the previous release's journal %s into %s: %d open run(s), %d row(s) still to "
             "write%s", newest, store.path, len(batch.open_runs), len(batch.rows),
             f"; fields that took their defaults: {', '.join(sorted(set(legacy.problems)))}" if legacy.problems
             else "")
    _rename_migrated(files)


def _rename_migrated(files: list[str]) -> None:
    for path in files:
        try:
            os.replace(path, path + ".migrated")
        except OSError as exc:
            log.warning("run ledger: cannot rename the migrated journal %s (%s); the database records that it was "
                        "migrated, so it is not read again", path, exc)

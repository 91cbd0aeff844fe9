"""The run ledger's store and file writer on plain values and real files (``ledger.store``,
``ledger.filewriter``, ``ledger.restart``): a torn write-ahead log, a database that does not grow with its
checkpoints, a ledger restored from its database after a stop, a row already appended before a crash, a torn
CSV line and temporary files a crash left. Same snapshots, points and injected clock as tests/test_ledger.py;
the exporter process is killed for real in tests/test_ledger_restart.py. (Issue 20's journal tests, against
the database that replaced the journal in issue 30.)
"""

from __future__ import annotations

import csv
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from test_ledger import T0, UUID_A, Clock, Harness, constant, point, trainer

from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.files import HEADER_LINE, csv_line
from gpu_energy_exporter.ledger.store import WAL_LIMIT_BYTES, Batch, Store


def _state(n: int) -> Batch:
    return Batch(full=True, open_runs={"r": (T0, T0 + n, f'{{"n": {n}, "pad": "{"x" * 100_000}"}}', None)})


def _saved_n(store: Store) -> int:
    [(run_id, _, _, _, state, *_timeline)] = store.load().open_runs
    return int(state.split(",")[0].split(":")[1])


def test_a_torn_write_ahead_log_loses_only_the_torn_transaction(tmp_path: Path) -> None:
    """Killed in the middle of a commit: the transaction before it is whole, the torn one is not there."""
    store = Store.open(str(tmp_path / "state" / "runs.db"))
    store.commit(_state(1))
    store._connect().execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.commit(_state(2))  # in the write-ahead log only
    copy = tmp_path / "copy"
    copy.mkdir(mode=0o700)
    for suffix in ("", "-wal"):
        shutil.copy(str(tmp_path / "state" / "runs.db") + suffix, str(copy / "runs.db") + suffix)
    wal = copy / "runs.db-wal"
    size = wal.stat().st_size
    assert size > 100_000
    os.truncate(wal, size - 5000)  # the last frames never reached the disk
    store.close()
    assert _saved_n(Store.open(str(copy / "runs.db"))) == 1
    assert _saved_n(Store.open(str(tmp_path / "state" / "runs.db"))) == 2


def test_checkpoints_do_not_grow_the_database(tmp_path: Path) -> None:
    """200 checkpoints of a 100 KB state: the database and its write-ahead log stay a few times one state, never
    rewritten by hand (SQLite's own checkpoints and ``journal_size_limit``)."""
    path = tmp_path / "state" / "runs.db"
    store = Store.open(str(path))
    for n in range(200):
        store.commit(_state(n))
    db, wal = path.stat().st_size, Path(str(path) + "-wal").stat().st_size
    print(f"store figures: database {db >> 10} KB, WAL {wal >> 10} KB after 200 checkpoints of 100 KB")
    assert db < 2_000_000 and wal <= max(WAL_LIMIT_BYTES, 5_000_000)
    store.close()
    assert _saved_n(Store.open(str(path))) == 199
    assert not Path(str(path) + "-wal").exists() or Path(str(path) + "-wal").stat().st_size == 0, \
        "a clean close leaves the database whole in one file"


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_ledger_stopped_mid_run_comes_back_and_charges_the_gap(tmp_path: Path) -> None:
    """A run at 100 W and 10 tokens/s: 10 s, a stop, 10 s down, 10 s more. One row: 30 s, 3,000 J (the gap's
    1,000 J from the counter), 300 tokens; never an ``exporter_stopped`` row."""
    csv_path, state = tmp_path / "runs.csv", str(tmp_path / "state")
    clock = Clock()
    first = RunLedger(str(csv_path), warmup_s=0.0, stale_after_s=300.0, clock=clock, state_dir=state)
    h = Harness(first, clock, {UUID_A: constant(100.0)})
    pushes = trainer(h, "long", T0, T0 + 30, rate=10.0, every=1.0)
    h.run_until(T0 + 10, pushes)
    first.close()
    assert not csv_path.exists(), "an open run is kept in the database, not closed as exporter_stopped"
    clock.t = T0 + 20  # the downtime: the trainer went on, its counter too
    second = RunLedger(str(csv_path), warmup_s=0.0, stale_after_s=300.0, clock=clock, state_dir=state)
    h2 = Harness(second, clock, {UUID_A: constant(100.0)})  # its first snapshot, at +20, closes the gap
    h2.t = T0 + 20
    h2.run_until(T0 + 31, going_on(h2, "long", T0, T0 + 21, T0 + 30, rate=10.0))
    second.close()
    [row] = _rows(csv_path)
    assert row["run_id"] == "long" and row["status"] == "finished"
    assert float(row["duration_s"]) == pytest.approx(30.0)
    assert float(row["energy_j"]) == pytest.approx(3000.0)
    assert float(row["tokens"]) == pytest.approx(300.0)
    assert "gap_s=10.0" in row["ledger_notes"]


def going_on(h: Harness, run_id: str, origin: float, start: float, end: float, rate: float):  # type: ignore[no-untyped-def]
    """The trainer's pushes after the restart: cumulative tokens since ``origin``, every second from
    ``start``; the finish at ``end``."""
    state = {"next": start, "done": False}

    def pushes(t: float) -> None:
        while state["next"] <= min(t, end) + 1e-9:
            pt = state["next"]
            h.push(point(run_id, "training_tokens_total", rate * (pt - origin), pt))
            state["next"] += 1.0
        if t >= end and not state["done"]:
            h.push(point(run_id, "training_run_finished", 1, end))
            state["done"] = True

    return pushes


def test_a_stored_row_already_appended_is_not_appended_again_and_leftovers_go(tmp_path: Path) -> None:
    """Killed after the row's append but before the database marked it exported: the restart finds the row
    among the CSV's last lines. A torn last line and temporary files from another crash are cleaned up."""
    csv_path, state = tmp_path / "runs.csv", str(tmp_path / "state")
    clock = Clock()
    first = RunLedger(str(csv_path), warmup_s=0.0, stale_after_s=300.0, clock=clock, state_dir=state)
    h = Harness(first, clock, {UUID_A: constant(100.0)})
    h.run_until(T0 + 10, trainer(h, "done", T0, T0 + 5, rate=10.0, every=1.0))
    [written] = first.runs()
    first.close()
    line = csv_path.read_bytes().splitlines(keepends=True)[1]
    assert line == csv_line(written)
    with sqlite3.connect(os.path.join(state, "runs.db")) as db:
        assert db.execute("SELECT run_id, exported FROM runs").fetchall() == [("done", 1)]
        # What the database would hold had the process died right after the append: the row, unexported.
        db.execute("UPDATE runs SET exported = 0")
    with csv_path.open("ab") as f:
        f.write(b"half,a,ro")  # and a torn line from an interrupted append after it
    (tmp_path / ".runs.csv.abc123.tmp").write_bytes(b"x" * 1000)
    (tmp_path / "runs" / ".done.json.def456.tmp").write_bytes(b"{")
    second = RunLedger(str(csv_path), warmup_s=0.0, stale_after_s=300.0, clock=clock, state_dir=state)
    Harness(second, clock, {UUID_A: constant(100.0)})
    second.close()
    assert csv_path.read_bytes() == HEADER_LINE + line, "the row once, the torn line cut off"
    leftovers = [p for p in (*tmp_path.iterdir(), *(tmp_path / "runs").iterdir()) if p.name.endswith(".tmp")]
    assert leftovers == []
    assert os.path.exists(tmp_path / "runs" / "done.json")
    with sqlite3.connect(os.path.join(state, "runs.db")) as db:
        assert db.execute("SELECT run_id, exported FROM runs").fetchall() == [("done", 1)]


def test_a_senders_clock_is_placed_against_arrival_and_keeps_its_spacing() -> None:
    """``restart.steady_point_time``: clocks that agree are trusted (a late point stays late); a skewed one
    is placed by arrival; a step either way never puts a point after its arrival or an hour away."""
    from gpu_energy_exporter.ledger.restart import steady_point_time

    offsets: dict[str, dict[str, float]] = {}

    def place(run: str, t: float, received: float) -> float:
        return steady_point_time(offsets, run, "0", t, received, late_window_s=120.0)

    assert place("ok", 100.0, 100.2) == 100.0
    assert place("ok", 90.0, 130.0) == 90.0  # a retried export: late, kept at its own time
    assert place("behind", 70.0, 100.0) == 100.0  # 30 s behind: at its arrival
    assert place("behind", 71.0, 101.0) == 101.0  # its spacing kept
    assert place("behind", 71.5, 101.6) == pytest.approx(101.5)
    assert place("ahead", 3700.0, 100.0) == 100.0  # an hour ahead
    assert place("ahead", 3701.0, 101.0) == 101.0
    assert place("ok", 3800.0, 140.0) == 140.0  # stepped forward an hour: never after its arrival
    assert place("ok", 3801.0, 141.0) == 141.0
    assert place("ok", 202.0, 142.0) == 142.0  # and back an hour: re-anchored at its arrival
    assert place("ok", 203.0, 143.0) == 143.0

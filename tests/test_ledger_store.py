"""The run ledger's database (issue 30), in process on real files: the state codec round-trips every field of
the ledger's classes whatever they are; a damaged record names the run it loses; a directory or database that
is not the exporter's own is refused and nothing in it is read; a planted pickle never runs, even in a trusted
directory; the schema only moves forward; the example queries of docs/ledger.md run in the ``sqlite3``
command-line tool; ``runs --db`` reads the file. Same snapshots, points and clock as tests/test_ledger.py; the
exporter process and the previous release's real state: tests/test_ledger_upgrade.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pickle
import re
import shutil
import sqlite3
import subprocess
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from test_ledger import T0, UUID_A, Clock, Harness, constant, point, trainer

from gpu_energy_exporter.client import runs as runs_cli
from gpu_energy_exporter.core import runs_db
from gpu_energy_exporter.core.runs_schema import COLUMN_NAMES
from gpu_energy_exporter.ledger import RunLedger, codec
from gpu_energy_exporter.ledger.accounting import Acc
from gpu_energy_exporter.ledger.journal import FORMAT, record
from gpu_energy_exporter.ledger.runs import Run
from gpu_energy_exporter.ledger.series_state import SeriesState
from gpu_energy_exporter.ledger.snapshot_frames import Frame, GPUFrame, SpanFrame
from gpu_energy_exporter.ledger.split import Proc
from gpu_energy_exporter.ledger.store import Batch, Store, StoredRow

ROOT = Path(__file__).resolve().parent.parent


def _ledger(tmp_path: Path, clock: Clock, **kw: Any) -> RunLedger:
    return RunLedger(str(tmp_path / "runs.csv"), warmup_s=0.0, stale_after_s=300.0, clock=clock,
                     state_dir=str(tmp_path / "state"), **kw)


def _lost(ledger: RunLedger) -> dict[str, float]:
    return dict(ledger._durable.losses.counts)


# ----------------------------------------------------------------------------------------------------
# the codec


def _value_for(annotation: str, n: int) -> Any:
    """A value of a field's type that is not its default (``n`` makes it distinct)."""
    text = annotation.replace(" ", "")
    base = text.split("|")[0]
    if base.startswith("float"):
        return 1.5 + n
    if base.startswith("int"):
        return 7 + n
    if base.startswith("str"):
        return f"s{n}\r\x1b"
    if base.startswith("bool"):
        return True
    if base.startswith("dict"):
        return {"k": 2.5 + n, ("t", n): [1, 2]} if "tuple" in base.split(",")[0] else {"k": 2.5 + n}
    if base.startswith("set"):
        return {f"m{n}"}
    if base.startswith("frozenset"):
        return frozenset({n})
    if base.startswith("tuple"):
        return (1.0 + n, "x")
    if base.startswith("deque"):
        return deque([(1.0, 2.0 + n)], maxlen=64)
    if base.startswith("list"):
        return [n, "y"]
    return None


def _filled(cls: type) -> Any:
    kwargs = {f.name: _value_for(str(f.type), i) for i, f in enumerate(dataclasses.fields(cls)) if f.init}
    return cls(**{k: v for k, v in kwargs.items() if v is not None})


@pytest.mark.parametrize("cls", [Acc, SeriesState, GPUFrame, SpanFrame, Proc])
def test_every_field_of_the_ledgers_dataclasses_round_trips_whatever_they_are(cls: type) -> None:
    """Generic over ``dataclasses.fields``: a field added to these classes later is covered as it comes."""
    obj = _filled(cls)
    back = codec.loads(codec.dumps(codec.encode(obj)))
    assert type(back) is cls
    for f in dataclasses.fields(cls):
        assert getattr(back, f.name) == getattr(obj, f.name), f.name
        assert type(getattr(back, f.name)) is type(getattr(obj, f.name)), f.name


def test_a_record_missing_a_field_takes_its_default_and_an_unknown_field_is_dropped() -> None:
    data = codec.encode(Acc(t=5.0, energy_j=12.0, per_gpu_j={"a": 1.0}))
    del data["f"]["energy_j"]  # written by a release before the field existed
    data["f"]["joules_of_the_future"] = 3.0  # by a release after this one
    back = codec.decode(data, codec.Decoded())
    assert back == Acc(t=5.0, per_gpu_j={"a": 1.0})
    del data["f"]["t"]  # a required field: its type's zero
    assert codec.decode(data, codec.Decoded()).t == 0.0


def test_a_whole_run_round_trips_and_a_field_that_does_not_decode_keeps_the_run() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    h.run_until(T0 + 20, trainer(h, "r", T0, T0 + 100, rate=10.0, every=1.0, metadata={"model": "m"}))
    run = ledger._active["r"]
    data = codec.encode(run)
    back = codec.loads(codec.dumps(data))
    assert isinstance(back, Run)
    for key, value in vars(run).items():
        if key in codec.TRANSIENT[Run]:
            continue
        got = getattr(back, key)
        if key == "timeline":
            assert vars(got) == vars(value)
        else:
            assert got == value, key
    data["f"]["gauges"] = {"__d": "not a list"}  # damaged in part
    report = codec.Decoded()
    partly = codec.decode(data, report)
    assert partly.run_id == "r" and partly.acc == run.acc and partly.gauges == {}
    assert report.problems and "gauges" in report.problems[0]


def test_a_record_cannot_name_a_class_outside_the_ledgers_state() -> None:
    for name in ("os:system", "subprocess:Popen", "builtins:eval", "gpu_energy_exporter.ledger.store:Store"):
        with pytest.raises(codec.DecodeError):
            codec.loads(json.dumps({"__c": name, "f": {}}))


# ----------------------------------------------------------------------------------------------------
# damaged records


def test_a_damaged_record_names_the_lost_run_and_its_row_says_so(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Two open runs saved; a byte of one run's record changes on disk: the other is restored, the lost one is
    logged with its id and how many seconds of it are lost, counted, and its row, when it pushes again, says
    so. Before: a bad record dropped the run with no log line."""
    clock = Clock()
    first = _ledger(tmp_path, clock)
    h = Harness(first, clock, {UUID_A: constant(100.0)})
    keep, lose = trainer(h, "keep-me", T0, T0 + 100, rate=10.0, every=1.0), \
        trainer(h, "lose-me", T0, T0 + 100, rate=10.0, every=1.0)
    h.run_until(T0 + 30, lambda t: (keep(t), lose(t)))
    first.close()
    db = tmp_path / "state" / "runs.db"
    data = bytearray(db.read_bytes())
    at = data.find(b'"run_id":"lose-me"')
    assert at > 0, "the record is in the database file (the WAL was checkpointed at close)"
    flip = at + len(b'"run_id":"lose-me"') + 2  # the next key's first letter (",\"s\":..." -> ",\"t\":...")
    data[flip] ^= 0x07  # one byte changed on disk
    db.write_bytes(bytes(data))
    caplog.set_level(logging.ERROR)
    clock.t = T0 + 40
    second = _ledger(tmp_path, clock)
    assert set(second._active) == {"keep-me"}
    lost = [r.getMessage() for r in caplog.records if "lose-me" in r.getMessage()]
    assert lost and "checksum" in lost[0] and "30 s" in lost[0], lost
    assert _lost(second)["damaged_record"] == 1
    text = "\n".join(s.name + str(s.labels) + str(s.value) for m in second.collect() for s in m.samples)
    assert "gpuenergy_ledger_state_lost_total{'reason': 'damaged_record'}1.0" in text
    h2 = Harness(second, clock, {UUID_A: constant(100.0)})
    h2.t = T0 + 40
    h2.push(point("lose-me", "training_tokens_total", 400.0, T0 + 40))
    h2.push(point("lose-me", "training_run_finished", 1, T0 + 45))
    h2.push(point("keep-me", "training_run_finished", 1, T0 + 45))
    h2.run_until(T0 + 50)
    second.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT reason, run_id FROM losses").fetchall() == [("damaged_record", "lose-me")]
    rows = {r["run_id"]: r for r in runs_cli.load_csv(str(tmp_path / "runs.csv"))}
    assert "lost this run's state" in rows["lose-me"]["ledger_notes"]
    assert "lost this run's state" not in rows["keep-me"]["ledger_notes"] and rows["keep-me"]["tokens"] == 300.0
    assert "gap_s=10.0" in rows["keep-me"]["ledger_notes"]


def test_a_damaged_database_is_moved_aside_and_a_new_one_started(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    (tmp_path / "state").mkdir(mode=0o700)
    db = tmp_path / "state" / "runs.db"
    db.write_bytes(b"SQLite format 3\0" + os.urandom(8192))
    db.chmod(0o600)
    caplog.set_level(logging.ERROR)
    ledger = _ledger(tmp_path, clock)
    assert ledger._durable.store is not None
    assert [p.name for p in (tmp_path / "state").iterdir() if p.name.endswith(".damaged")]
    assert _lost(ledger)["damaged_database"] == 1
    assert any("is damaged" in r.getMessage() for r in caplog.records)
    ledger.close()


# ----------------------------------------------------------------------------------------------------
# trust


class _Planted:
    """A record that runs a command when unpickled (what a tenant plants)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _plant(directory: Path, marker: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    payload = pickle.dumps({"format": FORMAT, "active": [_Planted(marker)], "pending": []})
    path = directory / "journal-00000001.log"
    path.write_bytes(record(payload))  # a valid CRC: the old journal would have unpickled it
    return path


def test_a_planted_record_in_a_foreign_world_writable_directory_is_never_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: the journal in a pre-created, world-writable state directory was unpickled (code ran as root)."""
    marker = tmp_path / "pwned"
    state = tmp_path / "state"
    _plant(state, marker)
    state.chmod(0o777)
    if os.geteuid() == 0:
        os.chown(state, 65534, 65534)  # nobody's
    caplog.set_level(logging.ERROR)
    clock = Clock()
    ledger = _ledger(tmp_path, clock)
    assert not marker.exists(), "the planted record ran"
    assert ledger._durable.store is None, "runs in memory"
    refusal = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert refusal and str(state) in refusal[0] and "chmod" in refusal[0], refusal
    assert _lost(ledger)["refused"] == 1
    assert not (state / "runs.db").exists()
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    h.run_until(T0 + 10, trainer(h, "still-counted", T0, T0 + 5, rate=10.0, every=1.0))
    ledger.close()
    [row] = runs_cli.load_csv(str(tmp_path / "runs.csv"))
    assert row["run_id"] == "still-counted" and row["energy_j"] == pytest.approx(500.0)
    assert "without the state of the runs going before" in row["ledger_notes"]


def test_a_planted_record_in_a_trusted_directory_is_refused_by_the_restricted_unpickler(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "pwned"
    journal = _plant(tmp_path / "state", marker)
    (tmp_path / "state").chmod(0o700)
    caplog.set_level(logging.ERROR)
    ledger = _ledger(tmp_path, Clock())
    assert not marker.exists(), "the planted record ran"
    assert ledger._durable.store is not None
    assert _lost(ledger)["migration_failed"] == 1
    msg = [r.getMessage() for r in caplog.records if "cannot migrate" in r.getMessage()]
    assert msg and "posix.system" in msg[0] and "refused" in msg[0], msg
    assert journal.exists(), "left as it is"
    ledger.close()


@pytest.mark.parametrize("case", ["group-writable db", "db of another user", "db a symlink", "group-owned dir"])
def test_a_database_or_directory_others_could_write_is_refused(tmp_path: Path, case: str) -> None:
    state = tmp_path / "parent" / "state"
    state.mkdir(parents=True, mode=0o700)
    db = state / "runs.db"
    Store.open(str(db)).close()
    if case == "group-writable db":
        db.chmod(0o660)
    elif case == "db of another user":
        if os.geteuid() != 0:
            pytest.skip("needs root to give a file to another user")
        os.chown(db, 65534, 65534)
    elif case == "db a symlink":
        db.rename(state / "real.db")
        db.symlink_to(state / "real.db")
    else:
        state.chmod(0o770)
    ledger = _ledger(tmp_path, Clock(), db_path=str(db))
    assert ledger._durable.store is None and _lost(ledger)["refused"] == 1
    ledger.close()


def test_a_parent_others_can_write_is_warned_about_not_refused(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """They could move the state away, not plant one (a Kubernetes emptyDir's mount point is 0777)."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o777)
    caplog.set_level(logging.WARNING)
    ledger = RunLedger(None, clock=Clock(), state_dir=str(tmp_path / "shared" / "state"))
    assert ledger._durable.store is not None
    assert any("writable by other users" in r.getMessage() and "shared" in r.getMessage() for r in caplog.records)
    ledger.close()


def test_the_database_is_created_private_to_the_exporters_user(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, Clock())
    ledger.close()
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "state" / "runs.db").stat().st_mode & 0o777 == 0o600


# ----------------------------------------------------------------------------------------------------
# schema


def test_a_database_of_a_newer_release_is_refused_and_an_older_runs_table_gains_the_columns(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir(mode=0o700)
    db = tmp_path / "state" / "runs.db"
    Store.open(str(db)).close()
    with sqlite3.connect(db) as conn:
        conn.execute("ALTER TABLE runs DROP COLUMN mfu")  # an older release had no such column
    store = Store.open(str(db))
    assert "mfu" in [r[1] for r in store._connect().execute("PRAGMA table_info(runs)")]
    store.close()
    with sqlite3.connect(db) as conn:
        conn.execute(f"PRAGMA user_version={runs_db.SCHEMA_VERSION + 1}")
    ledger = _ledger(tmp_path, Clock())
    assert ledger._durable.store is None and _lost(ledger)["refused"] == 1
    ledger.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == runs_db.SCHEMA_VERSION + 1, "never written"


# ----------------------------------------------------------------------------------------------------
# queries


def _summary(run_id: str, day: str, backend: str, kwh: float, tokens: float) -> dict[str, Any]:
    s: dict[str, Any] = dict.fromkeys(COLUMN_NAMES)
    s.update(run_id=run_id, status="finished", start_time=f"{day}T10:00:00.000Z", end_time=f"{day}T11:00:00.000Z",
             backend=backend, energy_kwh=kwh, energy_j=kwh * 3.6e6, tokens=tokens, duration_s=3600.0,
             j_per_token=kwh * 3.6e6 / tokens, co2_g=kwh * 400)
    return s


def _queries() -> list[str]:
    """The example queries of docs/ledger.md (the ```sql blocks of its "Querying" section)."""
    text = (ROOT / "docs" / "ledger.md").read_text()
    section = text.split("### Example queries", 1)[1]
    return re.findall(r"```sql\n(.*?)```", section, re.S)[:3]


def test_the_example_queries_of_the_docs_run_in_the_sqlite3_tool(tmp_path: Path) -> None:
    """Per backend, per day and per Slurm account, with Debian's sqlite3 command-line tool."""
    tool = shutil.which("sqlite3")
    if tool is None:
        pytest.fail("the sqlite3 command-line tool is missing (Debian package sqlite3; .ci/setup-test-env installs it)")
    (tmp_path / "state").mkdir(mode=0o700)
    db = tmp_path / "state" / "runs.db"
    store = Store.open(str(db))
    rows = [("a", "2024-05-01", "unsloth", 1.0, 1e6, "ml-team"), ("b", "2024-05-01", "bitsandbytes", 2.0, 1e6, ""),
            ("c", "2024-05-02", "unsloth", 3.0, 3e6, "ml-team"), ("d", "2024-05-02", "unsloth", 0.5, 1e6, "vision")]
    batch = Batch()
    for seq, (run_id, day, backend, kwh, tokens, account) in enumerate(rows, 1):
        meta = {"backend": backend, **({"slurm_account": account, "slurm_job_id": str(100 + seq)} if account else {})}
        batch.rows.append(StoredRow(seq, run_id, 0.0, _summary(run_id, day, backend, kwh, tokens),
                                    {"run_id": run_id, "metadata": meta}, exported=True))
    store.commit(batch)
    store.close()
    per_backend, per_day, per_account = _queries()
    out = [subprocess.run([tool, "-csv", str(db), q], capture_output=True, text=True, check=True).stdout
           for q in (per_backend, per_day, per_account)]
    print("sqlite3 figures:", *out, sep="\n")
    backend = {line.split(",")[0]: line.split(",")[1:] for line in out[0].splitlines()}
    assert backend["unsloth"][0] == "3" and float(backend["unsloth"][1]) == pytest.approx(4.5)
    assert float(backend["unsloth"][2]) == pytest.approx(4.5 * 3.6e6 / 5e6)
    assert backend["bitsandbytes"][0] == "1"
    day = {line.split(",")[0]: line.split(",")[1:] for line in out[1].splitlines()}
    assert day["2024-05-01"][0] == "2" and float(day["2024-05-02"][1]) == pytest.approx(3.5)
    account = {line.split(",")[0]: line.split(",")[1:] for line in out[2].splitlines()}
    assert set(account) == {"ml-team", "vision"} and float(account["ml-team"][1]) == pytest.approx(4.0)


def test_runs_db_reads_the_finished_and_the_open_runs(tmp_path: Path) -> None:
    clock = Clock()
    ledger = _ledger(tmp_path, clock)
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    done, going = trainer(h, "done", T0, T0 + 5, rate=10.0, every=1.0), \
        trainer(h, "going", T0, T0 + 100, rate=10.0, every=1.0)
    h.run_until(T0 + 10, lambda t: (done(t), going(t)))
    ledger.close()
    import io

    out, err = io.StringIO(), io.StringIO()
    assert runs_cli.main(["--db", str(tmp_path / "state" / "runs.db"), "--format", "json"], stdout=out, stderr=err,
                         environ={}) == 0, err.getvalue()
    got = {r["run_id"]: r for r in json.loads(out.getvalue())["runs"]}
    assert got["done"]["status"] == "finished" and got["done"]["tokens"] == 50.0
    assert math.isclose(got["done"]["energy_j"], 250.0)  # the GPU shared evenly with "going"
    assert got["going"]["status"] == "running" and got["going"]["start_time"].startswith("2023-11-14T22:13:20")
    out = io.StringIO()
    assert runs_cli.main(["--db", str(tmp_path / "runs.csv")], stdout=out, stderr=err, environ={}) == 2
    assert "not a run ledger database" in err.getvalue()


def test_a_frame_round_trips_with_its_gpus_and_processes() -> None:
    g = _filled(GPUFrame)
    frame = Frame(T0, {"a": g}, {"m": "a"}, 400.0, 1.2, 5e9, (), {"m": (3, 0.5)}, 0.1, (2.0, 300.0))
    assert codec.loads(codec.dumps(codec.encode(frame))) == frame


def test_a_journal_record_that_does_not_migrate_names_its_run_and_the_rest_migrates(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A journal of the pickle releases whose open runs are one good run and one record that is no run (a row
    where a run belongs): the good run is restored, the other is named as lost and its row says so."""
    from gpu_energy_exporter.ledger.filewriter import Row

    clock = Clock()
    old = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(old, clock, {UUID_A: constant(100.0)})
    h.run_until(T0 + 10, trainer(h, "good", T0, T0 + 100, rate=10.0, every=1.0))
    good = old._active["good"]
    good.live_memo = good.settled_memo = None
    misplaced = Row(1, "misplaced", T0, {}, {})
    state = {"format": FORMAT, "active": [good, misplaced], "pending": [], "frame": old._history[-1],
             "seq": 0, "finished_counts": {}, "saved_wall": T0 + 10}
    (tmp_path / "state").mkdir(mode=0o700)
    (tmp_path / "state" / "journal-00000001.log").write_bytes(record(pickle.dumps(state)))
    caplog.set_level(logging.ERROR)
    clock.t = T0 + 15
    ledger = _ledger(tmp_path, clock)
    assert set(ledger._active) == {"good"} and ledger._active["good"].acc.energy_j == pytest.approx(1000.0)
    assert _lost(ledger)["migration_failed"] == 1
    assert any("'misplaced'" in r.getMessage() and "did not migrate" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "state" / "journal-00000001.log.migrated").exists()
    h2 = Harness(ledger, clock, {UUID_A: constant(100.0)})
    h2.t = T0 + 15
    h2.run_until(T0 + 25, trainer(h2, "misplaced", T0 + 16, T0 + 20, rate=10.0, every=1.0))
    ledger.close()
    [row] = runs_cli.load_csv(str(tmp_path / "runs.csv"))
    assert row["run_id"] == "misplaced" and "lost this run's state" in row["ledger_notes"]


def test_state_saved_before_a_module_was_renamed_decodes_as_it_was() -> None:
    # Issue 32 renamed ledger modules: a database written by the release before names the old modules, and an
    # upgrade must restore its open runs whole (the class is found by its unique name).
    frame = Frame(t=5.0, gpus={"GPU-a": GPUFrame("GPU-a", "H100", 10.0, 300.0, 1, 2, 50.0, "flag", 0, None)},
                  mig_parent={}, intensity=400.0, pue=1.2, host_available=None)
    old, new = "gpu_energy_exporter.ledger." + "frames:", "gpu_energy_exporter.ledger.snapshot_frames:"
    text = codec.dumps(codec.encode(frame))
    assert new in text
    text = text.replace(new, old)
    report = codec.Decoded()
    assert codec.loads(text, report) == frame and not report.problems

"""Exports every reader reads (issue 30, item 5): the runs CSV quoted as RFC 4180 requires, a torn line of any
length kept apart from the rows after it, ``runs --csv`` reading past any bad line, and no control character
from a run id reaching the terminal through ``runs --format csv`` or ``report``. The ledger in process (same
snapshots, points and clock as tests/test_ledger.py), the commands through their ``main``.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from test_ledger import T0, UUID_A, Clock, Harness, constant, trainer

from gpu_energy_exporter.client import runs as runs_cli
from gpu_energy_exporter.client.report import cli as report_cli
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.files import HEADER_LINE

#: What a terminal acts on: C0 controls but tab and line feed, DEL, C1 (CSI \x9b, OSC \x9d ...).
CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _finish(csv_path: Path, run_ids: list[str]) -> None:
    """Each run: 100 W, 10 tokens/s, 5 s; written to ``csv_path`` when it closes."""
    clock = Clock()
    ledger = RunLedger(str(csv_path), warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    pushes = [trainer(h, run_id, T0, T0 + 5, rate=10.0, every=1.0) for run_id in run_ids]

    def push_all(t: float) -> None:
        for p in pushes:
            p(t)

    h.run_until(T0 + 10, push_all)
    ledger.close()


def _reader_rows(path: Path) -> list[list[str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_a_run_id_with_a_carriage_return_round_trips_through_the_csv_and_runs(tmp_path: Path) -> None:
    """Before: ``'\\r=1+1`` was written unquoted, splitting the row for every CSV reader and making
    ``runs --csv`` fail on the whole file."""
    path = tmp_path / "runs.csv"
    ids = ["\r=1+1", "two\rparts", "a \"quoted\", comma\nand line"]
    _finish(path, ids)
    rows = _reader_rows(path)
    header = rows[0]
    assert len(rows) == 1 + len(ids), rows
    assert all(len(r) == len(header) for r in rows)
    got = [dict(zip(header, r, strict=True)) for r in rows[1:]]
    assert [r["run_id"] for r in got] == ["'\r=1+1", "two\rparts", "a \"quoted\", comma\nand line"], \
        "the ids as written (the formula-like one neutralised with its leading ')"
    assert [r["status"] for r in got] == ["finished"] * 3 and [float(r["tokens"]) for r in got] == [50.0] * 3
    out, err = io.StringIO(), io.StringIO()
    assert runs_cli.main(["--csv", str(path), "--format", "json"], stdout=out, stderr=err, environ={}) == 0, \
        err.getvalue()
    doc = json.loads(out.getvalue())
    assert [r["run_id"] for r in doc["runs"]] == ["'\r=1+1", "two\rparts", "a \"quoted\", comma\nand line"]
    assert err.getvalue() == ""


def test_a_torn_line_of_a_megabyte_leaves_the_next_rows_readable(tmp_path: Path) -> None:
    """Before: the ledger appended its next row to a torn line longer than the 256 KiB it looks back, gluing
    the row onto it (and a quote left open in it swallowed the rows after)."""
    path = tmp_path / "runs.csv"
    _finish(path, ["before"])
    torn = b'torn,"a quote left open ' + b"x" * (1 << 20)
    with path.open("ab") as f:
        f.write(torn)  # no line break: a 1 MB line cut short (or another tool's)
    _finish(path, ["after-1", "after-2"])
    data = path.read_bytes()
    assert data.startswith(HEADER_LINE) and torn in data, "the foreign line is kept, not cut"
    old = csv.field_size_limit(1 << 24)
    try:
        rows = _reader_rows(path)
    finally:
        csv.field_size_limit(old)
    ids = [r[0] for r in rows[1:]]
    assert ids[0] == "before" and ids[-2:] == ["after-1", "after-2"], ids[:1] + ids[-2:]
    assert len(rows[-1]) == len(rows[0]) and len(rows[-2]) == len(rows[0])
    out, err = io.StringIO(), io.StringIO()
    assert runs_cli.main(["--csv", str(path), "--format", "json"], stdout=out, stderr=err, environ={}) == 0
    assert [r["run_id"] for r in json.loads(out.getvalue())["runs"]] == ["before", "after-1", "after-2"]
    assert "line 3:" in err.getvalue() and "skipped" in err.getvalue(), err.getvalue()


def test_runs_csv_never_crashes_and_reports_each_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "runs.csv"
    _finish(path, ["one"])
    good = path.read_bytes().splitlines(keepends=True)[1]
    with path.open("ab") as f:
        f.write(b"short,row\n")
        f.write(b"\xff\xfe not utf-8," + good[3:])
        f.write(b"\0\0\0\n")
        f.write(good.replace(b"one,", b"two,", 1))
    out, err = io.StringIO(), io.StringIO()
    assert runs_cli.main(["--csv", str(path)], stdout=out, stderr=err, environ={}) == 0
    assert re.search(r"^one\s", out.getvalue(), re.M) and re.search(r"^two\s", out.getvalue(), re.M)
    assert err.getvalue().count("skipped") == 3, err.getvalue()


SNEAKY = "evil\x1b]0;owned\x07\x1b[2J\x9b31m\x08\x7f"


def test_no_escape_sequence_reaches_stdout_from_runs_in_any_format(tmp_path: Path) -> None:
    """Before: ``runs --format csv`` wrote ESC, BEL and OSC sequences of run ids straight to the terminal."""
    path = tmp_path / "runs.csv"
    _finish(path, [SNEAKY])
    for fmt in ("csv", "table", "json"):
        out, err = io.StringIO(), io.StringIO()
        assert runs_cli.main(["--csv", str(path), "--format", fmt], stdout=out, stderr=err, environ={}) == 0
        assert "evil" in out.getvalue(), fmt
        assert not CONTROLS.search(out.getvalue()), (fmt, out.getvalue()[:300])
        assert not CONTROLS.search(err.getvalue())
    out, err = io.StringIO(), io.StringIO()
    runs_cli.main(["--csv", str(tmp_path / f"missing{SNEAKY}.csv")], stdout=out, stderr=err, environ={})
    assert "does not exist" in err.getvalue() and not CONTROLS.search(err.getvalue())


def test_no_escape_sequence_reaches_the_terminal_from_report(tmp_path: Path) -> None:
    """Before: ``report`` printed run ids and file names as they were, in its summary and progress lines."""
    pytest.importorskip("matplotlib", reason="report's plots need the [report] extra")
    path = tmp_path / "runs.csv"
    _finish(path, [SNEAKY])
    [written] = list((tmp_path / "runs").glob("*.json"))
    assert json.loads(written.read_text())["run_id"] == SNEAKY, "the summary keeps the id as pushed"
    summary = tmp_path / f"run{SNEAKY}.json"
    shutil.copy(written, summary)
    out, err = io.StringIO(), io.StringIO()
    rc = report_cli.main([str(summary), "--out", str(tmp_path / "report")], stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    assert "evil" in out.getvalue() and "reading" in err.getvalue()
    assert not CONTROLS.search(out.getvalue()), out.getvalue()
    assert not CONTROLS.search(err.getvalue()), err.getvalue()

"""``gpu-energy-exporter runs``: the table, the group comparison, the formats and the errors.

The CSV is written by the ledger's own ``append_csv_row`` (what the exporter writes); ``--url`` reads a
real ledger served by the real HTTP server on an ephemeral port.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from helpers import free_port

from gpu_energy_exporter.client.api import URL_ENV
from gpu_energy_exporter.client.runs import CSV_ENV, main
from gpu_energy_exporter.core.runs_schema import COLUMN_NAMES
from gpu_energy_exporter.daemon import cli
from gpu_energy_exporter.daemon.api import api_routes
from gpu_energy_exporter.http.server import HTTPServer
from gpu_energy_exporter.http.webconfig import load_web_config
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.files import append_csv_row

GIB = float(1 << 30)


def _row(run_id: str, backend: str, j_per_token: float, tok_s: float, vram_gib: float, **extra: Any) -> dict:  # type: ignore[type-arg]
    tokens = tok_s * 600
    energy = j_per_token * tokens
    return {
        "run_id": run_id, "status": "finished", "start_time": "2024-05-01T10:00:00.000Z",
        "end_time": "2024-05-01T10:10:00.000Z", "duration_s": 600.0, "warmup_s": 30.0, "window_s": 570.0,
        "model": "llama-3-8b", "backend": backend, "tokens": tokens, "tokens_per_s": tok_s,
        "j_per_token": j_per_token, "energy_j": energy, "energy_kwh": energy / 3.6e6, "avg_power_w": energy / 600,
        "peak_power_w": 612.4, "vram_peak_bytes": vram_gib * GIB, "co2_g": energy / 3.6e6 * 480, **extra,
    }


@pytest.fixture
def ledger_csv(tmp_path: Path) -> Path:
    path = tmp_path / "runs.csv"
    for row in (
        _row("bnb-1", "bitsandbytes", 0.80, 1000.0, 12.0, mfu=0.375),
        _row("uns-1", "unsloth", 0.50, 1900.0, 6.0),
        _row("bnb-2", "bitsandbytes", 1.00, 1200.0, 13.0),
        _row("uns-2", "unsloth", 0.62, 2100.0, 7.5, status="stale"),
    ):
        append_csv_row(str(path), row)
    return path


def run_cli(argv: list[str], environ: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(argv, stdout=out, stderr=err, environ=environ or {})
    return rc, out.getvalue(), err.getvalue()


def test_table_lists_every_run_aligned(ledger_csv: Path) -> None:
    rc, out, err = run_cli(["--csv", str(ledger_csv)])
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["run", "id", "start", "(UTC)", "duration", "model", "backend", "tokens", "tok/s",
                                "J/token", "MFU", "kWh", "avg", "W", "peak", "W", "VRAM", "peak", "GiB", "gCO2",
                                "status"]
    assert [line.split()[0] for line in lines[1:]] == ["bnb-1", "uns-1", "bnb-2", "uns-2"]
    bnb1 = lines[1].split()
    # run id, date, time, duration, model, backend, tokens, tok/s, J/token, MFU, kWh, avg W, peak W, VRAM, gCO2,
    # status (the README promises MFU per run: issue 22)
    assert bnb1[3:] == ["0:10:00", "llama-3-8b", "bitsandbytes", "600,000", "1,000", "0.800", "37.5%", "0.133",
                        "800", "612", "12.0", "64.00", "finished"]
    assert lines[2].split()[9] == "-"  # a run without FLOPs or peak has no MFU
    # Right-aligned numbers: every row has the same length up to the status column.
    status_at = lines[0].index("status")
    assert all(line[status_at - 2: status_at] == "  " for line in lines[1:])


def test_group_by_backend_compares_means_and_ratios(ledger_csv: Path) -> None:
    rc, out, err = run_cli(["--csv", str(ledger_csv), "--group-by", "backend"])
    assert rc == 0, err
    assert "by backend (mean over runs):" in out
    groups = out.split("by backend (mean over runs):\n", 1)[1].splitlines()
    assert groups[0].split()[:3] == ["backend", "runs", "mean"]
    assert groups[1].split()[:5] == ["bitsandbytes", "2", "0.900", "1,100", "12.5"]
    assert groups[2].split()[:5] == ["unsloth", "2", "0.560", "2,000", "6.8"]
    # unsloth / bitsandbytes: J/token 0.56/0.9, tokens/s 2000/1100, VRAM 6.75/12.5
    assert "unsloth vs bitsandbytes: J/token 0.62x, tokens/s 1.82x, VRAM peak 0.54x" in out

    rc, out, _ = run_cli(["--csv", str(ledger_csv), "--group-by", "backend", "--baseline", "unsloth"])
    assert rc == 0
    assert "bitsandbytes vs unsloth: J/token 1.61x, tokens/s 0.55x, VRAM peak 1.85x" in out


def test_status_filter_and_json_and_csv_formats(ledger_csv: Path) -> None:
    rc, out, _ = run_cli(["--csv", str(ledger_csv), "--status", "finished", "--format", "json",
                          "--group-by", "backend"])
    assert rc == 0
    doc = json.loads(out)
    assert [r["run_id"] for r in doc["runs"]] == ["bnb-1", "uns-1", "bnb-2"]
    assert doc["runs"][0]["j_per_token"] == 0.8 and doc["runs"][0]["notes"] is None
    comp = doc["comparison"]
    assert comp["baseline"] == "bitsandbytes"
    assert comp["comparisons"][0]["j_per_token_ratio"] == pytest.approx(0.5 / 0.9)

    rc, out, _ = run_cli(["--csv", str(ledger_csv), "--format", "csv"])
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == list(COLUMN_NAMES) and rows[3]["status"] == "stale"
    assert rows[0]["tokens"] == "600000"


def test_environment_variable_names_the_file(ledger_csv: Path) -> None:
    rc, out, _ = run_cli([], environ={CSV_ENV: str(ledger_csv)})
    assert rc == 0 and "uns-2" in out
    assert CSV_ENV == "GPU_ENERGY_EXPORTER_RUNS_CSV"


def test_clear_errors(tmp_path: Path, ledger_csv: Path) -> None:
    # without --csv or --url: the exporter's URL ($GPU_ENERGY_EXPORTER_URL here: a port nothing listens on)
    rc, _, err = run_cli([], environ={URL_ENV: f"http://127.0.0.1:{free_port()}"})
    assert rc == 2 and "nothing listens at" in err
    rc, _, err = run_cli(["--csv", str(tmp_path / "nope.csv")])
    assert rc == 2 and "does not exist" in err and "--runs.csv=" in err
    foreign = tmp_path / "energy_results.csv"
    foreign.write_text("model,backend,energy_J,J_per_token\nllama,bnb,1,2\n")
    rc, _, err = run_cli(["--csv", str(foreign)])
    assert rc == 2 and "is not a runs CSV written by gpu-energy-exporter" in err and "run_id" in err
    binary = tmp_path / "blob.csv"
    binary.write_bytes(b"\xff\xfe\x00\x81garbage")
    rc, _, err = run_cli(["--csv", str(binary)])
    assert rc == 2 and "not a runs CSV" in err
    rc, _, err = run_cli(["--csv", str(ledger_csv), "--group-by", "colour"])
    assert rc == 2 and "not a ledger column" in err
    rc, _, err = run_cli(["--csv", str(ledger_csv), "--group-by", "backend", "--baseline", "deepspeed"])
    assert rc == 2 and "groups: bitsandbytes, unsloth" in err
    rc, _, err = run_cli(["--url", "http://127.0.0.1:1"])
    assert rc == 2 and "nothing listens at http://127.0.0.1:1 (connection refused): is the exporter running?" in err


def test_empty_ledger_says_so(tmp_path: Path) -> None:
    path = tmp_path / "runs.csv"
    path.write_text(",".join(COLUMN_NAMES) + "\n")
    rc, out, _ = run_cli(["--csv", str(path)])
    assert rc == 0 and out == f"no runs in {path} yet\n"


def test_status_filter_that_matches_nothing_says_what_the_file_has(ledger_csv: Path) -> None:
    # Issue 12: `runs --status stale` on a file with 5 runs (none stale) said "no runs in ... yet".
    rc, out, _ = run_cli(["--csv", str(ledger_csv), "--status", "exporter_stopped"])
    assert rc == 0 and out == f"none of the 4 runs in {ledger_csv} has status exporter_stopped\n"
    rc, out, _ = run_cli(["--csv", str(ledger_csv), "--status", "stale"])
    assert rc == 0 and "uns-2" in out and "no runs" not in out


def test_abbreviated_flags_are_refused(ledger_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, _ = run_cli(["--csv", str(ledger_csv), "--group", "backend"])
    assert rc == 2 and "unrecognized arguments: --group" in capsys.readouterr().err


def _live_ledger() -> RunLedger:
    clock_t = [1_700_000_000.0]
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=lambda: clock_t[0])
    from gpu_energy_exporter.otlp.store import AcceptedPoint

    labels = {"run_id": "live-1", "rank": "0", "gpu_uuid": "GPU-SIM00000-x", "backend": "unsloth"}
    ledger.on_point(AcceptedPoint("live-1", "training_run_info", labels, 1.0, clock_t[0], "gauge"))
    ledger.on_point(AcceptedPoint("live-1", "training_tokens_total", labels, 4096.0, clock_t[0], "counter"))
    return ledger


def test_without_csv_it_reads_the_exporter_at_the_url_environment_variable() -> None:
    # Issue 12: `runs` had no default exporter URL ($GPU_ENERGY_EXPORTER_URL, then localhost:9863).
    ledger = _live_ledger()
    server = HTTPServer(("127.0.0.1", 0), api_routes(dict, ledger.runs, ledger.run), name="test").start()
    try:
        rc, out, err = run_cli([], environ={URL_ENV: server.url})
    finally:
        server.shutdown()
    assert rc == 0, err
    assert out.splitlines()[1].startswith("live-1")


def test_url_with_basic_auth_takes_user_and_password_file(tmp_path: Path) -> None:
    # Issue 12: `runs --url` had no --user/--password-file (top and report have them); one client for all.
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  ops: '{hashed}'\n")
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    ledger = _live_ledger()
    server = HTTPServer(("127.0.0.1", 0), api_routes(dict, ledger.runs, ledger.run), name="test",
                        web_config=load_web_config(str(web))).start()
    try:
        rc, out, err = run_cli(["--url", server.url, "--user", "ops", "--password-file", str(pw)])
        rc_no, _, err_no = run_cli(["--url", server.url])
    finally:
        server.shutdown()
    assert rc == 0, err
    assert "live-1" in out
    assert rc_no == 2 and "needs credentials (401 Unauthorized): pass --user and --password-file" in err_no
    assert "running" not in err_no


def test_demo_runs_are_marked_simulated_in_the_table() -> None:
    ledger = _live_ledger()
    server = HTTPServer(("127.0.0.1", 0), api_routes(dict, ledger.runs, ledger.run), name="test").start()
    try:
        rc, out, err = run_cli(["--url", server.url])
    finally:
        server.shutdown()
    assert rc == 0, err
    assert "not a measurement" in out
    header, row = out.splitlines()[:2]
    # The first column is the bare run id, so that copying it into `report RUN_ID` works (issue 22: it
    # read "live-1 (SIMULATED)", which report did not know); the mark is on the status, the last column.
    assert row.split()[0] == "live-1"
    assert header.split()[-1] == "status" and row.endswith("(SIMULATED)")
    assert "live-1 (SIMULATED)" not in out


def test_url_reads_a_running_ledger() -> None:
    clock_t = [1_700_000_000.0]
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=lambda: clock_t[0])
    from gpu_energy_exporter.otlp.store import AcceptedPoint

    labels = {"run_id": "live-1", "rank": "0", "gpu_uuid": "GPU-x", "backend": "unsloth"}
    ledger.on_point(AcceptedPoint("live-1", "training_run_info", labels, 1.0, clock_t[0], "gauge"))
    ledger.on_point(AcceptedPoint("live-1", "training_tokens_total", labels, 4096.0, clock_t[0], "counter"))
    server = HTTPServer(("127.0.0.1", 0), api_routes(dict, ledger.runs, ledger.run), name="test").start()
    try:
        rc, out, err = run_cli(["--url", server.url])
        rc_json, out_json, _ = run_cli(["--url", server.url, "--format", "json"])
    finally:
        server.shutdown()
    assert rc == 0, err
    row = out.splitlines()[1].split()
    assert row[0] == "live-1" and "unsloth" in row and "4,096" in row and row[-1] == "running"
    assert json.loads(out_json)["runs"][0]["tokens"] == 4096.0


def test_the_exporter_cli_dispatches_to_runs(ledger_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["runs", "--csv", str(ledger_csv), "--group-by", "backend"]) == 0
    assert "unsloth vs bitsandbytes" in capsys.readouterr().out
    assert cli.main(["runs", "--help"]) == 0
    assert "--group-by" in capsys.readouterr().out


def test_a_live_runs_unsettled_energy_is_marked_provisional_in_runs_and_top() -> None:
    """Issue 28: a live run whose energy includes the power readings' estimate since the last counter read
    is marked `~` (J/token, kWh, average power, CO2) with one line saying what it means; a settled one is not."""
    from gpu_energy_exporter.client import fmt
    from gpu_energy_exporter.client.runs import runs_table
    from gpu_energy_exporter.client.top.frame import _run_cells

    live = {"run_id": "r1", "status": "running", "tokens": 1000.0, "j_per_token": 0.5, "energy_kwh": 0.001,
            "energy_j": 3600.0, "avg_power_w": 300.0, "co2_g": 1.2, "energy_provisional_j": 120.0}
    settled = {**live, "run_id": "r2", "energy_provisional_j": 0.0}
    text = runs_table([live, settled])
    r1 = next(line for line in text.splitlines() if line.startswith("r1"))
    r2 = next(line for line in text.splitlines() if line.startswith("r2"))
    assert r1.count(fmt.PROVISIONAL_MARK) == 4 and fmt.PROVISIONAL_MARK not in r2
    assert fmt.PROVISIONAL_NOTE in text
    assert fmt.PROVISIONAL_NOTE not in runs_table([settled])
    cells = _run_cells(live)
    assert [c for c in cells if c.startswith(fmt.PROVISIONAL_MARK)] == [cells[3], cells[6], cells[7]]
    assert not any(c.startswith(fmt.PROVISIONAL_MARK) for c in _run_cells(settled))


def test_a_report_of_a_live_run_says_which_energy_is_provisional() -> None:
    from gpu_energy_exporter.client.report.render import summary_rows
    from gpu_energy_exporter.client.report.run import RunData

    summary = {"run_id": "r1", "status": "running", "energy_j": 3600.0, "avg_power_w": 300.0, "j_per_token": 0.5,
               "co2_g": 1.2, "tokens": 1000.0, "warmup_s": 30.0, "energy_provisional_j": 120.0}
    rows = dict(summary_rows(RunData("r1", "api", summary)))
    assert rows["settlement"].startswith("~120") and "provisional" in rows["settlement"]
    assert rows["total energy"].startswith("~") and rows["CO2"].startswith("~")
    assert rows["J/token (after a 30 s warm-up)"].startswith("~")
    assert "settlement" not in dict(summary_rows(RunData("r1", "api", {**summary, "energy_provisional_j": 0.0})))

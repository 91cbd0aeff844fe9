"""Files off the hot path (issue 20, item 3), with the exporter as a real process: a stalled file system
(a FIFO standing in for hung NFS: opening it for writing blocks until a reader comes), a full one (a small
tmpfs), a big CSV and 256 open runs. Sampling, scrapes and shutdown never wait on the ledger's files; a
row is appended (free space and memory for one line), and a row not written stays in the journal until it
is, exactly once.

Runs are pushed as raw OTLP protobuf (the helpers of test_otlp_limits.py); fake NVML draws 300 W.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fakenvml import Constant, Scenario, h100
from helpers import ExporterProcess, free_port, sample_value, wait_until
from test_otlp_limits import _wrap, counter, gauge, post

from gpu_energy_exporter.core.runs_schema import COLUMN_NAMES
from gpu_energy_exporter.ledger.files import HEADER_LINE

WATTS = 300.0


def _push(exp: ExporterProcess, run_ids: list[str], gpu: str, tokens: float, finished: float | None = None) -> None:
    for start in range(0, len(run_ids), 16):  # --otlp.max-new-runs-per-request
        metrics = [counter("training.tokens", {"run_id": r, "rank": "0", "gpu_uuid": gpu}, tokens, unit="{token}")
                   for r in run_ids[start:start + 16]]
        if finished is not None:
            metrics.append(gauge("training.run.finished",
                                 [({"run_id": r, "rank": "0"}, finished) for r in run_ids[start:start + 16]]))
        status, response = post(exp.push_url, _wrap(*metrics))
        assert status == 200 and response.partial_success.rejected_data_points == 0, response


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _metrics_when(exp: ExporterProcess, check: Callable[[str], bool]) -> str | None:
    text = exp.metrics()
    return text if check(text) else None


def _gpu_energy(exp: ExporterProcess) -> float:
    value = sample_value(exp.metrics(), "gpuenergy_gpu_energy_joules_total", gpu="0")
    assert value is not None
    return value


def _exporter(start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path, runs_csv: Path,
              *extra: str) -> tuple[ExporterProcess, str]:
    gpu = h100(0, power=Constant(WATTS))
    if not (tmp_path / "scenario.ini").exists():
        Scenario(epoch=time.time() - 60, gpus=[gpu]).write(tmp_path / "scenario.ini")
    env = {"FAKE_NVML_SCENARIO": str(tmp_path / "scenario.ini")}
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", "--runs.warmup=0s",
                          f"--runs.csv={runs_csv}", *extra], env).wait_ready()
    return exp, gpu.uuid


def _stop_within(exp: ExporterProcess, seconds: float) -> float:
    t0 = time.monotonic()
    exp.proc.terminate()
    try:
        rc = exp.proc.wait(seconds + 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the exporter did not stop within {seconds + 10:g}s of SIGTERM:\n{exp.log(40)}")
    took = time.monotonic() - t0
    print(f"files figures: SIGTERM took {took:.2f}s")
    assert rc == 0, exp.log(40)
    assert took < seconds, f"SIGTERM took {took:.1f}s (the systemd unit kills at 20s, Kubernetes at 30s)"
    return took


def test_a_stalled_runs_csv_delays_neither_sampling_scrapes_nor_shutdown_and_the_row_survives(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    """Before: with runs.csv on a stalled file system the GPU energy on /metrics froze for 22 s while the
    GPU drew 300 W, SIGTERM did not stop the process, and the run closed with 35 J of about 3,600 J."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    runs_csv = ledger / "runs.csv"
    os.mkfifo(runs_csv)  # no reader ever comes: a write to it hangs like one to a hung NFS server
    port = free_port()
    exp, gpu = _exporter(start_exporter, fake_nvml_lib, tmp_path, runs_csv, f"--otlp.listen-address=127.0.0.1:{port}")
    _push(exp, ["stalled"], gpu, 0.0)
    time.sleep(3.0)
    _push(exp, ["stalled"], gpu, 3000.0, finished=1.0)
    text = wait_until(lambda: _metrics_when(exp, lambda t: sample_value(t, "gpuenergy_ledger_writes_pending") == 1),
                      timeout=20, what="the row waiting to be written")
    assert sample_value(text, "gpuenergy_run_active", run_id="stalled") == 0.0
    # The writer is stuck in open(); the sampler is not: the GPU's energy keeps moving at 300 W.
    e0, t0 = _gpu_energy(exp), time.monotonic()
    time.sleep(2.0)
    e1, t1 = _gpu_energy(exp), time.monotonic()
    print(f"files figures: GPU energy +{e1 - e0:.0f} J in {t1 - t0:.1f}s while the CSV stalled")
    assert e1 - e0 >= 0.5 * WATTS * (t1 - t0), "the GPU energy on /metrics froze while the CSV stalled"
    backlog = sample_value(exp.metrics(), "gpuenergy_ledger_write_backlog_seconds")
    assert backlog is not None and backlog >= 1.0
    _stop_within(exp, 5.0)
    # The file system recovers (here: a plain file instead of the FIFO); the journaled row is written once.
    runs_csv.unlink()
    exp2, _ = _exporter(start_exporter, fake_nvml_lib, tmp_path, runs_csv, f"--otlp.listen-address=127.0.0.1:{port}")
    rows = wait_until(lambda: runs_csv.exists() and _rows(runs_csv) or None, timeout=20,
                      what="the journaled row written after the restart")
    assert [r["run_id"] for r in rows] == ["stalled"]
    row = rows[0]
    assert float(row["tokens"]) == 3000.0
    assert float(row["energy_j"]) == pytest.approx(WATTS * float(row["duration_s"]), rel=0.05)
    assert float(row["duration_s"]) >= 2.5
    assert (ledger / row["summary_file"]).exists()
    exp2.stop()
    assert len(_rows(runs_csv)) == 1


def csv_line(row: dict[str, str]) -> bytes:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([row.get(name, "") for name in COLUMN_NAMES])
    return buf.getvalue().encode()


def _big_csv(path: Path, megabytes: int) -> None:
    row = {name: "x" for name in COLUMN_NAMES}
    line = csv_line(row)
    block = line * max(1, (1 << 20) // len(line))
    with path.open("wb") as f:
        f.write(HEADER_LINE)
        for _ in range(megabytes):
            f.write(block)


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_shutdown_with_a_big_csv_and_256_open_runs_is_quick_and_they_all_come_back(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    """Before: 50 MB of CSV and 256 open runs, SIGTERM took 41.7 s; a 300 MB CSV took the RSS from 45 to
    618 MB for each closed run (the whole file was read and rewritten per row)."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    runs_csv = ledger / "runs.csv"
    _big_csv(runs_csv, 100)
    size = runs_csv.stat().st_size
    port = free_port()
    # one client opens all 256 runs: lift the per-client bounds (issue 20 item 9) above that
    exp, gpu = _exporter(start_exporter, fake_nvml_lib, tmp_path, runs_csv, f"--otlp.listen-address=127.0.0.1:{port}",
                         "--runs.max-active-per-client=512", "--runs.max-new-per-client=1000")
    names = [f"open-{i:03d}" for i in range(255)]
    _push(exp, [*names, "closing"], gpu, 100.0)
    time.sleep(1.0)
    before = _peak_rss(exp.pid)
    _push(exp, ["closing"], gpu, 200.0, finished=1.0)
    wait_until(lambda: runs_csv.stat().st_size > size, timeout=20, what="the closed run's row appended")
    grown = _peak_rss(exp.pid) - before
    print(f"files figures: peak RSS {before >> 20} MB, +{grown >> 20} MB for a row appended to 100 MB of CSV")
    assert grown < 20 << 20, f"appending one row to a 100 MB CSV took {grown >> 20} MB of memory"
    tail = runs_csv.read_bytes()[size:]
    assert tail.startswith(b"closing,") and tail.count(b"\n") == 1, "one line appended, nothing rewritten"
    _push(exp, ["closing-too"], gpu, 100.0)  # the 256th open run
    wait_until(lambda: len([1 for line in exp.metrics().splitlines()
                            if line.startswith("gpuenergy_run_active{") and line.endswith(" 1.0")]) == 256,
               timeout=20, what="256 open runs")
    _stop_within(exp, 5.0)
    exp2, _ = _exporter(start_exporter, fake_nvml_lib, tmp_path, runs_csv, f"--otlp.listen-address=127.0.0.1:{port}")
    text = exp2.metrics()
    active = [line for line in text.splitlines() if line.startswith("gpuenergy_run_active{") and line.endswith(" 1.0")]
    assert len(active) == 256, "every open run came back after the restart"
    _stop_within(exp2, 5.0)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only; the test set-up runs as root in CI and the container)."""
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_nearly_full_file_system_takes_a_row_and_a_full_one_keeps_it_until_there_is_room(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path, small_tmpfs: Path
) -> None:
    """Before: a row needed free space of at least the whole CSV (the file was rewritten for each row)."""
    runs_csv = small_tmpfs / "runs.csv"
    _big_csv(runs_csv, 0)
    with runs_csv.open("ab") as f:  # 600 KB of earlier rows, ~400 KB free: too little to copy the file
        line = csv_line({name: "y" for name in COLUMN_NAMES})
        f.write(line * ((600 << 10) // len(line)))
    exp, gpu = _exporter(start_exporter, fake_nvml_lib, tmp_path, runs_csv,
                         f"--runs.state-dir={tmp_path / 'state'}")
    _push(exp, ["first"], gpu, 10.0)
    time.sleep(1.0)
    _push(exp, ["first"], gpu, 20.0, finished=1.0)
    wait_until(lambda: any(r["run_id"] == "first" for r in _rows(runs_csv)), timeout=20,
               what="the row appended to a CSV larger than the free space")
    # Now fill the file system: the next row cannot be written, is kept and retried.
    filler = small_tmpfs / "filler"
    with filler.open("wb") as f:
        try:
            f.write(b"\0" * (2 << 20))
        except OSError:
            pass
    _push(exp, ["second"], gpu, 10.0)
    time.sleep(1.0)
    _push(exp, ["second"], gpu, 20.0, finished=1.0)
    text = wait_until(lambda: _metrics_when(
        exp, lambda t: (sample_value(t, "gpuenergy_ledger_write_errors_total") or 0) >= 1),
        timeout=20, what="the failed write counted")
    assert sample_value(text, "gpuenergy_ledger_writes_pending") == 1.0
    assert sample_value(text, "gpuenergy_gpu_energy_joules_total", gpu="0") is not None
    filler.unlink()
    wait_until(lambda: [r["run_id"] for r in _rows(runs_csv) if r["run_id"] in ("first", "second")]
               == ["first", "second"], timeout=30, what="the kept row written once there was room (back-off 5 s)")
    wait_until(lambda: _metrics_when(exp, lambda t: sample_value(t, "gpuenergy_ledger_writes_pending") == 0.0),
               timeout=10, what="the backlog back to 0")
    _stop_within(exp, 5.0)
    lines = runs_csv.read_bytes().splitlines()
    assert sum(1 for x in lines if x.startswith(b"second,")) == 1


def test_a_read_only_disk_loses_nothing_accepted_and_writes_once_it_is_writable(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path, small_tmpfs: Path
) -> None:
    """The node's disk remounted read-only (as after file system errors) with a run open in the database and
    the exporter restarted: the run is restored from the read-only database, goes on, finishes; its row
    waits (counted) and is written, once, to the database and the CSV when the disk is writable again."""
    runs_csv = small_tmpfs / "runs.csv"  # the database in .runs-state/ beside it, on the same disk
    exp, gpu = _exporter(start_exporter, fake_nvml_lib, tmp_path, runs_csv)
    _push(exp, ["open-across"], gpu, 100.0)
    time.sleep(1.5)
    _stop_within(exp, 5.0)
    done = subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    try:
        exp, _ = _exporter(start_exporter, fake_nvml_lib, tmp_path, runs_csv)
        assert "read-only file system" in exp.log()
        text = exp.metrics()
        assert sample_value(text, "gpuenergy_run_active", run_id="open-across") == 1.0, "restored, read-only"
        time.sleep(1.0)
        _push(exp, ["open-across"], gpu, 300.0, finished=1.0)
        text = wait_until(lambda: _metrics_when(exp, lambda t: sample_value(t, "gpuenergy_ledger_writes_pending") == 1
                                                and (sample_value(t, "gpuenergy_ledger_write_errors_total") or 0) >= 1),
                          timeout=20, what="the finished run kept, its writes failing")
        e0 = _gpu_energy(exp)
        time.sleep(1.0)
        assert _gpu_energy(exp) > e0, "sampling goes on"
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=False)
    rows = wait_until(lambda: [r for r in _rows(runs_csv) if r["run_id"] == "open-across"] if runs_csv.exists()
                      else None, timeout=30, what="the row written once the disk is writable (back-off 5 s)")
    wait_until(lambda: _metrics_when(exp, lambda t: sample_value(t, "gpuenergy_ledger_writes_pending") == 0.0),
               timeout=10, what="the backlog back to 0")
    _stop_within(exp, 5.0)
    [row] = rows
    assert float(row["tokens"]) == 300.0 and "gap_s=" in row["ledger_notes"]
    assert float(row["energy_j"]) == pytest.approx(WATTS * float(row["duration_s"]), rel=0.05)
    assert [r["run_id"] for r in _rows(runs_csv)] == ["open-across"]
    import sqlite3

    with sqlite3.connect(small_tmpfs / ".runs-state" / "runs.db") as db:
        assert db.execute("SELECT run_id, tokens, exported FROM runs").fetchall() == [("open-across", 300.0, 1)]

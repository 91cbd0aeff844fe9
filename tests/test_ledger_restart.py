"""Runs outlive the exporter (issue 20, item 1): the exporter process killed with SIGTERM or SIGKILL in the
middle of a run and started again on the same ports and files, while a trainer pushes through the training
helper. One row per run, every token once, the downtime's energy from the GPU's counter.

Fake NVML draws a constant 300 W, so the run's energy by hand is 300 W x its duration, whatever the
sampling; tokens are the trainer's own count.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fakenvml import Constant, Scenario, h100
from helpers import ExporterProcess, free_port, wait_until

WATTS = 300.0
TOKENS_PER_STEP = 1000


def _runs(exp: ExporterProcess) -> list[dict[str, Any]]:
    with urllib.request.urlopen(exp.metrics_url + "/api/v1/runs", timeout=10) as r:
        return list(json.load(r)["runs"])


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


class Trainer:
    """A training loop on a thread: ``TOKENS_PER_STEP`` tokens per step, pushing through the helper."""

    def __init__(self, run_id: str, endpoint: str, gpu: str) -> None:
        from gpu_energy_exporter.training import start_run

        self.run = start_run(run_id, model="m", endpoint=endpoint, export_interval=0.5, export_timeout=1.0,
                             gpu_uuids=[gpu])
        self.steps = 0
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.run.step(tokens=TOKENS_PER_STEP)
            self.steps += 1
            time.sleep(0.05)

    def finish(self) -> float:
        self._stop.set()
        self._thread.join(10)
        self.run.finish()
        return time.time()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_run_spanning_an_exporter_restart_is_one_run_with_every_token_and_joule(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    gpu = h100(0, power=Constant(WATTS))
    Scenario(epoch=time.time() - 60, gpus=[gpu]).write(tmp_path / "scenario.ini")
    runs_csv = tmp_path / "ledger" / "runs.csv"
    env = {"FAKE_NVML_SCENARIO": str(tmp_path / "scenario.ini")}
    port = free_port()
    args = [f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", "--runs.warmup=0s",
            f"--runs.csv={runs_csv}", f"--otlp.listen-address=127.0.0.1:{port}", "--runs.journal-interval=1s"]
    first = start_exporter(args, env).wait_ready()
    trainer = Trainer("restart", first.otlp_url, gpu.uuid)

    def running(exp: ExporterProcess) -> dict[str, Any] | None:
        for doc in _runs(exp):
            if doc["run_id"] == "restart" and (doc["tokens"] or 0) > 0:
                return doc
        return None

    wait_until(lambda: running(first), timeout=30, what="the run to show in the ledger")
    time.sleep(2.0)  # a checkpoint or two
    if sig == signal.SIGKILL:
        first.proc.send_signal(sig)
        first.proc.wait(10)
    else:
        assert first.stop(timeout=10) == 0
    time.sleep(1.5)  # the downtime: the trainer keeps training, its pushes fail
    second = start_exporter(args, env).wait_ready()
    assert second.otlp_url == first.otlp_url
    wait_until(lambda: running(second), timeout=30, what="the run to come back after the restart")
    time.sleep(2.0)
    end = trainer.finish()

    def finished() -> dict[str, Any] | None:
        for doc in _runs(second):
            if doc["run_id"] == "restart" and doc["status"] == "finished":
                return doc
        return None

    s = wait_until(finished, timeout=30, what="the run to finish")
    wait_until(lambda: any(r["status"] == "finished" for r in _rows(runs_csv)), timeout=15,
               what="the finished run's CSV row")
    rows = _rows(runs_csv)
    print("restart figures:", sig.name, [(r["status"], r["tokens"], r["energy_j"], r["duration_s"]) for r in rows],
          "trainer tokens", trainer.steps * TOKENS_PER_STEP)
    assert [r["run_id"] for r in rows] == ["restart"], "one row for a run spanning the restart"
    row = rows[0]
    assert float(row["tokens"]) == trainer.steps * TOKENS_PER_STEP, "every token once"
    duration = float(row["duration_s"])
    # The run lasted from the trainer's first point to its finish (both within a second of these marks).
    assert end - trainer.started - 1.5 <= duration <= end - trainer.started + 1.0
    # 300 W over the whole run, the downtime included (the driver's counter across the gap).
    assert float(row["energy_j"]) == pytest.approx(WATTS * duration, rel=0.03)
    assert "gap_s=" in row["ledger_notes"]
    assert s["tokens"] == float(row["tokens"])
    summary = runs_csv.parent / row["summary_file"]
    assert json.loads(summary.read_text())["run_id"] == "restart"
    # The run's Prometheus counters continued from their restored values (none went back to 0).
    text = second.metrics()
    energy = [line for line in text.splitlines() if line.startswith("gpuenergy_run_energy_joules_total{")]
    assert energy and float(energy[0].rsplit(" ", 1)[1]) == pytest.approx(float(row["energy_j"]), rel=0.01)
    second.stop()
    assert [p for p in os.listdir(runs_csv.parent) if p.endswith(".tmp")] == []

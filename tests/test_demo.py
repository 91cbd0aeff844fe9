"""``gpu-energy-exporter demo`` as a user starts it: a subprocess serving simulated GPUs and a simulated
training run on /metrics, filling the run ledger, marked as simulated everywhere, stopping cleanly."""

from __future__ import annotations

import csv
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, ExporterProcess, sample_value, wait_until

from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.tools.demo import DEMO_WARMUP, parse_args

FAST = ["--collector.interval=200ms", "--demo.pause=1s", "--demo.run-duration=3s", "--demo.export-interval=300ms"]


def _json(exp: ExporterProcess, path: str) -> dict[str, Any]:
    status, body, _ = exp.get(path)
    assert status == 200, body
    doc: dict[str, Any] = json.loads(body)
    return doc


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_demo_serves_simulated_gpus_and_runs_then_stops_on_sigterm(
    start_exporter: type[ExporterProcess], tmp_path: Path
) -> None:
    csv_path = tmp_path / "runs.csv"
    exp = start_exporter([*FAST, "--demo.gpus=3", f"--runs.csv={csv_path}"], subcommand=("demo",)).wait_ready()
    text = exp.metrics()
    # Every simulated series is marked as such.
    for gpu in ("0", "1", "2"):
        assert 'backend="simulated"' in text
        assert sample_value(text, "gpuenergy_gpu_up", gpu=gpu) == 1.0
    assert sample_value(text, "gpuenergy_gpu_info", gpu="2", backend="simulated",
                        model="NVIDIA H100 80GB HBM3 (simulated)") == 1.0
    assert "GPU-SIM00002" in text
    assert any("SIMULATED DATA" in line and "level=warn" in line for line in exp.lines)
    status = _json(exp, "/api/v1/status")
    assert status["simulated"] is True and status["backend"] == "simulated" and len(status["gpus"]) == 3
    # The banner says what to do next, with the real URL.
    wait_until(lambda: any("gpu-energy-exporter top" in line for line in exp.lines), what="next steps")
    assert any(f"{exp.metrics_url}/metrics" in line for line in exp.lines)

    # A run pushes through OTLP: training series on /metrics, GPUs under load. The ledger's run series are
    # those of the latest snapshot (prepared on the sampler thread): they follow the first push within one
    # sampling interval.
    def running() -> str | None:
        m = exp.metrics()
        if sample_value(m, "gpuenergy_run_active") is None:
            return None
        for line in m.splitlines():
            if line.startswith("training_tokens_total{") and 'run_id="demo-' in line and float(line.split()[-1]) > 0:
                return m
        return None

    m = wait_until(running, timeout=30, what="a simulated run pushing tokens")
    assert (sample_value(m, "gpuenergy_gpu_utilization_ratio", gpu="0") or 0.0) > 0.5
    assert sample_value(m, "gpuenergy_run_active") == 1.0

    # It finishes, the ledger records it (CSV row + JSON summary), and the next one starts.
    finished = wait_until(lambda: [r for r in _json(exp, "/api/v1/runs")["runs"] if r["status"] == "finished"],
                          timeout=30, what="a finished run in the ledger")
    run = finished[0]
    assert run["energy_j"] > 0 and run["tokens"] > 0 and run["j_per_token"] > 0
    assert run["gpu_count"] == 2 and "(simulated)" in run["gpu_models"]  # GPU 2 serves (below)
    assert run["notes"] == "simulated by gpu-energy-exporter demo"
    assert run["backend"] == "bitsandbytes" and run["total_steps"] > 0
    detail = _json(exp, "/api/v1/run?id=" + run["run_id"])
    assert detail["configured_warmup_s"] == 5.0  # the demo's shortened warm-up
    assert len(detail["timeline"]) >= 5
    wait_until(lambda: csv_path.exists(), what="the runs CSV")
    rows = _rows(csv_path)
    assert rows[0]["run_id"] == run["run_id"] and rows[0]["status"] == "finished"
    assert (tmp_path / "runs" / f"{run['run_id']}.json").exists()
    wait_until(lambda: any(r["backend"] == "unsloth" for r in _json(exp, "/api/v1/runs")["runs"]),
               timeout=20, what="the second run (the other backend)")

    # The simulated vLLM server on the last GPU is a serving session beside the training runs: scraped by the
    # inference collector, charged its GPU's energy, with its output tokens; `runs` marks it.
    [serving] = wait_until(lambda: [r for r in _json(exp, "/api/v1/runs")["runs"] if r.get("kind") == "serving"
                                    and (r.get("energy_j") or 0) > 0 and (r.get("tokens") or 0) > 0],
                           timeout=30, what="the simulated server's serving session")
    assert serving["run_id"].startswith("serving-") and serving["backend"] == "vllm"
    assert serving["gpu_count"] == 1 and "GPU-SIM00002" in serving["gpu_uuids"]
    assert serving["j_per_token"] > 0 and serving["prompt_tokens"] > serving["tokens"]
    assert sample_value(exp.metrics(), "gpuenergy_inference_servers", engine="vllm") == 1.0
    listed = subprocess.run([sys.executable, "-m", "gpu_energy_exporter", "runs", "--url", exp.metrics_url],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert listed.returncode == 0, listed.stderr
    line = next(x for x in listed.stdout.splitlines() if x.startswith(serving["run_id"]))
    assert "(serving)" in line, listed.stdout

    start = time.monotonic()
    assert exp.stop() == 0, exp.log()
    assert time.monotonic() - start < 15
    log = exp.log()
    assert "stopping the demo" in log and "demo stopped" in log
    assert "Traceback" not in log
    # The run going at SIGTERM finished (its final export reached the receiver before it stopped).
    statuses = [r["status"] for r in _rows(csv_path)]
    assert statuses and set(statuses) <= {"finished"}, statuses


def test_demo_says_what_to_do_when_the_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "gpu_energy_exporter", "demo", f"--web.listen-address=127.0.0.1:{port}",
             "--otlp.listen-address=127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "already running" in out.stderr and "--web.listen-address" in out.stderr
    # docs/workstation.md quotes the message a user gets with the default port: the same words (issue 22).
    error = next(line for line in out.stderr.splitlines() if "error:" in line)
    doc = (ROOT / "docs" / "workstation.md").read_text(encoding="utf-8")
    assert error.replace(f"127.0.0.1:{port}", ":9863") in doc


def test_demo_stops_on_sigint_during_the_idle_pause(start_exporter: type[ExporterProcess]) -> None:
    demo = start_exporter(["--demo.pause=1m"], subcommand=("demo",))
    demo.wait_for("Ctrl-C stops the demo", 60)
    demo.proc.send_signal(signal.SIGINT)
    assert demo.proc.wait(20) == 0
    assert demo.stop() == 0
    assert "demo stopped" in demo.log().split("Ctrl-C stops the demo", 1)[1]


def test_flags_are_the_exporters_plus_the_demos() -> None:
    config, opts = parse_args(["--demo.gpus=4", "--demo.run-duration=90s", "--web.listen-address=:9999"], {})
    assert opts.gpus == 4 and opts.run_duration == 90.0 and opts.pause == 20.0 and opts.runs == 0
    assert config.web_listen_address == ("", 9999)
    assert config.runs_warmup == 5.0 and DEMO_WARMUP == "5s"
    # An explicit warm-up, by flag or by environment, wins over the demo's default.
    assert parse_args(["--runs.warmup=1m"], {})[0].runs_warmup == 60.0
    assert parse_args([], {"GPU_ENERGY_EXPORTER_RUNS_WARMUP": "12s"})[0].runs_warmup == 12.0
    with pytest.raises(ConfigError, match="--demo.run-duration"):
        parse_args(["--demo.run-duration=soon"], {})
    with pytest.raises(ConfigError, match="--demo.gpus"):
        parse_args(["--demo.gpus=0"], {})
    with pytest.raises(ConfigError, match="simulates GPUs"):
        parse_args(["--no-collector.gpu"], {})

"""The whole exporter's exposition, as served, against reviewed golden files (node_exporter's
``end-to-end-output.txt`` habit): tests/golden/exporter.prom (text format 0.0.4) and exporter.om
(OpenMetrics, asked for with ``Accept``).

One ``python -m gpu_energy_exporter`` process with every default collector on and fixed inputs:

- GPUs: the fake libnvidia-ml.so.1 with a frozen driver clock, an H100 (a compute process, GPM) and an A100,
  both with an energy counter, so every GPU value is fixed (the counter read at every sample,
  ``--collector.energy-interval=200ms``: between two reads the energy is apportioned by power over wall-clock
  time, which a frozen driver clock does not stop);
- RAPL: ``--path.sysfs`` at the bundled powercap tree (tests/fixtures/sysfs-rapl-server);
- carbon: ``--carbon.region=FRA`` from the bundled table, ``--carbon.pue=1.2``; ``--gpu.idle-power=60``;
- training: one OTLP/JSON request with a point for every instrument of the training contract
  (``core.contract.ALL``) from two ranks: run ``golden-finished`` (done in that one point: a ledger run of
  zero duration, written to ``--runs.csv``) and run ``golden-running`` (still going).

The golden files were made by the same test with ``UPDATE_GOLDEN=1``: review the diff before committing one.
The masks are the shared ``helpers.normalise`` (timestamps, durations, process self-metrics, the Python
version) plus ``MACHINE_OR_TIME`` below, and nothing else: any change of a series name, a label, a
HELP/TYPE/UNIT line or a fixed value fails the test.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from fakenvml import Constant, Driver, Process, Scenario, a100, h100
from helpers import TESTS, VOLATILE, ExporterProcess, check_golden, normalise, sample_value, wait_until

from gpu_energy_exporter.core import contract

GOLDEN = TESTS / "golden"
SYSFS = TESTS / "fixtures" / "sysfs-rapl-server"
PROCFS = Path(__file__).parent / "fixtures" / "procfs-host"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"

#: Families whose values read the machine running the test or the wall clock, on top of ``VOLATILE``:
#: the host's logical CPU count (psutil asks the kernel, not --path.procfs, whose fixed tree gives every other
#: host value), the open
#: connection gauge (a scrape's connection may or may not be closed yet when the next one is counted) and
#: the running run's figures that grow with wall time since its first point (its energy does not: the
#: frozen driver clock keeps the GPU's energy counter still, so dynamic energy = 0 - idle power x time).
MACHINE_OR_TIME = ("gpuenergy_host_logical_cpus", "gpuenergy_http_open_connections", "gpuenergy_run_duration_seconds",
                   "gpuenergy_run_active_seconds_total", "gpuenergy_run_tokens_per_second",
                   "gpuenergy_run_mfu_ratio", "gpuenergy_run_dynamic_energy_joules")

#: The value each instrument's point carries (counters and gauges; the histogram is built below).
VALUES: dict[str, float] = {
    contract.TOKENS.name: 40960.0, contract.SAMPLES.name: 80.0, contract.STEPS.name: 10.0,
    contract.FLOPS.name: 3.1e15, contract.LOSS.name: 2.25, contract.VALIDATION_LOSS.name: 2.5,
    contract.LEARNING_RATE.name: 3e-4, contract.EPOCH.name: 0.5, contract.RUN_INFO.name: 1.0,
    contract.RUN_GPU_INFO.name: 1.0, contract.GLOBAL_STEP.name: 10.0, contract.RUN_TOTAL_STEPS.name: 1000.0,
    contract.MODEL_PARAMETERS.name: 1.5e8,
}


def _attr(key: str, value: str | int) -> dict[str, Any]:
    return {"key": key, "value": {"intValue": str(value)} if isinstance(value, int) else {"stringValue": value}}


def _rank(run_id: str, gpu_uuid: str, finished: bool, now_ns: int) -> dict[str, Any]:
    """One rank's resource with a point for every instrument of the training contract."""
    attrs = [_attr(contract.ATTR_RUN_ID, run_id), _attr(contract.ATTR_RANK, 0), _attr(contract.ATTR_GPU_UUID, gpu_uuid)]
    start, t = str(now_ns - 10_000_000_000), str(now_ns)
    metrics: list[dict[str, Any]] = []
    for ins in contract.ALL:
        point: dict[str, Any] = {"timeUnixNano": t, "attributes": list(attrs)}
        metric: dict[str, Any] = {"name": ins.name, "unit": ins.unit, "description": ins.description}
        if ins is contract.RUN_INFO:
            info = {"model": "tiny-llama", "backend": "eager", "optimizer": "adamw", "precision": "bf16",
                    "batch_size": "8", "seq_len": "512"}
            point["attributes"] += [_attr(k, v) for k, v in info.items()]
        if ins.kind == "histogram":
            counts = ["0"] * (len(contract.STEP_DURATION_BOUNDS) + 1)
            counts[7] = "10"  # every step took 0.1-0.25 s
            point.update(startTimeUnixNano=start, count="10", sum=1.7, bucketCounts=counts,
                         explicitBounds=list(contract.STEP_DURATION_BOUNDS))
            metric["histogram"] = {"aggregationTemporality": 2, "dataPoints": [point]}
        elif ins.kind == "counter":
            point.update(startTimeUnixNano=start, asDouble=VALUES[ins.name])
            metric["sum"] = {"isMonotonic": True, "aggregationTemporality": 2, "dataPoints": [point]}
        else:
            value = (1.0 if finished else 0.0) if ins is contract.RUN_FINISHED else VALUES[ins.name]
            metric["gauge"] = {"dataPoints": [dict(point, asDouble=value)]}
        metrics.append(metric)
    resource = [_attr("service.name", contract.SERVICE_NAME), _attr("service.instance.id", f"{run_id}/0")]
    return {"resource": {"attributes": resource},
            "scopeMetrics": [{"scope": {"name": contract.SCOPE_NAME}, "metrics": metrics}]}


def _push(exp: ExporterProcess, body: dict[str, Any]) -> None:
    req = urllib.request.Request(exp.push_url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200, resp.read()


def _settled(exp: ExporterProcess) -> str | None:
    """The text once every source is in: GPM (two samples), the finished run closed, the running run
    charged at least one snapshot."""
    text = exp.metrics()
    ready = (sample_value(text, "gpuenergy_gpu_sm_active_ratio", gpu="0") is not None
             and sample_value(text, "gpuenergy_ledger_runs_finished_total", status="finished") == 1.0
             and (sample_value(text, "gpuenergy_run_duration_seconds", run_id="golden-running") or 0.0) > 0.0
             and sample_value(text, "gpuenergy_rapl_energy_joules_total", zone="intel-rapl:0") is not None)
    return text if ready else None


def test_whole_exporter_golden_exposition(fake_nvml_lib: Path, tmp_path: Path,
                                          start_exporter: type[ExporterProcess]) -> None:
    t0 = 1_750_000_000.0
    gpus = [h100(0, power=Constant(400.0), energy_offset_mj=123_456_789, processes=(Process(4242, 8 << 30, 80),)),
            a100(1, power=Constant(250.0), util_gpu_pct=55, util_memory_pct=20, memory_used_bytes=10 << 30)]
    scenario = tmp_path / "scenario.ini"
    Scenario(epoch=t0, driver=Driver(frozen_time=t0 + 100.0), gpus=gpus).write(scenario)
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", "--collector.processes",
                          "--collector.energy-interval=200ms", "--collector.gpm-interval=200ms",
                          "--gpu.idle-power=60", f"--path.sysfs={SYSFS}",
                          f"--path.procfs={PROCFS}", "--carbon.region=FRA", "--carbon.pue=1.2",
                          f"--runs.csv={tmp_path / 'runs.csv'}", "--runs.warmup=0s"],
                         {"FAKE_NVML_SCENARIO": str(scenario)}).wait_ready()
    now = time.time_ns()
    _push(exp, {"resourceMetrics": [_rank("golden-finished", gpus[1].uuid, True, now),
                                    _rank("golden-running", gpus[0].uuid, False, now)]})
    wait_until(lambda: _settled(exp), timeout=20, what="every source in the exposition")
    time.sleep(0.5)  # one more snapshot, so that nothing is caught half way

    status, text, headers = exp.get()
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    status, om, headers = exp.get(headers={"Accept": OPENMETRICS})
    assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    assert om.endswith("# EOF\n")
    assert "Traceback" not in exp.log() and "golden-finished finished" in exp.log(), exp.log()

    masked = (*VOLATILE, *MACHINE_OR_TIME)
    check_golden(normalise(text, volatile=masked), GOLDEN / "exporter.prom")
    check_golden(normalise(om, volatile=masked), GOLDEN / "exporter.om")

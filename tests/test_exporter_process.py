"""The whole exporter as a subprocess on the fake NVML library: serving, faults, shutdown, promtool lint."""

from __future__ import annotations

import gzip
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from fakenvml import Constant, Driver, Scenario, build_library, h100, v100
from helpers import ExporterProcess, require_binary, sample_value, wait_until

FAST = ["--collector.interval=200ms"]


def _scenario(tmp_path: Path, sc: Scenario) -> dict[str, str]:
    path = tmp_path / "scenario.ini"
    sc.write(path)
    return {"FAKE_NVML_SCENARIO": str(path)}


def test_serves_gpu_and_host_metrics_and_stops_cleanly_on_sigterm(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    gpus = [h100(0, power=Constant(300.0)), v100(1, power=Constant(150.0))]
    env = _scenario(tmp_path, Scenario(epoch=time.time() - 10, gpus=gpus))
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", *FAST], env).wait_ready()
    text = exp.metrics()
    assert sample_value(text, "gpuenergy_gpu_up", gpu="0", gpu_uuid=gpus[0].uuid) == 1.0
    assert sample_value(text, "gpuenergy_gpu_power_watts", gpu="1") == pytest.approx(150.0)
    assert sample_value(text, "gpuenergy_host_memory_total_bytes") > 0
    assert sample_value(text, "gpuenergy_collector_success", collector="host") == 1.0
    assert sample_value(text, "gpuenergy_build_info") == 1.0
    assert sample_value(text, "gpuenergy_process_resident_memory_bytes") > 0
    status, body, _ = exp.get("/-/ready")
    assert status == 200
    status, body, _ = exp.get("/")
    assert status == 200 and "/metrics" in body
    # OpenMetrics by negotiation, gzip on request
    req = urllib.request.Request(exp.metrics_url + "/metrics", headers={
        "Accept": "application/openmetrics-text;version=1.0.0", "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        om = gzip.decompress(resp.read()).decode()
    assert om.rstrip().endswith("# EOF") and "gpuenergy_gpu_energy_joules_total" in om
    start = time.monotonic()
    assert exp.stop() == 0
    assert time.monotonic() - start < 10
    assert "shutting down" in exp.log()


def test_promtool_check_metrics_on_a_live_scrape(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    promtool = require_binary("promtool")
    from fakenvml import Process, a100, grace_hopper, pascal_no_counter

    gpus = [h100(0, processes=(Process(77, 1 << 30, 50),)), a100(1), grace_hopper(2), pascal_no_counter(3)]
    env = _scenario(tmp_path, Scenario(epoch=time.time() - 100, gpus=gpus))
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", "--collector.processes", *FAST], env).wait_ready()
    wait_until(lambda: "gpuenergy_gpu_sm_active_ratio" in exp.metrics(), what="GPM series")
    text = exp.metrics()
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "" and out.stderr.strip() == "", out.stdout + out.stderr


def test_no_driver_starts_serves_host_metrics_and_says_so_once(start_exporter: type[ExporterProcess]) -> None:
    exp = start_exporter(FAST, {}).wait_ready()
    time.sleep(1.0)  # several sample intervals
    text = exp.metrics()
    assert sample_value(text, "gpuenergy_nvml_available", reason="driver_not_loaded") == 0.0 or \
        sample_value(text, "gpuenergy_nvml_available", reason="library_not_found") == 0.0
    assert sample_value(text, "gpuenergy_host_memory_available_bytes") > 0
    assert "gpuenergy_gpu_up" not in text
    assert sum("NVML unavailable" in line for line in exp.lines) == 1
    assert exp.stop() == 0


def test_gpu_lost_at_runtime(start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path) -> None:
    epoch = time.time()
    gpus = [h100(0), h100(1)]
    env = _scenario(tmp_path, Scenario(epoch=epoch, gpus=gpus))
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", *FAST], env).wait_ready()
    assert sample_value(exp.metrics(), "gpuenergy_gpu_up", gpu="1") == 1.0
    lost = [gpus[0], h100(1, lost_at_s=time.time() - epoch)]
    Scenario(epoch=epoch, gpus=lost).write(tmp_path / "scenario.ini")
    wait_until(lambda: sample_value(exp.metrics(), "gpuenergy_gpu_up", gpu="1") == 0.0, what="GPU 1 down")
    text = exp.metrics()
    assert sample_value(text, "gpuenergy_gpu_up", gpu="0") == 1.0
    assert "lost" in exp.log()


def test_old_driver_without_energy_symbol_integrates_power(
    start_exporter: type[ExporterProcess], tmp_path: Path
) -> None:
    lib = build_library(tmp_path / "oldlib", omit=("nvmlDeviceGetTotalEnergyConsumption", "nvmlGpmQueryDeviceSupport"))
    env = _scenario(tmp_path, Scenario(epoch=time.time(), gpus=[h100(0, power=Constant(200.0))]))
    exp = start_exporter([f"--nvml.library={lib}", "--collector.power-interval=20ms", *FAST], env).wait_ready()
    first = wait_until(lambda: sample_value(exp.metrics(), "gpuenergy_gpu_energy_joules_total", gpu="0"),
                       what="integrated energy")
    t0 = time.monotonic()
    time.sleep(1.5)
    second = sample_value(exp.metrics(), "gpuenergy_gpu_energy_joules_total", gpu="0")
    elapsed = time.monotonic() - t0
    assert 'energy_method="integrated_instant_power"' in exp.metrics()
    assert (second - first) == pytest.approx(200.0 * elapsed, rel=0.25)  # scrape-time jitter of 200 ms samples


def test_scrapes_are_served_from_the_snapshot_while_nvml_hangs(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    path = tmp_path / "scenario.ini"
    epoch = time.time()
    Scenario(epoch=epoch, gpus=[h100(0), h100(1)]).write(path)
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", *FAST], {"FAKE_NVML_SCENARIO": str(path)}).wait_ready()
    # From now on every NVML call takes 3 s: one sample of 2 GPUs takes about a minute.
    Scenario(epoch=epoch, driver=Driver(delay_ms=3000), gpus=[h100(0), h100(1)]).write(path)
    time.sleep(0.5)
    for _ in range(5):
        start = time.monotonic()
        text = exp.metrics()
        took = time.monotonic() - start
        assert "gpuenergy_gpu_energy_joules_total" in text
        # a functional bound, not a benchmark: one NVML call alone would take 3 s
        assert took < 2.5, f"scrape took {took:.2f}s while NVML is slow"


def test_bad_web_config_fails_before_serving(tmp_path: Path) -> None:
    import sys

    cfg = tmp_path / "web.yml"
    cfg.write_text("basic_auth_users:\n  admin: not-a-bcrypt-hash\n")
    out = subprocess.run([sys.executable, "-m", "gpu_energy_exporter", f"--web.config.file={cfg}",
                          "--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "admin" in out.stderr and "listening" not in out.stderr


def test_port_in_use_is_one_clear_error(start_exporter: type[ExporterProcess]) -> None:
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "gpu_energy_exporter", f"--web.listen-address=127.0.0.1:{port}",
                              "--otlp.listen-address=127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr


def test_a_driver_hanging_at_start_up_does_not_keep_the_port_closed(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    # nvmlInit itself hangs for a minute: the exporter must still bind its port, serve the other
    # collectors, answer liveness and say it is not ready (rather than never binding: a liveness probe
    # would restart it forever).
    env = _scenario(tmp_path, Scenario(epoch=time.time(), driver=Driver(function_delay_ms={"nvmlInitWithFlags": 60000}),
                                       gpus=[h100(0)]))
    start = time.monotonic()
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", *FAST], env).wait_ready(timeout=30)
    assert time.monotonic() - start < 25
    assert exp.get("/-/healthy")[0] == 200
    status, body, _ = exp.get("/-/ready")
    assert status == 503 and "gpu" in body
    text = exp.metrics()
    assert "gpuenergy_gpu_up" not in text
    assert sample_value(text, "gpuenergy_host_memory_total_bytes") > 0
    assert sample_value(text, "gpuenergy_collector_success", collector="gpu") == 0.0
    assert sample_value(text, "gpuenergy_collector_success", collector="host") == 1.0

"""End to end: the exporter on the fake NVML library, scraped by a real Prometheus on loopback.

Prometheus's answer to ``rate(gpuenergy_gpu_energy_joules_total[1m])`` must match the scenario's true
power within 1%. ``rate()`` over 1m is only exact once the series has a full minute of history (before
that Prometheus extrapolates from a partial window), so the test waits 65 s of scraping.
"""

from __future__ import annotations

import time
import urllib.parse
from pathlib import Path

import pytest
from conftest import ExporterProcess, wait_until
from fakenvml import Constant, Scenario, Square, h100, v100
from prom import Prometheus

pytestmark = pytest.mark.slow


def test_prometheus_rate_of_the_energy_counter_matches_true_power(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    gpus = [
        h100(0, power=Constant(312.0), energy_offset_mj=4_000_000_000),
        # bursty training steps: 80 ms period, 60% at 650 W, 40% at 120 W -> 438 W mean
        h100(1, power=Square(120.0, 650.0, 0.08, 0.6)),
        v100(2, power=Constant(151.5)),
    ]
    scenario = Scenario(epoch=time.time() - 3600, gpus=gpus)
    scenario.write(tmp_path / "scenario.ini")
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", "--collector.interval=1s"],
                         {"FAKE_NVML_SCENARIO": str(tmp_path / "scenario.ini")}).wait_ready()
    target = urllib.parse.urlparse(exp.metrics_url).netloc
    prom = Prometheus(tmp_path / "prom", [target])
    try:
        wait_until(lambda: prom.value('up{job="gpu-energy-exporter"}') == 1.0, timeout=30, what="first scrape")
        time.sleep(65)
        for g, true_mean in ((gpus[0], 312.0), (gpus[1], 438.0), (gpus[2], 151.5)):
            rate = prom.value(f'rate(gpuenergy_gpu_energy_joules_total{{gpu_uuid="{g.uuid}"}}[1m])')
            assert rate == pytest.approx(true_mean, rel=0.01), (g.name, rate)
        # the counter has no resets and the collector is healthy throughout
        assert prom.value('max_over_time(gpuenergy_collector_success{collector="gpu"}[1m])') == 1.0
        assert prom.value("sum(resets(gpuenergy_gpu_energy_joules_total[1m]))") == 0.0
        # instant power sampled through the 25 ms window under-reads nothing for constant power
        assert prom.value(f'gpuenergy_gpu_power_watts{{gpu_uuid="{gpus[0].uuid}"}}') == pytest.approx(312.0)
    finally:
        prom.stop()

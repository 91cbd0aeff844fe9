"""The loadavg collector: the smallest collector, added as one file (issue 32's example of the registry)."""

from __future__ import annotations

import logging
import urllib.request
from pathlib import Path

import pytest

from gpu_energy_exporter.collectors.base import NoData
from gpu_energy_exporter.collectors.loadavg import LoadAverageCollector, parse_loadavg
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.devices.simulated import SimulatedBackend


@pytest.mark.parametrize(("text", "values"), [
    ("0.52 0.58 0.59 1/389 12345\n", (0.52, 0.58, 0.59)),
    ("12.00 8.50 3.25 17/2048 99", (12.0, 8.5, 3.25)),
])
def test_loadavg_line_gives_the_three_averages(text: str, values: tuple[float, float, float]) -> None:
    assert parse_loadavg(text) == values


@pytest.mark.parametrize("text", ["", "0.5 0.6", "a b c 1/2 3"])
def test_a_malformed_loadavg_line_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_loadavg(text)


def test_loadavg_collector_reads_procfs_and_says_once_when_it_cannot(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpu_energy_exporter.collectors.loadavg")
    collector = LoadAverageCollector(procfs=str(tmp_path))
    for _ in range(2):
        with pytest.raises(NoData, match="loadavg"):
            collector.update()
    assert sum("cannot read the load average" in r.message for r in caplog.records) == 1
    (tmp_path / "loadavg").write_text("1.50 0.75 0.25 3/400 4242\n")
    fam = collector.update()[0]
    assert fam.name == "gpuenergy_host_load_average"
    assert {s.labels["window"]: s.value for s in fam.samples} == {"1m": 1.5, "5m": 0.75, "15m": 0.25}


def test_loadavg_is_off_by_default_and_served_when_enabled(tmp_path: Path) -> None:
    assert not load_config([], {}).enabled("loadavg")
    (tmp_path / "loadavg").write_text("2.00 1.00 0.50 1/10 7\n")
    config = load_config(["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                          "--otlp.grpc.listen-address=", "--no-collector.gpu", "--no-collector.rapl",
                          "--no-collector.host", "--collector.loadavg", f"--path.procfs={tmp_path}"], {})
    exp = Exporter(config, backend_factory=lambda: SimulatedBackend(1))
    exp.start()
    try:
        assert exp.web is not None
        with urllib.request.urlopen(exp.web.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        exp.stop()
    assert 'gpuenergy_host_load_average{window="5m"} 1.0' in text
    assert 'gpuenergy_collector_success{collector="loadavg"} 1.0' in text

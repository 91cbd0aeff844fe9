"""Docs generated from the code are current; the GPU exposition matches a reviewed golden file."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from fakenvml import Constant, Driver, Process, Scenario, Square, a100, grace_hopper, h100, pascal_no_counter
from helpers import check_golden

from gpu_energy_exporter.core.metrics import CATALOGUE
from gpu_energy_exporter.daemon.config import Config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.devices.nvml import NVMLBackend
from gpu_energy_exporter.tools import docgen

GOLDEN = Path(__file__).parent / "golden" / "gpu-exposition.prom"


def test_generated_docs_are_current() -> None:
    assert docgen.main(["--check"]) == 0, "run: python -m gpu_energy_exporter.tools.docgen"


def test_catalogue_covers_every_module_and_names_follow_conventions() -> None:
    docgen.load_catalogue()
    collectors = {s.collector for s in CATALOGUE.values()}
    assert {"gpu", "host", "rapl", "carbon", "kubernetes", "otlp", "ledger", "exporter"} <= collectors
    for spec in CATALOGUE.values():
        assert spec.name.startswith("gpuenergy_"), spec.name
        for unit, suffixes in (("watts", ("_watts",)), ("joules", ("_joules", "_joules_total")),
                               ("bytes", ("_bytes", "_bytes_total")), ("celsius", ("_celsius",)),
                               ("hertz", ("_hertz",))):
            if spec.unit == unit:
                assert spec.name.endswith(suffixes), spec.name
        assert "_count" not in spec.name.removesuffix("_total")[-6:], spec.name


def _served(config: Config, backend: Callable[[], NVMLBackend], now: float) -> tuple[str, str]:
    """/metrics and /metrics?name[]=gpuenergy_gpu_energy_joules_total as the running exporter serves
    them: its HTTP server, its cached exposition. Process and ledger self-metrics are left out."""
    exporter = Exporter(config, backend_factory=backend, clock=lambda: now)
    exporter.start()
    try:
        assert exporter.web is not None
        url = exporter.web.url + config.web_telemetry_path
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        with urllib.request.urlopen(url + "?name[]=gpuenergy_gpu_energy_joules_total", timeout=10) as resp:
            filtered = resp.read().decode()
    finally:
        exporter.stop()
    keep = []
    family_ok = True
    for line in text.splitlines(keepends=True):
        name = line.split(" ")[2] if line.startswith("# ") else line.split("{")[0].split(" ")[0]
        if line.startswith("# HELP "):
            family_ok = not name.startswith(_NOT_IN_GOLDEN)
        if family_ok:
            keep.append(line)
    return "".join(keep), filtered


# Families of the exporter itself whose values depend on the machine or that the GPU golden is not about.
_NOT_IN_GOLDEN = ("gpuenergy_process_", "gpuenergy_ledger_", "gpuenergy_http_", "gpuenergy_run", "gpuenergy_otlp_",
                  "gpuenergy_training_")


def test_golden_gpu_exposition(fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole GPU exposition for a fixed scenario (frozen clock). Review diffs, then regenerate with
    UPDATE_GOLDEN=1."""
    t0 = 1_750_000_000.0
    gpus = [
        h100(0, power=Square(100, 700, 0.1, 0.5), energy_offset_mj=123_456_789, processes=(Process(4242, 8 << 30, 80),),
             clocks_event_reasons=0x4),
        a100(1, power=Constant(250.0), util_gpu_pct=55, util_memory_pct=20, memory_used_bytes=10 << 30),
        grace_hopper(2),
        pascal_no_counter(3),
    ]
    path = tmp_path / "scenario.ini"
    Scenario(epoch=t0, driver=Driver(frozen_time=t0 + 100.0), gpus=gpus).write(path)
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))
    config = Config(web_listen_address=("127.0.0.1", 0), otlp_listen_address=("127.0.0.1", 0),
                    otlp_grpc_listen_address=None,  # the suite never binds the default 4317
                    collectors=frozenset({"gpu", "processes"}))
    text, text_filtered = _served(config, lambda: NVMLBackend(str(fake_nvml_lib), clock=lambda: t0 + 100.0),
                                  t0 + 100.0)
    # Values that depend on the machine, not on the scenario, are masked.
    lines = []
    for line in text.splitlines():
        if line.startswith("gpuenergy_build_info{"):
            line = "gpuenergy_build_info{<masked: versions>} 1.0"
        if line.startswith(("gpuenergy_collector_duration_seconds{", "gpuenergy_nvml_call_seconds_total{",
                            "gpuenergy_nvml_calls_total{")):
            line = line.rsplit(" ", 1)[0] + " <masked>"
        if line.startswith("gpuenergy_gpu_energy_joules_total") and 'gpu="3"' in line:
            line = line.split("} ", 1)[0] + "} <integrated: timing dependent>"
        lines.append(line)
    got = "\n".join(lines) + "\n"
    # name[] is cut from those same served bytes: a filtered scrape is the golden's matching lines.
    name = "gpuenergy_gpu_energy_joules_total"
    want = [ln for ln in got.splitlines() if ln.split("{")[0].split(" ")[0] == name
            or ln.startswith((f"# HELP {name} ", f"# TYPE {name} "))]
    filtered = text_filtered.splitlines()
    assert len(want) > 2 and [ln.split("} ")[0] for ln in filtered] == [ln.split("} ")[0] for ln in want]
    check_golden(got, GOLDEN)

"""Issue 19 items 5 and 6 on the exporter's side: CO2 counted by the exporter interval by interval (per GPU
and per run) at the intensity in force, also with ``--no-collector.carbon``; and the run ledger's
post-warm-up counters, whose ratio is the ledger's own J/token.

Every expected figure is worked out by hand in the test. The PromQL side (rules and panels reading these
counters, across a 500 -> 100 g/kWh change and a 60 s warm-up) is in dashboards/tests/*.yaml.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import registry_of
from test_ledger import T0, UUID_A, Clock, Harness, constant, identity, summary_of, trainer

from gpu_energy_exporter.collectors.carbon import CarbonCollector, CO2Meter
from gpu_energy_exporter.core.state import GPUState
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.ledger import RunLedger

KWH = 3.6e6


def write_intensity(path: Path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def state(energy_j: float | None, up: bool = True) -> GPUState:
    return GPUState(identity=identity(UUID_A), up=up, reading=None, energy_j=energy_j, energy_resets=0,
                    last_good=None)


# ----------------------------------------------------------------------------------------------------
# per GPU: gpuenergy_gpu_co2_grams_total


def test_gpu_co2_counter_prices_each_interval_at_the_intensity_then(tmp_path: Path) -> None:
    f = tmp_path / "intensity"
    write_intensity(f, "500\n", 1_000_000_000_000_000_000)
    gpu = {"state": state(0.0)}
    c = CarbonCollector.from_config(load_config([f"--carbon.intensity-file={f}", "--carbon.pue=1.2"], {}),
                                    gpu_states=lambda: (gpu["state"],))
    assert c.depends_on == ("gpu",)
    name, labels = "gpuenergy_gpu_co2_grams_total", {"gpu": "0", "gpu_uuid": UUID_A}
    assert registry_of(c.update()).get_sample_value(name, labels) == 0.0  # the series exists from the start
    gpu["state"] = state(1 * KWH)  # 1 kWh at 500 g/kWh x PUE 1.2 = 600 g
    assert registry_of(c.update()).get_sample_value(name, labels) == pytest.approx(600.0)
    write_intensity(f, "100\n", 1_000_000_001_000_000_000)
    gpu["state"] = state(2 * KWH)  # 1 kWh more, at 100 g/kWh x 1.2 = 120 g
    assert registry_of(c.update()).get_sample_value(name, labels) == pytest.approx(720.0)


def test_gpu_co2_counter_prices_an_interval_straddling_a_change_part_at_each_intensity(tmp_path: Path) -> None:
    """Issue 28: the intensity file rewritten 4 s into a 10 s interval (its mtime): 40% of the interval's
    energy at the value before, 60% at the new one. Before, the whole interval at the new value (-48% of
    this interval's grams here)."""
    f = tmp_path / "intensity"
    t0 = 1_800_000_000.0
    write_intensity(f, "500\n", int((t0 - 60) * 1e9))
    now = [t0]
    gpu = {"state": state(0.0)}
    c = CarbonCollector.from_config(load_config([f"--carbon.intensity-file={f}", "--carbon.pue=1.2"], {}),
                                    gpu_states=lambda: (gpu["state"],), clock=lambda: now[0])
    name, labels = "gpuenergy_gpu_co2_grams_total", {"gpu": "0", "gpu_uuid": UUID_A}
    assert registry_of(c.update()).get_sample_value(name, labels) == 0.0
    write_intensity(f, "100\n", int((t0 + 4) * 1e9))
    now[0] = t0 + 10
    gpu["state"] = state(1 * KWH)  # 0.4 kWh at 500 + 0.6 kWh at 100, x PUE 1.2: 240 + 72 = 312 g
    assert registry_of(c.update()).get_sample_value(name, labels) == pytest.approx(312.0)
    now[0] = t0 + 20
    gpu["state"] = state(2 * KWH)  # then all at 100: + 120 g
    assert registry_of(c.update()).get_sample_value(name, labels) == pytest.approx(432.0)


def test_co2_meter_skips_a_counter_reset_and_a_gpu_that_is_down() -> None:
    m = CO2Meter()
    m.add([("0", "GPU-x", 10 * KWH)], 100.0, 1.0)  # baseline only
    m.add([("0", "GPU-x", 12 * KWH)], 100.0, 1.0)  # +2 kWh: 200 g
    m.add([("0", "GPU-x", None)], 900.0, 1.0)  # down: nothing, and no baseline change
    m.add([("0", "GPU-x", 13 * KWH)], 300.0, 1.0)  # +1 kWh since the last reading, at the intensity now
    m.add([("0", "GPU-x", 0.5 * KWH)], 300.0, 1.0)  # driver reload: rebased, nothing added
    m.add([("0", "GPU-x", 1.5 * KWH)], 50.0, 2.0)  # +1 kWh x 2 x 50 = 100 g
    assert m.grams() == [("0", "GPU-x", pytest.approx(200.0 + 300.0 + 100.0))]


# ----------------------------------------------------------------------------------------------------
# the ledger with --no-collector.carbon: the intensity in force, not the start-up one (was +66.7%)


def test_ledger_follows_the_intensity_file_without_the_carbon_collector(tmp_path: Path) -> None:
    f = tmp_path / "intensity"
    write_intensity(f, "500\n", 1_000_000_000_000_000_000)
    exp = Exporter(load_config([
        "--no-collector.carbon", "--no-collector.gpu", "--no-collector.host", "--no-collector.rapl",
        f"--carbon.intensity-file={f}", "--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
        "--otlp.grpc.listen-address=",
    ], {}))
    assert exp.carbon is None
    exp.sampler.sample_once()
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock, carbon=exp.carbon_now)
    h = Harness(ledger, clock, {UUID_A: constant(720.0)})
    pushes = trainer(h, "grid", T0, T0 + 100, rate=10.0)
    h.run_until(T0 + 50, pushes)
    write_intensity(f, "100\n", 1_000_000_001_000_000_000)
    exp.sampler.sample_once()  # the exporter's sampler follows the file (on a collector thread)
    h.run_until(T0 + 100, pushes)
    s = summary_of(ledger, "grid")
    half_kwh = 720.0 * 50 / KWH  # 0.01 kWh each half
    # 0.01 kWh x 500 + 0.01 kWh x 100 = 6 g; the start-up intensity for ever gave 10 g (+66.7%).
    assert s["co2_g"] == pytest.approx(half_kwh * 500.0 + half_kwh * 100.0)
    assert s["carbon_intensity_g_per_kwh"] == pytest.approx(300.0)
    assert exp.carbon_now() == (100.0, 1.0)
    assert "carbon_intensity_file" in [r.name for r in exp.sampler.snapshot.results]  # type: ignore[union-attr]
    assert "gpuenergy_carbon_intensity_grams_per_kilowatt_hour" not in {
        s.name for fam in exp.sampler.snapshot.families for s in fam.samples}  # type: ignore[union-attr]


# ----------------------------------------------------------------------------------------------------
# per run: gpuenergy_run_co2_grams_total and the post-warm-up counters


def _served(ledger: RunLedger, name: str, run_id: str) -> float | None:
    return registry_of(ledger.collect()).get_sample_value(name, {"run_id": run_id})


def test_run_co2_counter_serves_the_ledgers_grams() -> None:
    clock = Clock()
    grid = {"intensity": 500.0}
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock, carbon=lambda: (grid["intensity"], 1.0))
    h = Harness(ledger, clock, {UUID_A: constant(720.0)})
    pushes = trainer(h, "co2run", T0, T0 + 100, rate=10.0)
    h.run_until(T0 + 50, pushes)
    grid["intensity"] = 100.0
    h.run_until(T0 + 101, pushes)
    assert _served(ledger, "gpuenergy_run_co2_grams_total", "co2run") == pytest.approx(0.01 * 500 + 0.01 * 100)
    assert _served(ledger, "gpuenergy_run_co2_grams", "co2run") is None  # the gauge is gone


def test_window_counters_stay_at_zero_in_the_warmup_then_give_the_ledgers_j_per_token() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=60.0, stale_after_s=300.0, clock=clock)
    # 700 W throughout; 10 tokens/s in the 60 s warm-up, then 20 tokens/s for 240 s.
    h = Harness(ledger, clock, {UUID_A: constant(700.0)})
    pushes = trainer(h, "warm", T0, T0 + 300, rate=0.0,
                     rate_at=lambda t: 10.0 * (t - T0) if t <= T0 + 60 else 600.0 + 20.0 * (t - T0 - 60))
    h.run_until(T0 + 40, pushes)
    assert _served(ledger, "gpuenergy_run_window_energy_joules_total", "warm") == 0.0
    assert _served(ledger, "gpuenergy_run_window_tokens_total", "warm") == 0.0
    assert _served(ledger, "gpuenergy_run_energy_joules_total", "warm") == pytest.approx(700.0 * 40)
    h.run_until(T0 + 301, pushes)
    s = summary_of(ledger, "warm")
    energy = _served(ledger, "gpuenergy_run_window_energy_joules_total", "warm")
    tokens = _served(ledger, "gpuenergy_run_window_tokens_total", "warm")
    # After the warm-up: 700 W x 240 s = 168 kJ for 20 x 240 = 4,800 tokens: 35 J/token, the ledger's.
    assert energy == pytest.approx(168_000.0) and tokens == pytest.approx(4_800.0)
    assert energy / tokens == pytest.approx(35.0) == s["j_per_token"]
    # The whole-run counters include the warm-up: 210 kJ / 5,400 tokens = 38.9 J/token (+11.1%).
    whole = (_served(ledger, "gpuenergy_run_energy_joules_total", "warm") or 0.0) / (
        _served(ledger, "gpuenergy_run_tokens_total", "warm") or 1.0)
    assert whole == pytest.approx(210_000 / 5_400)

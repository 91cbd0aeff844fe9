"""The ledger's energy accounting of one snapshot interval (``ledger.accounting``): plain frames and holdings
in, an accumulator out; no ledger, no sampler, no clock."""

from __future__ import annotations

import math

import pytest

from gpu_energy_exporter.ledger.accounting import Acc, integrate, unattributed
from gpu_energy_exporter.ledger.billing import idle_total
from gpu_energy_exporter.ledger.snapshot_frames import Frame, GPUFrame
from gpu_energy_exporter.ledger.split import Holding


def gpu(energy_j: float | None, power_w: float | None = None, memory_used: int | None = None,
        idle_w: float | None = None) -> GPUFrame:
    return GPUFrame(uuid="GPU-a", name="NVIDIA H100 80GB HBM3", energy_j=energy_j, power_w=power_w,
                    memory_used=memory_used, memory_total=80 << 30, idle_w=idle_w, idle_source="flag", index=0)


def frame(t: float, g: GPUFrame | None, intensity: float | None = None, pue: float | None = None) -> Frame:
    return Frame(t, {"a": g} if g is not None else {}, {}, intensity, pue, None)


def test_a_run_alone_on_its_gpu_is_charged_the_counter_delta_cut_at_its_start() -> None:
    acc = Acc(t=0.0)
    f0, f1 = frame(10.0, gpu(1000.0)), frame(20.0, gpu(3000.0, power_w=250.0, memory_used=1 << 30))
    seg = integrate(acc, f0, f1, 15.0, math.inf, run_id="r", window_start=15.0, keys=["a"],
                    holders={"a": [Holding("r", 15.0)]})
    assert seg is not None and seg.inside and seg.splits == {"exclusive"} and not seg.sharers
    # Half of the interval lies in the run: half of the 2000 J delta, all of it after the warm-up.
    assert acc.energy_j == pytest.approx(1000.0)
    assert acc.win_energy_j == pytest.approx(1000.0)
    assert acc.per_gpu_j == {"a": pytest.approx(1000.0)}
    assert acc.expected_gpu_s == acc.measured_gpu_s == pytest.approx(5.0)
    # Peak power: the larger of the interval's charged mean power (200 W) and the instant at f1 (250 W).
    assert acc.peak_power_w == pytest.approx(250.0)
    assert acc.vram_peak == float(1 << 30) and seg.vram_sum == float(1 << 30)


def test_two_runs_on_one_gpu_share_its_energy_and_the_warm_up_cuts_the_window() -> None:
    acc = Acc(t=0.0)
    f0, f1 = frame(0.0, gpu(0.0)), frame(10.0, gpu(4000.0))
    holders = {"a": [Holding("r", 0.0), Holding("other", 0.0)]}
    seg = integrate(acc, f0, f1, 0.0, math.inf, run_id="r", window_start=5.0, keys=["a"], holders=holders)
    assert seg is not None and seg.splits == {"even"} and seg.sharers == {"other"}
    assert acc.energy_j == pytest.approx(2000.0)
    assert acc.win_energy_j == pytest.approx(1000.0), "only the half after the warm-up"


def test_an_interval_outside_the_run_adds_nothing() -> None:
    acc = Acc(t=0.0)
    seg = integrate(acc, frame(0.0, gpu(0.0)), frame(10.0, gpu(100.0)), 10.0, math.inf, run_id="r",
                    window_start=0.0, keys=["a"], holders={})
    assert seg is None and acc == Acc(t=0.0)


def test_a_gpu_without_counter_counts_as_expected_gpu_time_without_energy() -> None:
    acc = Acc(t=0.0)
    seg = integrate(acc, frame(0.0, gpu(None)), frame(10.0, gpu(None, idle_w=None)), 0.0, math.inf,
                    run_id="r", window_start=0.0, keys=["a", "remote"], holders={"a": [Holding("r", 0.0)]})
    assert seg is not None and [k for k, _ in seg.gpus] == ["a"], "a GPU of another node is not counted"
    assert acc.expected_gpu_s == pytest.approx(10.0) and acc.measured_gpu_s == 0.0 and acc.energy_j == 0.0
    assert acc.idle_unknown_s == {"a": pytest.approx(10.0)}
    # The idle power learned later fills in the seconds it was unknown; unknown still: no figure.
    assert idle_total(5.0, acc.idle_unknown_s, {"a": 40.0}) == pytest.approx(405.0)
    assert idle_total(5.0, acc.idle_unknown_s, {"a": None}) is None


def test_co2_uses_the_intensity_and_pue_of_the_interval_end() -> None:
    acc = Acc(t=0.0)
    integrate(acc, frame(0.0, gpu(0.0)), frame(10.0, gpu(3.6e6), intensity=400.0, pue=1.5), 0.0, math.inf,
              run_id="r", window_start=0.0, keys=["a"], holders={"a": [Holding("r", 0.0)]})
    assert acc.co2_g == pytest.approx(1.0 * 1.5 * 400.0)
    assert acc.carbon_kwh == pytest.approx(1.0) and acc.carbon_missing_kwh == 0.0


def test_energy_no_run_held_is_the_gpus_unattributed_energy() -> None:
    f0, f1 = frame(0.0, gpu(0.0)), frame(10.0, gpu(1000.0))
    got = list(unattributed(f0, f1, {"a": [Holding("r", 6.0)]}))
    assert [(key, joules) for key, _, joules in got] == [("a", pytest.approx(600.0))]
    assert list(unattributed(f0, f1, {"a": [Holding("r", 0.0)]})) == []


def test_a_counter_correction_in_one_short_interval_is_not_a_power_peak() -> None:
    # On a real H100 (docs/gpu-validation.md) at a 200 ms interval, the sample that read the energy counter
    # carried 290 J the 1 s average had not shown yet (the GPU had just gone from idle to 680 W): that
    # interval's mean is 1,450 W beside a 680 W power reading, and the run's peak read 2,129 W on a 700 W GPU.
    acc = Acc(t=0.0)
    f0, f1 = frame(10.0, gpu(1000.0, power_w=680.0)), frame(10.2, gpu(1000.0 + 136.0 + 290.0, power_w=680.0))
    integrate(acc, f0, f1, 0.0, math.inf, run_id="r", window_start=0.0, keys=["a"],
              holders={"a": [Holding("r", 0.0)]})
    assert acc.energy_j == pytest.approx(426.0), "the energy is charged in full"
    assert acc.peak_power_w == pytest.approx(680.0), "the peak is what the GPU reported drawing"


def test_without_power_readings_the_interval_mean_is_the_peak() -> None:
    acc = Acc(t=0.0)
    f0, f1 = frame(0.0, gpu(0.0)), frame(10.0, gpu(3000.0))
    integrate(acc, f0, f1, 0.0, math.inf, run_id="r", window_start=0.0, keys=["a"],
              holders={"a": [Holding("r", 0.0)]})
    assert acc.peak_power_w == pytest.approx(300.0)

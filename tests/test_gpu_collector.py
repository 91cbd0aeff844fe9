"""The production NVML code path (devices.nvml + collectors.gpu) against the fake libnvidia-ml.so.1.

These run in-process: the exporter's own ``--nvml.library`` loading puts the fake library into pynvml once
per session, and each test points the library at its scenario file (``FAKE_NVML_SCENARIO``, read at
nvmlInit) and shuts NVML down at the end. Builds with missing symbols run in a subprocess (test_exporter_process).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from fakenvml import (
    GPU,
    POWER_SCOPE_MODULE,
    Constant,
    Driver,
    Process,
    Scenario,
    Square,
    a100,
    grace_hopper,
    h100,
    pascal_no_counter,
    v100,
)
from helpers import GPURig

from gpu_energy_exporter.collectors.gpu import GPUCollector
from gpu_energy_exporter.devices.nvml import NVMLBackend
from gpu_energy_exporter.engine.exposition import SnapshotCollector, new_registry
from gpu_energy_exporter.engine.sampler import Sampler

T0 = 1_750_000_000.0
FI_POWER_INSTANT, FI_POWER_AVERAGE = pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_FI_DEV_POWER_AVERAGE
FI_MEMORY_TEMP = pynvml.NVML_FI_DEV_MEMORY_TEMP


class Rig(GPURig):
    """A scenario file, the collector on the fake library, and the exposition registry."""

    def __init__(self, lib: Path, path: Path, scenario: Scenario, **kw) -> None:  # type: ignore[no-untyped-def]
        self.lib, self.path, self.scenario = lib, path, scenario
        scenario.write(path)
        # Readings carry the scenario's frozen time, so the energy counter's plausibility checks see the
        # time that passed for the fake GPU, not the milliseconds between two test samples.
        super().__init__(lambda: NVMLBackend(str(lib), clock=self.now), clock=self.now, monotonic=self.now, **kw)

    def now(self) -> float:
        frozen_time = self.scenario.driver.frozen_time
        return time.time() if frozen_time is None else frozen_time

    def rewrite(self, scenario: Scenario) -> None:
        self.scenario = scenario
        scenario.write(self.path)


@pytest.fixture
def rig(fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:  # type: ignore[type-arg]
    path = tmp_path / "scenario.ini"
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))
    made: list[Rig] = []

    def make(scenario: Scenario, **kw) -> Rig:  # type: ignore[no-untyped-def]
        r = Rig(fake_nvml_lib, path, scenario, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def frozen(at: float, gpus: list[GPU], **driver) -> Scenario:  # type: ignore[no-untyped-def]
    return Scenario(epoch=T0, driver=Driver(frozen_time=at, **driver), gpus=gpus)


def L(i: int, gpus: list[GPU]) -> dict[str, str]:
    return {"gpu": str(i), "gpu_uuid": gpus[i].uuid}


def test_identity_info_and_energy_method_per_generation(rig) -> None:  # type: ignore[no-untyped-def]
    gpus = [h100(0), a100(1), v100(2), pascal_no_counter(3), grace_hopper(4)]
    r = rig(frozen(T0 + 10, gpus))
    r.sample()
    methods = {}
    for i, g in enumerate(gpus):
        for line in r.text().splitlines():
            if line.startswith("gpuenergy_gpu_info{") and f'gpu_uuid="{g.uuid}"' in line:
                methods[i] = line.split('energy_method="')[1].split('"')[0]
                assert f'model="{g.name}"' in line and 'driver_version="550.54.15"' in line
                assert 'backend="nvml"' in line and f'pci_bus_id="{g.pci_bus_id}"' in line
    assert methods == {0: "counter", 1: "counter", 2: "counter", 3: "integrated_power_usage", 4: "counter"}
    assert r.value("gpuenergy_nvml_available", reason="") == 1.0
    assert all(r.value("gpuenergy_gpu_up", **L(i, gpus)) == 1.0 for i in range(5))


def test_energy_counter_in_joules_follows_the_exact_integral(rig) -> None:  # type: ignore[no-untyped-def]
    gpus = [h100(0, power=Square(100, 700, 0.05, 0.4), energy_offset_mj=5_000_000)]
    sc = frozen(T0 + 100, gpus)
    r = rig(sc)
    r.sample()
    e1 = r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus))
    assert e1 == pytest.approx(sc.energy_counter_mj(0, T0 + 100) / 1000.0)
    sc2 = frozen(T0 + 160, gpus)
    r.rewrite(sc2)
    r.sample()
    e2 = r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus))
    # 60 s of a 100/700 W square wave at 40% duty = 340 W mean: 20400 J, exactly the scenario's integral
    assert e2 - e1 == pytest.approx(sc.true_energy_j(0, T0 + 100, T0 + 160), abs=0.002)
    assert e2 - e1 == pytest.approx(20400.0, rel=1e-6)


def test_driver_reset_is_confirmed_then_exposed_as_a_counter_reset(rig) -> None:  # type: ignore[no-untyped-def]
    gpus = [h100(0, power=Constant(300.0), energy_offset_mj=9_000_000, energy_reset_at_s=(50.0,))]
    r = rig(frozen(T0 + 40, gpus))
    r.sample()
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus)) == pytest.approx(9000.0 + 40 * 300.0)
    r.rewrite(frozen(T0 + 45, gpus))
    r.sample()
    before = r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus))
    assert before == pytest.approx(9000.0 + 45 * 300.0)
    r.rewrite(frozen(T0 + 60, gpus))  # the driver reloaded at t=50: raw counter now 10 s x 300 W
    r.sample()
    # a candidate reset, held until the next reading confirms it: no trusted value, so no sample (a held
    # flat one would let increase() pour the reset's energy into a window starting after it)
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus)) is None
    assert r.value("gpuenergy_gpu_energy_resets_total", **L(0, gpus)) == 0.0
    r.rewrite(frozen(T0 + 61, gpus))
    r.sample()
    # confirmed: the driver's own value, which Prometheus' rate()/increase() take as a counter reset
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus)) == pytest.approx(11 * 300.0)
    assert r.value("gpuenergy_gpu_energy_resets_total", **L(0, gpus)) == 1.0
    for reason in ("decrease", "jump", "unconfirmed"):
        assert r.value("gpuenergy_gpu_energy_rejected_readings_total", reason=reason, **L(0, gpus)) == 0.0
    # In-process consumers (ledger, pod attribution) get a monotonic total: the value before the reset,
    # a credit of one interval (1 s) at the last average power for the 15 s the new counter does not
    # cover, and the new counter.
    (state,) = r.collector.states()
    assert state.energy_j == pytest.approx(before + 1 * 300.0 + 11 * 300.0)
    assert state.energy_resets == 1


def test_energy_counter_has_no_sample_timestamp_unless_asked(rig) -> None:  # type: ignore[no-untyped-def]
    gpus = [h100(0, power=Constant(300.0), energy_offset_mj=1_000_000)]
    plain = rig(frozen(T0 + 10, gpus))
    stamped = rig(frozen(T0 + 10, gpus), energy_timestamps=True)
    for r in (plain, stamped):
        r.sample()

    def energy_line(r: Rig) -> str:
        (line,) = [ln for ln in r.text().splitlines() if ln.startswith("gpuenergy_gpu_energy_joules_total{")]
        return line

    # Prometheus' guide for exporters: the scrape time, no timestamp of our own
    assert energy_line(plain).endswith("} 4000.0")
    # opt-in: the time the counter was read, in ms
    assert energy_line(stamped).endswith(f"}} 4000.0 {int((T0 + 10) * 1000)}")


def test_bad_readings_are_held_back_counted_and_logged_once(rig, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    from fakenvml import bad_reading, energy_jump

    gpus = [h100(0, power=Constant(300.0), energy_offset_mj=4e11,
                 energy_faults=(bad_reading(12.0), bad_reading(14.0), energy_jump(16.0, 5e11)))]
    r = rig(frozen(T0 + 10, gpus))
    seen = []
    with caplog.at_level("DEBUG", logger="gpu_energy_exporter.collectors.gpu_tracks"):
        for t in range(10, 19):
            r.rewrite(frozen(T0 + t, gpus))
            r.sample()
            seen.append(r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus)))
    truth = [4e8 + 300.0 * t for t in range(10, 19)]
    # 12 and 14 read 0 (held back: no sample), 16 reads 500 MJ too much; the others are the truth exactly
    assert seen == [None if t in (12, 14, 16) else pytest.approx(v) for t, v in zip(range(10, 19), truth, strict=True)]
    assert r.value("gpuenergy_gpu_energy_rejected_readings_total", reason="decrease", **L(0, gpus)) == 2.0
    assert r.value("gpuenergy_gpu_energy_rejected_readings_total", reason="jump", **L(0, gpus)) == 1.0
    assert r.value("gpuenergy_gpu_energy_resets_total", **L(0, gpus)) == 0.0
    (state,) = r.collector.states()
    assert state.energy_j == pytest.approx(truth[-1])  # the in-process total too
    warnings = [rec for rec in caplog.records if rec.levelname == "WARNING" and "rejected" in rec.getMessage()]
    assert [("decrease" in w.getMessage(), "jump" in w.getMessage()) for w in warnings] == [(True, False),
                                                                                          (False, True)]


def test_a_driver_turning_slow_does_not_make_good_readings_look_like_jumps(rig) -> None:  # type: ignore[no-untyped-def]
    # Real time, a GPU drawing its whole 700 W limit. When the energy call suddenly takes 0.6 s, the value
    # it returns is 0.6 s newer than the moment the read began: judged from the start of the read alone it
    # is more than 1.5x what the GPU can draw in the time between two quick samples. (0.6 s stays within
    # the sampler's 1 s wait, so every sample here completes.)
    gpus = [h100(0, power=Constant(700.0), energy_offset_mj=1e9)]
    sc = Scenario(epoch=time.time(), gpus=gpus)
    r = rig(sc)
    r.sample()
    r.sample()
    # (the counter is read through nvmlDeviceGetFieldValues, field 83; its own call where that fails)
    slow = Scenario(epoch=sc.epoch, driver=Driver(function_delay_ms={"nvmlDeviceGetTotalEnergyConsumption": 600.0,
                                                                     "nvmlDeviceGetFieldValues": 600.0}),
                    gpus=gpus)
    r.rewrite(slow)
    r.sample()
    e_slow = r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus))
    r.rewrite(sc)
    r.sample()  # fast again
    e_fast = r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus))
    for reason in ("decrease", "jump", "unconfirmed"):
        assert r.value("gpuenergy_gpu_energy_rejected_readings_total", reason=reason, **L(0, gpus)) == 0.0
    assert e_slow is not None and e_fast is not None and e_fast >= e_slow
    assert e_fast == pytest.approx(sc.energy_counter_mj(0, time.time()) / 1000.0, abs=700.0)


def test_instant_and_average_power_are_separate_series(rig) -> None:  # type: ignore[no-untyped-def]
    # 25 ms in 100 ms windows on a 50 ms square wave: the instant reading sees only part of the wave
    gpus = [h100(0, power=Square(100, 700, 0.1, 0.25)), a100(1, power=Constant(250.0), power_average_field=False)]
    at = T0 + 10.03
    sc = frozen(at, gpus)
    r = rig(sc)
    r.sample()
    assert r.value("gpuenergy_gpu_power_watts", **L(0, gpus)) == pytest.approx(sc.reported_instant_w(0, at), abs=0.001)
    assert r.value("gpuenergy_gpu_power_average_watts", **L(0, gpus)) == pytest.approx(
        sc.reported_average_w(0, at), abs=0.001)
    # A100 (GA100): PowerUsage is instant, no average field: no average series at all
    assert r.value("gpuenergy_gpu_power_watts", **L(1, gpus)) == pytest.approx(250.0)
    assert r.value("gpuenergy_gpu_power_average_watts", **L(1, gpus)) is None


def test_lost_gpu_shows_down_and_others_keep_working(rig) -> None:  # type: ignore[no-untyped-def]
    gpus = [h100(0, power=Constant(200.0)), h100(1, power=Constant(400.0), lost_at_s=20.0)]
    r = rig(frozen(T0 + 10, gpus))
    r.sample()
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(1, gpus)) == pytest.approx(4000.0)
    r.rewrite(frozen(T0 + 30, gpus))
    r.sample()
    assert r.value("gpuenergy_gpu_up", **L(1, gpus)) == 0.0
    assert r.value("gpuenergy_gpu_power_watts", **L(1, gpus)) is None
    # No reading, no sample: Prometheus marks the counter stale, and increase() across the outage counts
    # what the counter shows once the GPU answers again.
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(1, gpus)) is None
    assert r.value("gpuenergy_gpu_energy_resets_total", **L(1, gpus)) == 0.0
    assert r.value("gpuenergy_gpu_up", **L(0, gpus)) == 1.0
    assert r.value("gpuenergy_gpu_power_watts", **L(0, gpus)) == pytest.approx(200.0)
    assert r.value("gpuenergy_collector_success", collector="gpu") == 1.0


def test_not_supported_and_missing_functions_remove_only_their_series(rig) -> None:  # type: ignore[no-untyped-def]
    gpus = [
        h100(0, not_supported=("nvmlDeviceGetTemperature",), temperature_memory_c=None),
        h100(1, missing=("nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetClockInfo")),
    ]
    r = rig(frozen(T0 + 5, gpus))
    r.sample()
    r.sample()
    assert r.value("gpuenergy_gpu_temperature_celsius", **L(0, gpus)) is None
    assert r.value("gpuenergy_gpu_memory_temperature_celsius", **L(0, gpus)) is None
    assert r.value("gpuenergy_gpu_temperature_celsius", **L(1, gpus)) == 34.0
    assert r.value("gpuenergy_gpu_sm_clock_hertz", **L(1, gpus)) is None
    assert r.value("gpuenergy_gpu_sm_clock_hertz", **L(0, gpus)) == 1980e6
    # no energy counter: integrated from instant power instead, and the info label says so
    assert 'energy_method="integrated_instant_power"' in r.text()
    assert r.value("gpuenergy_gpu_up", **L(1, gpus)) == 1.0


def test_memory_utilisation_clocks_and_throttle_reasons(rig) -> None:  # type: ignore[no-untyped-def]
    gpus = [h100(0, memory_used_bytes=40 << 30, util_gpu_pct=87, util_memory_pct=31,
                 clocks_event_reasons=0x4 | 0x40)]
    r = rig(frozen(T0 + 5, gpus))
    r.sample()
    lab = L(0, gpus)
    assert r.value("gpuenergy_gpu_memory_used_bytes", **lab) == 40 << 30
    assert r.value("gpuenergy_gpu_memory_total_bytes", **lab) == gpus[0].memory_total_bytes
    assert r.value("gpuenergy_gpu_memory_reserved_bytes", **lab) == gpus[0].memory_reserved_bytes
    assert r.value("gpuenergy_gpu_utilization_ratio", **lab) == pytest.approx(0.87)
    assert r.value("gpuenergy_gpu_memory_utilization_ratio", **lab) == pytest.approx(0.31)
    assert r.value("gpuenergy_gpu_power_limit_watts", **lab) == 700.0
    assert r.value("gpuenergy_gpu_memory_clock_hertz", **lab) == 2619e6
    active = {reason: r.value("gpuenergy_gpu_clock_event_active", **lab, reason=reason)
              for reason in ("sw_power_cap", "hw_thermal_slowdown", "gpu_idle", "hw_slowdown")}
    assert active == {"sw_power_cap": 1.0, "hw_thermal_slowdown": 1.0, "gpu_idle": 0.0, "hw_slowdown": 0.0}


def test_a_power_limit_change_is_seen_within_its_read_cadence(rig) -> None:  # type: ignore[no-untyped-def]
    """The enforced limit is read once per LIMIT_INTERVAL_S (10 s) of the backend's clock and held between:
    a limit set in between shows at the first sample 10 s after the last read, never later."""
    from gpu_energy_exporter.devices.nvml import LIMIT_INTERVAL_S

    assert LIMIT_INTERVAL_S == 10.0
    gpus = [h100(0, power_limit_mw=700_000)]
    r = rig(frozen(T0 + 5, gpus))
    r.sample()
    lab = L(0, gpus)

    def limit_reads() -> int:
        return r.collector.backend.call_costs()["nvmlDeviceGetEnforcedPowerLimit"][0]

    assert r.value("gpuenergy_gpu_power_limit_watts", **lab) == 700.0
    assert limit_reads() == 1
    lowered = [h100(0, power_limit_mw=450_000)]
    for t in (T0 + 6, T0 + 14.9):  # within the cadence: the held value, and no call
        r.rewrite(frozen(t, lowered))
        r.sample()
        assert r.value("gpuenergy_gpu_power_limit_watts", **lab) == 700.0
    assert limit_reads() == 1
    r.rewrite(frozen(T0 + 15, lowered))  # 10 s after the first read
    r.sample()
    assert r.value("gpuenergy_gpu_power_limit_watts", **lab) == 450.0
    assert limit_reads() == 2
    r.rewrite(frozen(T0 + 3, lowered))  # the clock stepped back: read again rather than hold for ever
    r.sample()
    assert limit_reads() == 3


def _fake_counts(lib_path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(lib_path))
    lib.fakeNvmlCallCount.restype = ctypes.c_ulonglong
    lib.fakeNvmlFieldCount.restype = ctypes.c_ulonglong
    return lib


def test_memory_clock_and_temperature_are_read_every_10_s_and_still_update(  # type: ignore[no-untyped-def]
        rig, fake_nvml_lib: Path) -> None:
    """The memory clock and the HBM temperature move slowly: read once per SLOW_INTERVAL_S (10 s) of the
    backend's clock and held between (one call and one field per GPU per sample saved); a change shows at the
    first sample 10 s after the last read, never later; the power and SM clock are still read every sample."""
    from gpu_energy_exporter.devices.nvml import SLOW_INTERVAL_S

    assert SLOW_INTERVAL_S == 10.0
    lib = _fake_counts(fake_nvml_lib)
    gpus = [h100(0, clock_memory_mhz=2619, temperature_memory_c=42, clock_sm_mhz=1980)]
    r = rig(frozen(T0 + 5, gpus))
    r.sample()
    lab = L(0, gpus)
    assert r.value("gpuenergy_gpu_memory_clock_hertz", **lab) == 2619e6
    assert r.value("gpuenergy_gpu_memory_temperature_celsius", **lab) == 42.0
    lib.fakeNvmlResetCallCounts()
    changed = [h100(0, clock_memory_mhz=1593, temperature_memory_c=61, clock_sm_mhz=1410)]
    for t in (T0 + 6, T0 + 14.9):  # within the cadence: the held values, and neither asked
        r.rewrite(frozen(t, changed))
        r.sample()
        assert r.value("gpuenergy_gpu_memory_clock_hertz", **lab) == 2619e6
        assert r.value("gpuenergy_gpu_memory_temperature_celsius", **lab) == 42.0
        assert r.value("gpuenergy_gpu_sm_clock_hertz", **lab) == 1410e6  # every sample
    assert lib.fakeNvmlCallCount(b"nvmlDeviceGetClockInfo") == 2  # the SM clock alone, twice
    assert lib.fakeNvmlFieldCount(FI_MEMORY_TEMP, 0) == 0
    assert lib.fakeNvmlFieldCount(FI_POWER_INSTANT, 0) == 2  # power: every sample
    r.rewrite(frozen(T0 + 15, changed))  # 10 s after the first read
    r.sample()
    assert r.value("gpuenergy_gpu_memory_clock_hertz", **lab) == 1593e6
    assert r.value("gpuenergy_gpu_memory_temperature_celsius", **lab) == 61.0
    assert lib.fakeNvmlCallCount(b"nvmlDeviceGetClockInfo") == 4
    assert lib.fakeNvmlFieldCount(FI_MEMORY_TEMP, 0) == 1
    r.rewrite(frozen(T0 + 3, changed))  # the clock stepped back: read again rather than hold for ever
    r.sample()
    assert lib.fakeNvmlFieldCount(FI_MEMORY_TEMP, 0) == 2


def test_a_field_the_driver_does_not_support_is_asked_once_then_never(  # type: ignore[no-untyped-def]
        rig, fake_nvml_lib: Path) -> None:
    """An H100 SXM has no module power sensor (NOT_SUPPORTED, as on the real driver): the field is asked in the
    first sample's batched request, counted once in gpuenergy_nvml_field_errors_total, and left out of every
    later request (each field asked costs the driver about 40 µs); the other fields keep coming."""
    lib = _fake_counts(fake_nvml_lib)
    gpus = [h100(0), h100(1)]
    r = rig(frozen(T0 + 5, gpus))
    lib.fakeNvmlResetCallCounts()
    r.sample()
    assert lib.fakeNvmlFieldCount(FI_POWER_INSTANT, POWER_SCOPE_MODULE) == 2  # once per GPU (start-up included)
    lib.fakeNvmlResetCallCounts()
    for k in range(1, 6):
        r.rewrite(frozen(T0 + 5 + k, gpus))
        r.sample()
    assert lib.fakeNvmlFieldCount(FI_POWER_INSTANT, POWER_SCOPE_MODULE) == 0
    assert lib.fakeNvmlFieldCount(FI_POWER_INSTANT, 0) == lib.fakeNvmlFieldCount(FI_POWER_AVERAGE, 0) == 10
    assert lib.fakeNvmlCallCount(b"nvmlDeviceGetFieldValues") == 10  # still one batched call per GPU and sample
    for i in range(2):
        assert r.value("gpuenergy_nvml_field_errors_total", **L(i, gpus), field="module_power_field",
                       reason="not_supported") == 1.0
        assert r.value("gpuenergy_gpu_power_watts", **L(i, gpus)) is not None


def test_gpm_ratios_on_hopper_and_no_leaked_samples(rig, fake_nvml_lib: Path) -> None:  # type: ignore[no-untyped-def]
    gpm = {2: 62.5, 3: 30.0, 5: 41.0, 10: 55.0, 1: 90.0}
    gpus = [h100(0, gpm=gpm), a100(1)]
    r = rig(Scenario(epoch=T0, gpus=gpus))  # real clock: GPM needs samples >= 100 ms apart
    r.sample()
    assert r.value("gpuenergy_gpu_sm_active_ratio", **L(0, gpus)) is None  # one sample is not a rate
    time.sleep(0.15)
    r.sample()
    lab = L(0, gpus)
    assert r.value("gpuenergy_gpu_sm_active_ratio", **lab) == pytest.approx(0.625)
    assert r.value("gpuenergy_gpu_sm_occupancy_ratio", **lab) == pytest.approx(0.30)
    assert r.value("gpuenergy_gpu_tensor_active_ratio", **lab) == pytest.approx(0.41)
    assert r.value("gpuenergy_gpu_dram_bandwidth_utilization_ratio", **lab) == pytest.approx(0.55)
    assert r.value("gpuenergy_gpu_sm_active_ratio", **L(1, gpus)) is None  # A100: not supported = no data
    lib = ctypes.CDLL(str(fake_nvml_lib))
    # two buffers per GPM GPU, reused every sample: the last sample and the one filled next
    assert lib.fakeNvmlGpmSamplesOutstanding() == 2
    r.collector.close()
    assert lib.fakeNvmlGpmSamplesOutstanding() == 0


def test_processes_are_opt_in_and_idle_power_is_learned(rig) -> None:  # type: ignore[no-untyped-def]
    busy = [h100(0, processes=(Process(4242, 8 << 30, 80),)), h100(1, power=Constant(70.0))]
    r = rig(frozen(T0 + 5, busy), processes=True)
    for _ in range(12):
        r.sample()
    assert r.value("gpuenergy_gpu_process_memory_used_bytes", **L(0, busy), pid="4242") == 8 << 30
    assert r.value("gpuenergy_gpu_compute_processes", **L(0, busy)) == 1.0
    assert r.value("gpuenergy_gpu_idle_power_watts", **L(1, busy), source="learned") == pytest.approx(70.0)
    assert r.value("gpuenergy_gpu_idle_power_watts", **L(0, busy), source="learned") is None  # never idle
    r.collector.close()
    r2 = rig(frozen(T0 + 5, busy), idle_power_w=55.0)
    r2.sample()
    assert r2.value("gpuenergy_gpu_process_memory_used_bytes", **L(0, busy), pid="4242") is None
    assert r2.value("gpuenergy_gpu_idle_power_watts", **L(0, busy), source="flag") == 55.0


def test_grace_hopper_module_power_is_its_own_series(rig) -> None:  # type: ignore[no-untyped-def]
    gpus = [grace_hopper(0, power=Constant(400.0), module_extra_w=150.0), h100(1)]
    r = rig(frozen(T0 + 5, gpus))
    r.sample()
    assert r.value("gpuenergy_gpu_power_watts", **L(0, gpus)) == pytest.approx(400.0)
    assert r.value("gpuenergy_gpu_module_power_watts", **L(0, gpus)) == pytest.approx(550.0)
    assert r.value("gpuenergy_gpu_module_power_watts", **L(1, gpus)) is None


def test_pre_volta_energy_is_integrated_by_the_fast_sampler(rig) -> None:  # type: ignore[no-untyped-def]
    gpus = [pascal_no_counter(0, power=Constant(150.0))]
    r = rig(Scenario(epoch=T0, gpus=gpus), power_interval=0.02)
    # The fast sampler starts when NVML is opened, inside the first sample: under load that sample can take
    # a few hundred ms, so the counter is compared between two samples, not against zero.
    r.sample()
    e0 = r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus))
    t_start = time.time()
    time.sleep(1.0)
    r.sample()
    elapsed = time.time() - t_start
    e = r.value("gpuenergy_gpu_energy_joules_total", **L(0, gpus))
    assert e0 is not None and e is not None
    assert e - e0 == pytest.approx(150.0 * elapsed, rel=0.1)
    assert r.value("gpuenergy_gpu_energy_resets_total", **L(0, gpus)) is None


def test_no_driver_is_reported_once_and_is_not_fatal(fake_nvml_lib: Path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("FAKE_NVML_SCENARIO", raising=False)
    c = GPUCollector(lambda: NVMLBackend(str(fake_nvml_lib)), retry_interval=3600)
    s = Sampler([c], 1.0)
    reg = new_registry(SnapshotCollector(s))
    for _ in range(3):
        s.sample_once()
    assert reg.get_sample_value("gpuenergy_nvml_available", {"reason": "driver_not_loaded"}) == 0.0
    assert reg.get_sample_value("gpuenergy_collector_success", {"collector": "gpu"}) == 0.0
    warnings = [rec for rec in caplog.records if "NVML unavailable" in rec.getMessage()]
    assert len(warnings) == 1 and "nvidia-smi" in warnings[0].getMessage()


def test_scrape_path_never_calls_nvml(rig, fake_nvml_lib: Path) -> None:  # type: ignore[no-untyped-def]
    gpus = [h100(i) for i in range(4)]
    r = rig(frozen(T0 + 5, gpus))
    r.sample()
    lib = ctypes.CDLL(str(fake_nvml_lib))
    lib.fakeNvmlCallCount.restype = ctypes.c_ulonglong
    lib.fakeNvmlResetCallCounts()
    for _ in range(20):
        assert "gpuenergy_gpu_energy_joules_total" in r.text()
    assert lib.fakeNvmlCallCount(None) == 0
    r.sample()
    assert lib.fakeNvmlCallCount(None) > 0

"""The driver-generation matrix: one fake machine per NVIDIA driver and GPU generation the exporter supports.

Each ``Generation`` names the symbols its library lacks (``omit``) or has beyond what the exporter knows
(``extra``), the driver it reports and its GPUs, all on a frozen clock so every reading is reproducible.
``tests/test_driver_generations.py`` runs the whole exporter on each and compares the served ``/metrics``
with ``tests/golden/drivers/<name>.prom``. Generations with the same ``omit`` and ``extra`` share one
compiled library (``library_key``). This module must never load the library or pynvml.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .health import HOPPER_GENERATION
from .scenario import (
    ARCH_AMPERE,
    GPU,
    MIB,
    Driver,
    Process,
    Scenario,
    a100,
    grace_hopper,
    h100,
    mig_uuids,
    pascal_no_counter,
    v100,
)

#: t = 0 of every trace; the library's clock is frozen at EPOCH + AT_S.
EPOCH = 1_750_000_000.0
AT_S = 100.0

#: GPM arrived with R520 (Hopper); the exporter also reads nothing else of it.
GPM_FUNCTIONS = ("nvmlGpmMetricsGet", "nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleFree",
                 "nvmlGpmSampleGet")

#: What an R470 (CUDA 11.4) libnvidia-ml lacks that current pynvml reaches for: the _v3 process list (R510),
#: the power and memory-temperature field values (the fake drops nvmlDeviceGetFieldValues altogether),
#: memory info _v2 with reserved memory (R510), the "clocks event reasons" name (R535), GetTemperatureV
#: and GPM (R520).
R470_MISSING = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetTemperatureV",
    *GPM_FUNCTIONS,
)

#: Functions a driver newer than every pynvml we know might export: present, never called.
FUTURE_EXTRA = (
    "nvmlDeviceGetComputeRunningProcesses_v4",
    "nvmlDeviceGetMemoryInfo_v3",
    "nvmlDeviceGetTotalEnergyConsumption_v2",
    "nvmlDeviceGetPowerTelemetry_v1",
    "nvmlGpmMetricsGet_v2",
)

_TRAINING = (Process(4242, 8 << 30, 80),)


@dataclass(frozen=True)
class Generation:
    name: str
    summary: str
    driver: Driver
    gpus: tuple[GPU, ...]
    omit: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()

    @property
    def library_key(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(sorted(self.omit)), tuple(sorted(self.extra))

    def scenario(self) -> Scenario:
        return Scenario(epoch=EPOCH, driver=self.driver, gpus=list(self.gpus))

    def integrating(self) -> set[int]:
        """GPU indices without an energy counter (their energy is integrated over wall time)."""
        if "nvmlDeviceGetTotalEnergyConsumption" in self.omit:
            return {g.index for g in self.gpus}
        return {g.index for g in self.gpus if not g.energy_counter}


def _driver(version: str, cuda: int) -> Driver:
    return Driver(driver_version=version, nvml_version=f"{cuda // 1000}.{version}", cuda_version=cuda,
                  frozen_time=EPOCH + AT_S)


def _a10(index: int, **overrides: Any) -> GPU:
    """A10 (GA102): Ampere, but not GA100: nvmlDeviceGetPowerUsage is the 1 s average and this board has no
    instant power field; energy counter, no MIG, no GPM, GDDR6 (no memory temperature)."""
    base = GPU(
        index=index, name="NVIDIA A10", pci_device_id=0x223610DE, pci_subsystem_id=0x148210DE,
        architecture=ARCH_AMPERE, compute_capability=(8, 6), memory_total_bytes=23028 * MIB,
        memory_used_bytes=2 << 30, temperature_gpu_c=41, clock_sm_mhz=1695, clock_memory_mhz=6251,
        power_limit_mw=150_000, power_usage="average", power_instant_field=False, power_average_field=False,
        energy_offset_mj=42_000_000,
    )
    return replace(base, **overrides) if overrides else base


def _mig_h100() -> GPU:
    g = h100(0, util_gpu_pct=90, memory_used_bytes=20 << 30)
    # three instances as an H100 carves them (3g.40gb, 2g.20gb, 1g.10gb): slices and SMs (issue 19)
    return replace(g, mig_mode=1, mig_devices=mig_uuids(g.uuid, 3), processes=_TRAINING,
                   mig_profiles=((3, 3, 60), (2, 2, 32), (1, 1, 16)))


GENERATIONS: tuple[Generation, ...] = (
    Generation(
        "r470",
        "R470 (CUDA 11.4) on A100 and V100: no _v3 process list, no field values, no memory info _v2, no "
        "clock-event reasons (throttle reasons instead), no GPM",
        _driver("470.223.02", 11040),
        (a100(0, processes=_TRAINING, memory_used_bytes=9 << 30, util_gpu_pct=97), v100(1)),
        omit=R470_MISSING,
    ),
    Generation(
        "pre_volta",
        "Pascal (P100) on R535: no energy counter, energy integrated from nvmlDeviceGetPowerUsage (instant)",
        _driver("535.183.01", 12020),
        (pascal_no_counter(0, processes=_TRAINING, util_gpu_pct=88),),
    ),
    Generation(
        "ampere",
        "Ampere A10 (GA102) on R535: nvmlDeviceGetPowerUsage is the 1 s average and the only power reading",
        _driver("535.183.01", 12020),
        (_a10(0, processes=_TRAINING, util_gpu_pct=75),),
    ),
    Generation(
        "hopper",
        "Hopper H100 on R550: energy counter, instant and average power fields, memory temperature, GPM",
        _driver("550.54.15", 12040),
        (h100(0, energy_offset_mj=123_456_789, processes=_TRAINING, clocks_event_reasons=0x4,
              gpm={2: 62.5, 3: 30.0, 5: 41.0, 10: 55.0, 1: 97.0}, health=HOPPER_GENERATION),),
    ),
    Generation(
        "grace_hopper",
        "Grace Hopper GH200 on R550: GPU power and module power (GPU + Grace CPU + memory) apart",
        _driver("550.54.15", 12040),
        (grace_hopper(0, processes=_TRAINING),),
    ),
    Generation(
        "mig",
        "H100 with MIG enabled on R550: no utilisation on the parent GPU, one energy series for the whole GPU",
        _driver("550.54.15", 12040),
        (_mig_h100(),),
    ),
    Generation(
        "future",
        "A driver newer than the exporter (R610, unknown architecture, extra symbols nobody wraps yet)",
        _driver("610.10", 13020),
        (h100(0, name="NVIDIA Future GPU", architecture=14, compute_capability=(12, 0), processes=_TRAINING),),
        extra=FUTURE_EXTRA,
    ),
)

BY_NAME = {g.name: g for g in GENERATIONS}

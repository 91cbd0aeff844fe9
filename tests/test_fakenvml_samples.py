"""The fake library's sample buffers (``nvmlDeviceGetSamples``), through the real pynvml API.

What bench.real_probe reads on a real driver, and what docs/measurement.md's "Why not the driver's
power-sample buffer" weighs: a ring of samples 20 ms apart, timestamps in microseconds, only those newer than
``lastSeenTimeStamp``, a size query with a NULL buffer, and what a read costs by type on the h100-580 cost
profile. Expected values are computed by hand from the scenario (a square wave whose 20 ms windows are flat
or split in half), never read back from the library.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from fakenvml import Driver, Scenario, Square, h100
from test_fakenvml import lib, run_nvml, scenario_path  # noqa: F401 - fixtures shared with the fake's tests

EPOCH = 1_700_000_000.0
NOW = EPOCH + 12.3456
PERIOD_S = 0.020
RING = 120
#: The newest sample at NOW closes the window ending at k = floor(12.3456 / 0.02) = 617 periods after the
#: epoch; the ring holds k = 498 .. 617.
LAST_K = 617
FIRST_K = LAST_K - RING + 1


def stamp_us(k: int) -> int:
    """Sample k's timestamp, unix µs (the same double arithmetic as the library)."""
    return math.floor((EPOCH + k * PERIOD_S) * 1e6)


#: Square(100 W, 700 W, period 0.1 s, duty 0.5): 700 W for [0, 50 ms), 100 W for [50, 100 ms) of each 100 ms.
#: Sample k is the mean over [(k-1) x 20 ms, k x 20 ms): by k mod 5: 1 -> [0, 20) 700 W; 2 -> [20, 40) 700 W;
#: 3 -> [40, 60) half and half, 400 W; 4 -> [60, 80) 100 W; 0 -> [80, 100) 100 W.
EXPECTED_MW = {1: 700_000, 2: 700_000, 3: 400_000, 4: 100_000, 0: 100_000}

_BODY = """
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    raw = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetSamples")

    def raw_read(kind, last_seen, size, with_buffer=True):
        vtype, count = pynvml._nvmlValueType_t(), ctypes.c_uint(size)
        buf = (pynvml.c_nvmlSample_t * max(size, 1))() if with_buffer else None
        rc = raw(h, pynvml._nvmlSamplingType_t(kind), ctypes.c_ulonglong(last_seen), ctypes.byref(vtype),
                 ctypes.byref(count), buf)
        got = [(s.timeStamp, s.sampleValue.uiVal) for s in buf[:count.value]] if with_buffer and rc == 0 else []
        return rc, vtype.value, count.value, got

    out["size_query"] = raw_read(pynvml.NVML_TOTAL_POWER_SAMPLES, 0, 0, with_buffer=False)
    vtype, samples = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_TOTAL_POWER_SAMPLES, 0)
    out["power"] = [vtype, [(s.timeStamp, s.sampleValue.uiVal) for s in samples]]
    ts = [s.timeStamp for s in samples]
    _, newer = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_TOTAL_POWER_SAMPLES, ts[99])
    out["newer"] = [s.timeStamp for s in newer]
    out["newer_size"] = raw_read(pynvml.NVML_TOTAL_POWER_SAMPLES, ts[99], 0, with_buffer=False)[2]
    out["none_newer"] = err(pynvml.nvmlDeviceGetSamples, h, pynvml.NVML_TOTAL_POWER_SAMPLES, ts[-1])
    out["small"] = raw_read(pynvml.NVML_TOTAL_POWER_SAMPLES, 0, 10)
    out["zero"] = raw_read(pynvml.NVML_TOTAL_POWER_SAMPLES, 0, 0)[0]
    vtype, util = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
    out["util"] = [vtype, [(s.timeStamp, s.sampleValue.uiVal) for s in util]]
    out["other"] = [err(pynvml.nvmlDeviceGetSamples, h, kind, 0)
                    for kind in (pynvml.NVML_MEMORY_UTILIZATION_SAMPLES, pynvml.NVML_MODULE_POWER_SAMPLES)]
    mig = pynvml.nvmlDeviceGetHandleByIndex(1)
    out["mig_util"] = err(pynvml.nvmlDeviceGetSamples, mig, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
    out["mig_power"] = len(pynvml.nvmlDeviceGetSamples(mig, pynvml.NVML_TOTAL_POWER_SAMPLES, 0)[1])
"""


def test_power_and_utilisation_sample_rings(lib: Path, scenario_path: Path) -> None:  # noqa: F811
    Scenario(epoch=EPOCH, driver=Driver(frozen_time=NOW),
             gpus=[h100(0, power=Square(100.0, 700.0, 0.1, 0.5), util_gpu_pct=87),
                   h100(1, mig_capable=True, mig_mode=1)]).write(scenario_path)
    out = run_nvml(lib, _BODY, scenario_path)
    uint = 1  # NVML_VALUE_TYPE_UNSIGNED_INT
    assert out["size_query"][:3] == [0, uint, RING]  # a NULL buffer: how many there are, nothing written
    vtype, power = out["power"]
    assert vtype == uint
    assert [t for t, _ in power] == [stamp_us(k) for k in range(FIRST_K, LAST_K + 1)]
    for k, (_, mw) in zip(range(FIRST_K, LAST_K + 1), power, strict=True):
        assert abs(mw - EXPECTED_MW[k % 5]) <= 1, (k, mw)
    # 120 samples x 20 ms of a 400 W-average wave (24 whole periods of 100 ms): 960 J
    assert sum(mw for _, mw in power) / 1000.0 * PERIOD_S == pytest.approx(960.0, abs=0.01)
    # only samples newer than lastSeenTimeStamp: the 20 after the 100th; none after the newest
    assert out["newer"] == [stamp_us(k) for k in range(FIRST_K + 100, LAST_K + 1)]
    assert out["newer_size"] == 20
    assert out["none_newer"] == 6  # NVML_ERROR_NOT_FOUND
    # a buffer of 10: the oldest 10, so a reader going on from the last it saw misses none
    rc, _, count, got = out["small"]
    assert (rc, count) == (0, 10) and [t for t, _ in got] == [stamp_us(k) for k in range(FIRST_K, FIRST_K + 10)]
    assert out["zero"] == 7  # a buffer with room for none: NVML_ERROR_INSUFFICIENT_SIZE
    vtype, util = out["util"]
    assert vtype == uint and [t for t, _ in util] == [t for t, _ in power] and {v for _, v in util} == {87}
    assert out["other"] == [3, 3]  # NOT_SUPPORTED
    assert out["mig_util"] == 3 and out["mig_power"] == RING  # no utilisation under MIG, as the rates


_COST_BODY = """
    fake.fakeNvmlCostSeconds.restype = ctypes.c_double
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    fake.fakeNvmlResetCostCounts()

    def charged(kind, reads):
        before = fake.fakeNvmlCostSeconds(b"nvmlDeviceGetSamples")
        for _ in range(reads):
            try:
                pynvml.nvmlDeviceGetSamples(h, kind, 0)
            except pynvml.NVMLError:
                pass
        return fake.fakeNvmlCostSeconds(b"nvmlDeviceGetSamples") - before

    out["power"] = charged(pynvml.NVML_TOTAL_POWER_SAMPLES, 5)
    out["util"] = charged(pynvml.NVML_GPU_UTILIZATION_SAMPLES, 5)
    out["other"] = charged(pynvml.NVML_MEMORY_UTILIZATION_SAMPLES, 5)
"""


def test_a_sample_buffer_read_costs_what_the_h100_charges_by_type(lib: Path, scenario_path: Path) -> None:  # noqa: F811
    """h100-580 (gpu-run-1, 2026-11-26): TOTAL_POWER 480 µs a read, GPU_UTILIZATION 2,100 µs, the base 5 µs
    for pynvml's size query before each and for a type the driver does not sample (rejected at the first,
    size-query call). Five reads through pynvml's wrapper: 5 x (5 + 480) = 2.425 ms; 5 x (5 + 2,100) =
    10.525 ms; 5 x 5 = 0.025 ms."""
    Scenario(epoch=time.time(), driver=Driver(cost_profile="h100-580"), gpus=[h100(0)]).write(scenario_path)
    out = run_nvml(lib, _COST_BODY, scenario_path)
    # The library counts the CPU it burned on the thread's clock: at least the figure, and over it by what the
    # last clock read and the interrupts served on this thread's time add, which on a loaded two-core machine
    # reached +5 µs a read (the CI run of 2026-11-28: 50.6 µs for the five 5 µs reads). 50 µs a read of slack
    # (or 20%, whichever is more) still tells the three types apart: an unsampled type charged as TOTAL_POWER
    # would be 2.4 ms, not 0.28.
    for kind, figure in (("power", 5 * 485e-6), ("util", 5 * 2105e-6), ("other", 5 * 5e-6)):
        assert figure <= out[kind] <= figure + max(0.2 * figure, 5 * 50e-6), kind

"""Tests of the fake NVML library, through the real pynvml API.

pynvml keeps process-wide state (the loaded library, a function-pointer cache, an init refcount), so every
pynvml scenario runs in a fresh Python process: a short script whose readings come back as JSON and are
checked here against the scenario's independently computed ground truth. These tests must never depend on
a real NVIDIA driver being present or absent.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from fakenvml import (
    GPM_ANY_TENSOR_UTIL,
    GPM_DRAM_BW_UTIL,
    GPM_GRAPHICS_UTIL,
    GPM_SM_OCCUPANCY,
    GPM_SM_UTIL,
    POWER_SCOPE_MODULE,
    CompilerNotFound,
    Constant,
    Driver,
    Process,
    Scenario,
    Square,
    Steps,
    a100,
    build_library,
    exported_functions,
    grace_hopper,
    h100,
    mig_uuids,
    pascal_no_counter,
    v100,
)

TESTS_DIR = Path(__file__).resolve().parent

# Loads the fake exactly as the exporter's --nvml.library does; `out` is printed as JSON at the end.
PRELUDE = """
import ctypes, json, os, sys, threading, time
sys.path.insert(0, {tests_dir!r})
import pynvml
LIB = {lib!r}
if LIB:
    with pynvml.libLoadLock:
        pynvml.nvmlLib = ctypes.CDLL(LIB)
    fake = ctypes.CDLL(LIB)
    fake.fakeNvmlCallCount.restype = ctypes.c_ulonglong
    fake.fakeNvmlLastError.restype = ctypes.c_char_p
out = {{}}

def err(fn, *args):
    '''The NVML error code fn raises, or None.'''
    try:
        fn(*args)
    except pynvml.NVMLError as e:
        return e.value
    return None

def text(x):
    return x.decode() if isinstance(x, bytes) else x

def timed(fn, *args):
    t0 = time.time()
    v = fn(*args)
    return t0, v, time.time()
"""


def run_nvml(lib: Path | None, body: str, scenario: Path | None = None, env: dict[str, str] | None = None,
             timeout: float = 30) -> dict[str, Any]:
    """Run ``body`` after PRELUDE in a fresh interpreter; return its ``out`` dict."""
    script = PRELUDE.format(tests_dir=str(TESTS_DIR), lib=str(lib) if lib else "") + textwrap.dedent(body)
    script += "\nprint('@@OUT@@' + json.dumps(out))\n"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
    if scenario is not None:
        child_env["FAKE_NVML_SCENARIO"] = str(scenario)
    child_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@OUT@@")][-1]
    result: dict[str, Any] = json.loads(line[len("@@OUT@@"):])
    result["_stderr"] = proc.stderr
    return result


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_library(tmp_path_factory.mktemp("fakenvml-lib"))


@pytest.fixture
def scenario_path(tmp_path: Path) -> Path:
    return tmp_path / "scenario.ini"


def in_bracket(value: float, lo: float, hi: float, slack: float = 0) -> bool:
    return min(lo, hi) - slack <= value <= max(lo, hi) + slack


# ---- Pure Python: the ground truth itself ---------------------------------------------------------------


@pytest.mark.parametrize("trace", [
    Constant(123.0),
    Square(100.0, 700.0, 0.5, 0.6),
    Steps(((0.2, 100.0), (0.3, 650.0), (0.1, 0.0)), repeat=True),
    Steps(((0.2, 100.0), (0.3, 650.0)), repeat=False),
])
def test_trace_integral_matches_numeric_integration(trace: Constant | Square | Steps) -> None:
    a, b, n = 0.0137, 2.3, 200_000
    dt = (b - a) / n
    numeric = sum(trace.power_w(a + (i + 0.5) * dt) for i in range(n)) * dt
    assert trace.cumulative_j(b) - trace.cumulative_j(a) == pytest.approx(numeric, rel=2e-4)
    assert trace.cumulative_j(-1.0) == pytest.approx(-trace.power_w(0.0))


def test_scenario_write_is_atomic_and_distinct(scenario_path: Path) -> None:
    sc = Scenario(epoch=1000.0, gpus=[h100(0)])
    sc.write(scenario_path)
    first = os.stat(scenario_path)
    sc.write(scenario_path)
    second = os.stat(scenario_path)
    assert (first.st_ino, first.st_mtime_ns) != (second.st_ino, second.st_mtime_ns)
    assert [p.name for p in scenario_path.parent.iterdir()] == ["scenario.ini"]  # no temp files left
    assert "epoch = 1000.0" in scenario_path.read_text()


def test_build_rejects_unknown_omit_and_caches(lib: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nvmlNoSuchFunction"):
        build_library(tmp_path, omit=["nvmlNoSuchFunction"])
    again = build_library(lib.parent)
    assert again == lib and again.stat().st_mtime_ns == lib.stat().st_mtime_ns
    exported = exported_functions()
    assert {"nvmlInit_v2", "nvmlErrorString", "nvmlGpmMetricsGet", "fakeNvmlCallCount"} <= exported
    loaded = ctypes.CDLL(str(lib))
    assert all(hasattr(loaded, name) for name in exported)


def test_build_without_compiler_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-for-fakenvml")
    with pytest.raises(CompilerNotFound, match="no-such-compiler-for-fakenvml"):
        build_library(tmp_path)


# ---- Through pynvml -------------------------------------------------------------------------------------


def test_devices_and_identity(lib: Path, scenario_path: Path) -> None:
    procs = (Process(4242, 8 << 30, 80, 30), Process(4343, 1 << 30, 5))
    sc = Scenario(
        epoch=time.time(),
        driver=Driver(driver_version="555.42.06", nvml_version="12.555.42.06", cuda_version=12050),
        gpus=[
            h100(0, processes=procs, memory_used_bytes=9 << 30, util_gpu_pct=97, util_memory_pct=41,
                 clocks_event_reasons=0x24),
            a100(1), v100(2), pascal_no_counter(3), grace_hopper(4),
        ],
    )
    sc.write(scenario_path)
    out = run_nvml(lib, """
        pynvml.nvmlInit()
        out["driver"] = [pynvml.nvmlSystemGetDriverVersion(), pynvml.nvmlSystemGetNVMLVersion(),
                         pynvml.nvmlSystemGetCudaDriverVersion(), pynvml.nvmlSystemGetCudaDriverVersion_v2()]
        out["gpus"] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pci = pynvml.nvmlDeviceGetPciInfo_v3(h)
            m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
            m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            out["gpus"].append(dict(
                index=pynvml.nvmlDeviceGetIndex(h), name=pynvml.nvmlDeviceGetName(h),
                uuid=pynvml.nvmlDeviceGetUUID(h), bus=text(pci.busId), legacy=text(pci.busIdLegacy),
                pci=[pci.domain, pci.bus, pci.device, pci.pciDeviceId, pci.pciSubSystemId],
                arch=pynvml.nvmlDeviceGetArchitecture(h), cc=list(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                by_uuid=pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(h))),
                m1=[m1.total, m1.used, m1.free], m2=[m2.total, m2.reserved, m2.used, m2.free],
                temp=[pynvml.nvmlDeviceGetTemperature(h, 0), pynvml.nvmlDeviceGetTemperatureV(h, 0)],
                clocks=[pynvml.nvmlDeviceGetClockInfo(h, c) for c in (0, 1, 2)],
                limits=[pynvml.nvmlDeviceGetEnforcedPowerLimit(h), pynvml.nvmlDeviceGetPowerManagementLimit(h)],
                reasons=[pynvml.nvmlDeviceGetCurrentClocksEventReasons(h),
                         pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)],
            ))
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        u = pynvml.nvmlDeviceGetUtilizationRates(h)
        out["util"] = [u.gpu, u.memory]
        out["procs"] = [[p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
        out["procutil"] = [[s.pid, s.smUtil, s.memUtil] for s in pynvml.nvmlDeviceGetProcessUtilization(h, 0)]
        h3 = pynvml.nvmlDeviceGetHandleByIndex(3)
        out["no_procs"] = [pynvml.nvmlDeviceGetComputeRunningProcesses(h3),
                           err(pynvml.nvmlDeviceGetProcessUtilization, h3, 0)]
        out["video_clock"] = err(pynvml.nvmlDeviceGetClockInfo, h, 3)
        out["unknown_uuid"] = err(pynvml.nvmlDeviceGetHandleByUUID, "GPU-nope")
        out["bad_index"] = err(pynvml.nvmlDeviceGetHandleByIndex, 5)
        pynvml.nvmlShutdown()
        out["after_shutdown"] = err(pynvml.nvmlDeviceGetCount)
    """, scenario_path)
    assert out["driver"] == ["555.42.06", "12.555.42.06", 12050, 12050]
    assert [g["index"] for g in out["gpus"]] == [0, 1, 2, 3, 4] == [g["by_uuid"] for g in out["gpus"]]
    for got, want in zip(out["gpus"], sc.gpus, strict=True):
        assert got["name"] == want.name and got["uuid"] == want.uuid and got["bus"] == want.pci_bus_id
        assert got["arch"] == want.architecture and tuple(got["cc"]) == want.compute_capability
        assert got["pci"][3:] == [want.pci_device_id, want.pci_subsystem_id]
        total, used, reserved = want.memory_total_bytes, want.memory_used_bytes, want.memory_reserved_bytes
        assert got["m2"] == [total, reserved, used, total - used - reserved]
        assert got["m1"] == [total, used + reserved, total - used - reserved]
        assert got["temp"] == [want.temperature_gpu_c] * 2
        assert got["clocks"] == [want.clock_sm_mhz, want.clock_sm_mhz, want.clock_memory_mhz]
        assert got["limits"] == [want.power_limit_mw] * 2
        assert got["uuid"].startswith("GPU-") and len(got["uuid"]) == 40
    g0 = out["gpus"][0]
    assert g0["pci"][:3] == [0, 0x18, 0] and g0["legacy"] == "0000:18:00.0"
    assert out["gpus"][4]["pci"][0] == 9  # Grace Hopper: PCI domain 9
    assert g0["reasons"] == [0x24, 0x24]
    assert [g["arch"] for g in out["gpus"]] == [9, 7, 5, 4, 9]
    assert out["util"] == [97, 41]
    assert out["procs"] == [[4242, 8 << 30], [4343, 1 << 30]]
    assert out["procutil"] == [[4242, 80, 30], [4343, 5, 0]]
    assert out["no_procs"] == [[], 6]  # empty list; NOT_FOUND (no samples)
    assert out["video_clock"] == 3 and out["unknown_uuid"] == 6 and out["bad_index"] == 2
    assert out["after_shutdown"] == 1  # UNINITIALIZED


def test_energy_counter_is_the_exact_integral(lib: Path, scenario_path: Path) -> None:
    epoch = time.time() - 3.0
    sc = Scenario(epoch=epoch, gpus=[
        h100(0, power=Square(120.0, 690.0, 0.07, 0.4), energy_offset_mj=987_654_321.0),
        v100(1, power=Steps(((0.03, 50.0), (0.05, 280.0), (0.011, 190.0)), repeat=True)),
    ])
    sc.write(scenario_path)
    out = run_nvml(lib, """
        pynvml.nvmlInit()
        out["readings"] = {}
        for i in (0, 1):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            rs = []
            for _ in range(15):
                rs.append(timed(pynvml.nvmlDeviceGetTotalEnergyConsumption, h))
                time.sleep(0.02)
            out["readings"][i] = rs
            fv = pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION])
            out.setdefault("field", []).append([fv[0].nvmlReturn, fv[0].value.ullVal])
    """, scenario_path)
    for key, readings in out["readings"].items():
        i = int(key)
        for t0, mj, t1 in readings:
            # the library read its clock somewhere between t0 and t1
            assert in_bracket(mj, sc.energy_counter_mj(i, t0), sc.energy_counter_mj(i, t1), slack=1), (i, mj)
        (a0, first, a1), (b0, last, b1) = readings[0], readings[-1]
        assert b0 - a1 > 0.25
        lo = sc.true_energy_j(i, a1, b0) * 1000
        hi = sc.true_energy_j(i, a0, b1) * 1000
        assert in_bracket(last - first, lo, hi, slack=2)
        # within 0.1%, give or take what the clock could not pin down (how long each call took)
        unsure_mj = 700.0 * ((a1 - a0) + (b1 - b0)) * 1000 / 2
        mid = sc.true_energy_j(i, (a0 + a1) / 2, (b0 + b1) / 2) * 1000
        assert last - first == pytest.approx(mid, rel=1e-3, abs=unsure_mj)
    assert readings and out["field"][0][0] == 0 and out["field"][0][1] >= 987_654_321


def test_instant_and_average_power_windows(lib: Path, scenario_path: Path) -> None:
    # High for exactly the 25 ms the driver measures of every 100 ms: the readings alias to 700 W while the
    # true mean is 250 W, which is why the exporter prefers the energy counter.
    aliased = Square(100.0, 700.0, 0.1, 0.25)
    epoch = time.time() - 2.0
    sc = Scenario(epoch=epoch, gpus=[
        h100(0, power=aliased),
        a100(1, power=Steps(((0.35, 150.0), (0.45, 390.0)), repeat=True)),
        h100(2, power=Square(80.0, 600.0, 0.6, 0.5), power_window_ms=40.0, power_period_ms=200.0,
             power_average_windows=5),
    ])
    sc.write(scenario_path)
    out = run_nvml(lib, """
        pynvml.nvmlInit()
        ids = [pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_FI_DEV_POWER_AVERAGE]
        out["r"] = []
        for _ in range(12):
            for i in (0, 1, 2):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                t0 = time.time()
                fv = pynvml.nvmlDeviceGetFieldValues(h, ids)
                pu = pynvml.nvmlDeviceGetPowerUsage(h)
                t1 = time.time()
                out["r"].append([i, t0, t1, fv[0].value.uiVal, fv[1].value.uiVal, pu,
                                 fv[0].nvmlReturn, fv[1].nvmlReturn, fv[0].valueType])
            time.sleep(0.037)
    """, scenario_path)
    kinds = set()
    for i, t0, t1, inst, avg, pu, ret0, ret1, vtype in out["r"]:
        assert ret0 == ret1 == 0 and vtype == 1  # success, unsigned int (mW)
        exp_inst = {sc_mw(sc.reported_instant_w(i, t)) for t in (t0, t1)}
        exp_avg = {sc_mw(sc.reported_average_w(i, t)) for t in (t0, t1)}
        assert inst in exp_inst and avg in exp_avg
        assert pu in {sc.reported_power_usage_mw(i, t) for t in (t0, t1)}
        assert pu == (avg if sc.gpu(i).power_usage == "average" else inst)
        kinds.add((i, inst))
        if i == 0:
            assert inst == avg == 700_000
            assert sc.true_energy_j(0, t0 - 1, t0) == pytest.approx(250.0)
    # the stepped trace was seen at different levels by the instant reading
    assert len({inst for i, inst in kinds if i == 1}) >= 2


def sc_mw(watts: float) -> int:
    return max(0, int(math.floor(watts * 1000.0 + 0.5)))


def test_frozen_clock_gives_exact_values(lib: Path, scenario_path: Path) -> None:
    epoch = 1_700_000_000.0
    now = epoch + 12.3456
    sc = Scenario(epoch=epoch, driver=Driver(frozen_time=now),
                  gpus=[h100(0, power=Square(100.0, 700.0, 0.5, 0.6), energy_offset_mj=5000.0)])
    sc.write(scenario_path)
    out = run_nvml(lib, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["v"] = [pynvml.nvmlDeviceGetTotalEnergyConsumption(h), pynvml.nvmlDeviceGetPowerUsage(h),
                    pynvml.nvmlDeviceGetFieldValues(h, [186])[0].value.uiVal]
    """, scenario_path)
    assert out["v"] == [sc.energy_counter_mj(0, now), sc.reported_power_usage_mw(0, now),
                        sc_mw(sc.reported_instant_w(0, now))]
    assert out["v"][0] == 5000 + int(sc.true_energy_j(0, epoch, now) * 1000)


def test_energy_counter_reset(lib: Path, scenario_path: Path) -> None:
    # A frozen clock, advanced by rewriting the scenario, makes the reset exact and immune to a slow machine.
    epoch = 1_700_000_000.0
    gpu = h100(0, power=Constant(400.0), energy_offset_mj=5e9, energy_reset_at_s=(0.4,))
    times = [epoch + 0.3, epoch + 0.55, epoch + 2.0]
    scenarios = [Scenario(epoch=epoch, driver=Driver(frozen_time=t), gpus=[gpu]) for t in times]
    scenarios[0].write(scenario_path)
    out = run_nvml(lib, f"""
        from fakenvml import Scenario, Constant, Driver, h100
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["mj"] = [pynvml.nvmlDeviceGetTotalEnergyConsumption(h)]
        gpu = h100(0, power=Constant(400.0), energy_offset_mj=5e9, energy_reset_at_s=(0.4,))
        for t in {times[1:]!r}:
            Scenario(epoch={epoch!r}, driver=Driver(frozen_time=t), gpus=[gpu]).write({str(scenario_path)!r})
            out["mj"].append(pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
    """, scenario_path)
    expected = [sc.energy_counter_mj(0, t) for sc, t in zip(scenarios, times, strict=True)]
    assert out["mj"] == expected
    # restarted from 0 at t = 0.4 s (floor of the mJ: unix-time rounding may cost the last one)
    assert expected == pytest.approx([5_000_000_000 + 120_000, 60_000, 640_000], abs=1)


def test_lost_gpu(lib: Path, scenario_path: Path) -> None:
    # The child writes the scenario so that "lost in 0.5 s" counts from its own start, not ours.
    out = run_nvml(lib, f"""
        from fakenvml import Scenario, h100
        epoch = time.time()
        Scenario(epoch=epoch, gpus=[h100(0, lost_at_s=0.5), h100(1), h100(2, lost_at_s=-1.0)]).write(
            {str(scenario_path)!r})
        pynvml.nvmlInit()
        h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        out["before"] = pynvml.nvmlDeviceGetPowerUsage(h0)
        out["before_in_time"] = time.time() < epoch + 0.5
        out["handle2"] = err(pynvml.nvmlDeviceGetHandleByIndex, 2)
        time.sleep(max(0.0, epoch + 0.55 - time.time()))
        out["after"] = [err(f, h0) for f in (pynvml.nvmlDeviceGetPowerUsage, pynvml.nvmlDeviceGetUUID,
                        pynvml.nvmlDeviceGetTotalEnergyConsumption, pynvml.nvmlDeviceGetMemoryInfo)]
        out["fields"] = err(pynvml.nvmlDeviceGetFieldValues, h0, [186])
        out["handle0"] = err(pynvml.nvmlDeviceGetHandleByIndex, 0)
        out["other"] = pynvml.nvmlDeviceGetPowerUsage(h1)
        try:
            pynvml.nvmlDeviceGetPowerUsage(h0)
        except pynvml.NVMLError_GpuIsLost:
            out["exception"] = "GpuIsLost"
    """, scenario_path)
    assert out["before"] > 0 and out["before_in_time"]
    assert out["handle2"] == 15
    assert out["after"] == [15, 15, 15, 15] and out["fields"] == 15 and out["handle0"] == 15
    assert out["other"] > 0 and out["exception"] == "GpuIsLost"


def test_not_supported_and_missing_from_scenario(lib: Path, scenario_path: Path) -> None:
    sc = Scenario(
        epoch=time.time(),
        driver=Driver(missing=("nvmlSystemGetCudaDriverVersion_v2",), device_count=4),
        gpus=[
            h100(0, not_supported=("nvmlDeviceGetPowerUsage",), missing=("nvmlDeviceGetTotalEnergyConsumption",),
                 fields_not_supported=(82,)),
            pascal_no_counter(1),
            h100(2, handle_error=4),
        ],
    )
    sc.write(scenario_path)
    out = run_nvml(lib, """
        pynvml.nvmlInit()
        h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        out["h0"] = [err(pynvml.nvmlDeviceGetPowerUsage, h0), err(pynvml.nvmlDeviceGetTotalEnergyConsumption, h0),
                     err(pynvml.nvmlDeviceGetName, h0)]
        try:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(h0)
        except pynvml.NVMLError_FunctionNotFound:
            out["exc"] = "FunctionNotFound"
        out["fields0"] = [[v.fieldId, v.nvmlReturn] for v in pynvml.nvmlDeviceGetFieldValues(h0, [82, 186, 185, 9999])]
        out["h1"] = [err(pynvml.nvmlDeviceGetTotalEnergyConsumption, h1), pynvml.nvmlDeviceGetPowerUsage(h1),
                     err(pynvml.nvmlDeviceGetMigMode, h1),
                     err(pynvml.nvmlGpmSampleGet, h1, pynvml.nvmlGpmSampleAlloc())]
        out["fields1"] = [v.nvmlReturn for v in pynvml.nvmlDeviceGetFieldValues(h1, [186, 185, 82])]
        out["cuda_v2"] = err(pynvml.nvmlSystemGetCudaDriverVersion_v2)
        out["cuda"] = pynvml.nvmlSystemGetCudaDriverVersion()
        out["count"] = pynvml.nvmlDeviceGetCount()
        out["handles"] = [err(pynvml.nvmlDeviceGetHandleByIndex, 2), err(pynvml.nvmlDeviceGetHandleByIndex, 3)]
    """, scenario_path)
    assert out["h0"] == [3, 13, None] and out["exc"] == "FunctionNotFound"
    assert out["fields0"] == [[82, 3], [186, 0], [185, 0], [9999, 3]]
    p100 = sc.gpu(1)
    assert out["h1"][0] == 3 and out["h1"][2] == 3 and out["h1"][3] == 3
    assert out["h1"][1] == p100.true_power_w(0.0) * 1000  # constant trace: every window reads the same
    assert out["fields1"] == [3, 3, 3]
    assert out["cuda_v2"] == 13 and out["cuda"] == 12040
    assert out["count"] == 4 and out["handles"] == [4, 999]  # NO_PERMISSION; no such section: UNKNOWN


def test_symbols_omitted_from_the_build(lib: Path, scenario_path: Path, tmp_path: Path) -> None:
    old = build_library(tmp_path / "old", omit=["nvmlDeviceGetTotalEnergyConsumption", "nvmlGpmQueryDeviceSupport"])
    assert old != lib
    cdll = ctypes.CDLL(str(old))
    assert not hasattr(cdll, "nvmlDeviceGetTotalEnergyConsumption") and hasattr(cdll, "nvmlDeviceGetPowerUsage")
    Scenario(epoch=time.time(), gpus=[h100(0)]).write(scenario_path)
    out = run_nvml(old, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["energy"] = err(pynvml.nvmlDeviceGetTotalEnergyConsumption, h)
        out["gpm"] = err(pynvml.nvmlGpmQueryDeviceSupport, h)
        out["power"] = pynvml.nvmlDeviceGetPowerUsage(h)
        out["calls"] = fake.fakeNvmlCallCount(b"nvmlDeviceGetTotalEnergyConsumption")
    """, scenario_path)
    assert out["energy"] == 13 and out["gpm"] == 13 and out["power"] == 350_000
    assert out["calls"] == 0  # pynvml never reached the library


def test_gpm_metrics_and_sample_tracking(lib: Path, scenario_path: Path) -> None:
    pcts = {GPM_GRAPHICS_UTIL: 91.0, GPM_SM_UTIL: 62.5, GPM_SM_OCCUPANCY: 33.0, GPM_ANY_TENSOR_UTIL: 48.25,
            GPM_DRAM_BW_UTIL: 17.0}
    Scenario(epoch=time.time(), gpus=[h100(0, gpm=pcts), a100(1)]).write(scenario_path)
    out = run_nvml(lib, """
        pynvml.nvmlInit()
        h, ha = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        out["support"] = [pynvml.nvmlGpmQueryDeviceSupport(x).isSupportedDevice for x in (h, ha)]
        s1, s2 = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
        out["outstanding_2"] = fake.fakeNvmlGpmSamplesOutstanding()
        pynvml.nvmlGpmSampleGet(h, s1)
        time.sleep(0.12)
        pynvml.nvmlGpmSampleGet(h, s2)
        ids = [1, 2, 3, 5, 10, 7, 300]
        mg = pynvml.c_nvmlGpmMetricsGet_t()
        mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(ids)
        mg.sample1, mg.sample2 = s1, s2
        for k, mid in enumerate(ids):
            mg.metrics[k].metricId = mid
        pynvml.nvmlGpmMetricsGet(mg)
        out["metrics"] = [[mg.metrics[k].metricId, mg.metrics[k].nvmlReturn, mg.metrics[k].value]
                          for k in range(len(ids))]
        out["name"] = text(mg.metrics[1].metricInfo.shortName)
        out["a100_get"] = err(pynvml.nvmlGpmSampleGet, ha, s1)
        mg.version = 99
        out["bad_version"] = err(pynvml.nvmlGpmMetricsGet, mg)
        pynvml.nvmlGpmSampleFree(s1)
        pynvml.nvmlGpmSampleFree(s2)
        out["outstanding_0"] = fake.fakeNvmlGpmSamplesOutstanding()
        out["double_free"] = err(pynvml.nvmlGpmSampleFree, s2)
        pynvml.nvmlGpmSampleAlloc()
        out["leaked"] = fake.fakeNvmlGpmSamplesOutstanding()
    """, scenario_path)
    assert out["support"] == [1, 0]
    assert out["outstanding_2"] == 2 and out["outstanding_0"] == 0 and out["leaked"] == 1
    got = {mid: (ret, value) for mid, ret, value in out["metrics"]}
    for mid, pct in pcts.items():
        assert got[mid][0] == 0 and got[mid][1] == pytest.approx(pct, rel=1e-9)
    assert got[7][0] == 3 and got[300][0] == 3  # not in the scenario / unknown: per-metric NOT_SUPPORTED
    assert out["name"] == "sm_util"
    assert out["a100_get"] == 3 and out["bad_version"] == 25 and out["double_free"] == 2


def test_gpm_averages_over_a_scenario_change(lib: Path, scenario_path: Path) -> None:
    Scenario(epoch=time.time(), gpus=[h100(0, gpm={GPM_SM_UTIL: 20.0})]).write(scenario_path)
    out = run_nvml(lib, f"""
        from fakenvml import Scenario, h100
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        s1, s2 = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
        pynvml.nvmlGpmSampleGet(h, s1)
        t1 = time.time()
        time.sleep(0.15)
        tw = time.time()
        Scenario(epoch=0.0, gpus=[h100(0, gpm={{2: 80.0}})]).write({str(scenario_path)!r})
        time.sleep(0.15)
        pynvml.nvmlGpmSampleGet(h, s2)
        t2 = time.time()
        mg = pynvml.c_nvmlGpmMetricsGet_t()
        mg.version, mg.numMetrics, mg.sample1, mg.sample2 = 1, 1, s1, s2
        mg.metrics[0].metricId = 2
        pynvml.nvmlGpmMetricsGet(mg)
        out["v"] = [mg.metrics[0].value, (20.0 * (tw - t1) + 80.0 * (t2 - tw)) / (t2 - t1)]
        pynvml.nvmlGpmSampleFree(s1)
        pynvml.nvmlGpmSampleFree(s2)
    """, scenario_path)
    value, expected = out["v"]
    assert 20.0 < value < 80.0
    assert value == pytest.approx(expected, abs=6.0)


def test_mig_handles(lib: Path, scenario_path: Path) -> None:
    parent = h100(0)
    migs = mig_uuids(parent.uuid, 2)
    Scenario(epoch=time.time(), gpus=[h100(0, mig_mode=1, mig_devices=migs), v100(1)]).write(scenario_path)
    out = run_nvml(lib, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["mode"] = pynvml.nvmlDeviceGetMigMode(h)
        out["max"] = pynvml.nvmlDeviceGetMaxMigDeviceCount(h)
        out["uuids"], out["is_mig"], out["parents"] = [], [], []
        for k in range(out["max"]):
            try:
                m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except pynvml.NVMLError_NotFound:
                continue
            out["uuids"].append(pynvml.nvmlDeviceGetUUID(m))
            out["is_mig"].append(pynvml.nvmlDeviceIsMigDeviceHandle(m).value)
            out["parents"].append(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)))
        out["parent_is_mig"] = pynvml.nvmlDeviceIsMigDeviceHandle(h).value
        m0 = pynvml.nvmlDeviceGetHandleByUUID(out["uuids"][0])
        out["by_uuid"] = [pynvml.nvmlDeviceIsMigDeviceHandle(m0).value, err(pynvml.nvmlDeviceGetPowerUsage, m0),
                          err(pynvml.nvmlDeviceGetTotalEnergyConsumption, m0)]
        out["beyond"] = err(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, h, 7)
        out["parent"] = [err(pynvml.nvmlDeviceGetUtilizationRates, h), pynvml.nvmlDeviceGetPowerUsage(h) > 0,
                         err(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, h)]
        hv = pynvml.nvmlDeviceGetHandleByIndex(1)
        out["v100"] = [err(pynvml.nvmlDeviceGetMigMode, hv), err(pynvml.nvmlDeviceGetMaxMigDeviceCount, hv)]
    """, scenario_path)
    assert out["mode"] == [1, 1] and out["max"] == 7
    assert out["uuids"] == list(migs) and all(u.startswith("MIG-") for u in migs)
    assert out["is_mig"] == [1, 1] and out["parent_is_mig"] == 0
    assert out["parents"] == [parent.uuid] * 2
    assert out["by_uuid"] == [1, 3, 3]
    assert out["beyond"] == 2
    assert out["parent"] == [3, True, 2]
    assert out["v100"] == [3, 3]


def test_module_scope_power(lib: Path, scenario_path: Path) -> None:
    sc = Scenario(epoch=time.time() - 2, gpus=[grace_hopper(0, power=Constant(420.0), module_extra_w=180.0),
                                               h100(1)])
    sc.write(scenario_path)
    out = run_nvml(lib, """
        pynvml.nvmlInit()
        res = []
        for i in (0, 1):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            ids = [(186, 0), (186, 1), (185, 0), (185, 1), (186, 2)]
            res.append([[v.nvmlReturn, v.value.uiVal] for v in pynvml.nvmlDeviceGetFieldValues(h, ids)])
        out["r"] = res
    """, scenario_path)
    gh, plain = out["r"]
    assert gh == [[0, 420_000], [0, 600_000], [0, 420_000], [0, 600_000], [3, 0]]
    assert sc.reported_instant_w(0, time.time(), POWER_SCOPE_MODULE) == pytest.approx(600.0)
    assert [r[0] for r in plain] == [0, 3, 0, 3, 3]


def test_scenario_reload_on_rewrite(lib: Path, scenario_path: Path) -> None:
    epoch = time.time() - 1
    Scenario(epoch=epoch, gpus=[h100(0, temperature_gpu_c=40, power=Constant(300.0))]).write(scenario_path)
    out = run_nvml(lib, f"""
        from fakenvml import Scenario, Constant, Driver, a100, h100
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["before"] = [pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetTemperature(h, 0),
                         pynvml.nvmlDeviceGetPowerUsage(h)]
        path = {str(scenario_path)!r}
        for temp in (55, 56, 57):  # rewrites in quick succession, same size: each one must be seen
            Scenario(epoch={epoch!r}, gpus=[h100(0, temperature_gpu_c=temp, power=Constant(300.0))]).write(path)
            out.setdefault("quick", []).append(pynvml.nvmlDeviceGetTemperature(h, 0))
        Scenario(epoch={epoch!r}, driver=Driver(driver_version="560.1.2"),
                 gpus=[h100(0, temperature_gpu_c=71, power=Constant(300.0), energy_offset_mj=1e6), a100(1)]).write(path)
        out["after"] = [pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetTemperature(h, 0),
                        pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(1)),
                        pynvml.nvmlSystemGetDriverVersion(),
                        pynvml.nvmlDeviceGetHandleByIndex(0).contents is not None]
        os.unlink(path)
        out["vanished"] = pynvml.nvmlDeviceGetTemperature(h, 0)
        with open(path, "w") as f:
            f.write("[gpu 0]\\nbogus_key = 1\\n")
        out["broken"] = [pynvml.nvmlDeviceGetTemperature(h, 0), text(fake.fakeNvmlLastError())]
    """, scenario_path)
    assert out["before"] == [1, 40, 300_000]
    assert out["quick"] == [55, 56, 57]
    assert out["after"] == [2, 71, "NVIDIA A100-SXM4-80GB", "560.1.2", True]
    assert out["vanished"] == 71
    assert out["broken"][0] == 71 and "unknown key bogus_key" in out["broken"][1]


def test_driver_not_loaded_and_init_errors(lib: Path, scenario_path: Path, tmp_path: Path) -> None:
    body = """
        out["pre"] = err(pynvml.nvmlDeviceGetCount)
        out["init"] = err(pynvml.nvmlInit)
        out["count_after_failed_init"] = err(pynvml.nvmlDeviceGetCount)
    """
    no_env = run_nvml(lib, body)
    assert no_env["init"] == 9 and no_env["pre"] == 1 and no_env["count_after_failed_init"] == 1
    missing_file = run_nvml(lib, body, tmp_path / "nope.ini")
    assert missing_file["init"] == 9
    Scenario(epoch=time.time(), driver=Driver(init_error=4), gpus=[h100(0)]).write(scenario_path)
    assert run_nvml(lib, body, scenario_path)["init"] == 4  # NO_PERMISSION
    scenario_path.write_text("[gpu 0]\npower = sawtooth 3\n")
    broken = run_nvml(lib, body, scenario_path)
    assert broken["init"] == 999 and "bad value for power" in broken["_stderr"]


def test_pynvml_finds_library_through_ld_library_path(lib: Path, scenario_path: Path) -> None:
    Scenario(epoch=time.time(), driver=Driver(driver_version="999.12.34"), gpus=[h100(0)]).write(scenario_path)
    out = run_nvml(None, """
        pynvml.nvmlInit()  # pynvml's own CDLL("libnvidia-ml.so.1")
        out["v"] = [pynvml.nvmlSystemGetDriverVersion(), pynvml.nvmlDeviceGetCount()]
    """, scenario_path, env={"LD_LIBRARY_PATH": str(lib.parent)})
    assert out["v"] == ["999.12.34", 1]


def test_call_counts_and_call_log(lib: Path, scenario_path: Path, tmp_path: Path) -> None:
    Scenario(epoch=time.time(), gpus=[h100(0)]).write(scenario_path)
    log = tmp_path / "calls.log"
    out = run_nvml(lib, """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for _ in range(3):
            pynvml.nvmlDeviceGetPowerUsage(h)
        names = [b"nvmlDeviceGetPowerUsage", b"nvmlInitWithFlags", b"nvmlDeviceGetName", None]
        out["counts"] = [fake.fakeNvmlCallCount(n) for n in names]
        fake.fakeNvmlResetCallCounts()
        out["reset"] = [fake.fakeNvmlCallCount(b"nvmlDeviceGetPowerUsage"), fake.fakeNvmlCallCount(None)]
    """, scenario_path, env={"FAKE_NVML_CALL_LOG": str(log)})
    assert out["counts"] == [3, 1, 0, 5] and out["reset"] == [0, 0]
    names = [line.split()[2] for line in log.read_text().splitlines()]
    assert names == ["nvmlInitWithFlags", "nvmlDeviceGetHandleByIndex_v2"] + ["nvmlDeviceGetPowerUsage"] * 3


def test_delays_do_not_serialise_threads(lib: Path, scenario_path: Path) -> None:
    Scenario(epoch=time.time(), driver=Driver(function_delay_ms={"nvmlDeviceGetPowerUsage": 200.0}),
             gpus=[h100(0, function_delay_ms={"nvmlDeviceGetTemperature": 100.0}), h100(1)]).write(scenario_path)
    out = run_nvml(lib, """
        pynvml.nvmlInit()
        h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        out["temp"] = [timed(pynvml.nvmlDeviceGetTemperature, h, 0) for h in (h0, h1)]
        durations, errors = [], []
        def slow():
            t0, _, t1 = timed(pynvml.nvmlDeviceGetPowerUsage, h0)
            durations.append(t1 - t0)
        def hammer(h):
            try:
                for _ in range(300):
                    pynvml.nvmlDeviceGetFieldValues(h, [186, 185])
                    pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
                    s = pynvml.nvmlGpmSampleAlloc()
                    pynvml.nvmlGpmSampleGet(h, s)
                    pynvml.nvmlGpmSampleFree(s)
            except Exception as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=slow) for _ in range(4)]
        threads += [threading.Thread(target=hammer, args=(h,)) for h in (h0, h1, h0)]
        t0 = time.time()
        for t in threads: t.start()
        for t in threads: t.join()
        out["wall"], out["durations"], out["errors"] = time.time() - t0, durations, errors
        out["outstanding"] = fake.fakeNvmlGpmSamplesOutstanding()
    """, scenario_path)
    (a0, _, a1), (b0, _, b1) = out["temp"]
    assert a1 - a0 >= 0.095 and b1 - b0 < 0.09  # per-GPU delay applies to GPU 0 only
    assert len(out["durations"]) == 4 and min(out["durations"]) >= 0.195
    assert out["errors"] == [] and out["outstanding"] == 0
    # four 200 ms calls overlapped instead of queueing on the library's lock
    assert max(out["durations"]) < 0.6


# ---- energy counter faults (issue 10) ----------------------------------------------------------------


def test_energy_faults_low_reading_jump_and_unreadable_spell(lib: Path, scenario_path: Path) -> None:
    # A frozen clock, advanced by rewriting the scenario, puts every read exactly inside or outside a fault.
    epoch = 1_700_000_000.0
    make = """h100(0, power=Constant(300.0), energy_offset_mj=1e9, energy_faults=(
        bad_reading(2.0), energy_jump(4.0, 5e11), energy_unreadable(6.0, 8.0), EnergyFault(9.0, 9.5, "error", 15)))"""
    from fakenvml import EnergyFault, bad_reading, energy_jump, energy_unreadable  # noqa: F401 (used by eval)

    gpu = eval(make)
    times = [1.0, 2.2, 3.0, 4.1, 5.0, 6.0, 7.9, 8.0, 9.2]
    Scenario(epoch=epoch, driver=Driver(frozen_time=epoch + times[0]), gpus=[gpu]).write(scenario_path)
    out = run_nvml(lib, f"""
        from fakenvml import Scenario, Constant, Driver, EnergyFault, h100, bad_reading, energy_jump, energy_unreadable
        gpu = {make}
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["mj"], out["field"] = [], []
        for t in {times!r}:
            Scenario(epoch={epoch!r}, driver=Driver(frozen_time={epoch!r} + t), gpus=[gpu]).write(
                {str(scenario_path)!r})
            try:
                out["mj"].append(pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
            except pynvml.NVMLError as e:
                out["mj"].append(-e.value)
            (v,) = pynvml.nvmlDeviceGetFieldValues(h, [83])
            out["field"].append(v.value.ullVal if v.nvmlReturn == 0 else -v.nvmlReturn)
    """, scenario_path)
    since_epoch = [(epoch + t) - epoch for t in times]  # as the library computes it from the frozen clock
    truth = [gpu.counter_mj(t) for t in since_epoch]
    reported = [gpu.reported_counter_mj(t) for t in since_epoch]
    assert out["mj"] == out["field"]
    assert out["mj"] == [truth[0], 0, truth[2], truth[3] + 5 * 10**11, truth[4], -999, -999, truth[7], -15]
    assert [(-999 if k in (5, 6) else -15) if r is None else r for k, r in enumerate(reported)] == out["mj"]
    assert truth[2] - truth[0] == 600_000  # the true counter runs on underneath: 2 s x 300 W


def test_energy_fault_specs_are_validated(lib: Path, scenario_path: Path) -> None:
    from fakenvml import EnergyFault

    with pytest.raises(ValueError):
        EnergyFault(2.0, 1.0, "set", 0.0)
    with pytest.raises(ValueError):
        EnergyFault(1.0, 2.0, "error", 0.5)
    Scenario(epoch=time.time(), gpus=[h100(0)]).write(scenario_path)
    scenario_path.write_text(scenario_path.read_text() + "energy_fault = 1 2 explode 0\n")
    out = run_nvml(lib, """
        out["init"] = err(pynvml.nvmlInit)
        out["why"] = text(fake.fakeNvmlLastError())
    """, scenario_path)
    assert out["init"] == 999 and "energy_fault" in out["why"]


# ---- The cost model ---------------------------------------------------------------------------------------


_COST_BODY = """
    fake.fakeNvmlCostSeconds.restype = ctypes.c_double
    fake.fakeNvmlCostProfile.restype = ctypes.c_char_p
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    out["profile"] = fake.fakeNvmlCostProfile().decode()
    fake.fakeNvmlResetCostCounts()

    def cpu(fn, *args):
        t0 = time.thread_time()
        try:
            fn(*args)
        except pynvml.NVMLError:
            pass
        return time.thread_time() - t0

    out["energy"] = min(cpu(pynvml.nvmlDeviceGetTotalEnergyConsumption, h) for _ in range(5))
    out["energy_field"] = min(cpu(pynvml.nvmlDeviceGetFieldValues, h, [83, 186]) for _ in range(5))
    out["power_fields"] = min(cpu(pynvml.nvmlDeviceGetFieldValues, h, [185, 186]) for _ in range(5))
    out["power"] = min(cpu(pynvml.nvmlDeviceGetPowerUsage, h) for _ in range(5))
    out["missing"] = cpu(pynvml.nvmlDeviceGetTemperature, h, 0)  # FUNCTION_NOT_FOUND: costs the driver nothing
    out["charged_energy"] = fake.fakeNvmlCostSeconds(b"nvmlDeviceGetTotalEnergyConsumption")
    out["charged_missing"] = fake.fakeNvmlCostSeconds(b"nvmlDeviceGetTemperature")
    out["charged_all"] = fake.fakeNvmlCostSeconds(None)
    # Serialised like the driver: four threads reading the counter 5 times each take the wall time of 20 reads
    # in one thread (on any number of cores).
    def reader():
        for _ in range(5):
            pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    threads = [threading.Thread(target=reader) for _ in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["four_threads_wall"] = time.monotonic() - t0
"""


@pytest.mark.parametrize("select", ["scenario", "env"])
def test_the_cost_model_burns_what_the_driver_burns(lib: Path, scenario_path: Path, select: str) -> None:
    """h100-580: the energy counter 3.5 ms of CPU a read (directly or as a field), power fields microseconds
    (5 + 2 x 40 µs)."""
    driver = Driver(cost_profile="h100-580" if select == "scenario" else None, missing=("nvmlDeviceGetTemperature",))
    Scenario(epoch=time.time(), driver=driver, gpus=[h100(0)]).write(scenario_path)
    env = {"FAKE_NVML_COST_PROFILE": "h100-580"} if select == "env" else {}
    out = run_nvml(lib, _COST_BODY, scenario_path, env=env)
    assert out["profile"] == "h100-580"
    assert 0.0035 <= out["energy"] < 0.04  # burned on this thread's CPU clock: at least the profile's 3.5 ms
    assert 0.0035 <= out["energy_field"] < 0.04
    assert out["power_fields"] < 0.002 and out["power"] < 0.002
    assert out["missing"] < 0.002 and out["charged_missing"] == 0.0
    assert out["charged_energy"] == pytest.approx(5 * 0.0035, rel=0.2)
    assert out["charged_all"] >= 10 * 0.0035
    assert out["four_threads_wall"] >= 20 * 0.0035


def test_no_cost_unless_a_profile_is_chosen_and_the_environment_wins(lib: Path, scenario_path: Path) -> None:
    Scenario(epoch=time.time(), driver=Driver(cost_profile="h100-580"), gpus=[h100(0)]).write(scenario_path)
    off = run_nvml(lib, _COST_BODY, scenario_path, env={"FAKE_NVML_COST_PROFILE": "off"})
    assert off["profile"] == "" and off["charged_all"] == 0.0 and off["energy"] < 0.002
    Scenario(epoch=time.time(), gpus=[h100(0)]).write(scenario_path)
    default = run_nvml(lib, _COST_BODY, scenario_path)
    assert default["profile"] == "" and default["charged_all"] == 0.0

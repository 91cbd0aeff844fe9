"""One failing NVML call loses one reading; one failing GPU loses one GPU; processes are read only when used.

In-process, on the fake library (the production NVML code path). Faults come from the scenario
(``missing``, ``error.<function>``) or, for "the installed pynvml lacks this wrapper", from removing the
wrapper from the pynvml module for the test (monkeypatch restores it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fakenvml import Driver, Process, Scenario, h100, v100
from helpers import GPURig

from gpu_energy_exporter.core.state import GPUIdentity, GPUReading
from gpu_energy_exporter.devices.nvml import NVMLBackend

T0 = 1_750_000_000.0
ERRORS = "gpuenergy_nvml_field_errors_total"


@pytest.fixture
def rig(fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    path = tmp_path / "scenario.ini"
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))
    made: list[GPURig] = []

    def make(gpus: list[Any], backend: type[NVMLBackend] = NVMLBackend, **kw: Any) -> GPURig:
        Scenario(epoch=T0, driver=Driver(frozen_time=T0 + 100), gpus=gpus).write(path)
        r = GPURig(lambda: backend(str(fake_nvml_lib)), **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def L(gpu: Any, **extra: str) -> dict[str, str]:
    return {"gpu": str(gpu.index), "gpu_uuid": gpu.uuid, **extra}


def test_one_gpu_without_the_v3_process_list_falls_back_to_v2_and_nothing_is_lost(rig: Any) -> None:
    # pynvml's unversioned wrapper raises NVMLLibraryMismatchError (not an NVMLError) when _v3 is missing
    gpus = [h100(0, processes=(Process(11, 1 << 30, 50),)),
            v100(1, processes=(Process(22, 2 << 30, 10),), missing=("nvmlDeviceGetComputeRunningProcesses_v3",))]
    r = rig(gpus, processes=True)
    r.sample()
    assert r.value("gpuenergy_collector_success", collector="gpu") == 1.0
    for g in gpus:
        assert r.value("gpuenergy_gpu_up", **L(g)) == 1.0
        assert r.value("gpuenergy_gpu_energy_joules_total", **L(g)) is not None
        assert r.value("gpuenergy_gpu_compute_processes", **L(g)) == 1.0
    assert r.value("gpuenergy_gpu_process_memory_used_bytes", **L(gpus[1], pid="22")) == 2 << 30
    assert 'field="processes"' not in r.text()  # the fallback answered: nothing was lost


def test_a_failing_field_loses_that_field_only_is_counted_and_logged_once(
    rig: Any, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = [h100(0), h100(1, function_error={"nvmlDeviceGetTemperature": 999})]  # NVML_ERROR_UNKNOWN
    r = rig(gpus)
    with caplog.at_level(logging.WARNING, logger="gpu_energy_exporter"):
        r.sample(3)
    assert r.value("gpuenergy_gpu_temperature_celsius", **L(gpus[0])) == 34.0
    assert r.value("gpuenergy_gpu_temperature_celsius", **L(gpus[1])) is None
    assert r.value("gpuenergy_gpu_up", **L(gpus[1])) == 1.0
    assert r.value("gpuenergy_gpu_power_watts", **L(gpus[1])) == 350.0
    # a transient error is asked again at every read, and counted every time: three samples, plus the
    # read that confirms the energy counter at start-up
    assert r.value(ERRORS, **L(gpus[1], field="temperature", reason="nvml_error")) == 4.0
    assert r.value(ERRORS, **L(gpus[0], field="temperature", reason="nvml_error")) is None
    warnings = [rec.getMessage() for rec in caplog.records if "temperature" in rec.getMessage()]
    assert len(warnings) == 1 and "GPU 1" in warnings[0], warnings


def test_a_wrapper_missing_from_pynvml_falls_back_or_loses_only_its_field(
    rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An older pynvml: no "clocks event reasons" wrapper (the throttle-reasons one answers instead), and no
    # wrapper at all for the enforced power limit.
    monkeypatch.delattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
    monkeypatch.delattr(pynvml, "nvmlDeviceGetEnforcedPowerLimit")
    gpus = [h100(0, clocks_event_reasons=0x4)]
    r = rig(gpus)
    r.sample(2)
    assert r.value("gpuenergy_collector_success", collector="gpu") == 1.0
    assert r.value("gpuenergy_gpu_clock_event_active", **L(gpus[0], reason="sw_power_cap")) == 1.0
    assert r.value("gpuenergy_gpu_power_limit_watts", **L(gpus[0])) is None
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(gpus[0])) == 35000.0
    assert r.value(ERRORS, **L(gpus[0], field="power_limit", reason="function_not_found")) == 1.0  # asked once
    assert r.value(ERRORS, **L(gpus[0], field="clocks_event_reasons", reason="function_not_found")) is None


class _FailsOnGPU1(NVMLBackend):
    """The real backend, except that reading GPU 1 raises something that is not GPULost (a bug, a sick
    driver binding) once ``failing`` is set."""

    failing = False

    def read(self, gpu: GPUIdentity, **kw: Any) -> GPUReading:
        if gpu.index == 1 and type(self).failing:
            raise RuntimeError("boom")
        return super().read(gpu, **kw)


class _FailsOnGPU1SecondRead(NVMLBackend):
    """GPU 1 answers its first read and raises on every later one: at start-up the energy counter is
    confirmed by a second read within the same sample, which must not take the other GPUs down either."""

    calls = 0

    def read(self, gpu: GPUIdentity, **kw: Any) -> GPUReading:
        if gpu.index == 1:
            type(self).calls += 1
            if type(self).calls > 1:
                raise RuntimeError("boom")
        return super().read(gpu, **kw)


def test_a_failing_confirming_read_at_start_up_keeps_the_other_gpus(rig: Any) -> None:
    gpus = [h100(0), h100(1)]
    r = rig(gpus, backend=_FailsOnGPU1SecondRead)
    r.sample()  # the first sample is the one that confirms
    assert r.value("gpuenergy_collector_success", collector="gpu") == 1.0
    assert r.value("gpuenergy_gpu_up", **L(gpus[0])) == 1.0
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(gpus[0])) == 35000.0
    # GPU 1 answered its sample; only its counter stays unconfirmed (no energy sample yet)
    assert r.value("gpuenergy_gpu_up", **L(gpus[1])) == 1.0
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(gpus[1])) is None
    r.sample()
    assert r.value("gpuenergy_gpu_up", **L(gpus[1])) == 0.0
    assert r.value("gpuenergy_gpu_up", **L(gpus[0])) == 1.0


def test_one_gpu_raising_anything_marks_that_gpu_only_and_holds_its_energy(
    rig: Any, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = [h100(0), h100(1, energy_offset_mj=5_000_000)]
    _FailsOnGPU1.failing = False
    r = rig(gpus, backend=_FailsOnGPU1)
    r.sample()
    held = r.value("gpuenergy_gpu_energy_joules_total", **L(gpus[1]))
    _FailsOnGPU1.failing = True
    assert held == 5000.0 + 35000.0
    with caplog.at_level(logging.ERROR, logger="gpu_energy_exporter"):
        r.sample(3)
    assert r.value("gpuenergy_collector_success", collector="gpu") == 1.0
    assert r.value("gpuenergy_gpu_up", **L(gpus[0])) == 1.0
    assert r.value("gpuenergy_gpu_power_watts", **L(gpus[0])) == 350.0
    assert r.value("gpuenergy_gpu_up", **L(gpus[1])) == 0.0
    # the counter is held (not lost, not reset); while GPU 1 gives no reading its sample is absent rather
    # than flat, so increase() never books the outage's energy into one scrape (docs/measurement.md)
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(gpus[1])) is None
    assert [s.energy_j for s in r.collector.states() if s.identity.index == 1] == [held]
    assert r.value("gpuenergy_gpu_power_watts", **L(gpus[1])) is None
    errors = [rec.getMessage() for rec in caplog.records if "GPU 1" in rec.getMessage()]
    assert len(errors) == 1 and "RuntimeError: boom" in errors[0], errors
    assert all(rec.exc_info is None for rec in caplog.records)  # no traceback at the default level


def _calls(lib: Path) -> Any:
    c = ctypes.CDLL(str(lib))
    c.fakeNvmlCallCount.restype = ctypes.c_ulonglong
    c.fakeNvmlResetCallCounts()
    return lambda fn: int(c.fakeNvmlCallCount(fn.encode()))


@pytest.mark.parametrize(
    ("kw", "lists", "utilization"),
    [
        ({"idle_power_w": 60.0}, False, False),  # nothing uses the processes
        ({}, True, False),  # the learned idle baseline needs to know whether any process runs
        ({"processes": True, "idle_power_w": 60.0}, True, False),  # --collector.processes
        ({"process_utilization": True, "idle_power_w": 60.0}, True, True),  # SM-weighted pod attribution
    ],
)
def test_processes_are_read_only_when_something_uses_them(
    rig: Any, fake_nvml_lib: Path, kw: dict[str, Any], lists: bool, utilization: bool
) -> None:
    gpus = [h100(0, processes=(Process(11, 1 << 30, 50),))]
    r = rig(gpus, **kw)
    calls = _calls(fake_nvml_lib)
    r.sample()
    first = r.collector.states()[0].reading
    assert first is not None and (first.processes is not None) is lists
    if utilization:  # (later samples may find no utilisation sample newer than the last: the clock is frozen)
        assert first.processes is not None and first.processes[0].sm_util_pct == 50.0
    r.sample(2)
    assert (calls("nvmlDeviceGetComputeRunningProcesses_v3") > 0) is lists
    assert (calls("nvmlDeviceGetProcessUtilization") > 0) is utilization
    assert (r.value("gpuenergy_gpu_compute_processes", **L(gpus[0])) is not None) is lists
    assert r.value("gpuenergy_gpu_up", **L(gpus[0])) == 1.0


@pytest.mark.parametrize("symbol", ["nvmlDeviceGetComputeRunningProcesses_v3",
                                    "nvmlDeviceGetComputeRunningProcesses_v2"])  # a driver without _v3
def test_the_process_list_is_one_call_and_a_list_that_outgrew_its_buffer_is_read_whole(
    fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, symbol: str
) -> None:
    """pynvml's wrapper asks for the count, then for the list: two calls. The backend passes a buffer sized
    from the last list, so a sample makes one; a list that grew past it takes the two-call form once."""
    path = tmp_path / "scenario.ini"
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))
    missing = ("nvmlDeviceGetComputeRunningProcesses_v3",) if symbol.endswith("_v2") else ()

    def write(n: int) -> None:
        procs = tuple(Process(100 + k, (k + 1) << 20, 5) for k in range(n))
        Scenario(epoch=T0, driver=Driver(frozen_time=T0 + 100),
                 gpus=[h100(0, processes=procs, missing=missing)]).write(path)
        os.utime(path, ns=(time.time_ns(), time.time_ns()))

    def listed(g: GPUIdentity) -> list[tuple[int, int | None]]:
        procs = backend.read(g, processes=True).processes
        assert procs is not None
        return [(p.pid, p.used_memory_bytes) for p in procs]

    write(0)
    backend = NVMLBackend(str(fake_nvml_lib))
    try:
        (g,) = backend.devices()
        calls = _calls(fake_nvml_lib)
        assert listed(g) == []
        for n, made in ((1, 2), (1, 1), (3, 1), (12, 2), (12, 1), (2, 1), (0, 1)):
            write(n)
            before = calls(symbol)
            assert listed(g) == [(100 + k, (k + 1) << 20) for k in range(n)]
            assert calls(symbol) - before == made, (n, made)
        assert not [k for k in backend.field_errors() if k[1] == "processes"]
    finally:
        backend.close()


def test_a_driver_without_either_process_list_loses_that_reading_once(
    fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither _v3 nor _v2 (older than R470's list): the processes are not read, counted once as
    function_not_found and never asked again; the rest of the reading goes on."""
    path = tmp_path / "scenario.ini"
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))
    missing = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
    Scenario(epoch=T0, driver=Driver(frozen_time=T0 + 100),
             gpus=[h100(0, processes=(Process(11, 1 << 30, 50),), missing=missing)]).write(path)
    backend = NVMLBackend(str(fake_nvml_lib))
    try:
        (g,) = backend.devices()
        calls = _calls(fake_nvml_lib)
        readings = [backend.read(g, processes=True) for _ in range(3)]
        assert all(r.processes is None and r.temperature_gpu_c == 34.0 for r in readings)
        assert backend.field_errors()[(0, "processes", "function_not_found")] == 1
        assert [calls(fn) for fn in missing] == [1, 1]
    finally:
        backend.close()


def test_a_gpu_that_cannot_be_opened_is_left_out_and_the_others_are_served(
    rig: Any, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = [h100(0), h100(1, handle_error=4)]  # NVML_ERROR_NO_PERMISSION for GPU 1's handle
    r = rig(gpus)
    with caplog.at_level(logging.WARNING, logger="gpu_energy_exporter"):
        r.sample(2)
    assert r.value("gpuenergy_collector_success", collector="gpu") == 1.0
    assert r.value("gpuenergy_gpu_up", **L(gpus[0])) == 1.0
    assert r.value("gpuenergy_gpu_up", **L(gpus[1])) is None
    left_out = [rec.getMessage() for rec in caplog.records if "GPU 1" in rec.getMessage()]
    assert len(left_out) == 1 and "left out" in left_out[0], left_out


def test_a_transient_field_value_error_does_not_switch_instant_power_off_for_good(
    fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pre-Volta GPU integrates instant power; one NVML_ERROR_UNKNOWN from nvmlDeviceGetFieldValues must
    lose that sample only (it used to mark the field unsupported, freezing the energy for good)."""
    from fakenvml import pascal_no_counter

    path = tmp_path / "scenario.ini"
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))

    def write(error: bool) -> None:
        errors = {"nvmlDeviceGetFieldValues": 999} if error else {}
        Scenario(epoch=T0, driver=Driver(frozen_time=T0 + 100),
                 gpus=[pascal_no_counter(0, power_instant_field=True, function_error=errors)]).write(path)
        os.utime(path, ns=(time.time_ns(), time.time_ns()))

    write(False)
    backend = NVMLBackend(str(fake_nvml_lib))
    try:
        (g,) = backend.devices()
        assert g.energy_method == "integrated_instant_power"
        assert backend.read_power_w(g) == 150.0
        write(True)
        assert backend.read_power_w(g) is None
        write(False)
        assert backend.read_power_w(g) == 150.0
        assert backend.field_errors()[(0, "field_values", "nvml_error")] == 1
    finally:
        backend.close()


def test_a_transient_energy_error_at_discovery_keeps_the_counter(
    fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One NVML_ERROR_UNKNOWN from the energy counter while GPUs are discovered must not make an H100
    integrate sampled power for the life of the process."""
    path = tmp_path / "scenario.ini"
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))
    Scenario(epoch=T0, driver=Driver(frozen_time=T0 + 100),
             gpus=[h100(0, function_error={"nvmlDeviceGetTotalEnergyConsumption": 999})]).write(path)
    backend = NVMLBackend(str(fake_nvml_lib))
    try:
        (g,) = backend.devices()
        assert g.energy_method == "counter"
    finally:
        backend.close()


@pytest.mark.parametrize(("fault", "lost"), [
    ({"function_error": {"nvmlDeviceGetFieldValues": 999}}, ("field_values", "nvml_error")),  # the batched call fails
    ({"fields_not_supported": (83,)}, ("energy_field", "not_supported")),  # a driver without field 83
])
def test_the_energy_counter_is_read_on_its_own_when_the_batched_field_read_cannot_give_it(
    rig: Any, fake_nvml_lib: Path, fault: dict[str, Any], lost: tuple[str, str]
) -> None:
    """The counter is one of the field values a sample asks for; when that read fails or lacks it, the counter's
    own call reads it, so a failing batched call still loses only the readings nothing else can give."""
    gpus = [h100(0, **fault), h100(1)]
    r = rig(gpus)
    calls = _calls(fake_nvml_lib)
    r.sample(3)
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(gpus[0])) == 35000.0
    assert r.value("gpuenergy_gpu_energy_joules_total", **L(gpus[1])) == 35000.0
    assert r.value("gpuenergy_gpu_power_average_watts", **L(gpus[0])) == 350.0  # PowerUsage: the 1 s average
    assert r.value(ERRORS, **L(gpus[0], field=lost[0], reason=lost[1])) is not None
    assert r.value(ERRORS, **L(gpus[0], field="energy", reason="nvml_error")) is None
    assert calls("nvmlDeviceGetTotalEnergyConsumption") >= 3  # GPU 0's counter on its own call, every sample

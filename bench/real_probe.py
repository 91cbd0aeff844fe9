"""What the real NVIDIA driver charges per NVML call, and whether its power-sample buffer can be trusted.

Real driver only (``python -m bench.real_probe --real-driver``; without a GPU it says NOT RUN). Two tables:

- CPU time per call for each NVML function the exporter calls (and ``nvmlDeviceGetSamples``), measured with
  this thread's CPU clock around each call, on an idle GPU and under a bursty bf16 matmul load (torch, when
  it sees CUDA), beside the fake library's ``h100-580`` cost profile (tests/fakenvml/fakenvml.c), so the
  profile can be checked against the card at hand;
- the driver's power-sample buffer (``nvmlDeviceGetSamples(NVML_TOTAL_POWER_SAMPLES)``, one sample about
  every 20 ms) against the energy counter over 3 s windows of the same bursty load, beside "1 s average
  power x time": what docs/measurement.md's "why not the power-sample buffer" rests on.

With ``GPU_REPORT_DIR`` set the figures are also written to ``$GPU_REPORT_DIR/real_probe.json``.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import Context, Table, fmt

TITLE = "Real driver: CPU per NVML call, and the power-sample buffer against the energy counter"

#: The fake library's h100-580 profile, µs per call (tests/fakenvml/fakenvml.c, recalibrated 2026-11-26 from
#: this probe's loaded column), for the comparison column. Field values: 5 + 40 per field, the energy
#: counter's field 3,500.
FAKE_H100_580 = {
    "nvmlDeviceGetTotalEnergyConsumption": 3500, "nvmlDeviceGetFieldValues(energy)": 3505,
    "nvmlDeviceGetFieldValues(power instant)": 45, "nvmlDeviceGetPowerUsage": 15,
    "nvmlDeviceGetProcessUtilization": 2000, "nvmlDeviceGetSamples(TOTAL_POWER)": 480,
    "nvmlDeviceGetSamples(GPU_UTILIZATION)": 2100, "nvmlGpmSampleGet": 105,
    "nvmlDeviceGetComputeRunningProcesses": 90, "nvmlDeviceGetMemoryInfo": 16,
    "nvmlDeviceGetUtilizationRates": 7, "nvmlDeviceGetTemperature": 12, "nvmlDeviceGetClockInfo": 10,
    "nvmlDeviceGetCurrentClocksEventReasons": 7, "nvmlDeviceGetEnforcedPowerLimit": 15,
    "nvmlDeviceGetPerformanceState": 20, "nvmlDeviceGetTotalEccErrors": 22, "nvmlDeviceGetRemappedRows": 20,
    "nvmlDeviceGetPcieReplayCounter": 340, "nvmlDeviceGetPcieThroughput": 770, "nvmlDeviceGetMigMode": 300,
}


def _calls(pynvml: Any, h: Any) -> dict[str, Callable[[], Any]]:
    buf = (pynvml.c_nvmlSample_t * 512)()

    def samples(kind: int) -> Callable[[], Any]:
        def call() -> Any:
            raw_samples = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetSamples")
            vtype, count = pynvml._nvmlValueType_t(), ctypes.c_uint(512)
            return raw_samples(h, pynvml._nvmlSamplingType_t(kind), ctypes.c_ulonglong(0), ctypes.byref(vtype),
                               ctypes.byref(count), buf)
        return call

    gpm = pynvml.nvmlGpmSampleAlloc()
    return {
        "nvmlDeviceGetTotalEnergyConsumption": lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h),
        "nvmlDeviceGetFieldValues(energy)":
            lambda: pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION]),
        "nvmlDeviceGetFieldValues(power instant)":
            lambda: pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_POWER_INSTANT]),
        "nvmlDeviceGetPowerUsage": lambda: pynvml.nvmlDeviceGetPowerUsage(h),
        "nvmlDeviceGetProcessUtilization": lambda: pynvml.nvmlDeviceGetProcessUtilization(h, 0),
        "nvmlDeviceGetSamples(TOTAL_POWER)": samples(pynvml.NVML_TOTAL_POWER_SAMPLES),
        "nvmlDeviceGetSamples(GPU_UTILIZATION)": samples(pynvml.NVML_GPU_UTILIZATION_SAMPLES),
        "nvmlGpmSampleGet": lambda: pynvml.nvmlGpmSampleGet(h, gpm),
        "nvmlDeviceGetComputeRunningProcesses": lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(h),
        "nvmlDeviceGetMemoryInfo": lambda: pynvml.nvmlDeviceGetMemoryInfo(h),
        "nvmlDeviceGetUtilizationRates": lambda: pynvml.nvmlDeviceGetUtilizationRates(h),
        "nvmlDeviceGetTemperature": lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        "nvmlDeviceGetClockInfo": lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
        "nvmlDeviceGetCurrentClocksEventReasons": lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h),
        "nvmlDeviceGetEnforcedPowerLimit": lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h),
        "nvmlDeviceGetPerformanceState": lambda: pynvml.nvmlDeviceGetPerformanceState(h),
        "nvmlDeviceGetTotalEccErrors": lambda: pynvml.nvmlDeviceGetTotalEccErrors(
            h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
        "nvmlDeviceGetRemappedRows": lambda: pynvml.nvmlDeviceGetRemappedRows(h),
        "nvmlDeviceGetPcieReplayCounter": lambda: pynvml.nvmlDeviceGetPcieReplayCounter(h),
        "nvmlDeviceGetPcieThroughput": lambda: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES),
        "nvmlDeviceGetMigMode": lambda: pynvml.nvmlDeviceGetMigMode(h),
    }


def _cost(fn: Callable[[], Any], budget_s: float, max_calls: int) -> tuple[float | None, str]:
    """Median CPU µs of this thread per call, and the outcome ('ok' or the NVML error)."""
    per: list[float] = []
    outcome = "ok"
    t_end = time.monotonic() + budget_s
    while len(per) < max_calls and (len(per) < 3 or time.monotonic() < t_end):
        c0 = time.thread_time()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - an unsupported call is a figure too (NOT_FOUND costs CPU)
            outcome = type(exc).__name__ if not str(exc) else str(exc)[:40]
        per.append(time.thread_time() - c0)
        time.sleep(0.002)
    return (1e6 * statistics.median(per) if per else None), outcome


class _Load:
    """Training-like bursts on GPU 0: ~60 ms of bf16 matmuls, ~40 ms idle. Nothing when torch has no CUDA."""

    def __init__(self) -> None:
        self.error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import torch

            if not torch.cuda.is_available():
                self.error = "torch sees no CUDA device"
        except ImportError:
            self.error = "torch is not installed"

    def __enter__(self) -> _Load:
        if not self.error:
            import torch

            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            (a @ a).sum().item()  # the CUDA context and cuBLAS handle in this thread: no warning in the load's

            def run() -> None:
                while not self._stop.is_set():
                    t = time.perf_counter()
                    while time.perf_counter() - t < 0.06:
                        (a @ a).sum()
                    torch.cuda.synchronize()
                    time.sleep(0.04)

            self._thread = threading.Thread(target=run, daemon=True)
            self._thread.start()
            time.sleep(2.0)  # clocks up
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _buffer_windows(pynvml: Any, h: Any, windows: int, span: float) -> list[dict[str, float]]:
    """Per ``span`` s window: the counter's mean power, the buffer's mean and integral, the 1 s average's mean."""
    out = []
    for _ in range(windows):
        seen: dict[int, float] = {}
        avg: list[float] = []
        last_ts = 0
        e0, t0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(h), time.time()
        while time.time() - t0 < span:
            try:
                _, samples = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_TOTAL_POWER_SAMPLES, last_ts)
            except pynvml.NVMLError:
                samples = []
            for s in samples:
                seen[int(s.timeStamp)] = s.sampleValue.uiVal / 1000.0
                last_ts = max(last_ts, int(s.timeStamp))
            avg.append(pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
            time.sleep(0.25)
        e1, t1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(h), time.time()
        inside = sorted((ts, w) for ts, w in seen.items() if t0 * 1e6 <= ts <= t1 * 1e6)
        counter_w = (e1 - e0) / 1000.0 / (t1 - t0)
        row = {"window_s": t1 - t0, "counter_w": counter_w, "average_1s_w": statistics.fmean(avg),
               "buffer_samples": float(len(inside)), "buffer_mean_w": float("nan"), "buffer_integral_w": float("nan")}
        if len(inside) >= 2:
            row["buffer_mean_w"] = statistics.fmean(w for _, w in inside)
            integral = sum(0.5 * (a[1] + b[1]) * (b[0] - a[0]) for a, b in zip(inside, inside[1:], strict=False))
            row["buffer_integral_w"] = integral / (inside[-1][0] - inside[0][0])
            gaps = [b[0] - a[0] for a, b in zip(inside, inside[1:], strict=False)]
            row["buffer_spacing_ms"] = statistics.median(gaps) / 1000.0
        out.append(row)
    return out


def run(ctx: Context) -> list[Table]:
    harness.require_real_driver()
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name, driver = pynvml.nvmlDeviceGetName(h), pynvml.nvmlSystemGetDriverVersion()
        calls = _calls(pynvml, h)
        budget, max_calls = ctx.pick(0.05, 0.4), ctx.pick(10, 60)
        idle = {fn: _cost(c, budget, max_calls) for fn, c in calls.items()}
        load = _Load()
        with load:
            loaded = {fn: _cost(c, budget, max_calls) for fn, c in calls.items()} if not load.error else {}
            windows = _buffer_windows(pynvml, h, ctx.pick(2, 8), 3.0) if not load.error else []
    finally:
        pynvml.nvmlShutdown()
    cost = Table(f"CPU per NVML call on {name}, driver {driver} (median, thread CPU clock), µs",
                 ["function", "idle GPU", "loaded GPU", "fake h100-580 profile", "outcome"],
                 ["Loaded: bursts of 8192² bf16 matmuls (60 ms busy, 40 ms idle) on GPU 0"
                  + (f"; not measured: {load.error}" if load.error else "") + ". nvmlDeviceGetSamples: one call "
                  "into a 512-entry buffer (pynvml's wrapper calls it twice, once for the size)."])
    for fn in calls:
        i, outcome = idle[fn]
        lo = loaded.get(fn, (None, ""))[0]
        cost.add(fn, fmt(i) if i is not None else "-", fmt(lo) if lo is not None else "-",
                 FAKE_H100_580.get(fn, "-"), outcome)
    buf = Table("Power-sample buffer against the energy counter, 3 s windows of the bursty load, W",
                ["window", "counter", "1 s average (mean)", "buffer mean", "buffer integral", "samples",
                 "buffer error", "1 s average error"])
    for k, w in enumerate(windows):
        buf.add(k + 1, fmt(w["counter_w"]), fmt(w["average_1s_w"]), fmt(w["buffer_mean_w"]),
                fmt(w["buffer_integral_w"]), int(w["buffer_samples"]),
                f"{100 * (w['buffer_integral_w'] / w['counter_w'] - 1):+.1f}%",
                f"{100 * (w['average_1s_w'] / w['counter_w'] - 1):+.1f}%")
    if not windows:
        buf.note(f"not measured: {load.error}")
    out = os.environ.get("GPU_REPORT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "real_probe.json").write_text(json.dumps(
            {"gpu": name, "driver": driver, "idle_us": idle, "loaded_us": loaded, "buffer_windows": windows},
            indent=2))
    return [cost, buf]


if __name__ == "__main__":
    sys.exit(harness.main_for("bench.real_probe"))

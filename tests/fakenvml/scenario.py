"""Scenario model for the fake NVML library: write scenario files, and compute their ground truth.

A ``Scenario`` describes the driver and each GPU; ``write()`` renders it in the line format that fakenvml.c
parses (README.md documents it) and replaces the file atomically, so a running exporter sees either the old
or the new scenario, never half of one. The ground-truth methods (``true_power_w``, ``true_energy_j``,
``energy_counter_mj``, ``reported_instant_w``, ``reported_average_w``) are computed here, independently of
the C code, from the same trace definition: tests compare what the exporter reports against them.

Times passed to the ground-truth methods are wall-clock unix seconds (``time.time()``); the scenario's own
times (``lost_at_s``, ``energy_reset_at_s``) are seconds since ``Scenario.epoch``. This module must never
load the library or pynvml.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .health import Health

# NVML constants the scenarios speak in (values from nvml.h / pynvml).
ARCH_KEPLER, ARCH_MAXWELL, ARCH_PASCAL, ARCH_VOLTA, ARCH_TURING = 2, 3, 4, 5, 6
ARCH_AMPERE, ARCH_ADA, ARCH_HOPPER, ARCH_BLACKWELL = 7, 8, 9, 10
POWER_SCOPE_GPU, POWER_SCOPE_MODULE = 0, 1
GPM_GRAPHICS_UTIL, GPM_SM_UTIL, GPM_SM_OCCUPANCY, GPM_INTEGER_UTIL, GPM_ANY_TENSOR_UTIL = 1, 2, 3, 4, 5
GPM_DFMA_TENSOR_UTIL, GPM_HMMA_TENSOR_UTIL, GPM_DMMA_TENSOR_UTIL, GPM_IMMA_TENSOR_UTIL = 6, 7, 8, 9
GPM_DRAM_BW_UTIL, GPM_FP64_UTIL, GPM_FP32_UTIL, GPM_FP16_UTIL = 10, 11, 12, 13

#: GPM metric id -> scenario key (must match GPM_METRICS in fakenvml.c).
GPM_KEYS: dict[int, str] = {
    GPM_GRAPHICS_UTIL: "gpm_graphics_util_pct",
    GPM_SM_UTIL: "gpm_sm_util_pct",
    GPM_SM_OCCUPANCY: "gpm_sm_occupancy_pct",
    GPM_INTEGER_UTIL: "gpm_integer_util_pct",
    GPM_ANY_TENSOR_UTIL: "gpm_any_tensor_util_pct",
    GPM_DFMA_TENSOR_UTIL: "gpm_dfma_tensor_util_pct",
    GPM_HMMA_TENSOR_UTIL: "gpm_hmma_tensor_util_pct",
    GPM_DMMA_TENSOR_UTIL: "gpm_dmma_tensor_util_pct",
    GPM_IMMA_TENSOR_UTIL: "gpm_imma_tensor_util_pct",
    GPM_DRAM_BW_UTIL: "gpm_dram_bw_util_pct",
    GPM_FP64_UTIL: "gpm_fp64_util_pct",
    GPM_FP32_UTIL: "gpm_fp32_util_pct",
    GPM_FP16_UTIL: "gpm_fp16_util_pct",
}

#: The five GPM metrics the exporter reads, all idle.
IDLE_GPM: dict[int, float] = {
    GPM_GRAPHICS_UTIL: 0.0,
    GPM_SM_UTIL: 0.0,
    GPM_SM_OCCUPANCY: 0.0,
    GPM_ANY_TENSOR_UTIL: 0.0,
    GPM_DRAM_BW_UTIL: 0.0,
}

MIB = 1024 * 1024


def _num(x: float) -> str:
    # repr() is the shortest string that strtod reads back to the same double: C and Python agree exactly.
    return repr(float(x))


# ---- Power traces: true power P(t), t in seconds since the epoch, and its closed-form integral -----------


@dataclass(frozen=True)
class Constant:
    """``watts`` all the time."""

    watts: float

    def power_w(self, t: float) -> float:
        return self.watts

    def cumulative_j(self, t: float) -> float:
        """Integral of P from 0 to t (before 0 the value at 0 extends back)."""
        return self.watts * t

    def spec(self) -> str:
        return f"constant {_num(self.watts)}"


@dataclass(frozen=True)
class Square:
    """``high_w`` for the first ``duty`` fraction of every ``period_s``, ``low_w`` for the rest: training
    steps (compute burst, then data loading / communication)."""

    low_w: float
    high_w: float
    period_s: float
    duty: float

    def __post_init__(self) -> None:
        if self.period_s <= 0 or not 0 <= self.duty <= 1:
            raise ValueError("Square needs period_s > 0 and 0 <= duty <= 1")

    def power_w(self, t: float) -> float:
        t = max(t, 0.0)
        return self.high_w if math.fmod(t, self.period_s) < self.duty * self.period_s else self.low_w

    def cumulative_j(self, t: float) -> float:
        if t <= 0:
            return self.power_w(0.0) * t
        n = float(math.floor(t / self.period_s))
        r = t - n * self.period_s
        on = self.duty * self.period_s
        per = self.high_w * on + self.low_w * (self.period_s - on)
        part = self.high_w * r if r < on else self.high_w * on + self.low_w * (r - on)
        return n * per + part

    def spec(self) -> str:
        return (
            f"square low={_num(self.low_w)} high={_num(self.high_w)} "
            f"period={_num(self.period_s)} duty={_num(self.duty)}"
        )


@dataclass(frozen=True)
class Steps:
    """Piecewise constant: ``steps`` is ((duration_s, watts), ...). After the last step the trace repeats
    from the first (``repeat``) or holds the last value."""

    steps: tuple[tuple[float, float], ...]
    repeat: bool = False

    def __post_init__(self) -> None:
        if not self.steps or any(d <= 0 for d, _ in self.steps):
            raise ValueError("Steps needs at least one step, each with a positive duration")
        if len(self.steps) > 64:
            raise ValueError("Steps supports at most 64 steps")

    @property
    def cycle_s(self) -> float:
        total = 0.0
        for d, _ in self.steps:
            total += d
        return total

    @property
    def cycle_j(self) -> float:
        total = 0.0
        for d, w in self.steps:
            total += d * w
        return total

    def power_w(self, t: float) -> float:
        t = max(t, 0.0)
        if t >= self.cycle_s:
            if not self.repeat:
                return self.steps[-1][1]
            t = math.fmod(t, self.cycle_s)
        for d, w in self.steps:
            if t < d:
                return w
            t -= d
        return self.steps[-1][1]

    def cumulative_j(self, t: float) -> float:
        if t <= 0:
            return self.power_w(0.0) * t
        acc = 0.0
        if t >= self.cycle_s:
            if not self.repeat:
                return self.cycle_j + self.steps[-1][1] * (t - self.cycle_s)
            n = float(math.floor(t / self.cycle_s))
            acc = n * self.cycle_j
            t -= n * self.cycle_s
        for d, w in self.steps:
            if t <= 0:
                break
            step = min(t, d)
            acc += w * step
            t -= step
        return acc

    def spec(self) -> str:
        body = " ".join(f"{_num(d)}:{_num(w)}" for d, w in self.steps)
        return f"steps {body} {'repeat' if self.repeat else 'once'}"


PowerTrace = Constant | Square | Steps


# ---- Devices -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Process:
    pid: int
    used_memory_bytes: int
    sm_util_pct: int = 0
    mem_util_pct: int = 0
    mig_index: int = -1  # issue 19: the MIG device it runs on (its GPU/compute instance ids in the list)
    #: issue 28: its SM % over time (a trace in percent: Constant, Square or Steps), instead of sm_util_pct
    sm_trace: PowerTrace | None = None


@dataclass(frozen=True)
class EnergyFault:
    """A scripted fault of the energy counter: reads at times in [start_s, end_s) (s since the epoch)
    return ``value`` mJ (``set``), the true counter + ``value`` mJ (``add``), or fail with the nvmlReturn_t
    ``value`` (``error``). The true energy is unaffected: only what the driver reports is wrong."""

    start_s: float
    end_s: float
    kind: str
    value: float

    def __post_init__(self) -> None:
        if self.kind not in ("set", "add", "error") or not self.end_s > self.start_s:
            raise ValueError("EnergyFault needs kind set/add/error and end_s > start_s")
        if self.kind == "error" and (self.value <= 0 or self.value != int(self.value)):
            raise ValueError("an error fault's value is an nvmlReturn_t code (a positive integer)")

    def spec(self) -> str:
        value = str(int(self.value)) if self.kind == "error" else _num(self.value)
        return f"{_num(self.start_s)} {_num(self.end_s)} {self.kind} {value}"


def bad_reading(at_s: float, value_mj: float = 0.0, width_s: float = 0.5) -> EnergyFault:
    """One implausible low reading (a driver returning 0 or garbage): reads in [at_s, at_s + width_s)."""
    return EnergyFault(at_s, at_s + width_s, "set", value_mj)


def energy_jump(at_s: float, add_mj: float, width_s: float = 0.5) -> EnergyFault:
    """One implausibly high reading: the true counter + ``add_mj`` for reads in [at_s, at_s + width_s)."""
    return EnergyFault(at_s, at_s + width_s, "add", add_mj)


def energy_unreadable(start_s: float, end_s: float, code: int = 999) -> EnergyFault:
    """The counter cannot be read in [start_s, end_s) (default NVML_ERROR_UNKNOWN; 15 is GPU_IS_LOST)."""
    return EnergyFault(start_s, end_s, "error", float(code))


@dataclass(frozen=True)
class GPU:
    """One physical GPU. Field names are the scenario keys; units are in the names."""

    index: int
    name: str = "NVIDIA Fake GPU"
    uuid: str = ""  # "" -> derived from name and index
    pci_bus_id: str = ""  # "" -> derived from index
    pci_device_id: int = 0x233010DE  # (device id << 16) | vendor 0x10DE
    pci_subsystem_id: int = 0
    architecture: int = ARCH_HOPPER
    compute_capability: tuple[int, int] = (9, 0)
    memory_total_bytes: int = 80 * 1024 * MIB
    memory_used_bytes: int = 0
    memory_reserved_bytes: int = 0
    util_gpu_pct: int = 0
    util_memory_pct: int = 0
    temperature_gpu_c: int = 40
    temperature_memory_c: int | None = None  # None: NVML_FI_DEV_MEMORY_TEMP not supported
    clock_graphics_mhz: int | None = None  # None: same as the SM clock
    clock_sm_mhz: int = 1500
    clock_memory_mhz: int = 1500
    power_limit_mw: int = 700_000
    power_management_limit_mw: int | None = None  # None: same as the enforced limit
    clocks_event_reasons: int = 0
    processes: tuple[Process, ...] = ()
    mig_capable: bool = False
    mig_mode: int = 0
    mig_pending_mode: int | None = None
    max_mig_devices: int = 7
    mig_devices: tuple[str, ...] = ()  # MIG device UUIDs ("MIG-..."), reachable while mig_mode is 1
    #: issue 19: each MIG device's (GPU-instance slices, compute-instance slices, SMs), in mig_devices' order,
    #: as nvmlDeviceGetAttributes_v2 reports them (e.g. (3, 3, 60) for a 3g.40gb on an H100)
    mig_profiles: tuple[tuple[int, int, int], ...] = ()
    multiprocessor_count: int = 0  # the whole GPU's SMs for nvmlDeviceGetAttributes_v2 (0: NOT_SUPPORTED)
    gpm_supported: bool = False
    gpm: Mapping[int, float] = field(default_factory=dict)  # GPM metric id -> percent (others: unsupported)
    energy_counter: bool = True
    energy_offset_mj: float = 0.0  # counter value at the epoch ("driver load")
    energy_reset_at_s: tuple[float, ...] = ()  # counter restarts from 0 at these times (driver reload)
    energy_faults: tuple[EnergyFault, ...] = ()  # scripted bad readings and unreadable spells (at most 16)
    lost_at_s: float | None = None  # from then on every call on this GPU returns GPU_IS_LOST
    handle_error: int = 0  # nvmlReturn_t for GetHandleByIndex/UUID (e.g. 4: NO_PERMISSION)
    missing: tuple[str, ...] = ()  # functions answering FUNCTION_NOT_FOUND on this GPU
    not_supported: tuple[str, ...] = ()  # functions answering NOT_SUPPORTED on this GPU
    fields_not_supported: tuple[int, ...] = ()  # field ids answering NOT_SUPPORTED
    function_delay_ms: Mapping[str, float] = field(default_factory=dict)
    function_error: Mapping[str, int] = field(default_factory=dict)  # function -> nvmlReturn_t it returns
    power: PowerTrace = Constant(100.0)
    power_usage: str = "average"  # nvmlDeviceGetPowerUsage: "average" (1 s) or "instant"
    power_instant_field: bool = True  # NVML_FI_DEV_POWER_INSTANT supported
    power_average_field: bool = True  # NVML_FI_DEV_POWER_AVERAGE supported
    power_window_ms: float = 25.0  # the driver measures this long ...
    power_period_ms: float = 100.0  # ... out of every period
    power_average_windows: int = 10  # windows in the "1 s" average
    module_power_extra_w: float | None = None  # Grace Hopper: module power = GPU power + this
    #: issue 28: per-process utilisation samples this far apart (None: the fake's 1/6 s), and kept (1,024)
    process_sample_period_ms: float | None = None
    process_samples_kept: int | None = None
    health: Health | None = None  # ECC, remapping, PCIe, NVLink, events (health.py); None: none of them

    def __post_init__(self) -> None:
        if self.power_usage not in ("average", "instant"):
            raise ValueError("power_usage must be 'average' or 'instant'")
        if not self.uuid:
            object.__setattr__(self, "uuid", gpu_uuid(self.name, self.index))
        if not self.pci_bus_id:
            object.__setattr__(self, "pci_bus_id", pci_bus_id(self.index))

    # -- ground truth, t in seconds since the epoch --

    def true_power_w(self, t: float, scope: int = POWER_SCOPE_GPU) -> float:
        return self.power.power_w(t) + self._extra(scope)

    def cumulative_j(self, t: float, scope: int = POWER_SCOPE_GPU) -> float:
        return self.power.cumulative_j(t) + self._extra(scope) * t

    def _extra(self, scope: int) -> float:
        if scope == POWER_SCOPE_GPU:
            return 0.0
        if scope == POWER_SCOPE_MODULE and self.module_power_extra_w is not None:
            return self.module_power_extra_w
        raise ValueError(f"GPU {self.index} has no power scope {scope}")

    def window_mean_w(self, k: float, scope: int = POWER_SCOPE_GPU) -> float:
        """Mean true power over the k-th measurement window [k*period, k*period + window)."""
        period_s, window_s = self.power_period_ms / 1000.0, self.power_window_ms / 1000.0
        a = k * period_s
        return (self.cumulative_j(a + window_s, scope) - self.cumulative_j(a, scope)) / window_s

    def last_window(self, t: float) -> float:
        return float(math.floor((t - self.power_window_ms / 1000.0) / (self.power_period_ms / 1000.0)))

    def counter_mj(self, t: float) -> int:
        since, offset = 0.0, self.energy_offset_mj
        for r in self.energy_reset_at_s:
            if since <= r <= t:
                since, offset = r, 0.0
        t = max(t, since)
        mj = offset + (self.cumulative_j(t) - self.cumulative_j(since)) * 1000.0
        return 0 if mj <= 0 else int(math.floor(mj))

    def reported_counter_mj(self, t: float) -> int | None:
        """What the driver reports at t, faults included; None where a fault makes the read fail."""
        mj = float(self.counter_mj(t))
        for f in self.energy_faults:
            if f.start_s <= t < f.end_s:
                if f.kind == "error":
                    return None
                mj = f.value if f.kind == "set" else mj + f.value
        return 0 if mj <= 0 else int(math.floor(mj))

    def render(self) -> str:
        lines = [f"[gpu {self.index}]"]

        def put(key: str, value: Any) -> None:
            lines.append(f"{key} = {value}")

        put("name", self.name)
        put("uuid", self.uuid)
        put("pci_bus_id", self.pci_bus_id)
        put("pci_device_id", f"0x{self.pci_device_id:08x}")
        put("pci_subsystem_id", f"0x{self.pci_subsystem_id:08x}")
        put("architecture", self.architecture)
        put("compute_capability", f"{self.compute_capability[0]}.{self.compute_capability[1]}")
        put("memory_total_bytes", self.memory_total_bytes)
        put("memory_used_bytes", self.memory_used_bytes)
        put("memory_reserved_bytes", self.memory_reserved_bytes)
        put("util_gpu_pct", self.util_gpu_pct)
        put("util_memory_pct", self.util_memory_pct)
        put("temperature_gpu_c", self.temperature_gpu_c)
        if self.temperature_memory_c is not None:
            put("temperature_memory_c", self.temperature_memory_c)
        if self.clock_graphics_mhz is not None:
            put("clock_graphics_mhz", self.clock_graphics_mhz)
        put("clock_sm_mhz", self.clock_sm_mhz)
        put("clock_memory_mhz", self.clock_memory_mhz)
        put("power_limit_mw", self.power_limit_mw)
        if self.power_management_limit_mw is not None:
            put("power_management_limit_mw", self.power_management_limit_mw)
        put("clocks_event_reasons", f"0x{self.clocks_event_reasons:x}")
        for p in self.processes:
            put("process", f"{p.pid} {p.used_memory_bytes} {p.sm_util_pct} {p.mem_util_pct}"
                + (f" {p.mig_index}" if p.mig_index >= 0 else ""))
        for p in self.processes:
            if p.sm_trace is not None:
                put("process_sm", f"{p.pid} {p.sm_trace.spec()}")
        if self.process_sample_period_ms is not None:
            put("process_sample_period_ms", self.process_sample_period_ms)
        if self.process_samples_kept is not None:
            put("process_samples_kept", self.process_samples_kept)
        put("mig_capable", _yes(self.mig_capable))
        put("mig_mode", self.mig_mode)
        if self.mig_pending_mode is not None:
            put("mig_pending_mode", self.mig_pending_mode)
        put("max_mig_devices", self.max_mig_devices)
        if self.mig_devices:
            put("mig_devices", " ".join(self.mig_devices))
        if self.mig_profiles:
            put("mig_profiles", " ".join(f"{gi}:{ci}:{sm}" for gi, ci, sm in self.mig_profiles))
        if self.multiprocessor_count:
            put("multiprocessor_count", self.multiprocessor_count)
        put("gpm_supported", _yes(self.gpm_supported))
        for metric_id, pct in sorted(self.gpm.items()):
            put(GPM_KEYS[metric_id], _num(pct))
        put("energy_counter", _yes(self.energy_counter))
        put("energy_offset_mj", _num(self.energy_offset_mj))
        if self.energy_reset_at_s:
            put("energy_reset_at", " ".join(_num(t) for t in self.energy_reset_at_s))
        if len(self.energy_faults) > 16:
            raise ValueError("at most 16 energy faults per GPU")
        for fault in self.energy_faults:
            put("energy_fault", fault.spec())
        if self.lost_at_s is not None:
            put("lost_at", _num(self.lost_at_s))
        if self.handle_error:
            put("handle_error", self.handle_error)
        if self.missing:
            put("missing", " ".join(self.missing))
        if self.not_supported:
            put("not_supported", " ".join(self.not_supported))
        if self.fields_not_supported:
            put("fields_not_supported", " ".join(str(f) for f in self.fields_not_supported))
        for fn, ms in sorted(self.function_delay_ms.items()):
            put(f"delay_ms.{fn}", _num(ms))
        for fn, code in sorted(self.function_error.items()):
            put(f"error.{fn}", code)
        put("power", self.power.spec())
        put("power_usage", self.power_usage)
        put("power_instant_field", _yes(self.power_instant_field))
        put("power_average_field", _yes(self.power_average_field))
        put("power_window_ms", _num(self.power_window_ms))
        put("power_period_ms", _num(self.power_period_ms))
        put("power_average_windows", self.power_average_windows)
        if self.module_power_extra_w is not None:
            put("module_power_extra_w", _num(self.module_power_extra_w))
        if self.health is not None:
            lines += self.health.lines()
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Driver:
    driver_version: str = "550.54.15"
    nvml_version: str = "12.550.54.15"
    cuda_version: int = 12040  # 1000 * major + 10 * minor
    init_error: int = 0  # nvmlReturn_t returned by nvmlInit (e.g. 4: NO_PERMISSION)
    device_count: int | None = None  # None: highest [gpu N] + 1
    delay_ms: float = 0.0  # added to every call
    function_delay_ms: Mapping[str, float] = field(default_factory=dict)
    missing: tuple[str, ...] = ()  # FUNCTION_NOT_FOUND for every caller
    not_supported: tuple[str, ...] = ()
    frozen_time: float | None = None  # unix time the library uses as "now" (None: the real clock)
    # The cost model's profile (``COST_PROFILES``): every call burns what that real driver burns. None: none,
    # unless the environment variable FAKE_NVML_COST_PROFILE names one (it wins over this).
    cost_profile: str | None = None

    def render(self) -> str:
        lines = [
            "[driver]",
            f"driver_version = {self.driver_version}",
            f"nvml_version = {self.nvml_version}",
            f"cuda_version = {self.cuda_version}",
            f"init_error = {self.init_error}",
        ]
        if self.device_count is not None:
            lines.append(f"device_count = {self.device_count}")
        lines.append(f"delay_ms = {_num(self.delay_ms)}")
        lines += [f"delay_ms.{fn} = {_num(ms)}" for fn, ms in sorted(self.function_delay_ms.items())]
        if self.missing:
            lines.append("missing = " + " ".join(self.missing))
        if self.not_supported:
            lines.append("not_supported = " + " ".join(self.not_supported))
        if self.frozen_time is not None:
            lines.append(f"frozen_time = {_num(self.frozen_time)}")
        if self.cost_profile is not None:
            lines.append(f"cost_profile = {self.cost_profile}")
        return "\n".join(lines) + "\n"


_write_lock = threading.Lock()
_last_mtime_ns = 0


@dataclass
class Scenario:
    """The whole fake machine. ``epoch`` (unix seconds) is t = 0 of every power trace."""

    epoch: float
    driver: Driver = field(default_factory=Driver)
    gpus: list[GPU] = field(default_factory=list)

    def __post_init__(self) -> None:
        indices = [g.index for g in self.gpus]
        if len(set(indices)) != len(indices) or any(not 0 <= i < 16 for i in indices):
            raise ValueError(f"GPU indices must be distinct and in 0..15, got {indices}")

    def render(self) -> str:
        parts = [
            "# fake NVML scenario (tests/fakenvml/README.md)\n",
            f"epoch = {_num(self.epoch)}\n\n",
            self.driver.render(),
        ]
        parts += ["\n" + g.render() for g in self.gpus]
        return "".join(parts)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Atomically (temp file + rename) write the scenario to ``path``."""
        global _last_mtime_ns
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.render())
            # The library notices a rewrite by inode, size and mtime; a strictly increasing mtime makes
            # two rewrites within one coarse kernel clock tick (and a recycled inode) still distinct.
            with _write_lock:
                _last_mtime_ns = max(time.time_ns(), _last_mtime_ns + 1000)
                stamp = _last_mtime_ns
            os.utime(tmp, ns=(stamp, stamp))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def gpu(self, index: int) -> GPU:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU {index} in the scenario")

    # -- ground truth; every t is a unix time --

    def true_power_w(self, gpu_index: int, t: float, scope: int = POWER_SCOPE_GPU) -> float:
        return self.gpu(gpu_index).true_power_w(t - self.epoch, scope)

    def true_energy_j(self, gpu_index: int, t0: float, t1: float, scope: int = POWER_SCOPE_GPU) -> float:
        """Exact energy the GPU used between unix times t0 and t1 (counter resets do not matter)."""
        g = self.gpu(gpu_index)
        return g.cumulative_j(t1 - self.epoch, scope) - g.cumulative_j(t0 - self.epoch, scope)

    def energy_counter_mj(self, gpu_index: int, t: float) -> int:
        """What nvmlDeviceGetTotalEnergyConsumption returns at unix time t (offset and resets included)."""
        return self.gpu(gpu_index).counter_mj(t - self.epoch)

    def reported_instant_w(self, gpu_index: int, t: float, scope: int = POWER_SCOPE_GPU) -> float:
        """The driver's instant power at t: the mean over the last completed measurement window."""
        g = self.gpu(gpu_index)
        return g.window_mean_w(g.last_window(t - self.epoch), scope)

    def reported_average_w(self, gpu_index: int, t: float, scope: int = POWER_SCOPE_GPU) -> float:
        """The driver's "1 s" average at t: the mean of the last ``power_average_windows`` windows."""
        g = self.gpu(gpu_index)
        k = g.last_window(t - self.epoch)
        total = 0.0
        for i in range(g.power_average_windows):
            total += g.window_mean_w(k - i, scope)
        return total / g.power_average_windows

    def reported_power_usage_mw(self, gpu_index: int, t: float) -> int:
        """What nvmlDeviceGetPowerUsage returns at t, in mW."""
        g = self.gpu(gpu_index)
        w = self.reported_average_w(gpu_index, t) if g.power_usage == "average" else (
            self.reported_instant_w(gpu_index, t)
        )
        return to_mw(w)


def to_mw(watts: float) -> int:
    """Round watts to the integer milliwatts NVML reports."""
    return max(0, int(math.floor(watts * 1000.0 + 0.5)))


def _yes(b: bool) -> str:
    return "yes" if b else "no"


# ---- Ready-made GPUs -----------------------------------------------------------------------------------

_UUID_NS = uuid.UUID("6a1f0c8e-9b7d-4d4e-8f43-3c2b1a0f5e71")
_DGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


def gpu_uuid(name: str, index: int) -> str:
    """A deterministic, plausible GPU UUID ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")."""
    return f"GPU-{uuid.uuid5(_UUID_NS, f'{name}/{index}')}"


def mig_uuids(parent_uuid: str, count: int) -> tuple[str, ...]:
    """Deterministic MIG device UUIDs for a parent GPU."""
    return tuple(f"MIG-{uuid.uuid5(_UUID_NS, f'{parent_uuid}/mig/{i}')}" for i in range(count))


def pci_bus_id(index: int) -> str:
    bus = _DGX_BUSES[index] if index < len(_DGX_BUSES) else 0xE0 + index
    return f"00000000:{bus:02X}:00.0"


def _make(index: int, base: dict[str, Any], overrides: dict[str, Any]) -> GPU:
    gpu = GPU(index=index, **base)
    return replace(gpu, **overrides) if overrides else gpu


def h100(index: int = 0, *, power: PowerTrace = Constant(350.0), **overrides: Any) -> GPU:
    """H100 SXM5 80GB: Hopper, energy counter, 1 s average PowerUsage, GPM, MIG-capable, 700 W."""
    return _make(index, dict(
        name="NVIDIA H100 80GB HBM3", pci_device_id=0x233010DE, pci_subsystem_id=0x16C110DE,
        architecture=ARCH_HOPPER, compute_capability=(9, 0), memory_total_bytes=81559 * MIB,
        memory_reserved_bytes=529 * MIB, temperature_gpu_c=34, temperature_memory_c=42,
        clock_sm_mhz=1980, clock_memory_mhz=2619, power_limit_mw=700_000, mig_capable=True,
        gpm_supported=True, gpm=dict(IDLE_GPM), power=power, power_usage="average",
    ), overrides)


def a100(index: int = 0, *, power: PowerTrace = Constant(250.0), **overrides: Any) -> GPU:
    """A100 SXM4 80GB: GA100, so PowerUsage is instant (not the 1 s average); no GPM; MIG-capable, 400 W."""
    return _make(index, dict(
        name="NVIDIA A100-SXM4-80GB", pci_device_id=0x20B210DE, pci_subsystem_id=0x147F10DE,
        architecture=ARCH_AMPERE, compute_capability=(8, 0), memory_total_bytes=81920 * MIB,
        memory_reserved_bytes=0, temperature_gpu_c=31, temperature_memory_c=38,
        clock_sm_mhz=1410, clock_memory_mhz=1593, power_limit_mw=400_000, mig_capable=True,
        gpm_supported=False, power=power, power_usage="instant",
    ), overrides)


def v100(index: int = 0, *, power: PowerTrace = Constant(200.0), **overrides: Any) -> GPU:
    """V100 SXM2 16GB: Volta, energy counter, instant PowerUsage, no MIG, no GPM, 300 W."""
    return _make(index, dict(
        name="Tesla V100-SXM2-16GB", pci_device_id=0x1DB110DE, pci_subsystem_id=0x121210DE,
        architecture=ARCH_VOLTA, compute_capability=(7, 0), memory_total_bytes=16384 * MIB,
        temperature_gpu_c=36, temperature_memory_c=35, clock_sm_mhz=1530, clock_memory_mhz=877,
        power_limit_mw=300_000, power=power, power_usage="instant",
    ), overrides)


def pascal_no_counter(index: int = 0, *, power: PowerTrace = Constant(150.0), **overrides: Any) -> GPU:
    """P100 PCIe 16GB: no energy counter and no power fields; instant PowerUsage only, 250 W."""
    return _make(index, dict(
        name="Tesla P100-PCIE-16GB", pci_device_id=0x15F810DE, pci_subsystem_id=0x118F10DE,
        architecture=ARCH_PASCAL, compute_capability=(6, 0), memory_total_bytes=16280 * MIB,
        temperature_gpu_c=38, clock_sm_mhz=1328, clock_memory_mhz=715, power_limit_mw=250_000,
        energy_counter=False, power_instant_field=False, power_average_field=False,
        power=power, power_usage="instant",
    ), overrides)


def grace_hopper(
    index: int = 0, *, power: PowerTrace = Constant(400.0), module_extra_w: float = 150.0, **overrides: Any
) -> GPU:
    """GH200: Hopper GPU whose module power (GPU + Grace CPU + memory) exceeds GPU power by module_extra_w."""
    return _make(index, dict(
        name="NVIDIA GH200 480GB", pci_device_id=0x234210DE, pci_subsystem_id=0x16EB10DE,
        pci_bus_id=f"00000009:{0x01 + index:02X}:00.0",
        architecture=ARCH_HOPPER, compute_capability=(9, 0), memory_total_bytes=97871 * MIB,
        memory_reserved_bytes=612 * MIB, temperature_gpu_c=33, temperature_memory_c=40,
        clock_sm_mhz=1980, clock_memory_mhz=2619, power_limit_mw=900_000, mig_capable=True,
        gpm_supported=True, gpm=dict(IDLE_GPM), power=power, power_usage="average",
        module_power_extra_w=module_extra_w,
    ), overrides)

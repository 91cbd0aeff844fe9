"""The NVML device backend: the only module in the package that imports ``pynvml``.

Every NVML call is isolated: whatever one call raises (an ``NVMLError``, pynvml's
``NVMLLibraryMismatchError`` when an unversioned wrapper needs a symbol this driver lacks, an
``AttributeError`` because the installed pynvml has no such wrapper, or anything else) loses that one
reading and nothing more. Each failure is counted per GPU, field and reason (``field_errors()``, exposed as
``gpuenergy_nvml_field_errors_total``) and logged once per GPU and field. Calls that NVML versions
(``..._v3``, ``..._v2``, unversioned) fall back to the older variant when the newer one is missing, so a
driver older than pynvml (R470 lacks ``nvmlDeviceGetComputeRunningProcesses_v3``) keeps every reading it can
give. "Not supported" and "function not found" after the last variant are cached per GPU and field: an
unavailable reading costs one failed call in the whole life of the process. Only a lost GPU
(``GPU_IS_LOST`` and friends) is raised, as ``GPULost``; the collector then marks that GPU alone.

This module must never be called from the scrape path: NVML calls can block for a long time on a sick
driver. The sampler thread calls it; ``/metrics`` reads the snapshot.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from gpu_energy_exporter.core.errors import GPULost, NotSupported, NVMLUnavailable
from gpu_energy_exporter.devices.base import (
    ENERGY_METHOD_COUNTER,
    ENERGY_METHOD_INTEGRATED_INSTANT,
    ENERGY_METHOD_INTEGRATED_USAGE,
    ENERGY_METHOD_NONE,
    GPUBackend,
    GPUIdentity,
    GPUProcess,
    GPUReading,
    MIGDevice,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_ARCHITECTURES = {
    2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere", 8: "ada",
    9: "hopper", 10: "blackwell", 13: "rubin",
}

# Errors meaning "this reading does not exist here": no data, asked once.
_NO_DATA = {
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    pynvml.NVML_ERROR_DEPRECATED,
}
# Errors meaning "nothing to read right now": no data this time, asked again next sample, logged at debug.
_NOT_NOW = {
    pynvml.NVML_ERROR_NO_DATA,
    pynvml.NVML_ERROR_NOT_READY,
}
# Errors meaning the GPU itself is gone or unusable until reset.
_LOST = {
    pynvml.NVML_ERROR_GPU_IS_LOST,
    pynvml.NVML_ERROR_RESET_REQUIRED,
    pynvml.NVML_ERROR_GPU_NOT_FOUND,
}

#: ``reason`` label values of ``field_errors()`` (the ``gpuenergy_nvml_field_errors_total`` counter).
#: not_supported and function_not_found are asked once; nvml_error and exception are retried every sample.
REASON_NOT_SUPPORTED = "not_supported"  # NOT_SUPPORTED, ARGUMENT_VERSION_MISMATCH, DEPRECATED from the driver
REASON_NO_DATA = "no_data"  # NO_DATA, NOT_READY: nothing to read this time (asked again, logged at debug)
REASON_FUNCTION_NOT_FOUND = "function_not_found"  # symbol missing in the library, or wrapper missing in pynvml
REASON_NVML_ERROR = "nvml_error"  # any other NVML return code (timeout, unknown, ...)
REASON_EXCEPTION = "exception"  # anything else a call raised
FIELD_ERROR_REASONS = (REASON_NOT_SUPPORTED, REASON_FUNCTION_NOT_FOUND, REASON_NVML_ERROR, REASON_EXCEPTION)
_ASKED_ONCE = {REASON_NOT_SUPPORTED, REASON_FUNCTION_NOT_FOUND}

#: One way to make a call: the pynvml function (or its name, looked up at call time so that a pynvml
#: without it is "function not found", not a crash) followed by its arguments.
Variant = tuple[Any, ...]

#: nvmlDeviceGetFieldValues ids we read in one call per sample.
_FI_POWER_INSTANT = pynvml.NVML_FI_DEV_POWER_INSTANT
_FI_POWER_AVERAGE = pynvml.NVML_FI_DEV_POWER_AVERAGE
_FI_MEMORY_TEMP = pynvml.NVML_FI_DEV_MEMORY_TEMP
_SCOPE_GPU = pynvml.NVML_POWER_SCOPE_GPU
_SCOPE_MODULE = pynvml.NVML_POWER_SCOPE_MODULE
#: (field id, scope) -> the field name used in errors and in gpuenergy_nvml_field_errors_total.
_FIELD_NAMES: dict[tuple[Any, ...], str] = {
    (_FI_POWER_INSTANT, _SCOPE_GPU): "power_instant_field",
    (_FI_POWER_AVERAGE, _SCOPE_GPU): "power_average_field",
    (_FI_MEMORY_TEMP, 0): "memory_temperature_field",
    (_FI_POWER_INSTANT, _SCOPE_MODULE): "module_power_field",
}

#: A reading that fails transiently at discovery is asked this many times, this far apart.
_DISCOVERY_TRIES = 3
_DISCOVERY_RETRY_S = 0.05

#: GPM metrics we expose (name used in GPUReading.gpm -> NVML metric id).
GPM_METRICS: dict[str, int] = {
    "graphics_active": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "sm_active": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "tensor_active": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_bandwidth": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
}
#: NVML requires GPM samples at least 100 ms apart for meaningful metrics.
GPM_MIN_INTERVAL_S = 0.1

_INIT_ADVICE = {
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        "driver_not_loaded",
        "the NVIDIA kernel driver is not loaded: check `nvidia-smi`; in a container, run with the NVIDIA "
        "container runtime (NVIDIA_DRIVER_CAPABILITIES=utility) or mount the driver",
    ),
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "library_not_found",
        "libnvidia-ml.so.1 was not found: install the NVIDIA driver, or point --nvml.library at the "
        "library (containers: it is usually under /usr/lib/x86_64-linux-gnu or /usr/local/nvidia/lib64)",
    ),
    pynvml.NVML_ERROR_NO_PERMISSION: (
        "no_permission",
        "no permission to open the NVIDIA device files (/dev/nvidia*): run as a user in the group that owns "
        "them, or with the device files mounted",
    ),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "driver_library_mismatch",
        "libnvidia-ml does not match the loaded kernel driver (driver upgraded without reboot?): reboot, "
        "or reload the nvidia kernel modules",
    ),
}


def _decode(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def load_library(path: str | None) -> None:
    """Load libnvidia-ml from ``path`` (``--nvml.library``) instead of the dynamic linker's choice.

    pynvml loads the library lazily into its module global ``nvmlLib`` under ``libLoadLock``; loading it
    ourselves first is the documented-by-source way to choose the file.
    """
    if path is None:
        return
    with pynvml.libLoadLock:
        if pynvml.nvmlLib is not None:
            return
        try:
            pynvml.nvmlLib = ctypes.CDLL(path)
        except OSError as exc:
            raise NVMLUnavailable(
                f"cannot load NVML library {path!r} given by --nvml.library: {exc}", reason="library_not_found"
            ) from None


class NVMLBackend(GPUBackend):
    """GPUs through NVML. Construct with ``NVMLBackend(library_path)``; raises ``NVMLUnavailable``."""

    kind = "nvml"

    def __init__(self, library_path: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # guards the error counts (sampler and power-sampler threads)
        load_library(library_path)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            reason, advice = _INIT_ADVICE.get(code, ("init_failed", f"nvmlInit failed: {exc}"))
            raise NVMLUnavailable(f"NVML unavailable: {advice}", reason=reason) from None
        self._closed = False
        self._handles: dict[int, Any] = {}
        self._unsupported: set[tuple[int, str]] = set()
        self._variant: dict[tuple[int, str], int] = {}
        self._errors: dict[tuple[int, str, str], int] = {}
        self._logged: set[tuple[int, str]] = set()
        self._gpm_supported: dict[int, bool] = {}
        self._gpm_prev: dict[int, tuple[float, Any]] = {}
        self._process_util_ts: dict[int, int] = {}
        self._driver = self._call_global("", "nvmlSystemGetDriverVersion")
        self._nvml_version = self._call_global("", "nvmlSystemGetNVMLVersion")
        cuda = self._call_global(0, "nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion")
        self._cuda_version = f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda else ""

    # ------------------------------------------------------------------------------------------------
    # error translation

    @staticmethod
    def _call_global(default: Any, *names: str) -> Any:
        """A driver-wide getter, trying ``names`` in turn; ``default`` when none answers."""
        for name in names:
            fn = getattr(pynvml, name, None)
            if fn is None:
                continue
            try:
                value = fn()
            except Exception as exc:  # noqa: BLE001 - a version string is never worth failing for
                log.debug("%s failed: %s: %s", name, type(exc).__name__, exc)
                continue
            return _decode(value) if isinstance(value, bytes | str) else value
        return default

    def field_errors(self) -> dict[tuple[int, str, str], int]:
        """Failed readings so far: ``(gpu index, field, reason) -> count`` (a copy)."""
        with self._lock:
            return dict(self._errors)

    def _classify(self, index: int, what: str, exc: BaseException) -> str:
        """The reason label for ``exc``; raises ``GPULost`` when it says the GPU is gone."""
        if isinstance(exc, pynvml.NVMLLibraryMismatchError):
            return REASON_FUNCTION_NOT_FOUND
        if isinstance(exc, pynvml.NVMLError):
            code = getattr(exc, "value", None)
            if code in _LOST:
                raise GPULost(
                    f"GPU {index} is lost ({exc}) while reading {what}: check `nvidia-smi` and the kernel log "
                    "(Xid errors); the GPU may need a reset or the node a reboot"
                ) from None
            if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                return REASON_FUNCTION_NOT_FOUND
            return self._reason_of_code(code)
        return REASON_EXCEPTION

    @staticmethod
    def _reason_of_code(code: Any) -> str:
        if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            return REASON_FUNCTION_NOT_FOUND
        if code in _NO_DATA:
            return REASON_NOT_SUPPORTED
        if code in _NOT_NOW:
            return REASON_NO_DATA
        return REASON_NVML_ERROR

    def _lose(self, index: int, what: str, reason: str, detail: str) -> None:
        """Count and log (once per GPU and field) a reading that could not be had."""
        key = (index, what)
        with self._lock:
            self._errors[(index, what, reason)] = self._errors.get((index, what, reason), 0) + 1
        if reason in _ASKED_ONCE:
            self._unsupported.add(key)
            log.debug("GPU %d: %s not available (%s); not asking again", index, what, detail)
            return
        if reason == REASON_NO_DATA:
            log.debug("GPU %d: %s has no data this time (%s)", index, what, detail)
            return
        if key in self._logged:
            log.debug("GPU %d: reading %s failed again: %s", index, what, detail)
            return
        self._logged.add(key)
        log.warning(
            "GPU %d: reading %s failed (%s); this reading is left out while it fails, every other reading "
            "goes on (counted in gpuenergy_nvml_field_errors_total; if it persists, check `nvidia-smi -q` "
            "and the kernel log)", index, what, detail,
        )

    def _get(self, index: int, what: str, *variants: Variant) -> Any:
        """Read one field of GPU ``index``: the first variant that answers (newest first), else None.

        A variant whose function is missing (``function_not_found``) or that does not support the reading is
        skipped for the next one; the variant that answered is remembered. Any other failure loses this
        field for this sample only. Raises only ``GPULost``.
        """
        key = (index, what)
        if key in self._unsupported:
            return None
        reason, detail = REASON_EXCEPTION, "no variant"
        start = self._variant.get(key, 0)
        for k in range(start, len(variants)):
            fn, *args = variants[k]
            name = fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))
            if isinstance(fn, str):
                fn = getattr(pynvml, fn, None)
            if fn is None:
                reason, detail = REASON_FUNCTION_NOT_FOUND, f"the installed pynvml has no {name}"
            else:
                try:
                    value = fn(*args)
                except Exception as exc:  # noqa: BLE001 - one call never takes more than its own reading
                    reason = self._classify(index, what, exc)
                    detail = f"{name}: {type(exc).__name__}: {exc}"
                else:
                    if self._variant.get(key) != k:
                        self._variant[key] = k
                        if k:
                            log.debug("GPU %d: %s read with %s (the newer variants are missing)", index, what,
                                      name)
                    return value
            if reason not in _ASKED_ONCE:
                break  # a real failure: the older variant would not fix it
            if k + 1 < len(variants):
                log.debug("GPU %d: %s: %s; trying the next variant", index, what, detail)
        self._lose(index, what, reason, detail)
        return None

    def _field(self, index: int, what: str, fn: Callable[..., T] | str, *args: Any) -> T | None:
        """One NVML getter for GPU ``index`` (no fallback); None when it cannot be read."""
        value: T | None = self._get(index, what, (fn, *args))
        return value

    def _handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as exc:
                if getattr(exc, "value", None) in _LOST | {pynvml.NVML_ERROR_INVALID_ARGUMENT}:
                    raise GPULost(f"GPU {index} cannot be opened ({exc})") from None
                raise
            self._handles[index] = handle
        return handle

    # ------------------------------------------------------------------------------------------------
    # discovery

    def driver_version(self) -> str:
        return str(self._driver)

    def nvml_version(self) -> str:
        return str(self._nvml_version)

    def cuda_driver_version(self) -> str:
        return self._cuda_version

    def devices(self) -> list[GPUIdentity]:
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            raise NVMLUnavailable(f"NVML cannot count GPUs: {exc}", reason="device_count_failed") from None
        found = []
        for index in range(count):
            try:
                found.append(self._identify(index))
            except GPULost as exc:
                log.warning("%s; it is left out until the exporter restarts", exc)
            except Exception as exc:  # noqa: BLE001 - one GPU never hides the others
                log.warning("GPU %d cannot be identified (%s: %s); it is left out until the exporter restarts, "
                            "the other GPUs are served", index, type(exc).__name__, exc)
        return found

    def _identify(self, index: int) -> GPUIdentity:
        h = self._handle(index)
        uuid = _decode(self._field(index, "uuid", "nvmlDeviceGetUUID", h) or f"unknown-{index}")
        name = _decode(self._field(index, "name", "nvmlDeviceGetName", h) or "unknown")
        pci = self._field(index, "pci", "nvmlDeviceGetPciInfo", h)
        pci_bus_id = _decode(pci.busId) if pci is not None else ""
        arch_code = self._field(index, "architecture", "nvmlDeviceGetArchitecture", h)
        arch = _ARCHITECTURES.get(arch_code, "unknown") if arch_code is not None else "unknown"
        cc = self._field(index, "compute_capability", "nvmlDeviceGetCudaComputeCapability", h)
        compute_capability = f"{cc[0]}.{cc[1]}" if cc else ""
        energy_method = self._energy_method(index, h)
        # nvmlDeviceGetPowerUsage is a 1 s average on Ampere and newer, except GA100 (A100, A30).
        ga100 = any(tag in name for tag in ("A100", "A30"))
        power_usage_is_average = arch in ("ampere", "ada", "hopper", "blackwell", "rubin") and not ga100
        mig_enabled, mig_devices = self._mig(index, h, uuid)
        return GPUIdentity(
            index=index, uuid=uuid, name=name, pci_bus_id=pci_bus_id, architecture=arch,
            compute_capability=compute_capability, energy_method=energy_method,
            power_usage_is_average=power_usage_is_average, mig_enabled=mig_enabled,
            mig_devices=mig_devices,
        )

    def _energy_method(self, index: int, h: Any) -> str:
        """Chosen once per GPU, at discovery. Only a reading the driver says does not exist here moves the
        choice down (counter, then instant power, then PowerUsage): a transient error is asked again a few
        times, and a method that keeps failing transiently is still chosen (its readings are left out while
        they fail), so one bad moment at start-up never downgrades a GPU for the life of the process."""
        for what, method, read in (
            ("energy", ENERGY_METHOD_COUNTER,
             lambda: self._field(index, "energy", "nvmlDeviceGetTotalEnergyConsumption", h)),
            ("power_instant_field", ENERGY_METHOD_INTEGRATED_INSTANT, lambda: self._instant_field(index, h)),
            ("power_usage", ENERGY_METHOD_INTEGRATED_USAGE,
             lambda: self._field(index, "power_usage", "nvmlDeviceGetPowerUsage", h)),
        ):
            for attempt in range(_DISCOVERY_TRIES):
                if read() is not None:
                    return method
                if (index, what) in self._unsupported or (what == "power_instant_field"
                                                          and (index, "field_values") in self._unsupported):
                    break  # the driver says it does not exist here: next method
                if attempt + 1 < _DISCOVERY_TRIES:
                    time.sleep(_DISCOVERY_RETRY_S)
            else:
                log.warning("GPU %d: %s kept failing at start-up; still using it for energy (its readings are "
                            "left out while they fail)", index, what)
                return method
        return ENERGY_METHOD_NONE

    def _mig(self, index: int, h: Any, uuid: str) -> tuple[bool, tuple[MIGDevice, ...]]:
        mode = self._field(index, "mig_mode", "nvmlDeviceGetMigMode", h)
        if not mode or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return False, ()
        devices = []
        count = self._field(index, "mig_count", "nvmlDeviceGetMaxMigDeviceCount", h) or 0
        for mig_index in range(count):
            try:
                mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, mig_index)
                mig_uuid = _decode(pynvml.nvmlDeviceGetUUID(mh))
            except pynvml.NVMLError as exc:
                if getattr(exc, "value", None) == pynvml.NVML_ERROR_NOT_FOUND:
                    continue  # an empty MIG slot
                self._lose(index, "mig_device", self._classify(index, "mig_device", exc), str(exc))
                continue
            except Exception as exc:  # noqa: BLE001
                self._lose(index, "mig_device", REASON_EXCEPTION, f"{type(exc).__name__}: {exc}")
                continue
            devices.append(MIGDevice(uuid=mig_uuid, parent_uuid=uuid, index=mig_index))
        return True, tuple(devices)

    # ------------------------------------------------------------------------------------------------
    # sampling

    def _field_values(self, index: int, h: Any, ids: list[Any]) -> list[float | None]:
        """Read several field values in one call; per-field failures are None."""
        values = self._field(index, "field_values", "nvmlDeviceGetFieldValues", h, ids)
        if values is None:
            return [None] * len(ids)
        out: list[float | None] = []
        for want, v in zip(ids, values, strict=False):
            if v.nvmlReturn != pynvml.NVML_SUCCESS:
                if v.nvmlReturn in _LOST:
                    raise GPULost(f"GPU {index} is lost (field {v.fieldId})")
                what = _FIELD_NAMES.get(tuple(want), f"field {v.fieldId}")
                if (index, what) not in self._unsupported:
                    # Per field, as for a whole call: "not supported" is remembered, anything else (a
                    # transient error) loses this field for this sample only.
                    self._lose(index, what, self._reason_of_code(v.nvmlReturn), f"NVML return code {v.nvmlReturn}")
                out.append(None)
                continue
            out.append(_field_value(v))
        return out

    def _instant_field(self, index: int, h: Any) -> float | None:
        if (index, "power_instant_field") in self._unsupported or (index, "field_values") in self._unsupported:
            return None
        (value,) = self._field_values(index, h, [(_FI_POWER_INSTANT, _SCOPE_GPU)])
        return value

    def read_power_mw(self, gpu: GPUIdentity) -> float | None:
        h = self._handle(gpu.index)
        if gpu.energy_method == ENERGY_METHOD_INTEGRATED_INSTANT:
            return self._instant_field(gpu.index, h)
        value = self._field(gpu.index, "power_usage", "nvmlDeviceGetPowerUsage", h)
        return float(value) if value is not None else None

    def read(self, gpu: GPUIdentity, *, processes: bool = False, process_utilization: bool = False,
             gpm: bool = False) -> GPUReading:
        i = gpu.index
        h = self._handle(i)
        now = self._clock()
        energy = self._field(i, "energy", "nvmlDeviceGetTotalEnergyConsumption", h)
        usage = self._field(i, "power_usage", "nvmlDeviceGetPowerUsage", h)
        want = [(_FI_POWER_INSTANT, _SCOPE_GPU), (_FI_POWER_AVERAGE, _SCOPE_GPU), (_FI_MEMORY_TEMP, 0),
                (_FI_POWER_INSTANT, _SCOPE_MODULE)]
        instant, average, mem_temp, module = self._field_values(i, h, want)
        if usage is not None:
            if gpu.power_usage_is_average:
                average = average if average is not None else float(usage)
            else:
                instant = instant if instant is not None else float(usage)
        limit = self._field(i, "power_limit", "nvmlDeviceGetEnforcedPowerLimit", h)
        # v2 reports reserved memory apart (R510+); v1 counts it as used.
        mem = self._get(i, "memory", ("nvmlDeviceGetMemoryInfo", h, pynvml.nvmlMemory_v2),
                        ("nvmlDeviceGetMemoryInfo", h))
        reserved = getattr(mem, "reserved", None) if mem is not None else None
        util = self._field(i, "utilization", "nvmlDeviceGetUtilizationRates", h)
        temp = self._field(i, "temperature", "nvmlDeviceGetTemperature", h, pynvml.NVML_TEMPERATURE_GPU)
        sm_clock = self._field(i, "clock_sm", "nvmlDeviceGetClockInfo", h, pynvml.NVML_CLOCK_SM)
        mem_clock = self._field(i, "clock_mem", "nvmlDeviceGetClockInfo", h, pynvml.NVML_CLOCK_MEM)
        # "Clocks event reasons" is the R535+ name of the throttle reasons.
        reasons = self._get(i, "clocks_event_reasons", ("nvmlDeviceGetCurrentClocksEventReasons", h),
                            ("nvmlDeviceGetCurrentClocksThrottleReasons", h))
        procs = self._processes(i, h, process_utilization) if processes or process_utilization else None
        gpm_values = self._gpm(i, h) if gpm else {}
        # Module scope equal to GPU scope means the board has no separate module sensor.
        if module is not None and instant is not None and module <= instant:
            module = None
        return GPUReading(
            timestamp=now,
            energy_mj=int(energy) if energy is not None else None,
            power_instant_mw=instant,
            power_average_mw=average,
            module_power_mw=module,
            power_limit_mw=float(limit) if limit is not None else None,
            memory_used_bytes=int(mem.used) if mem is not None else None,
            memory_total_bytes=int(mem.total) if mem is not None else None,
            memory_reserved_bytes=int(reserved) if reserved is not None else None,
            util_gpu_pct=float(util.gpu) if util is not None else None,
            util_memory_pct=float(util.memory) if util is not None else None,
            temperature_gpu_c=float(temp) if temp is not None else None,
            temperature_memory_c=mem_temp if mem_temp else None,
            clock_sm_mhz=float(sm_clock) if sm_clock is not None else None,
            clock_memory_mhz=float(mem_clock) if mem_clock is not None else None,
            clocks_event_reasons=int(reasons) if reasons is not None else None,
            processes=procs,
            gpm=gpm_values,
        )

    def _processes(self, i: int, h: Any, utilization: bool) -> tuple[GPUProcess, ...] | None:
        # pynvml's unversioned wrapper calls _v3 (R510+) and raises NVMLLibraryMismatchError without it.
        procs = self._get(i, "processes", ("nvmlDeviceGetComputeRunningProcesses", h),
                          ("nvmlDeviceGetComputeRunningProcesses_v3", h),
                          ("nvmlDeviceGetComputeRunningProcesses_v2", h))
        if procs is None:
            return None
        sm: dict[int, float] = {}
        if utilization and procs:
            last_seen = self._process_util_ts.get(i, 0)
            samples = self._field(i, "process_utilization", _process_utilization, h, last_seen)
            for s in samples or ():
                sm[int(s.pid)] = float(s.smUtil)
                self._process_util_ts[i] = max(self._process_util_ts.get(i, 0), int(s.timeStamp))
        return tuple(
            GPUProcess(
                pid=int(p.pid),
                used_memory_bytes=int(p.usedGpuMemory) if p.usedGpuMemory is not None else None,
                sm_util_pct=sm.get(int(p.pid)),
            )
            for p in procs
        )

    def _gpm(self, i: int, h: Any) -> dict[str, float]:
        supported = self._gpm_supported.get(i)
        if supported is None:
            support = self._field(i, "gpm_support", "nvmlGpmQueryDeviceSupport", h)
            supported = bool(support is not None and support.isSupportedDevice)
            self._gpm_supported[i] = supported
            if not supported:
                log.debug("GPU %d: GPM not supported (pre-Hopper GPU, older driver or vGPU); no GPM metrics", i)
        if not supported:
            return {}
        now = time.monotonic()
        prev = self._gpm_prev.get(i)
        if prev is not None and now - prev[0] < GPM_MIN_INTERVAL_S:
            return {}
        sample = self._field(i, "gpm_sample_alloc", "nvmlGpmSampleAlloc")
        if sample is None:
            return {}
        try:
            got = self._field(i, "gpm_sample", "nvmlGpmSampleGet", h, sample)
        except GPULost:
            self._free_gpm(i, sample)
            raise
        if got is None:
            self._free_gpm(i, sample)
            return {}
        self._gpm_prev[i] = (now, sample)
        if prev is None:
            return {}
        out: dict[str, float] = {}
        try:
            req = pynvml.c_nvmlGpmMetricsGet_t()
            req.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            req.numMetrics = len(GPM_METRICS)
            req.sample1 = prev[1]
            req.sample2 = sample
            for n, metric_id in enumerate(GPM_METRICS.values()):
                req.metrics[n].metricId = metric_id
            result = self._field(i, "gpm_metrics", "nvmlGpmMetricsGet", req)
            if result is not None:
                for n, name in enumerate(GPM_METRICS):
                    m = result.metrics[n]
                    if m.nvmlReturn == pynvml.NVML_SUCCESS:
                        out[name] = float(m.value)
        finally:
            self._free_gpm(i, prev[1])
        return out

    def _free_gpm(self, i: int, sample: Any) -> None:
        try:
            pynvml.nvmlGpmSampleFree(sample)
        except Exception as exc:  # noqa: BLE001 - a leak of one buffer is not worth a GPU
            log.debug("GPU %d: nvmlGpmSampleFree failed: %s", i, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for i, (_, sample) in self._gpm_prev.items():
            self._free_gpm(i, sample)
        self._gpm_prev.clear()
        try:
            pynvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001
            log.debug("nvmlShutdown: %s", exc)


def _process_utilization(h: Any, last_seen: int) -> Any:
    try:
        return pynvml.nvmlDeviceGetProcessUtilization(h, last_seen)
    except pynvml.NVMLError as exc:
        # NOT_FOUND: no process ran since last_seen; that is an empty list, not "unsupported".
        if getattr(exc, "value", None) == pynvml.NVML_ERROR_NOT_FOUND:
            return []
        raise


def _field_value(v: Any) -> float | None:
    """Decode an nvmlFieldValue_t union by its valueType."""
    t = v.valueType
    u = v.value
    if t == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return float(u.dVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return float(u.uiVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return float(u.ulVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return float(u.ullVal)
    if t == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return float(u.sllVal)
    if t == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
        return float(u.siVal)
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT:
        return float(u.usVal)
    return None


__all__ = ["NVMLBackend", "NotSupported", "load_library", "GPM_METRICS"]

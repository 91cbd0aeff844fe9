"""The NVML device backend: discovery of the GPUs and their readings, in base units.

``devices.nvml``, ``devices.nvml_calls`` and ``devices.nvml_gpm`` (and, for GPU health, ``devices.nvml_health``
and ``devices.nvml_events``) are the only modules of the package that import ``pynvml``.
Every NVML call goes through ``nvml_calls.NVMLCalls`` (one call loses at most its own reading, counted per
GPU, field and reason; only a lost GPU raises, as ``GPULost``, and the collector then marks that GPU alone).
This module decides which readings to take and what they mean: the energy method of each GPU, the power
fields, MIG, processes and GPM. On a real node every NVML call is a driver ioctl, so a sample makes as few as
it can (``tests/test_nvml_call_budget.py`` holds the budget): the power readings, the memory temperature and
the energy counter come from one ``nvmlDeviceGetFieldValues`` call, with each reading's own call where the
driver lacks the field or the batched call fails; ``nvmlDeviceGetPowerUsage`` only where no field gives its
reading; the running-process list in one call with a buffer kept per GPU (``nvml_calls.RunningProcesses``;
pynvml's wrapper makes two), and only when asked afresh, when the GPU's used memory moved or every
``PROCESS_LIST_INTERVAL_S``; GPM sample buffers are allocated once per GPU and reused. Vendor units stop
here: NVML's millijoules, milliwatts, percentages, MHz and clock-event bitmask become ``GPUReading`` in J,
W, ratios, Hz and reason names (``devices.base``).

This module must never be called from the scrape path: NVML calls can block for a long time on a sick
driver. The sampler thread calls it; ``/metrics`` reads the snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pynvml

from gpu_energy_exporter.core.errors import GPULost, NVMLUnavailable
from gpu_energy_exporter.core.state import (
    CLOCK_EVENT_REASONS,
    ENERGY_METHOD_COUNTER,
    ENERGY_METHOD_INTEGRATED_INSTANT,
    ENERGY_METHOD_INTEGRATED_USAGE,
    ENERGY_METHOD_NONE,
    GPUIdentity,
    GPUProcess,
    GPUReading,
    MIGDevice,
    ProcessSample,
)
from gpu_energy_exporter.devices.base import GPUBackend, HealthReader, hertz, joules, ratio, watts
from gpu_energy_exporter.devices.nvml_calls import (
    REASON_EXCEPTION,
    FieldValues,
    NVMLCalls,
    RunningProcesses,
    decode,
    init,
    load_library,
    process_utilization,
)
from gpu_energy_exporter.devices.nvml_gpm import GPM_METRICS, GPM_MIN_INTERVAL_S, GPMSampler

log = logging.getLogger(__name__)

_ARCHITECTURES = {
    2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere", 8: "ada",
    9: "hopper", 10: "blackwell", 13: "rubin",
}

#: nvmlDeviceGetFieldValues ids we read in one call per sample.
_FI_POWER_INSTANT = pynvml.NVML_FI_DEV_POWER_INSTANT
_FI_POWER_AVERAGE = pynvml.NVML_FI_DEV_POWER_AVERAGE
_FI_MEMORY_TEMP = pynvml.NVML_FI_DEV_MEMORY_TEMP
_FI_ENERGY = pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
_SCOPE_GPU = pynvml.NVML_POWER_SCOPE_GPU
_SCOPE_MODULE = pynvml.NVML_POWER_SCOPE_MODULE
#: (field id, scope) -> the field name used in errors and in gpuenergy_nvml_field_errors_total.
_FIELD_NAMES: dict[tuple[Any, ...], str] = {
    (_FI_POWER_INSTANT, _SCOPE_GPU): "power_instant_field",
    (_FI_POWER_AVERAGE, _SCOPE_GPU): "power_average_field",
    (_FI_MEMORY_TEMP, 0): "memory_temperature_field",
    (_FI_POWER_INSTANT, _SCOPE_MODULE): "module_power_field",
    (_FI_ENERGY, 0): "energy_field",
}
#: What a sample may ask nvmlDeviceGetFieldValues for: GPUs whose energy comes from the counter also ask for
#: the counter when it is due (field 83 is the value nvmlDeviceGetTotalEnergyConsumption returns), so a sample
#: makes one call where it made two; the memory temperature only when its slow cadence is due
#: (``SLOW_INTERVAL_S``). A field the driver answered NOT_SUPPORTED is left out of every later request (each
#: field asked costs the driver tens of microseconds: the module power of an H100 SXM, asked for nothing).
_F_INSTANT, _F_AVERAGE = (_FI_POWER_INSTANT, _SCOPE_GPU), (_FI_POWER_AVERAGE, _SCOPE_GPU)
_F_MEMORY_TEMP, _F_MODULE, _F_ENERGY = (_FI_MEMORY_TEMP, 0), (_FI_POWER_INSTANT, _SCOPE_MODULE), (_FI_ENERGY, 0)

#: A reading that fails transiently at discovery is asked this many times, this far apart.
_DISCOVERY_TRIES = 3
_DISCOVERY_RETRY_S = 0.05

#: Readings that change only when someone sets them or over many seconds are read at most this often per GPU
#: (seconds of the backend's clock) and held between reads: the enforced power limit (changes when someone
#: sets it), the memory clock (set by the driver's memory P-state, fixed under load on datacenter GPUs) and
#: the memory (HBM) temperature (a thermal mass: degrees over tens of seconds). Each was a call or a field per
#: GPU per sample. Power, utilisation, the SM clock, clock events and the GPU temperature stay every sample.
SLOW_INTERVAL_S = 10.0
LIMIT_INTERVAL_S = SLOW_INTERVAL_S

#: The running-process list (one call per GPU, about 90 µs of driver CPU on an H100: the largest per-second call
#: after the power fields) is read afresh when the caller asks (``read(fresh_processes=True)``: the GPU collector
#: asks at every read of the GPU's energy counter, which a run's, job's or pod's edge triggers, and whenever it
#: asks for per-process utilisation), when the GPU's used memory changed since the list was read (a process
#: cannot start or end on a GPU without its memory moving: a CUDA context takes hundreds of MB), and at least
#: this often (seconds of the backend's clock); between, the list last read is served (docs/measurement.md).
PROCESS_LIST_INTERVAL_S = 5.0

#: NVML's clock-event (throttle) reason bits, by the name a reading reports (``core.state.CLOCK_EVENT_REASONS``).
_CLOCK_EVENT_BITS: dict[str, int] = dict(zip(CLOCK_EVENT_REASONS, (
    0x1, 0x2, 0x4, 0x8, 0x10, 0x20, 0x40, 0x80, 0x100,
), strict=True))


class NVMLBackend(GPUBackend):
    """GPUs through NVML. Construct with ``NVMLBackend(library_path)``; raises ``NVMLUnavailable``."""

    kind = "nvml"

    def __init__(self, library_path: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        load_library(library_path)
        init()
        self._nvml = NVMLCalls()
        self._closed = False
        self._gpm = GPMSampler(self._nvml)
        self._process_util_ts: dict[int, int] = {}
        self._mig_instances: dict[int, dict[tuple[int, int], str]] = {}  # GPU -> (GI, CI) -> MIG uuid
        self._field_requests: dict[tuple[int, tuple[Any, ...]], FieldValues] = {}  # read()'s, per GPU and fields
        self._held: dict[tuple[int, str], tuple[float, Any]] = {}  # (GPU, reading) -> (when read, value): slow
        self._process_lists: dict[int, tuple[RunningProcesses, RunningProcesses]] = {}  # _v3, _v2 per GPU
        # GPU -> (when read, the GPU's used memory then, the list without SM figures): the list served between reads
        self._listed: dict[int, tuple[float, int | None, tuple[GPUProcess, ...]]] = {}
        self._driver = NVMLCalls.call_global("", "nvmlSystemGetDriverVersion")
        self._nvml_version = NVMLCalls.call_global("", "nvmlSystemGetNVMLVersion")
        cuda = NVMLCalls.call_global(0, "nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion")
        self._cuda_version = f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda else ""

    def field_errors(self) -> dict[tuple[int, str, str], int]:
        """Failed readings so far: ``(gpu index, field, reason) -> count`` (a copy)."""
        return self._nvml.field_errors()

    def call_costs(self) -> dict[str, tuple[int, float]]:
        return self._nvml.call_costs()

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
        h = self._nvml.handle(index)
        uuid = decode(self._nvml.field(index, "uuid", "nvmlDeviceGetUUID", h) or f"unknown-{index}")
        name = decode(self._nvml.field(index, "name", "nvmlDeviceGetName", h) or "unknown")
        pci = self._nvml.field(index, "pci", "nvmlDeviceGetPciInfo", h)
        pci_bus_id = decode(pci.busId) if pci is not None else ""
        arch_code = self._nvml.field(index, "architecture", "nvmlDeviceGetArchitecture", h)
        arch = _ARCHITECTURES.get(arch_code, "unknown") if arch_code is not None else "unknown"
        cc = self._nvml.field(index, "compute_capability", "nvmlDeviceGetCudaComputeCapability", h)
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
             lambda: self._nvml.field(index, "energy", "nvmlDeviceGetTotalEnergyConsumption", h)),
            ("power_instant_field", ENERGY_METHOD_INTEGRATED_INSTANT, lambda: self._instant_field(index, h)),
            ("power_usage", ENERGY_METHOD_INTEGRATED_USAGE,
             lambda: self._nvml.field(index, "power_usage", "nvmlDeviceGetPowerUsage", h)),
        ):
            for attempt in range(_DISCOVERY_TRIES):
                if read() is not None:
                    return method
                if self._nvml.unsupported(index, what) or (what == "power_instant_field"
                                                           and self._nvml.unsupported(index, "field_values")):
                    break  # the driver says it does not exist here: next method
                if attempt + 1 < _DISCOVERY_TRIES:
                    time.sleep(_DISCOVERY_RETRY_S)
            else:
                log.warning("GPU %d: %s kept failing at start-up; still using it for energy (its readings are "
                            "left out while they fail)", index, what)
                return method
        return ENERGY_METHOD_NONE

    def _mig(self, index: int, h: Any, uuid: str) -> tuple[bool, tuple[MIGDevice, ...]]:
        mode = self._nvml.field(index, "mig_mode", "nvmlDeviceGetMigMode", h)
        if not mode or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return False, ()
        devices = []
        count = self._nvml.field(index, "mig_count", "nvmlDeviceGetMaxMigDeviceCount", h) or 0
        for mig_index in range(count):
            try:
                mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, mig_index)
                mig_uuid = decode(pynvml.nvmlDeviceGetUUID(mh))
            except pynvml.NVMLError as exc:
                if getattr(exc, "value", None) == pynvml.NVML_ERROR_NOT_FOUND:
                    continue  # an empty MIG slot
                self._nvml.lose(index, "mig_device", self._nvml.classify(index, "mig_device", exc), str(exc))
                continue
            except Exception as exc:  # noqa: BLE001
                self._nvml.lose(index, "mig_device", REASON_EXCEPTION, f"{type(exc).__name__}: {exc}")
                continue
            attrs = self._nvml.field(index, "mig_attributes", "nvmlDeviceGetAttributes_v2", mh)
            gi = self._nvml.field(index, "mig_gpu_instance", "nvmlDeviceGetGpuInstanceId", mh)
            ci = self._nvml.field(index, "mig_compute_instance", "nvmlDeviceGetComputeInstanceId", mh)
            devices.append(MIGDevice(
                uuid=mig_uuid, parent_uuid=uuid, index=mig_index,
                gpu_instance_slices=int(attrs.gpuInstanceSliceCount) if attrs is not None else 0,
                compute_instance_slices=int(attrs.computeInstanceSliceCount) if attrs is not None else 0,
                multiprocessor_count=int(attrs.multiprocessorCount) if attrs is not None else 0,
                gpu_instance_id=int(gi) if gi is not None else -1,
                compute_instance_id=int(ci) if ci is not None else -1,
            ))
            if gi is not None and ci is not None:
                self._mig_instances.setdefault(index, {})[(int(gi), int(ci))] = mig_uuid
        if devices:
            # The whole GPU's SMs, where the driver answers on the parent (MFU's share of the GPU).
            whole = self._nvml.field(index, "attributes", "nvmlDeviceGetAttributes_v2", h)
            sms = int(whole.multiprocessorCount) if whole is not None else 0
            devices = [replace(d, parent_multiprocessor_count=sms) for d in devices]
        return True, tuple(devices)

    # ------------------------------------------------------------------------------------------------
    # sampling

    def _instant_field(self, index: int, h: Any) -> float | None:
        if self._nvml.unsupported(index, "power_instant_field") or self._nvml.unsupported(index, "field_values"):
            return None
        (value,) = self._nvml.field_values(index, h, [(_FI_POWER_INSTANT, _SCOPE_GPU)], _FIELD_NAMES)
        return value

    def read_power_w(self, gpu: GPUIdentity) -> float | None:
        h = self._nvml.handle(gpu.index)
        if gpu.energy_method == ENERGY_METHOD_INTEGRATED_INSTANT:
            mw = self._instant_field(gpu.index, h)
        else:
            usage = self._nvml.field(gpu.index, "power_usage", "nvmlDeviceGetPowerUsage", h)
            mw = float(usage) if usage is not None else None
        return watts(mw) if mw is not None else None

    def read(self, gpu: GPUIdentity, *, processes: bool = False, process_utilization: bool = False,
             gpm: bool = False, energy: bool = True, fresh_processes: bool = True) -> GPUReading:
        i = gpu.index
        h = self._nvml.handle(i)
        now = self._clock()
        # The energy counter costs about 4 ms of CPU a read on a real driver (the other fields microseconds):
        # it is asked only when the caller's schedule asks for it (``energy``).
        with_energy = (energy and gpu.energy_method == ENERGY_METHOD_COUNTER
                       and not self._nvml.unsupported(i, "energy_field"))
        mem_temp_due, mem_temp = self._slow(i, "memory_temperature_field", now)
        wanted = [f for f, ask in ((_F_INSTANT, True), (_F_AVERAGE, True), (_F_MEMORY_TEMP, mem_temp_due),
                                   (_F_MODULE, True), (_F_ENERGY, with_energy))
                  if ask and not self._nvml.unsupported(i, _FIELD_NAMES[f])]
        got: dict[tuple[int, int], float | None] = {}
        fields_at = None
        if wanted:
            key = (i, tuple(wanted))
            request = self._field_requests.get(key)
            if request is None:
                request = self._field_requests[key] = FieldValues(wanted, self._clock)
            got = dict(zip(wanted, self._nvml.field_values(i, h, wanted, _FIELD_NAMES, request), strict=True))
            fields_at = request.read_at
        instant, average, module = got.get(_F_INSTANT), got.get(_F_AVERAGE), got.get(_F_MODULE)
        if mem_temp_due:
            mem_temp = self._hold(i, "memory_temperature_field", now, got.get(_F_MEMORY_TEMP))
        counter = got.get(_F_ENERGY)
        if counter is None and energy:
            # No field values (R470), no field 83, or the batched call failed this time: the counter's own
            # call, so one failing call still loses only its own readings. (Not asked again where the driver
            # said it has no counter.) Timed by the call, as the batched read is.
            before = self._clock()
            counter = self._nvml.field(i, "energy", "nvmlDeviceGetTotalEnergyConsumption", h)
            if counter is not None:
                fields_at = 0.5 * (before + self._clock())
        # nvmlDeviceGetPowerUsage is the 1 s average or the instant reading (``power_usage_is_average``): asked
        # only when the field values did not give that reading.
        if (average if gpu.power_usage_is_average else instant) is None:
            usage = self._nvml.field(i, "power_usage", "nvmlDeviceGetPowerUsage", h)
            if usage is not None:
                if gpu.power_usage_is_average:
                    average = float(usage)
                else:
                    instant = float(usage)
        limit = self._power_limit(i, h, now)
        # v2 reports reserved memory apart (R510+); v1 counts it as used.
        mem = self._nvml.get(i, "memory", ("nvmlDeviceGetMemoryInfo", h, pynvml.nvmlMemory_v2),
                             ("nvmlDeviceGetMemoryInfo", h))
        reserved = getattr(mem, "reserved", None) if mem is not None else None
        util = self._nvml.field(i, "utilization", "nvmlDeviceGetUtilizationRates", h)
        temp = self._nvml.field(i, "temperature", "nvmlDeviceGetTemperature", h, pynvml.NVML_TEMPERATURE_GPU)
        sm_clock = self._nvml.field(i, "clock_sm", "nvmlDeviceGetClockInfo", h, pynvml.NVML_CLOCK_SM)
        mem_clock_due, mem_clock = self._slow(i, "clock_mem", now)
        if mem_clock_due:
            mem_clock = self._hold(i, "clock_mem", now, self._nvml.field(i, "clock_mem", "nvmlDeviceGetClockInfo", h,
                                                                         pynvml.NVML_CLOCK_MEM))
        # "Clocks event reasons" is the R535+ name of the throttle reasons.
        reasons = self._nvml.get(i, "clocks_event_reasons", ("nvmlDeviceGetCurrentClocksEventReasons", h),
                                 ("nvmlDeviceGetCurrentClocksThrottleReasons", h))
        if process_utilization or (processes and (fresh_processes or self._list_due(i, now, mem))):
            procs, samples = self._processes(i, h, process_utilization, now, mem)
        else:
            procs, samples = (self._listed[i][2] if processes else None), ()
        gpm_values = self._gpm.read(i, h) if gpm else {}
        # Module scope equal to GPU scope means the board has no separate module sensor.
        if module is not None and instant is not None and module <= instant:
            module = None
        return GPUReading(
            timestamp=now,
            energy_j=joules(int(counter)) if counter is not None else None,
            power_instant_w=watts(instant) if instant is not None else None,
            power_average_w=watts(average) if average is not None else None,
            module_power_w=watts(module) if module is not None else None,
            power_limit_w=watts(float(limit)) if limit is not None else None,
            memory_used_bytes=int(mem.used) if mem is not None else None,
            memory_total_bytes=int(mem.total) if mem is not None else None,
            memory_reserved_bytes=int(reserved) if reserved is not None else None,
            util_gpu_ratio=ratio(float(util.gpu)) if util is not None else None,
            util_memory_ratio=ratio(float(util.memory)) if util is not None else None,
            temperature_gpu_c=float(temp) if temp is not None else None,
            temperature_memory_c=mem_temp if mem_temp else None,
            clock_sm_hz=hertz(float(sm_clock)) if sm_clock is not None else None,
            clock_memory_hz=hertz(float(mem_clock)) if mem_clock is not None else None,
            clock_events=_clock_events(int(reasons)) if reasons is not None else None,
            processes=procs,
            gpm=gpm_values,
            process_samples=samples,
            fields_at=fields_at,
        )

    # -- readings that seldom change: read at a slow cadence ------------------------------------------

    def _slow(self, i: int, what: str, now: float) -> tuple[bool, Any]:
        """``(due, held value)`` of a reading read every ``SLOW_INTERVAL_S`` of ``now``: due when never read,
        when its last read failed, when the interval has passed, or when the clock stepped back (read again
        rather than hold for ever)."""
        held = self._held.get((i, what))
        if held is not None and 0.0 <= now - held[0] < SLOW_INTERVAL_S:
            return False, held[1]
        return True, None

    def _hold(self, i: int, what: str, now: float, value: Any) -> Any:
        """Keep ``value`` read at ``now`` until the next read is due; a failed read (None) is not held, so it is
        asked again at the next sample."""
        if value is None:
            self._held.pop((i, what), None)
        else:
            self._held[(i, what)] = (now, value)
        return value

    def _power_limit(self, i: int, h: Any, now: float) -> Any:
        """The enforced power limit (mW), read at most every ``SLOW_INTERVAL_S`` per GPU and held between: it
        changes only when someone sets it (``nvidia-smi -pl``, a power-capping policy), and it was one of the
        calls every sample made for every GPU."""
        due, limit = self._slow(i, "power_limit", now)
        if not due:
            return limit
        return self._hold(i, "power_limit", now,
                          self._nvml.field(i, "power_limit", "nvmlDeviceGetEnforcedPowerLimit", h))

    def _list_due(self, i: int, now: float, mem: Any) -> bool:
        """Whether GPU ``i``'s process list must be read now rather than served from the last read
        (``PROCESS_LIST_INTERVAL_S``): never read, or its last read failed; the interval passed, or the clock
        stepped back; the GPU's used memory changed since, or cannot be read now."""
        listed = self._listed.get(i)
        if listed is None or mem is None or int(mem.used) != listed[1]:
            return True
        return not 0.0 <= now - listed[0] < PROCESS_LIST_INTERVAL_S

    def _processes(self, i: int, h: Any, utilization: bool, now: float, mem: Any
                   ) -> tuple[tuple[GPUProcess, ...] | None, tuple[ProcessSample, ...]]:
        """The processes listed on GPU ``i`` and, when ``utilization`` asks, the per-process SM samples NVML
        gave since the last ask (each covering the time since the sample before it of the same process, or
        since the last ask; wall-clock seconds). The list (without SM figures) is kept with ``now`` and the
        GPU's used memory ``mem`` for the samples that serve it (``_list_due``)."""
        # _v3 (R510+), else _v2, each in one call with a buffer kept per GPU (pynvml's wrappers make two).
        lists = self._process_lists.get(i)
        if lists is None:
            lists = self._process_lists[i] = (RunningProcesses("nvmlDeviceGetComputeRunningProcesses_v3"),
                                              RunningProcesses("nvmlDeviceGetComputeRunningProcesses_v2"))
        procs = self._nvml.get(i, "processes", (lists[0], h), (lists[1], h))
        if procs is None:
            self._listed.pop(i, None)  # asked again at the next sample
            return None, ()
        sm: dict[int, float] = {}
        found: list[ProcessSample] = []
        if utilization and procs:
            last_seen = self._process_util_ts.get(i, 0)
            samples = self._nvml.field(i, "process_utilization", process_utilization, h, last_seen)
            # Every sample since the last call: a driver answers one mean per process over the time since
            # `last_seen` (R535-R580), or one sample per process and sampling period; each covers the time
            # since the one before it. Their mean per pid is the process's SM use over the whole period.
            seen: dict[int, list[float]] = {}
            begun: dict[int, float] = {}
            first = last_seen / 1e6 if last_seen else None
            for s in sorted(samples or (), key=lambda x: int(x.timeStamp)):
                pid, ts, util = int(s.pid), int(s.timeStamp), float(s.smUtil)
                seen.setdefault(pid, []).append(util)
                end = ts / 1e6
                start = begun.get(pid, first if first is not None else end)
                found.append(ProcessSample(pid, util, min(start, end), end))
                begun[pid] = end
                self._process_util_ts[i] = max(self._process_util_ts.get(i, 0), ts)
            sm = {pid: sum(v) / len(v) for pid, v in seen.items()}
        instances = self._mig_instances.get(i, {})
        listed = tuple(
            GPUProcess(
                pid=int(p.pid),
                used_memory_bytes=int(p.usedGpuMemory) if p.usedGpuMemory is not None else None,
                mig_uuid=instances.get((int(p.gpuInstanceId), int(p.computeInstanceId)), ""),
            )
            for p in procs
        )
        self._listed[i] = (now, int(mem.used) if mem is not None else None, listed)
        if sm:
            # Listed, but no sample since the last call while others have one: it used no SMs then.
            listed = tuple(replace(p, sm_util_pct=sm.get(p.pid, 0.0)) for p in listed)
        return listed, tuple(found)

    def health_reader(self) -> HealthReader:
        """ECC, remapping, PCIe, NVLink and Xid events (``devices.nvml_health``), sharing this backend's
        error counts."""
        from gpu_energy_exporter.devices.nvml_health import NVMLHealth

        return NVMLHealth(self._nvml, self._clock)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._gpm.close()
        try:
            pynvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001
            log.debug("nvmlShutdown: %s", exc)


def _clock_events(mask: int) -> frozenset[str]:
    return frozenset(name for name, bit in _CLOCK_EVENT_BITS.items() if mask & bit)


__all__ = ["NVMLBackend", "GPM_METRICS", "GPM_MIN_INTERVAL_S"]

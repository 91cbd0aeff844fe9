"""The per-GPU series: their specs, and a reading turned into samples.

Pure: ``emit_reading`` adds one ``core.state.GPUReading`` (already in base units) to the families of one
sample; it never converts a unit, never reads a clock and never calls NVML. The energy counter's series
are emitted by ``collectors.gpu_tracks`` (they depend on the plausibility filter), the rest of the
collector's work (NVML availability, discovery, isolation of failures) is ``collectors.gpu``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from gpu_energy_exporter.core.energy import REJECT_REASONS
from gpu_energy_exporter.core.metrics import GPU_LABELS, Kind, MetricSpec, add, define
from gpu_energy_exporter.core.state import CLOCK_EVENT_REASONS, GPUReading

_G = GPU_LABELS


def _gpu(name: str, kind: Kind, help: str, extra: tuple[str, ...] = (), unit: str = "") -> MetricSpec:
    return define("gpu", name, kind, help, _G + extra, collector="gpu", unit=unit)


NVML_AVAILABLE = define(
    "nvml", "available", "gauge",
    "1 if NVML initialised; 0 with the reason label (driver_not_loaded, library_not_found, no_permission, "
    "...) if not.", ["reason"], collector="gpu",
)
NVML_INFO = define(
    "nvml", "info", "info", "NVML and driver versions.",
    ["driver_version", "nvml_version", "cuda_driver_version", "backend"], collector="gpu",
)
GPU_INFO = _gpu(
    "info", "info",
    "GPU identity: model, driver, PCI bus id, architecture, how energy is measured (energy_method: counter "
    "| integrated_instant_power | integrated_power_usage | none), MIG mode and the data source (backend: "
    "nvml, or simulated for the demo).",
    ("model", "driver_version", "pci_bus_id", "architecture", "compute_capability", "energy_method",
     "mig_mode", "backend"),
)
GPU_UP = _gpu("up", "gauge", "1 if the GPU answered the last sample, 0 if it is lost or failing.")
ENERGY = _gpu(
    "energy_joules_total", "counter",
    "Energy consumed by the GPU. NVML's energy counter as the driver keeps it (since driver load; a driver "
    "reload restarts it, a counter reset that rate() and increase() handle), implausible readings held back; "
    "or, without a counter, trapezoid integration of sampled instant power since exporter start.",
    unit="joules",
)
ENERGY_RESETS = _gpu(
    "energy_resets_total", "counter",
    "Confirmed resets of the NVML energy counter (driver reload, GPU reset): it restarted near zero and "
    "the next reading grew from there at a plausible power.",
)
ENERGY_REJECTED = _gpu(
    "energy_rejected_readings_total", "counter",
    "Energy counter readings held back as implausible, by reason: decrease (below the last accepted value "
    "and not a restarted counter), jump (rose faster than the GPU can draw), unconfirmed (a first reading "
    "the next one contradicted).",
    ("reason",),
)
POWER = _gpu(
    "power_watts", "gauge",
    "Instant power draw (NVML_FI_DEV_POWER_INSTANT, or nvmlDeviceGetPowerUsage on GPUs where it is instant). "
    "On A100/H100 it reflects ~25 ms of every 100 ms: use the energy counter for energy.",
    unit="watts",
)
POWER_AVERAGE = _gpu(
    "power_average_watts", "gauge",
    "Power averaged by the driver over ~1 s (NVML_FI_DEV_POWER_AVERAGE, or nvmlDeviceGetPowerUsage on Ampere "
    "and newer except GA100).",
    unit="watts",
)
MODULE_POWER = _gpu(
    "module_power_watts", "gauge",
    "Grace Hopper module power (GPU + Grace CPU + memory). Includes the GPU's power: never add it to "
    "gpuenergy_gpu_power_watts.",
    unit="watts",
)
POWER_LIMIT = _gpu("power_limit_watts", "gauge", "Enforced power limit.", unit="watts")
MEM_USED = _gpu("memory_used_bytes", "gauge", "Framebuffer memory in use.", unit="bytes")
MEM_TOTAL = _gpu("memory_total_bytes", "gauge", "Framebuffer memory size.", unit="bytes")
MEM_RESERVED = _gpu(
    "memory_reserved_bytes", "gauge", "Framebuffer memory reserved by the driver and firmware.", unit="bytes"
)
UTIL = _gpu(
    "utilization_ratio", "gauge",
    "Fraction of the last sample period in which one or more kernels ran (NVML time-active utilisation; "
    "not SM occupancy: see sm_active_ratio).",
)
MEM_UTIL = _gpu(
    "memory_utilization_ratio", "gauge", "Fraction of the last sample period the memory controller was busy."
)
TEMP = _gpu("temperature_celsius", "gauge", "GPU die temperature.", unit="celsius")
MEM_TEMP = _gpu("memory_temperature_celsius", "gauge", "HBM memory temperature.", unit="celsius")
SM_CLOCK = _gpu("sm_clock_hertz", "gauge", "Current SM clock.", unit="hertz")
MEM_CLOCK = _gpu("memory_clock_hertz", "gauge", "Current memory clock.", unit="hertz")
CLOCK_EVENT = _gpu(
    "clock_event_active", "gauge",
    "1 while the clock-event (throttle) reason is active: gpu_idle, applications_clocks_setting, "
    "sw_power_cap, hw_slowdown, sync_boost, sw_thermal_slowdown, hw_thermal_slowdown, "
    "hw_power_brake_slowdown, display_clock_setting.",
    ("reason",),
)
GPM_SPECS = {
    "graphics_active": _gpu(
        "graphics_active_ratio", "gauge", "GPM: fraction of time any graphics/compute engine was active."),
    "sm_active": _gpu("sm_active_ratio", "gauge", "GPM: fraction of SMs busy (averaged over time and SMs)."),
    "sm_occupancy": _gpu(
        "sm_occupancy_ratio", "gauge", "GPM: resident warps as a fraction of the theoretical maximum."),
    "tensor_active": _gpu(
        "tensor_active_ratio", "gauge", "GPM: fraction of time the SMs issued any tensor-core instruction."),
    "dram_bandwidth": _gpu(
        "dram_bandwidth_utilization_ratio", "gauge", "GPM: DRAM bandwidth used as a fraction of the peak."),
}
PROCESS_MEMORY = _gpu(
    "process_memory_used_bytes", "gauge",
    "GPU memory used by each compute process (opt-in: --collector.processes; pid label is high-cardinality).",
    ("pid",), unit="bytes",
)
COMPUTE_PROCESSES = _gpu(
    "compute_processes", "gauge",
    "Number of compute processes on the GPU (read while the idle baseline is learned, or with "
    "--collector.processes).",
)
FIELD_ERRORS = define(
    "nvml", "field_errors_total", "counter",
    "NVML readings that could not be had, per GPU, field and reason. not_supported and function_not_found "
    "(the GPU or driver lacks it, after falling back to older function versions) are asked once, so count 1; "
    "no_data (NO_DATA, NOT_READY: nothing to read this time), nvml_error and exception are retried every "
    "sample. The other readings go on either way.",
    _G + ("field", "reason"), collector="gpu",
)
NVML_CALLS = define(
    "nvml", "calls_total", "counter",
    "NVML calls the exporter made, per NVML function (failed calls included): with "
    "gpuenergy_nvml_call_seconds_total, what sampling costs on this driver.",
    ["function"], collector="gpu",
)
NVML_CALL_SECONDS = define(
    "nvml", "call_seconds_total", "counter",
    "CPU time the exporter's threads spent inside NVML calls, per NVML function (the calling thread's CPU "
    "clock around each call). On an H100 with driver 580 the energy counter costs about 3.5 ms a read, "
    "GPM metrics about 1.9 ms, per-process utilisation about 2 ms, most other readings 7-90 microseconds "
    "(docs/benchmarks.md).",
    ["function"], collector="gpu", unit="seconds",
)
IDLE_POWER = _gpu(
    "idle_power_watts", "gauge",
    "Idle power baseline: learned (20th percentile of power while no compute process ran) or from "
    "--gpu.idle-power. Dynamic energy = energy - idle power x time.",
    ("source",), unit="watts",
)

PER_GPU_SPECS = [
    GPU_UP, ENERGY, ENERGY_RESETS, ENERGY_REJECTED, POWER, POWER_AVERAGE, MODULE_POWER, POWER_LIMIT, MEM_USED,
    MEM_TOTAL, MEM_RESERVED, UTIL, MEM_UTIL, TEMP, MEM_TEMP, SM_CLOCK, MEM_CLOCK, CLOCK_EVENT, *GPM_SPECS.values(),
    PROCESS_MEMORY, COMPUTE_PROCESSES, IDLE_POWER,
]

@dataclass(frozen=True)
class GPULabelSets:
    """One GPU's label sets, built once and shared by its samples in every snapshot (never mutated): the GPU
    labels, and those with each clock-event reason and each energy rejection reason."""

    base: dict[str, str]
    clock_event: dict[str, dict[str, str]]
    rejected: dict[str, dict[str, str]]


@lru_cache(maxsize=256)
def label_sets(gpu: str, uuid: str) -> GPULabelSets:
    base = dict(zip(_G, (gpu, uuid), strict=True))
    return GPULabelSets(base, {reason: {**base, "reason": reason} for reason in CLOCK_EVENT_REASONS},
                        {reason: {**base, "reason": reason} for reason in REJECT_REASONS})


def put(fams: dict[str, Metric], spec: MetricSpec, labels: dict[str, str], value: float,
        timestamp: float | None = None) -> None:
    """Append one sample of a gauge or counter (``spec.name`` is the exposed sample name) exactly as
    ``core.metrics.add`` builds it, with a label set from ``label_sets``: this runs for every GPU at every
    sample."""
    fams[spec.name].samples.append(Sample(spec.name, labels, float(value), timestamp))


#: The gauges of a reading that are one sample each: (exposed name, GPUReading attribute), in emit order.
_READING_GAUGES: tuple[tuple[str, str], ...] = tuple((spec.name, attr) for spec, attr in (
    (POWER, "power_instant_w"), (POWER_AVERAGE, "power_average_w"), (MODULE_POWER, "module_power_w"),
    (POWER_LIMIT, "power_limit_w"), (MEM_USED, "memory_used_bytes"), (MEM_TOTAL, "memory_total_bytes"),
    (MEM_RESERVED, "memory_reserved_bytes"), (UTIL, "util_gpu_ratio"), (MEM_UTIL, "util_memory_ratio"),
    (TEMP, "temperature_gpu_c"), (MEM_TEMP, "temperature_memory_c"), (SM_CLOCK, "clock_sm_hz"),
    (MEM_CLOCK, "clock_memory_hz"),
))
_GPM_GAUGES: tuple[tuple[str, str], ...] = tuple((key, spec.name) for key, spec in GPM_SPECS.items())


@lru_cache(maxsize=256)
def _last_samples(gpu: str, uuid: str) -> dict[str, Sample]:
    """The last gauge samples emitted for one GPU, by name (``emit_reading`` runs on one thread)."""
    return {}


@lru_cache(maxsize=256)
def _clock_event_samples(gpu: str, uuid: str) -> tuple[tuple[str, Sample, Sample], ...]:
    """Each clock-event reason's two possible samples for one GPU, (reason, active, inactive): built once and
    shared by every snapshot (a sample is an immutable tuple), instead of nine new samples per GPU per
    sample."""
    name = CLOCK_EVENT.name
    return tuple((reason, Sample(name, labels, 1.0, None), Sample(name, labels, 0.0, None))
                 for reason, labels in label_sets(gpu, uuid).clock_event.items())


#: GPU label sets -> (the GPM figures last emitted, their samples). The collector serves the same dict between
#: two GPM samples (--collector.gpm-interval), so its samples are built once per GPM sample, not per sample.
_GPM_SAMPLES: dict[tuple[str, str], tuple[Mapping[str, float], list[tuple[str, Sample]]]] = {}


def _gpm_samples(gpu: str, uuid: str, gpm: Mapping[str, float]) -> list[tuple[str, Sample]]:
    held = _GPM_SAMPLES.get((gpu, uuid))
    if held is not None and held[0] is gpm:
        return held[1]
    base = label_sets(gpu, uuid).base
    samples = [(name, Sample(name, base, float(gpm[key]), None)) for key, name in _GPM_GAUGES
               if gpm.get(key) is not None]
    if len(_GPM_SAMPLES) >= 256:  # bounded as label_sets is
        _GPM_SAMPLES.clear()
    _GPM_SAMPLES[(gpu, uuid)] = (gpm, samples)
    return samples


def emit_reading(fams: dict[str, Metric], r: GPUReading, labels: list[str], *, processes: bool,
                 gpm: Mapping[str, float] | None = None) -> None:
    """The samples of one good reading (all but energy and idle power). ``processes``: with the
    per-process memory series (``--collector.processes``). ``gpm``: the GPM figures to serve (the last GPM
    sample's, where this reading took none; None: the reading's own).

    Samples are appended as ``put`` builds them, with label sets made once per GPU, from a table of the
    reading's gauges (this runs for every GPU at every sample)."""
    sets = label_sets(labels[0], labels[1])
    base = sets.base
    # A gauge whose value did not change since the last sample (memory total, limit, clocks, temperature
    # mostly) reuses that sample's immutable tuple: fewer objects made here and freed with the old snapshot.
    last = _last_samples(labels[0], labels[1])
    for name, attr in _READING_GAUGES:
        value = getattr(r, attr)
        if value is not None:
            value = float(value)
            sample = last.get(name)
            if sample is None or sample.value != value:
                sample = last[name] = Sample(name, base, value, None)
            fams[name].samples.append(sample)
    if r.clock_events is not None:
        events = r.clock_events
        fams[CLOCK_EVENT.name].samples.extend(
            active if reason in events else inactive
            for reason, active, inactive in _clock_event_samples(labels[0], labels[1]))
    if gpm is None:
        gpm = r.gpm
    if gpm:
        for name, sample in _gpm_samples(labels[0], labels[1], gpm):
            fams[name].samples.append(sample)
    if r.processes is not None:
        put(fams, COMPUTE_PROCESSES, base, float(len(r.processes)))
        if processes:
            for p in r.processes:
                if p.used_memory_bytes is not None:
                    add(fams[PROCESS_MEMORY.name], [*labels, str(p.pid)], p.used_memory_bytes)

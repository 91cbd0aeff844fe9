"""Per-GPU metrics: energy, power, memory, utilisation, temperature, clocks, throttling, GPM, processes.

Runs on the sampler thread. Energy per GPU comes from NVML's energy counter where the GPU has one
(Volta and newer), every reading checked for plausibility before it is exposed (``energy.EnergyCounter``:
bad readings are held back and counted, driver resets confirmed before they show); otherwise from a fast
power sampler thread (``PowerSampler``) integrating instant power with the trapezoid rule. Which method a
GPU uses is the ``energy_method`` label of ``gpuenergy_gpu_info``. The energy counter carries no explicit
sample timestamp unless ``--collector.gpu.energy-timestamps`` asks for one.

NVML being unavailable (no driver, no library) is reported once in the log and continuously as
``gpuenergy_nvml_available{reason} 0``; the collector retries NVML periodically so a driver that loads
after the exporter is picked up. A lost GPU shows as ``gpuenergy_gpu_up 0`` and loses only its own
series. Conversions to base units (mJ -> J, mW -> W, MHz -> Hz, % -> ratio) happen here and only here.

Failures are isolated at the finest grain: a reading the backend cannot get is left out (and counted in
``gpuenergy_nvml_field_errors_total``), and anything one GPU's sample raises marks that GPU alone
(``gpuenergy_gpu_up 0``, its energy counter held at the last value); the other GPUs are served as usual.
The running processes are read only when something uses them: the ``processes`` collector, the learned idle
baseline (no ``--gpu.idle-power``) and, with SM utilisation per process, SM-weighted pod attribution.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from gpu_energy_exporter import __version__
from gpu_energy_exporter.collectors.base import Collector, NoData
from gpu_energy_exporter.core.energy import REJECT_REASONS, EnergyCounter, TrapezoidIntegrator, Verdict
from gpu_energy_exporter.core.errors import GPULost, NVMLUnavailable
from gpu_energy_exporter.core.metrics import GPU_LABELS, Kind, MetricSpec, add, define
from gpu_energy_exporter.devices.base import (
    ENERGY_METHOD_COUNTER,
    ENERGY_METHOD_NONE,
    GPUBackend,
    GPUIdentity,
    GPUReading,
)
from gpu_energy_exporter.engine.sampler import GPUState

log = logging.getLogger(__name__)

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
GPU_SAMPLE_AGE = _gpu(
    "last_sample_age_seconds", "gauge", "Seconds since the last good sample of this GPU (computed at scrape).",
    unit="seconds",
)
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
IDLE_POWER = _gpu(
    "idle_power_watts", "gauge",
    "Idle power baseline: learned (20th percentile of power while no compute process ran) or from "
    "--gpu.idle-power. Dynamic energy = energy - idle power x time.",
    ("source",), unit="watts",
)
BUILD_INFO = define(
    "build", "info", "info", "Exporter version and Python runtime.", ["version", "python_version"],
    collector="exporter",
)

CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


class IdleBaseline:
    """Learn a GPU's idle power from samples taken while no compute process runs.

    Uses the 20th percentile of the most recent idle samples: a GPU that just finished a job stays at a
    high performance state for a while, and a low percentile ignores that tail without trusting a single
    outlier.
    """

    def __init__(self, window: int = 600, min_samples: int = 10) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self._min = min_samples
        self._value: float | None = None
        self._dirty = 0

    def add(self, watts: float) -> None:
        self._samples.append(watts)
        self._dirty += 1

    @property
    def value(self) -> float | None:
        if len(self._samples) < self._min:
            return None
        if self._value is None or self._dirty >= 10:
            ordered = sorted(self._samples)
            self._value = ordered[int(0.2 * (len(ordered) - 1))]
            self._dirty = 0
        return self._value


@dataclass
class _Track:
    """Mutable per-GPU state, touched only by the sampler thread (the integrator also by PowerSampler)."""

    identity: GPUIdentity
    counter: EnergyCounter = field(default_factory=EnergyCounter)
    integrator: TrapezoidIntegrator | None = None
    logged: set[str] = field(default_factory=set)  # rejection reasons already logged at warning level
    fresh: bool = False  # this sample's energy counter reading was accepted
    idle: IdleBaseline = field(default_factory=IdleBaseline)
    reading: GPUReading | None = None
    last_good: float | None = None
    up: bool = False
    error: str = ""


def _max_power_w(r: GPUReading) -> float | None:
    """The most this reading says the GPU can draw: its enforced limit, or a power reading above it."""
    known = [mw for mw in (r.power_limit_mw, r.power_average_mw, r.power_instant_mw) if mw is not None]
    return max(known) / 1000.0 if known else None


class PowerSampler:
    """Fast sampler integrating instant power for GPUs without an energy counter (pre-Volta).

    Ticks on a fixed schedule (``interval``, 20 ms at the lowest) so the trapezoid intervals stay even;
    GPUs with an energy counter are never polled here.
    """

    def __init__(self, backend: GPUBackend, tracks: list[_Track], interval: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._backend = backend
        self._tracks = [t for t in tracks if t.integrator is not None]
        self._interval = max(0.02, interval)
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        for t in self._tracks:
            try:
                mw = self._backend.read_power_mw(t.identity)
            except Exception:  # noqa: BLE001 - GPULost or worse: the main sampler reports it
                continue
            if mw is not None and t.integrator is not None:
                t.integrator.add(self._clock(), mw / 1000.0)

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.wait(max(0.0, next_tick - time.monotonic())):
            self.tick()
            next_tick += self._interval
            if next_tick < time.monotonic():
                next_tick = time.monotonic() + self._interval

    def start(self) -> None:
        if not self._tracks:
            return
        self.tick()
        self._thread = threading.Thread(target=self._run, name="power-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)


class GPUCollector(Collector):
    """All per-GPU series. ``backend_factory`` raises NVMLUnavailable when there is no usable NVML."""

    name = "gpu"

    def __init__(
        self,
        backend_factory: Callable[[], GPUBackend],
        *,
        processes: bool = False,
        process_utilization: bool = False,
        gpm: bool = True,
        power_interval: float = 0.1,
        idle_power_w: float | None = None,
        retry_interval: float = 30.0,
        interval: float = 1.0,
        energy_timestamps: bool = False,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``interval``: the sampler's period (bounds the credit for a counter reset). ``energy_timestamps``:
        expose the energy counter with the time it was read. ``monotonic``: the clock the plausibility of
        energy readings is judged on (a wall-clock step must not make a reading look implausible)."""
        self._factory = backend_factory
        self._processes = processes
        self._process_utilization = process_utilization
        # The process list feeds the per-process series, the idle baseline (power while no process runs)
        # and pod attribution; nothing else needs the driver to walk its process table every sample.
        self._read_processes = processes or process_utilization or idle_power_w is None
        self._gpm = gpm
        self._power_interval = power_interval
        self._idle_flag = idle_power_w
        self._retry_interval = retry_interval
        self._interval = interval
        self._energy_timestamps = energy_timestamps
        self._clock = clock
        self._monotonic = monotonic
        self._backend: GPUBackend | None = None
        self._tracks: list[_Track] = []
        self._power_sampler: PowerSampler | None = None
        self._unavailable_reason = ""
        self._unavailable_logged = ""
        self._next_retry = 0.0
        self._states: tuple[GPUState, ...] = ()
        self._static: list[Metric] = []
        # NVML is opened by the first update(), on the sampler thread: nvmlInit can hang on a sick driver,
        # and construction runs before the HTTP port is bound.

    # ------------------------------------------------------------------------------------------------

    @property
    def backend(self) -> GPUBackend | None:
        return self._backend

    def states(self) -> tuple[GPUState, ...]:
        """The latest per-GPU states (an immutable tuple, replaced after each update)."""
        return self._states

    def identities(self) -> tuple[GPUIdentity, ...]:
        return tuple(t.identity for t in self._tracks)

    @property
    def unavailable_reason(self) -> str:
        return self._unavailable_reason

    def _connect(self) -> None:
        try:
            backend = self._factory()
            identities = backend.devices()
        except NVMLUnavailable as exc:
            self._unavailable_reason = exc.reason
            self._next_retry = time.monotonic() + self._retry_interval
            if self._unavailable_logged != exc.reason:
                log.warning("%s. GPU metrics are disabled; host metrics keep working. Retrying every %gs.",
                            exc, self._retry_interval)
                self._unavailable_logged = exc.reason
            return
        self._backend = backend
        self._unavailable_reason = ""
        if not identities:
            log.warning("NVML initialised (driver %s) but found no GPU; serving host metrics only",
                        backend.driver_version())
        else:
            log.info("found %d GPU(s) through %s, driver %s: %s", len(identities), backend.kind,
                     backend.driver_version(),
                     ", ".join(f"{g.index}={g.name} ({g.energy_method})" for g in identities))
        self._tracks = []
        for ident in identities:
            track = _Track(identity=ident, counter=EnergyCounter(interval_s=self._interval))
            if ident.energy_method not in (ENERGY_METHOD_COUNTER, ENERGY_METHOD_NONE):
                track.integrator = TrapezoidIntegrator(max_gap_s=max(1.0, 10 * self._power_interval))
            self._tracks.append(track)
        self._static = self._static_families(backend)
        self._power_sampler = PowerSampler(backend, self._tracks, self._power_interval, self._clock)
        self._power_sampler.start()

    def _static_families(self, backend: GPUBackend) -> list[Metric]:
        info = NVML_INFO.family()
        nvml_version = getattr(backend, "nvml_version", lambda: "")()
        cuda = getattr(backend, "cuda_driver_version", lambda: "")()
        add(info, [], {"driver_version": backend.driver_version(), "nvml_version": nvml_version,
                       "cuda_driver_version": cuda, "backend": backend.kind})
        gpu_info = GPU_INFO.family()
        for t in self._tracks:
            g = t.identity
            add(gpu_info, [], {
                "gpu": str(g.index), "gpu_uuid": g.uuid, "model": g.name,
                "driver_version": backend.driver_version(), "pci_bus_id": g.pci_bus_id,
                "architecture": g.architecture, "compute_capability": g.compute_capability,
                "energy_method": g.energy_method, "mig_mode": "enabled" if g.mig_enabled else "disabled",
                "backend": backend.kind,
            })
        return [info, gpu_info]

    # ------------------------------------------------------------------------------------------------

    def update(self) -> list[Metric]:
        available = NVML_AVAILABLE.family()
        if self._backend is None and time.monotonic() >= self._next_retry:
            self._connect()
        if self._backend is None:
            add(available, [self._unavailable_reason], 0.0)
            self._states = ()
            # NVML missing is "no data": collector success 0, logged once by _connect.
            raise NoData(f"NVML unavailable ({self._unavailable_reason})", [available])
        add(available, [""], 1.0)
        backend = self._backend
        fams = {spec.name: spec.family() for spec in _PER_GPU_SPECS}
        states = []
        for t in self._tracks:
            g = t.identity
            labels = [str(g.index), g.uuid]
            try:
                started = self._monotonic()
                r = backend.read(g, processes=self._read_processes, process_utilization=self._process_utilization,
                                 gpm=self._gpm)
            except Exception as exc:  # noqa: BLE001 - one GPU never takes the others down
                message = str(exc) if isinstance(exc, GPULost) else (
                    f"GPU {g.index} ({g.uuid}) could not be sampled ({type(exc).__name__}: {exc}); it shows as "
                    "gpuenergy_gpu_up 0 with its energy held until it answers, the other GPUs are served"
                )
                if t.up or not t.error:
                    log.error("%s", message)
                    if not isinstance(exc, GPULost):
                        log.debug("GPU %d sample failure", g.index, exc_info=True)
                t.up, t.error = False, message
                add(fams[GPU_UP.name], labels, 0.0)
                t.fresh = False  # no reading: the energy sample is absent (see _emit_energy)
                self._emit_energy(fams, t, labels)
                states.append(self._state(t))
                continue
            if not t.up and t.error:
                log.info("GPU %d (%s) answers again", g.index, g.uuid)
            t.up, t.error, t.reading, t.last_good = True, "", r, r.timestamp
            add(fams[GPU_UP.name], labels, 1.0)
            t.fresh = False
            if r.energy_mj is not None and t.integrator is None:
                self._count_energy(backend, t, r, started, self._monotonic())
            self._emit_energy(fams, t, labels)
            self._emit(fams, t, r, labels)
            states.append(self._state(t))
        self._states = tuple(states)
        errors = self._field_errors(backend)
        return [available, *self._static, *[f for f in fams.values() if f.samples], *errors]

    def _field_errors(self, backend: GPUBackend) -> list[Metric]:
        counts = backend.field_errors()
        if not counts:
            return []
        uuids = {t.identity.index: t.identity.uuid for t in self._tracks}
        fam = FIELD_ERRORS.family()
        for (index, what, reason), n in sorted(counts.items()):
            add(fam, [str(index), uuids.get(index, ""), what, reason], float(n))
        return [fam]

    def _count_energy(self, backend: GPUBackend, t: _Track, r: GPUReading, started: float, done: float) -> None:
        """``started``/``done``: the monotonic clock around the read (the counter was read in between)."""
        assert r.energy_mj is not None
        v = t.counter.update(r.energy_mj / 1000.0, done, started=started, stamp=r.timestamp,
                             max_power_w=_max_power_w(r))
        self._judge(t, v)
        t.fresh = v.accepted
        if t.counter.awaiting_first:
            # Nothing trusted yet (start-up): a second reading now confirms the first, so the counter is
            # exposed from the first sample instead of one interval later.
            try:
                started = self._monotonic()
                again = backend.read(t.identity)
            except Exception:  # noqa: BLE001 - one GPU never takes the others down; the next update reports it
                log.debug("GPU %d: confirming read of the energy counter failed", t.identity.index, exc_info=True)
                return
            if again.energy_mj is not None:
                v = t.counter.update(again.energy_mj / 1000.0, self._monotonic(), started=started,
                                     stamp=again.timestamp, max_power_w=_max_power_w(again))
                self._judge(t, v)
                t.fresh = v.accepted

    def _judge(self, t: _Track, v: Verdict) -> None:
        g, c = t.identity, t.counter
        for reason in v.rejected:
            level = logging.DEBUG if reason in t.logged else logging.WARNING
            t.logged.add(reason)
            log.log(level, "GPU %d (%s): energy counter reading rejected as implausible (%s); the counter "
                    "stays at %s J and has no sample until a reading is accepted. Counted in "
                    "gpuenergy_gpu_energy_rejected_readings_total; the rules are in docs/measurement.md. "
                    "Further ones are logged at debug level.", g.index, g.uuid, reason,
                    "none" if c.exposed_j is None else f"{c.exposed_j:.3f}")
        if v.reset:
            log.info("GPU %d (%s): energy counter reset (driver reload or GPU reset) confirmed, now %.3f J; "
                     "credited %.1f J for the part of the interval before it", g.index, g.uuid,
                     c.exposed_j or 0.0, v.credit_j)

    def _exposed(self, t: _Track) -> tuple[float | None, float | None]:
        """The exposed energy (J) and the wall time it was measured at."""
        if t.integrator is not None:
            return (t.integrator.energy_j, t.integrator.last_t) if t.integrator.samples else (None, None)
        return t.counter.exposed_j, t.counter.exposed_stamp

    def _emit_energy(self, fams: dict[str, Metric], t: _Track, labels: list[str]) -> None:
        energy, when = self._exposed(t)
        # The counter is exposed only when this sample's reading was accepted. Held back, unreadable or lost,
        # it is absent (Prometheus marks it stale): the next accepted value then spreads over the gap in
        # rate()/increase(), where a held flat value would pour the gap's energy into the scrape after it
        # and over-count any window starting inside the gap. No timestamp by default (Prometheus' exporter
        # guidelines): the scrape time is used.
        if energy is not None and (t.fresh or t.integrator is not None):
            add(fams[ENERGY.name], labels, energy, timestamp=when if self._energy_timestamps else None)
        if t.integrator is None:
            add(fams[ENERGY_RESETS.name], labels, float(t.counter.resets))
            for reason in REJECT_REASONS:
                add(fams[ENERGY_REJECTED.name], [*labels, reason], float(t.counter.rejected[reason]))

    def _energy(self, t: _Track) -> float | None:
        """Monotonic energy for in-process consumers (ledger, pod attribution)."""
        if t.integrator is not None:
            return t.integrator.energy_j if t.integrator.samples else None
        return t.counter.total_j

    def _state(self, t: _Track) -> GPUState:
        idle, source = self._idle(t)
        return GPUState(
            identity=t.identity, up=t.up, reading=t.reading, energy_j=self._energy(t),
            energy_resets=t.counter.resets, last_good=t.last_good, idle_power_w=idle,
            idle_power_source=source, error=t.error,
        )

    def _idle(self, t: _Track) -> tuple[float | None, str]:
        if self._idle_flag is not None:
            return self._idle_flag, "flag"
        return t.idle.value, "learned"

    def _emit(self, fams: dict[str, Metric], t: _Track, r: GPUReading, labels: list[str]) -> None:
        def put(spec: MetricSpec, value: float | None, scale: float = 1.0) -> None:
            if value is not None:
                add(fams[spec.name], labels, value * scale)

        put(POWER, r.power_instant_mw, 1e-3)
        put(POWER_AVERAGE, r.power_average_mw, 1e-3)
        put(MODULE_POWER, r.module_power_mw, 1e-3)
        put(POWER_LIMIT, r.power_limit_mw, 1e-3)
        put(MEM_USED, r.memory_used_bytes)
        put(MEM_TOTAL, r.memory_total_bytes)
        put(MEM_RESERVED, r.memory_reserved_bytes)
        put(UTIL, r.util_gpu_pct, 0.01)
        put(MEM_UTIL, r.util_memory_pct, 0.01)
        put(TEMP, r.temperature_gpu_c)
        put(MEM_TEMP, r.temperature_memory_c)
        put(SM_CLOCK, r.clock_sm_mhz, 1e6)
        put(MEM_CLOCK, r.clock_memory_mhz, 1e6)
        if r.clocks_event_reasons is not None:
            fam = fams[CLOCK_EVENT.name]
            for reason, bit in CLOCK_EVENT_REASONS.items():
                add(fam, [*labels, reason], 1.0 if r.clocks_event_reasons & bit else 0.0)
        for key, spec in GPM_SPECS.items():
            if key in r.gpm:
                put(spec, r.gpm[key], 0.01)
        if r.processes is not None:
            put(COMPUTE_PROCESSES, float(len(r.processes)))
            if self._processes:
                for p in r.processes:
                    if p.used_memory_bytes is not None:
                        add(fams[PROCESS_MEMORY.name], [*labels, str(p.pid)], p.used_memory_bytes)
            power = r.power_average_mw if r.power_average_mw is not None else r.power_instant_mw
            if not r.processes and power is not None:
                t.idle.add(power / 1000.0)
        idle, source = self._idle(t)
        if idle is not None:
            add(fams[IDLE_POWER.name], [*labels, source], idle)

    def close(self) -> None:
        if self._power_sampler is not None:
            self._power_sampler.stop()
        if self._backend is not None:
            self._backend.close()


_PER_GPU_SPECS = [
    GPU_UP, ENERGY, ENERGY_RESETS, ENERGY_REJECTED, POWER, POWER_AVERAGE, MODULE_POWER, POWER_LIMIT, MEM_USED,
    MEM_TOTAL, MEM_RESERVED, UTIL, MEM_UTIL, TEMP, MEM_TEMP, SM_CLOCK, MEM_CLOCK, CLOCK_EVENT, *GPM_SPECS.values(),
    PROCESS_MEMORY, COMPUTE_PROCESSES, IDLE_POWER,
]


def build_info_family() -> Metric:
    import platform

    fam = BUILD_INFO.family()
    add(fam, [], {"version": __version__, "python_version": platform.python_version()})
    return fam

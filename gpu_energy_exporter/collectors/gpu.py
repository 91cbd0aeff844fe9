"""The ``gpu`` collector: per-GPU metrics (energy, power, memory, utilisation, temperature, clocks,
throttling, GPM, processes), one update per sample on the sampler thread.

How energy is measured (counter with plausibility checks, or integrated power) is ``collectors.gpu_tracks``;
the series and how a reading becomes samples are ``collectors.gpu_metrics``; this module connects them:
NVML availability, discovery, and the isolation of failures. Which method a GPU uses is the
``energy_method`` label of ``gpuenergy_gpu_info``. The energy counter carries no explicit sample timestamp
unless ``--collector.gpu.energy-timestamps`` asks for one. Readings arrive in base units from the backend
(``devices/``): nothing here converts a unit.

NVML being unavailable (no driver, no library) is reported once in the log and continuously as
``gpuenergy_nvml_available{reason} 0``; the collector retries NVML periodically so a driver that loads
after the exporter is picked up. A lost GPU shows as ``gpuenergy_gpu_up 0`` and loses only its own
series.

Failures are isolated at the finest grain: a reading the backend cannot get is left out (and counted in
``gpuenergy_nvml_field_errors_total``), and anything one GPU's sample raises marks that GPU alone
(``gpuenergy_gpu_up 0``, its energy counter held at the last value); the other GPUs are served as usual.
The running processes are read only when something uses them: the ``processes`` collector, the learned idle
baseline (no ``--gpu.idle-power``) and, with SM utilisation per process, SM-weighted pod attribution; afresh at
every counter read and utilisation ask, and between them as often as ``devices.nvml`` finds it due.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from functools import lru_cache

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from gpu_energy_exporter.collectors.base import Collector, NoData
from gpu_energy_exporter.collectors.gpu_metrics import (
    FIELD_ERRORS,
    GPU_INFO,
    GPU_UP,
    NVML_AVAILABLE,
    NVML_CALL_SECONDS,
    NVML_CALLS,
    NVML_INFO,
    PER_GPU_SPECS,
    emit_reading,
    label_sets,
    put,
)
from gpu_energy_exporter.collectors.gpu_processes import ProcessTable, UtilizationCadence
from gpu_energy_exporter.collectors.gpu_tracks import GPUTrack, PowerSampler, reading_time, wall_minus_monotonic
from gpu_energy_exporter.collectors.registry import CollectorSpec, Settings, Wiring, register
from gpu_energy_exporter.core.apportion import Apportioner
from gpu_energy_exporter.core.energy import EnergyCounter, TrapezoidIntegrator
from gpu_energy_exporter.core.errors import ConfigError, GPULost, NVMLUnavailable
from gpu_energy_exporter.core.flagtypes import Flag, existing_file, non_negative_float, parse_bool, parse_duration
from gpu_energy_exporter.core.metrics import add
from gpu_energy_exporter.core.state import (
    ENERGY_METHOD_COUNTER,
    ENERGY_METHOD_NONE,
    GPUIdentity,
    GPUReading,
    GPUState,
)
from gpu_energy_exporter.devices.base import GPUBackend

log = logging.getLogger(__name__)


@lru_cache(maxsize=512)
def _function_labels(name: str) -> dict[str, str]:
    """The label set of one NVML function's self-cost samples, shared by every snapshot (never mutated)."""
    return {NVML_CALLS.labels[0]: name}


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
        energy_interval: float | None = None,
        gpm_interval: float | None = None,
        energy_timestamps: bool = False,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        process_interval: float = 0.0,
        procfs: str | None = None,
    ) -> None:
        """``interval``: the sampler's period (bounds the credit for a counter reset). ``energy_timestamps``:
        expose the energy counter with the time it was read. ``energy_interval``: how often the energy
        counter is read (None: every sample); the samples between get their energy from the power readings.
        ``gpm_interval``: how often GPM is sampled (None: every sample); between, the last GPM figures (an
        average over the span between the last two GPM samples) are served. ``monotonic``: the clock the plausibility of
        energy readings is judged on (a wall-clock step must not make a reading look implausible)."""
        self._factory = backend_factory
        self._processes = processes
        self._process_utilization = process_utilization
        # The process list feeds the per-process series, the idle baseline (power while no process runs)
        # and pod attribution; nothing else needs the driver to walk its process table every sample.
        self._read_processes = (processes or process_utilization or idle_power_w is None or process_interval > 0
                                or procfs is not None)
        # Per-process SM utilisation every process_interval on shared GPUs, and each listed pid's host
        # identity (collectors.gpu_processes): what splits a GPU between runs and pods by what they run.
        self._cadence = UtilizationCadence(process_interval, monotonic)
        self._table = ProcessTable(procfs)
        self._process_counts: dict[int, int] = {}
        self._gpm = gpm
        self._power_interval = power_interval
        self._idle_flag = idle_power_w
        self._retry_interval = retry_interval
        self._interval = interval
        # None: every sample (0 makes every sample due whatever the sampler's actual period).
        self._energy_interval = energy_interval if energy_interval and energy_interval > interval else 0.0
        self._gpm_interval = gpm_interval if gpm_interval and gpm_interval > interval else 0.0
        self._next_gpm = float("-inf")
        self._counter_wanted = False  # request_counter_read(): every GPU's counter at the next sample
        self._counter_checks: list[Callable[[], bool]] = []  # add_counter_read_check(): asked every sample
        self._last_gpm: dict[int, dict[str, float]] = {}
        self._energy_timestamps = energy_timestamps
        self._clock = clock
        self._monotonic = monotonic
        self._backend: GPUBackend | None = None
        self._tracks: list[GPUTrack] = []
        self._power_sampler: PowerSampler | None = None
        self._unavailable_reason = ""
        self._unavailable_logged = ""
        self._next_retry = 0.0
        self._states: tuple[GPUState, ...] = ()
        self._static: list[Metric] = []
        # NVML function -> ((calls, seconds), their two samples) last emitted (_call_costs)
        self._cost_samples: dict[str, tuple[tuple[int, float], Sample, Sample]] = {}
        # the last field-error counts and their samples (_field_errors)
        self._errors_seen: tuple[dict[tuple[int, str, str], int], tuple[Sample, ...]] = ({}, ())
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
        self._errors_seen = ({}, ())  # built again with the new GPUs' uuids
        for ident in identities:
            # A reset is credited at most one interval between counter reads.
            track = GPUTrack(identity=ident, counter=EnergyCounter(interval_s=max(self._interval,
                                                                                  self._energy_interval)),
                             apportion=Apportioner(max_gap_s=max(10.0, 3 * self._interval)),
                             series=Apportioner(max_gap_s=max(10.0, 3 * self._interval)))
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
        fams = {spec.name: spec.family() for spec in PER_GPU_SPECS}
        states = []
        listed: set[int] = set()
        # GPM is sampled every --collector.gpm-interval (a GPM sample costs 0.07-0.35 ms on a real driver);
        # its figures are averages over the span between two GPM samples, served until the next.
        gpm_now = self._gpm and self._monotonic() >= self._next_gpm
        if gpm_now and self._gpm_interval:
            # The first figures need two GPM samples: the second is taken 2 s after the first (a new exporter
            # shows GPM within seconds, not one interval later), then one every interval.
            first = self._next_gpm == float("-inf")
            gap = min(2.0, self._gpm_interval) if first else self._gpm_interval
            self._next_gpm = self._monotonic() + gap - 0.5 * self._interval
        wanted, self._counter_wanted = self._counter_wanted, False
        wanted = self._checks_want_counter() or wanted
        offset: float | None = None  # wall clock minus monotonic, read once a GPU answered
        for t in self._tracks:
            g = t.identity
            labels = [str(g.index), g.uuid]
            try:
                started = self._monotonic()
                asked = (wanted or t.counter_due(started)) if g.energy_method == ENERGY_METHOD_COUNTER else (
                    g.energy_method == ENERGY_METHOD_NONE)
                # Per-process SM use is read with every counter read of a shared GPU (what settles the span's
                # split: core.settle), and every --collector.gpu.process-interval between reads.
                counted = asked and g.energy_method == ENERGY_METHOD_COUNTER
                ask = self._process_utilization or self._cadence.due(
                    g.index, self._process_counts.get(g.index, 0), with_counter=counted)
                # The process list is read afresh with every counter read (the edges of runs, jobs and pods
                # are counter reads: settlement splits the span by who was listed) and every per-process
                # utilisation ask, every sample for the per-process series (--collector.processes); otherwise
                # the backend serves the last list until the GPU's used memory moves or a few seconds pass
                # (devices.nvml.PROCESS_LIST_INTERVAL_S).
                r = backend.read(g, processes=self._read_processes, process_utilization=ask, gpm=gpm_now,
                                 energy=asked, fresh_processes=asked or ask or self._processes)
                if ask and not self._process_utilization:
                    self._cadence.asked(g.index)
                if r.processes is not None:
                    self._process_counts[g.index] = len(r.processes)
                    listed.update(p.pid for p in r.processes)
                    r = self._cadence.apply(g.index, r, self._table, ask)
                gpm = self._gpm_served(g.index, r, gpm_now)
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
                t.fresh = False  # no reading: the energy sample is absent (see GPUTrack.emit_energy)
                t.emit_energy(fams, labels, self._energy_timestamps)
                states.append(t.state(self._idle_flag))
                continue
            if not t.up and t.error:
                log.info("GPU %d (%s) answers again", g.index, g.uuid)
            done = self._monotonic()
            if offset is None:
                offset = wall_minus_monotonic(self._clock, self._monotonic)
            t.up, t.error, t.reading, t.last_good = True, "", r, r.timestamp
            t.read_at = reading_time(r, started, done, offset)
            put(fams, GPU_UP, label_sets(labels[0], labels[1]).base, 1.0)
            t.fresh = False
            if r.process_samples:
                t.add_samples(r.process_samples, offset)
            if r.energy_j is not None and t.integrator is None:
                t.count_energy(backend, r, started, done, self._monotonic, offset)
            if t.integrator is None:
                t.apportion_sample(r, done, self._energy_interval, asked=asked)
            t.emit_energy(fams, labels, self._energy_timestamps)
            emit_reading(fams, r, labels, processes=self._processes, gpm=gpm)
            t.learn_idle(r)
            t.emit_idle(fams, labels, self._idle_flag)
            states.append(t.state(self._idle_flag))
        self._states = tuple(states)
        self._table.forget_except(listed)
        errors = self._field_errors(backend)
        return [available, *self._static, *[f for f in fams.values() if f.samples], *errors,
                *self._call_costs(backend)]

    def add_counter_read_check(self, check: Callable[[], bool]) -> None:
        """``check()`` runs at the start of every sample, on the sampler thread, before any GPU is read;
        True reads every energy counter in this very sample (who holds a GPU changed: the Slurm job map),
        so the edge falls on a counter read, not on energy apportioned between reads. Must be cheap."""
        self._counter_checks.append(check)

    def _checks_want_counter(self) -> bool:
        want = False
        for check in self._counter_checks:
            try:
                want = check() or want  # every check runs: each keeps its own view of what it saw
            except Exception:  # noqa: BLE001 - a failing check costs accuracy at an edge, never the sample
                log.debug("counter-read check failed", exc_info=True)
        return want

    def request_counter_read(self) -> None:
        """Read every GPU's energy counter at the next sample, whatever its schedule (a run started or
        finished: its energy between its edges is then the counter's delta). Any thread; sets a flag."""
        self._counter_wanted = True

    def _gpm_served(self, index: int, r: GPUReading, sampled: bool) -> Mapping[str, float]:
        """The GPM figures to serve with reading ``r``: its own when this sample took GPM, else the last GPM
        sample's (the reading itself is left as read: copying a frozen reading per GPU per sample to carry
        them cost more than anything else in the hand-off, and only the exposition uses them)."""
        if not self._gpm:
            return r.gpm
        if sampled:
            if r.gpm:
                self._last_gpm[index] = r.gpm
            return r.gpm
        return self._last_gpm.get(index) or r.gpm

    def _call_costs(self, backend: GPUBackend) -> list[Metric]:
        costs = backend.call_costs()
        if not costs:
            return []
        calls, seconds = NVML_CALLS.family(), NVML_CALL_SECONDS.family()
        held = self._cost_samples
        for name, cost in sorted(costs.items()):
            got = held.get(name)
            if got is None or got[0] != cost:
                # Most functions (discovery, health, the slow readings) were not called since the last sample:
                # their two samples are reused (immutable), the same as add() builds.
                labels = _function_labels(name)
                got = held[name] = (cost, Sample(NVML_CALLS.name, labels, float(cost[0]), None),
                                    Sample(NVML_CALL_SECONDS.name, labels, float(cost[1]), None))
            calls.samples.append(got[1])
            seconds.samples.append(got[2])
        return [calls, seconds]

    def _field_errors(self, backend: GPUBackend) -> list[Metric]:
        counts = backend.field_errors()
        if not counts:
            return []
        fam = FIELD_ERRORS.family()
        if counts != self._errors_seen[0]:
            # The counts change only when a reading fails (a GPU without health data lists a dozen fields
            # per GPU, each counted once): the samples are built again only then, and reused (immutable)
            # by every sample in between.
            uuids = {t.identity.index: t.identity.uuid for t in self._tracks}
            for (index, what, reason), n in sorted(counts.items()):
                add(fam, [str(index), uuids.get(index, ""), what, reason], float(n))
            self._errors_seen = (counts, tuple(fam.samples))
        else:
            fam.samples.extend(self._errors_seen[1])
        return [fam]

    def close(self) -> None:
        if self._power_sampler is not None:
            self._power_sampler.stop()
        if self._backend is not None:
            self._backend.close()



# ----------------------------------------------------------------------------------------------------
# the collectors this module runs (``collectors.registry``): gpu, and its two options gpm and processes


def _check(config: Settings) -> None:
    if not 0.02 <= config.collector_power_interval <= config.collector_interval:
        raise ConfigError(
            "--collector.power-interval must be between 20ms and --collector.interval "
            f"({config.collector_interval:g}s), got {config.collector_power_interval:g}s"
        )
    for name, value in (("energy", config.collector_energy_interval), ("gpm", config.collector_gpm_interval)):
        # Shorter than --collector.interval means every sample (the collector rounds it up).
        if value <= 0:
            raise ConfigError(f"--collector.{name}-interval must be positive, got {value:g}s")


def _build(w: Wiring) -> GPUCollector:
    config = w.config
    factory = w.backend_factory
    if factory is None:
        library = config.nvml_library

        def factory() -> GPUBackend:
            from gpu_energy_exporter.devices.nvml import NVMLBackend

            return NVMLBackend(library)

    return GPUCollector(
        factory,
        processes=config.enabled("processes"),
        gpm=config.enabled("gpm"),
        power_interval=config.collector_power_interval,
        idle_power_w=config.gpu_idle_power,
        interval=config.collector_interval,
        energy_interval=config.collector_energy_interval,
        gpm_interval=config.collector_gpm_interval,
        energy_timestamps=config.collector_gpu_energy_timestamps,
        clock=w.clock,
        process_interval=config.collector_gpu_process_interval,
        procfs=config.path_procfs,
    )


register(CollectorSpec(
    "gpu", True, "Per-GPU power, energy, memory, utilisation, temperature, clocks (NVML).",
    order=0, build=_build, check=_check, title="GPUs (collector `gpu`, `gpm`, `processes`)",
    flags=(
        Flag("collector.power-interval", parse_duration, "100ms",
             "Fast power sampling period used to integrate energy on GPUs without an energy counter "
             "(pre-Volta); 20ms at the lowest.", "DURATION"),
        Flag("collector.energy-interval", parse_duration, "30s",
             "How often each GPU's energy counter is read (about 3.5 ms of CPU a read on an H100, driver 580; "
             "the other readings cost microseconds). Between two reads each sample's energy is apportioned by "
             "the GPU's ~1 s average power, and at each read the exposed energy meets the counter exactly; runs "
             "and pods keep --collector.interval's grid (docs/measurement.md). At most --collector.interval "
             "reads it every sample.", "DURATION"),
        Flag("collector.gpu.energy-timestamps", parse_bool, "false",
             "Expose the GPU energy counter with the time it was read as an explicit sample timestamp. Off by "
             "default, as Prometheus' guidelines for exporters ask; see docs/measurement.md for what it costs "
             "(staleness markers, clock steps) and Prometheus' track_timestamps_staleness.", boolean=True),
        Flag("nvml.library", existing_file, None,
             "Path of libnvidia-ml.so.1 to load instead of the one the dynamic linker finds.", "PATH"),
        Flag("gpu.idle-power", non_negative_float, None,
             "Idle power of each GPU in watts, used for dynamic energy. Default: learned from samples "
             "with no compute process.", "WATTS"),
        Flag("collector.gpu.process-interval", parse_duration, "10s",
             "A GPU shared by several processes is asked for its per-process SM utilisation "
             "(nvmlDeviceGetProcessUtilization: 1.6-2.6 ms of CPU per call on an H100) with every read of its "
             "energy counter and this often between reads. The driver answers one mean per process since the "
             "last ask: the asks since a counter read split the span that read settles, piece by piece; between "
             "asks the last weights hold (provisional). A GPU with one process is never asked. 0 never asks "
             "(shared GPUs are split evenly).", "DURATION"),
    ),
))
register(CollectorSpec(
    "gpm", True, "GPM SM/tensor/DRAM activity on Hopper and newer (NVML GPM).", order=1,
    flags=(
        Flag("collector.gpm-interval", parse_duration, "60s",
             "How often GPM (SM, tensor, DRAM activity) is sampled: about 2 ms of CPU a sample on an H100 "
             "(1.8-2.0 ms of it computing the metrics). Each figure is the average over the span between two GPM "
             "samples, served until the next: a longer interval loses no activity, only time resolution (30s "
             "for finer panels costs 8 GPUs about 0.27 ms of CPU a second more).",
             "DURATION"),
    ),
))
register(CollectorSpec("processes", False, "Per-process GPU memory with pid labels (high cardinality).", order=2))

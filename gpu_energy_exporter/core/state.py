"""What the exporter knows about its GPUs and its last sample, in base units: plain frozen values.

The device backends (``devices/``) build ``GPUIdentity`` and ``GPUReading``; the GPU collector keeps one
``GPUState`` per GPU; the sampler publishes a ``Snapshot`` that the scrape, the run ledger, pod attribution
and the JSON API read. Every quantity is in the unit its field name says (``_j`` joules, ``_w`` watts,
``_ratio`` 0..1, ``_hz`` hertz, ``_bytes``, ``_c`` degrees Celsius, ``_s`` seconds): vendor units (NVML's
milliwatts, millijoules, percent, MHz, bitmasks) stop in ``devices/``, and nothing above converts again.

This module holds data only: it never calls NVML, never reads a clock and never does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.core import Metric

from gpu_energy_exporter.core.health import XidEvent
from gpu_energy_exporter.core.metrics import GPU_LABELS, define
from gpu_energy_exporter.core.procinfo import ProcessIdentity

#: How a GPU's energy counter is obtained (the ``energy_method`` info label).
ENERGY_METHOD_COUNTER = "counter"  # nvmlDeviceGetTotalEnergyConsumption (Volta and newer)
ENERGY_METHOD_INTEGRATED_INSTANT = "integrated_instant_power"  # trapezoid over NVML_FI_DEV_POWER_INSTANT
ENERGY_METHOD_INTEGRATED_USAGE = "integrated_power_usage"  # trapezoid over nvmlDeviceGetPowerUsage
ENERGY_METHOD_NONE = "none"  # no power reading at all

#: Clock-event (throttle) reasons a reading can report, in the order the ``reason`` label is exposed.
CLOCK_EVENT_REASONS: tuple[str, ...] = (
    "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
    "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting",
)

#: Computed at scrape time from ``GPUState.last_good`` (the one per-GPU value the snapshot cannot hold).
GPU_SAMPLE_AGE = define(
    "gpu", "last_sample_age_seconds", "gauge", "Seconds since the last good sample of this GPU (computed at scrape).",
    GPU_LABELS, collector="gpu", unit="seconds",
)


@dataclass(frozen=True)
class GPUIdentity:
    """What does not change while the driver stays loaded."""

    index: int  # NVML index (not the CUDA_VISIBLE_DEVICES index)
    uuid: str  # "GPU-..." (stable across reboots; the join key)
    name: str  # product name, e.g. "NVIDIA H100 80GB HBM3"
    pci_bus_id: str  # "00000000:17:00.0"
    architecture: str  # "volta", "ampere", "hopper", ... or "unknown"
    compute_capability: str  # "9.0" or ""
    energy_method: str  # one of ENERGY_METHOD_*
    #: nvmlDeviceGetPowerUsage is a 1 s average (Ampere+ except GA100) rather than instant power.
    power_usage_is_average: bool
    mig_enabled: bool = False
    mig_devices: tuple[MIGDevice, ...] = ()


@dataclass(frozen=True)
class MIGDevice:
    uuid: str  # "MIG-..."
    parent_uuid: str
    index: int  # MIG device index within the parent
    #: The instance's profile from nvmlDeviceGetAttributes_v2 (0: not known): its GPU-instance and
    #: compute-instance slices (of 7 on A100/H100) and its SMs. Energy of the parent is shared by compute
    #: slices; MFU uses the instance's share of the GPU's SMs.
    gpu_instance_slices: int = 0
    compute_instance_slices: int = 0
    multiprocessor_count: int = 0
    #: the parent GPU's SMs (0: not known; then the share is compute slices / 7)
    parent_multiprocessor_count: int = 0
    #: its GPU and compute instance ids (-1: not known): how the process list names the instance
    gpu_instance_id: int = -1
    compute_instance_id: int = -1

    @property
    def slices(self) -> int:
        """Compute slices (1 when not known: every instance then weighs the same)."""
        return self.compute_instance_slices or 1

    @property
    def sm_share(self) -> float | None:
        """The instance's share of its GPU's SMs (None: not known)."""
        if self.multiprocessor_count and self.parent_multiprocessor_count:
            return min(1.0, self.multiprocessor_count / self.parent_multiprocessor_count)
        if self.compute_instance_slices:
            return min(1.0, self.compute_instance_slices / MIG_MAX_COMPUTE_SLICES)
        return None


#: Compute slices of a whole A100 / H100 / B200 (MIG's 7g profile).
MIG_MAX_COMPUTE_SLICES = 7


@dataclass(frozen=True)
class GPUProcess:
    pid: int
    used_memory_bytes: int | None
    #: SM utilisation of the process over the last interval (nvmlDeviceGetProcessUtilization), when known.
    #: Percent as the driver reports it, on purpose: it is never exposed, only a relative weight for
    #: sharing one GPU's energy between pods, and scaling it would move the last digit of that split.
    sm_util_pct: float | None = None
    #: The process as the host's /proc describes it (pid namespaces, container, pod): None when it was not
    #: looked up (no process table) or is not there (the exporter does not see the host's processes).
    host: ProcessIdentity | None = None
    #: the MIG instance it runs on ("" the whole GPU, or not known)
    mig_uuid: str = ""


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One process's SM utilisation as NVML reported it (``nvmlDeviceGetProcessUtilization``): a mean over
    (``start``, ``end``] in seconds: on the wall clock in a ``GPUReading`` (the driver's CPU timestamps),
    on the monotonic clock of ``GPUState.read_at`` in an ``EnergySpan``."""

    pid: int
    sm_pct: float  # percent, as the driver reports it (a relative weight, never exposed)
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class EnergySpan:
    """Where a GPU's energy stands between two reads of its energy counter: what settles the span
    (``core.settle``). Times are on the monotonic clock of ``GPUState.read_at``; energy is the counter's
    monotonic total (resets absorbed, ``core.energy.EnergyCounter.total_j``)."""

    anchor_j: float  # the total at the last accepted counter read
    anchor_at: float  # when that read was taken
    raw_j: float  # the power readings integrated since (unscaled): the span's shape so far, up to read_at
    whole: bool  # every step since the anchor had a power reading (the shape is known)
    scale: float  # what the counter said of the power readings lately (provisional figures: raw x scale)
    #: on the sample that read the counter: the span that read settled, (start_at, start_j, raw_j, whole)
    #: with raw_j the shape's total up to this read; None on other samples
    closed: tuple[float, float, float, bool] | None = None
    #: per-process SM use over the span just closed, read with the counter (``ProcessSample``)
    samples: tuple[ProcessSample, ...] = ()
    #: the driver's own counter value (J) at the last accepted read (``anchor_j`` less the resets absorbed):
    #: what a restarted exporter settles the span across its downtime from (``ledger.carry``)
    anchor_counter_j: float | None = None


@dataclass(frozen=True)
class GPUReading:
    """One sample of one GPU, in base units. Every reading field may be None (not available)."""

    timestamp: float  # time.time() when the sample was taken
    energy_j: float | None = None  # the driver's energy counter, as read (may go backwards: see core.energy)
    power_instant_w: float | None = None
    power_average_w: float | None = None  # ~1 s average
    module_power_w: float | None = None  # Grace Hopper module scope (GPU + CPU + memory)
    power_limit_w: float | None = None  # enforced limit
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    util_gpu_ratio: float | None = None  # 0..1
    util_memory_ratio: float | None = None  # 0..1
    temperature_gpu_c: float | None = None
    temperature_memory_c: float | None = None
    clock_sm_hz: float | None = None
    clock_memory_hz: float | None = None
    clock_events: frozenset[str] | None = None  # active CLOCK_EVENT_REASONS; None: not readable
    processes: tuple[GPUProcess, ...] | None = None
    gpm: dict[str, float] = field(default_factory=dict)  # GPM metric name -> ratio 0..1
    #: every per-process SM sample NVML gave since its last answer (wall-clock seconds), when it was asked
    process_samples: tuple[ProcessSample, ...] = ()
    #: when the driver read the power fields and the energy counter, by the driver's clock (its timestamp of
    #: the batched field read; without one, the backend's clock around the call); None when no batched read
    #: answered. ``timestamp`` is when the sample began, which a loaded machine can put tenths of a second
    #: earlier than the counter's read (issue 28: +-2% on a 15 s run with a 0.15 s delay now and then).
    fields_at: float | None = None


@dataclass(frozen=True)
class GPUState:
    """What the exporter knows about one GPU after a sample."""

    identity: GPUIdentity
    up: bool
    reading: GPUReading | None  # the last good reading (kept while the GPU is down)
    energy_j: float | None  # monotonic energy counter, joules
    energy_resets: int
    last_good: float | None  # unix time of the last good reading
    idle_power_w: float | None = None
    idle_power_source: str = ""
    error: str = ""
    #: the monotonic time (``time.monotonic``) the last good reading was taken: ``energy_j`` is the energy
    #: at that moment, which can be tenths of a second before the snapshot that carries it is published
    read_at: float | None = None
    #: the span since the last counter read (None: no counter, or not read yet): its energy is provisional
    #: until the next read settles it (``core.settle``); ``energy_j`` is then the apportioned estimate
    span: EnergySpan | None = None


@dataclass(frozen=True)
class CollectorResult:
    name: str
    success: bool
    duration_s: float
    error: str = ""


@dataclass(frozen=True)
class SlurmJob:
    """A Slurm job holding GPUs on this node at one sample (the slurm collector's job-mapping directory):
    the run ledger opens a run for it (``ledger.jobs``)."""

    job_id: str
    gpus: tuple[str, ...]  # the GPU UUIDs it holds (a MIG instance's UUID where it holds an instance)
    user: str = ""
    account: str = ""
    partition: str = ""
    #: when its hold began: the wall-clock mtime of the job-mapping file the prolog wrote (None: not known,
    #: e.g. held when the exporter started)
    since: float | None = None
    #: on an entry with no ``gpus``: the job ended, at this wall-clock time (the epilog's write), carried
    #: for a while after it so that the ledger ends its run there
    until: float | None = None


@dataclass(frozen=True)
class ServedModel:
    """One model's token counters on a local inference server, as the server's /metrics last said (the
    inference collector): cumulative since the server process started."""

    model: str
    prompt_tokens: float
    output_tokens: float
    requests: float
    #: the wall-clock time of the last good scrape before the one that first showed this model's series, when the
    #: session had been scraped without it (SGLang and TGI create their series with the first request): its
    #: counters were 0 then. None: listed from the session's first scrape (counted from that value).
    appeared_after: float | None = None


@dataclass(frozen=True)
class ServingSession:
    """A local inference server's process lifetime (one session until the process or its counters restart),
    found and scraped by the inference collector: the run ledger charges its GPUs' share to it
    (``ledger.serving``)."""

    key: str  # stable for the session: "<port>-<pid>" and ".<n>" after the n-th counter reset of one process
    url: str
    engine: str  # vllm, sglang, tgi, triton
    pid: int  # the process listening on the server's port (host pid namespace)
    pids: tuple[int, ...]  # it and its descendants (vLLM's engine core and workers are the GPU processes)
    start: float  # wall clock: the session's first scrape, or the process's start when it started after the last
    last_scrape: float  # wall clock of the last good scrape (the counters are as of then)
    models: tuple[ServedModel, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """One published sample: the families every collector built, their results and the GPU states."""

    seq: int
    timestamp: float
    families: tuple[Metric, ...]
    results: tuple[CollectorResult, ...]
    gpus: tuple[GPUState, ...] = ()
    #: the most recent critical Xids of every GPU, oldest first (``core.health``; the run ledger notes them)
    xid_events: tuple[XidEvent, ...] = ()
    #: the Slurm jobs holding this node's GPUs (the slurm collector); None: no collector, or its job-mapping
    #: directory could not be read at this sample (the ledger then leaves its job runs as they are)
    slurm_jobs: tuple[SlurmJob, ...] | None = None
    #: the local inference servers' sessions (the inference collector); None: no collector
    serving: tuple[ServingSession, ...] | None = None
    #: the monotonic time (``time.monotonic``) it was published, the clock of ``GPUState.read_at``
    monotonic: float | None = None

    def value(self, name: str) -> float | None:
        """The first sample called ``name`` in this snapshot (for unlabelled series such as host memory)."""
        for fam in self.families:
            if not name.startswith(fam.name):
                continue  # a family's samples all start with its name: not one of them (the GPUs' hundreds)
            for sample in fam.samples:
                if sample.name == name:
                    return float(sample.value)
        return None

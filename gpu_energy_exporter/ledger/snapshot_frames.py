"""What one sampler snapshot says about the GPUs, as the run ledger needs it: a frame of plain values.

``frame_of`` is the one place the ledger reads the sampler's snapshot and GPU state (``gpu_frame`` the one
place it reads a GPU reading's fields); everything downstream (accounting, summaries) works on frames, so
it can be tested with plain values. Frames are immutable and kept in the ledger's snapshot history. This
module never calls NVML and never integrates power into energy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_energy_exporter.collectors.host import MEMORY_AVAILABLE
from gpu_energy_exporter.core.contract import gpu_key
from gpu_energy_exporter.core.health import XidEvent
from gpu_energy_exporter.core.state import GPUProcess, GPUState, MIGDevice, Snapshot
from gpu_energy_exporter.ledger.split import Proc


@dataclass(frozen=True, slots=True)
class GPUFrame:
    uuid: str
    name: str
    energy_j: float | None  # None: GPU down or no counter
    power_w: float | None
    memory_used: int | None
    memory_total: int | None
    idle_w: float | None
    idle_source: str
    index: int = -1
    #: The compute processes NVML listed on the GPU, with their SM use and host identity; None when not
    #: known: not read, GPU down, or none of the listed pids is in the exporter's view of /proc (no host
    #: pid namespace): then the runs' claims alone split the GPU (``ledger.split``).
    procs: tuple[Proc, ...] | None = None
    #: ``energy_j`` is settled: the counter read at this frame, or spread by the power samples' shape over the
    #: span between two counter reads (``ledger.settlement``); False while it is the estimate of a span the
    #: next counter read has not closed yet (provisional). A GPU state without a span is settled as it is.
    settled: bool = True
    #: The span since the last counter read (``core.state.EnergySpan``), its instants as offsets from the
    #: frame's time (so a frame moved onto another clock keeps them): None for a GPU without one.
    span: SpanFrame | None = None


@dataclass(frozen=True, slots=True)
class SpanFrame:
    """A GPU's ``EnergySpan`` in a frame: instants as seconds before the frame's time (``t``), so that
    ``frame.t + anchor_dt`` is when the span's counter read was taken."""

    anchor_dt: float
    anchor_j: float
    raw_j: float
    whole: bool
    scale: float
    #: the span this frame's counter read closed: (start_dt, start_j, raw_j, whole), or None
    closed: tuple[float, float, float, bool] | None = None
    #: per-process samples (pid, SM %, start_dt, end_dt) over the closed span
    samples: tuple[tuple[int, float, float, float], ...] = ()
    #: the driver's counter (J) at the span's read (``EnergySpan.anchor_counter_j``), None when not known
    anchor_counter_j: float | None = None


@dataclass(frozen=True, slots=True)
class Frame:
    t: float
    gpus: dict[str, GPUFrame]  # by uuid_key
    mig_parent: dict[str, str]  # MIG uuid key -> parent key
    intensity: float | None  # g/kWh
    pue: float | None
    host_available: float | None  # bytes
    xid_events: tuple[XidEvent, ...] = ()  # the most recent critical Xids of every GPU (core.health)
    #: MIG uuid key -> (compute slices, share of the parent's SMs or None), from NVML's instance attributes
    mig_profile: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    #: how long before the snapshot was published its GPUs were read (s): ``t`` is the time of the readings
    age: float = 0.0
    #: when the intensity in force took effect, as seconds before ``t`` (None: not within reach), and the
    #: intensity before it: an interval that straddles the change is priced part at each (``accounting``)
    intensity_change: tuple[float, float] | None = None


#: A reading older than this when its snapshot is published is not dated by: the GPU collector is stuck (a
#: hung driver call; its last states are carried on) or the two monotonic stamps are not on one clock (a
#: test's frozen clock). The frame then keeps the snapshot's time, so runs still close while a driver hangs.
#: A sampler publishes a slow collector's readings at most its wait budget (5 s) plus an interval late.
MAX_READING_AGE_S = 10.0


#: A GPU uuid as runs' GPUs are compared (``core.contract.gpu_key``).
uuid_key = gpu_key


#: A GPU read this long or longer before its frame's time is not carried forward to it (see ``gpu_frame``).
MAX_LAG_S = 2.0


def gpu_frame(g: GPUState, ref: float | None = None, latest: float | None = None) -> GPUFrame:
    """``ref``: the monotonic time the frame's ``t`` stands for (the span's instants are kept relative to it;
    None: the span is not placed, and the energy is taken as it is). ``latest``: the driver's time of the
    frame's latest GPU read (``GPUReading.fields_at``).

    A frame has one time, the latest of its GPUs' reads; a GPU read before it (the GPUs are read one after
    the other) has its energy carried forward to the frame's time by its power reading, the way the span's
    shape goes on. Dated at its own read instead, the GPUs read first were charged to runs by an interval
    that moved with the lag between the reads: on a loaded two-core machine that lag jumps by tenths of a
    second from one sample to the next, +-1% of a 15 s run. The lag is the one the driver's timestamps of
    the two reads and the exporter's read times both show (the lesser: a driver whose clock stands still,
    as a test's frozen one, carries none; a driver's stamp that runs ahead carries no more than the read
    times allow)."""
    r = g.reading
    power = None
    mem = total = None
    if r is not None:
        mem, total = r.memory_used_bytes, r.memory_total_bytes
        power = r.power_instant_w if r.power_instant_w is not None else r.power_average_w
    if not g.up:
        power = mem = None
    energy = g.energy_j if g.up else None
    carried = _carried_j(g, ref, latest)
    span = span_frame(g, ref, carried) if g.up else None
    if span is not None:
        # Provisional until the next counter read: the counter's last total plus the power readings since,
        # scaled by what the counter said of them lately (``ledger.settlement`` replaces it at the read).
        energy = span.anchor_j + span.scale * span.raw_j
    elif energy is not None:
        energy += carried
    return GPUFrame(
        uuid=g.identity.uuid, name=g.identity.name,
        energy_j=energy, power_w=power, memory_used=mem, memory_total=total,
        idle_w=g.idle_power_w, idle_source=g.idle_power_source, index=g.identity.index,
        procs=procs_of(r.processes, g.identity.mig_devices) if r is not None and g.up else None,
        settled=span is None or (g.span is not None and g.span.anchor_at == g.read_at), span=span,
    )


def _carried_j(g: GPUState, ref: float | None, latest: float | None) -> float:
    """The power readings' energy (unscaled, as a span's shape counts it) from the GPU's read to the frame's
    time: ``ref`` on the exporter's monotonic clock, ``latest`` on the driver's."""
    r = g.reading
    if ref is None or latest is None or g.read_at is None or r is None or r.fields_at is None or not g.up:
        return 0.0
    lag = min(latest - r.fields_at, ref - g.read_at)
    if not 0.0 < lag < MAX_LAG_S:
        return 0.0
    # the reading the span's shape counts (collectors.gpu_tracks.apportion_sample): the 1 s average first
    power = r.power_average_w if r.power_average_w is not None else r.power_instant_w
    return power * lag if power is not None and power > 0 else 0.0


def span_frame(g: GPUState, ref: float | None, carried_j: float = 0.0) -> SpanFrame | None:
    """The GPU's span with its instants relative to ``ref`` (None without a span, or without ``ref``); its
    shape carried on by ``carried_j`` from the GPU's read to ``ref``."""
    s = g.span
    if s is None or ref is None:
        return None
    closed = None
    if s.closed is not None:
        closed = (s.closed[0] - ref, s.closed[1], s.closed[2], s.closed[3])
    samples = tuple((p.pid, p.sm_pct, p.start - ref, p.end - ref) for p in s.samples)
    return SpanFrame(s.anchor_at - ref, s.anchor_j, s.raw_j + carried_j, s.whole, s.scale, closed, samples,
                     s.anchor_counter_j)


def procs_of(processes: tuple[GPUProcess, ...] | None, migs: tuple[MIGDevice, ...] = ()) -> tuple[Proc, ...] | None:
    """A reading's processes as the splitter's members (placed on their MIG instance, with its slices);
    None when the list says nothing usable (not read, or not one listed pid found in the host's process
    table)."""
    if processes is None:
        return None
    if processes and all(p.host is None for p in processes):
        return None
    slices = {m.uuid: m.slices for m in migs}
    return tuple(Proc(p.pid, p.sm_util_pct, p.host, uuid_key(p.mig_uuid) if p.mig_uuid else "",
                      slices.get(p.mig_uuid, 1)) for p in processes)


def frame_of(snapshot: Snapshot, intensity: float | None, pue: float | None,
             change: tuple[float, float] | None = None) -> Frame:
    """The frame of one snapshot, with the grid intensity (g/kWh) and PUE in force when it was taken;
    ``change``: (when the intensity took that value, wall clock; the value before)."""
    gpus: dict[str, GPUFrame] = {}
    mig: dict[str, str] = {}
    profile: dict[str, tuple[int, float | None]] = {}
    age = reading_age(snapshot)
    ref = snapshot.monotonic - age if snapshot.monotonic is not None else None
    stamps = [g.reading.fields_at for g in snapshot.gpus if g.up and g.reading is not None
              and g.reading.fields_at is not None]
    latest = max(stamps) if stamps else None
    for g in snapshot.gpus:
        key = uuid_key(g.identity.uuid)
        gpus[key] = gpu_frame(g, ref, latest)
        for m in g.identity.mig_devices:
            mig[uuid_key(m.uuid)] = key
            profile[uuid_key(m.uuid)] = (m.slices, m.sm_share)
    t = snapshot.timestamp - age
    since = None
    if change is not None and change[0] <= t:
        since = (change[0] - t, change[1])  # wall-clock offsets: steps of the clock aside, as the snapshot's
    return Frame(t, gpus, mig, intensity, pue, snapshot.value(MEMORY_AVAILABLE.name),
                 snapshot.xid_events, profile, age, since)


def reading_age(snapshot: Snapshot) -> float:
    """How long before ``snapshot`` was published its GPUs were read (the latest read of a GPU that is up),
    on the monotonic clock; 0 when not known.

    The GPU energy in a frame is the energy at the time of its reading, and runs are charged the part of
    each interval between two frames that they overlap: dated at the publication instead, a sample that
    waited 0.3 s for the other collectors (a loaded machine) moved 0.3 s of power across a run's edge, a
    few percent of an 8 s run."""
    if snapshot.monotonic is None:
        return 0.0
    read = [g.read_at for g in snapshot.gpus if g.up and g.read_at is not None]
    if not read:
        return 0.0
    age = snapshot.monotonic - max(read)
    return age if 0.0 <= age <= MAX_READING_AGE_S else 0.0

"""What the GPU collector remembers per GPU between samples: its energy and its idle power.

Energy comes from NVML's energy counter where the GPU has one (Volta and newer), every reading checked for
plausibility before it is exposed (``core.energy.EnergyCounter``: bad readings are held back and counted,
driver resets confirmed before they show). The counter is read every ``--collector.energy-interval`` (about
4 ms of CPU a read on a real driver); the samples in between get their energy from the power readings
(``core.apportion.Apportioner``), so the exposed energy and the runs and pods charged from it keep the
collector's time grid and sum exactly to the counter at each read. Otherwise from a fast power sampler
thread (``PowerSampler``) integrating instant power with the trapezoid rule. The idle baseline is learned
from power while no compute process runs. Readings arrive in base units (``core.state.GPUReading``): nothing
here converts a unit.

Touched only by the sampler thread, except a track's integrator, which ``PowerSampler`` feeds from its own
thread. Never called from the scrape path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.gpu_metrics import (
    ENERGY,
    ENERGY_REJECTED,
    ENERGY_RESETS,
    IDLE_POWER,
    label_sets,
    put,
)
from gpu_energy_exporter.core.apportion import Apportioner
from gpu_energy_exporter.core.energy import EnergyCounter, TrapezoidIntegrator, Verdict
from gpu_energy_exporter.core.metrics import add
from gpu_energy_exporter.core.state import EnergySpan, GPUIdentity, GPUReading, GPUState, ProcessSample
from gpu_energy_exporter.devices.base import GPUBackend

log = logging.getLogger(__name__)


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


def max_power_w(r: GPUReading) -> float | None:
    """The most this reading says the GPU can draw: its enforced limit, or a power reading above it."""
    known = [w for w in (r.power_limit_w, r.power_average_w, r.power_instant_w) if w is not None]
    return max(known) if known else None


def wall_minus_monotonic(wall: Callable[[], float], monotonic: Callable[[], float]) -> float:
    """The wall clock minus the monotonic one, from the tightest of three paired reads: a thread that loses
    the GIL between its two clock reads would otherwise date every reading of this sample by that wait."""
    best_gap, best = float("inf"), 0.0
    for _ in range(3):
        m0 = monotonic()
        w = wall()
        gap = monotonic() - m0
        if gap < best_gap:
            best_gap, best = gap, w - (m0 + 0.5 * gap)
        if gap < 1e-4:
            break
    return best


def reading_time(r: GPUReading, started: float, done: float, offset: float) -> float:
    """When a reading's counter and power fields were read, on the monotonic clock: the driver's batched read
    (``GPUReading.fields_at``) held within the read, ``started``..``done``; ``started`` without one. Timed
    by ``started`` alone, a read that waited 0.15 s for the GIL before reaching the driver (a loaded
    machine) charged a run's edge that much of the GPU's power: +-2% of a 15 s run."""
    if r.fields_at is None:
        return started
    return min(max(r.fields_at - offset, started), done)


@dataclass
class GPUTrack:
    """Mutable per-GPU state, touched only by the sampler thread (the integrator also by PowerSampler)."""

    identity: GPUIdentity
    counter: EnergyCounter = field(default_factory=EnergyCounter)
    integrator: TrapezoidIntegrator | None = None
    logged: set[str] = field(default_factory=set)  # rejection reasons already logged at warning level
    fresh: bool = False  # this sample's energy counter reading was accepted
    idle: IdleBaseline = field(default_factory=IdleBaseline)
    reading: GPUReading | None = None
    last_good: float | None = None
    read_at: float | None = None  # the collector's monotonic clock when the energy exposed was read
    up: bool = False
    error: str = ""
    apportion: Apportioner = field(default_factory=Apportioner)  # on the monotonic total (in-process use)
    series: Apportioner = field(default_factory=Apportioner)  # on the driver's value (what /metrics shows)
    reset_seen: bool = False  # count_energy confirmed a counter reset this sample
    estimated: bool = False  # this sample's energy is the counter's last total plus the power since
    next_counter_read: float = float("-inf")  # monotonic time the energy counter is next read
    counter_reads: int = 0  # accepted reads so far (the first spans are short)
    #: per-process samples (monotonic) gathered since the last counter read, handed on with the next one
    samples: list[ProcessSample] = field(default_factory=list)
    span: EnergySpan | None = None  # where the energy stands since the last counter read (settlement)

    # ---- the energy counter's schedule

    def counter_due(self, now: float) -> bool:
        """Read the counter this sample: its time has come, or a reading waits to be confirmed."""
        return now >= self.next_counter_read or self.counter.holding

    def apportion_sample(self, r: GPUReading, done: float, energy_interval: float, *, asked: bool) -> None:
        """After ``count_energy`` (or without a counter reading this sample): the exposed energy on the
        sample grid. ``done``: the monotonic time the reading returned (the schedule's clock). The energy
        between readings is timed by ``read_at``, the monotonic time each reading was taken: a step of the
        wall clock moves no estimate (timed by the readings' wall-clock timestamps, a step dropped one
        sample's energy until the next counter read). ``asked``: this sample asked for the counter; a counter
        that was asked and could not be read leaves the sample absent, as a rejected reading does."""
        average = r.power_average_w is not None
        power = r.power_average_w if average else r.power_instant_w
        # The total is timed by the read it came from (``read_at``): at start-up that is the read that
        # confirmed this sample's, taken after it (by a read's latency; on a loaded machine tenths of a
        # second), and the span from there to the next read teaches the scale. Timed by this sample's
        # reading, 0.4 s between the two reads made the first 3 s span's power readings look 15% high.
        t = self.read_at if self.read_at is not None else done
        self.estimated = False
        c = self.counter
        if self.fresh and c.total_j is not None and c.exposed_j is not None:
            self.apportion.counter(t, c.total_j, power, average=average)
            self.series.counter(t, c.exposed_j, power, average=average, restart=self.reset_seen)
            # The first spans are short (2, 4, 8, ... s up to the interval): the power readings' scale
            # against the counter is learned within seconds of start-up.
            self.counter_reads += 1
            self.next_counter_read = done + min(energy_interval, 2.0 ** self.counter_reads)
            self._span(settled=True)
        else:
            if power is not None and self.apportion.value_j is not None:
                # The in-process total goes on by the power readings (the span's shape, settled at the next
                # read) even when a read was asked and held back or rejected; the exposed series does not:
                # such a sample is absent there, as without a schedule (see emit_energy).
                self.apportion.power(t, power, average=average)
                if not asked:
                    self.series.power(t, power, average=average)
                    self.estimated = True
            self._span(settled=False)
        self.reset_seen = False

    def add_samples(self, samples: tuple[ProcessSample, ...], offset: float) -> None:
        """Per-process samples of this sample's reading (wall-clock times, ``offset``: wall minus monotonic
        now), kept on the monotonic clock until the counter read that settles their span."""
        if samples and len(self.samples) < 4096:
            self.samples.extend(ProcessSample(s.pid, s.sm_pct, s.start - offset, s.end - offset) for s in samples)

    def _span(self, *, settled: bool) -> None:
        """The span since the last counter read, as consumers settle it (``core.settle``)."""
        a = self.apportion
        anchor = a.anchor
        if anchor is None:
            self.span = None
            return
        samples: tuple[ProcessSample, ...] = ()
        if settled:
            samples, self.samples = tuple(self.samples), []
        self.span = EnergySpan(anchor_j=anchor[1], anchor_at=anchor[0], raw_j=a.raw_j, whole=a.whole,
                               scale=a.scale, closed=a.closed if settled else None, samples=samples,
                               anchor_counter_j=self.counter.exposed_j)

    # ---- the energy counter

    def count_energy(self, backend: GPUBackend, r: GPUReading, started: float, done: float,
                     monotonic: Callable[[], float], offset: float) -> None:
        """Feed the counter one reading. ``started``/``done``: the monotonic clock around the read (the
        counter was read in between); ``offset``: the wall clock minus the monotonic one."""
        assert r.energy_j is not None
        self._judge(self.counter.update(r.energy_j, done, started=started, stamp=r.timestamp,
                                        max_power_w=max_power_w(r)))
        if self.counter.awaiting_first:
            # Nothing trusted yet (start-up): a second reading now confirms the first, so the counter is
            # exposed from the first sample instead of one interval later.
            try:
                started = monotonic()
                again = backend.read(self.identity)
            except Exception:  # noqa: BLE001 - one GPU never takes the others down; the next update reports it
                log.debug("GPU %d: confirming read of the energy counter failed", self.identity.index, exc_info=True)
                return
            if again.energy_j is not None:
                self._judge(self.counter.update(again.energy_j, monotonic(), started=started,
                                                stamp=again.timestamp, max_power_w=max_power_w(again)))
                if self.fresh:
                    # the energy exposed is this read's: it is timed by it, and so is the reading the frames
                    # date the GPU by (its driver stamp beside ``read_at``): with the first read's stamp, a GPU
                    # read before a slow one carried its energy over the first read's lag, not the second's
                    self.read_at = reading_time(again, started, monotonic(), offset)
                    if self.reading is not None and again.fields_at is not None:
                        self.reading = replace(self.reading, fields_at=again.fields_at)

    def _judge(self, v: Verdict) -> None:
        g, c = self.identity, self.counter
        self.fresh = v.accepted
        for reason in v.rejected:
            level = logging.DEBUG if reason in self.logged else logging.WARNING
            self.logged.add(reason)
            log.log(level, "GPU %d (%s): energy counter reading rejected as implausible (%s); the counter "
                    "stays at %s J and has no sample until a reading is accepted. Counted in "
                    "gpuenergy_gpu_energy_rejected_readings_total; the rules are in docs/measurement.md. "
                    "Further ones are logged at debug level.", g.index, g.uuid, reason,
                    "none" if c.exposed_j is None else f"{c.exposed_j:.3f}")
        if v.reset:
            self.reset_seen = True
            log.info("GPU %d (%s): energy counter reset (driver reload or GPU reset) confirmed, now %.3f J; "
                     "credited %.1f J for the part of the interval before it", g.index, g.uuid,
                     c.exposed_j or 0.0, v.credit_j)

    def _exposed(self) -> tuple[float | None, float | None]:
        """The exposed energy (J) and the wall time it was measured at."""
        if self.integrator is not None:
            return (self.integrator.energy_j, self.integrator.last_t) if self.integrator.samples else (None, None)
        c, value = self.counter, self.series.value_j
        if value is None:
            return c.exposed_j, c.exposed_stamp
        # The driver's own value (it drops at a confirmed reset), moved on by the energy apportioned since.
        stamp = self.reading.timestamp if self.estimated and self.reading is not None else c.exposed_stamp
        return value, stamp

    def emit_energy(self, fams: dict[str, Metric], labels: list[str], timestamps: bool) -> None:
        energy, when = self._exposed()
        # The counter is exposed only when this sample's reading was accepted. Held back, unreadable or lost,
        # it is absent (Prometheus marks it stale): the next accepted value then spreads over the gap in
        # rate()/increase(), where a held flat value would pour the gap's energy into the scrape after it
        # and over-count any window starting inside the gap. No timestamp by default (Prometheus' exporter
        # guidelines): the scrape time is used.
        sets = label_sets(labels[0], labels[1])
        if energy is not None and (self.fresh or self.estimated or self.integrator is not None):
            put(fams, ENERGY, sets.base, energy, timestamp=when if timestamps else None)
        if self.integrator is None:
            put(fams, ENERGY_RESETS, sets.base, float(self.counter.resets))
            rejected = self.counter.rejected
            for reason, reason_labels in sets.rejected.items():
                put(fams, ENERGY_REJECTED, reason_labels, float(rejected[reason]))

    def energy(self) -> float | None:
        """Monotonic energy for in-process consumers (ledger, pod attribution)."""
        if self.integrator is not None:
            return self.integrator.energy_j if self.integrator.samples else None
        return self.apportion.value_j if self.apportion.value_j is not None else self.counter.total_j

    # ---- idle power

    def learn_idle(self, r: GPUReading) -> None:
        """A reading with no compute process running is an idle sample (the ~1 s average, else instant)."""
        power = r.power_average_w if r.power_average_w is not None else r.power_instant_w
        if r.processes is not None and not r.processes and power is not None:
            self.idle.add(power)

    def idle_power(self, flag_w: float | None) -> tuple[float | None, str]:
        if flag_w is not None:
            return flag_w, "flag"
        return self.idle.value, "learned"

    def emit_idle(self, fams: dict[str, Metric], labels: list[str], flag_w: float | None) -> None:
        idle, source = self.idle_power(flag_w)
        if idle is not None:
            add(fams[IDLE_POWER.name], [*labels, source], idle)

    def state(self, idle_flag_w: float | None) -> GPUState:
        idle, source = self.idle_power(idle_flag_w)
        return GPUState(
            identity=self.identity, up=self.up, reading=self.reading, energy_j=self.energy(),
            energy_resets=self.counter.resets, last_good=self.last_good, idle_power_w=idle,
            idle_power_source=source, error=self.error, read_at=self.read_at,
            span=self.span if self.integrator is None else None,
        )


class PowerSampler:
    """Fast sampler integrating instant power for GPUs without an energy counter (pre-Volta).

    Ticks on a fixed schedule (``interval``, 20 ms at the lowest) so the trapezoid intervals stay even;
    GPUs with an energy counter are never polled here.
    """

    def __init__(self, backend: GPUBackend, tracks: list[GPUTrack], interval: float,
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
                watts = self._backend.read_power_w(t.identity)
            except Exception:  # noqa: BLE001 - GPULost or worse: the main sampler reports it
                continue
            if watts is not None and t.integrator is not None:
                t.integrator.add(self._clock(), watts)

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

"""Energy accounting primitives: a plausibility filter over the driver's energy counter, and trapezoid
integration of sampled power.

Pure arithmetic with explicit inputs (values in joules, times in seconds on one monotonic clock), no I/O
and no clocks of their own, so every edge (reset, bad reading, outage, gap) is unit-testable with plain
values. The rules are stated in docs/measurement.md ("Which readings are trusted"). No millijoules here:
NVML's integer millijoule counter becomes joules once, in ``devices.base.joules`` (millijoules / 1000, the
value /metrics has always shown), and the checks below need no more exactness than that float has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Reasons a reading is rejected (the ``reason`` label of ``gpuenergy_gpu_energy_rejected_readings_total``).
REJECT_DECREASE = "decrease"  # below the last accepted value, and not a counter that restarted
REJECT_JUMP = "jump"  # above the last accepted value by more than the GPU could draw in the time
REJECT_UNCONFIRMED = "unconfirmed"  # a reading at start-up (nothing accepted yet) that the next one contradicted
REJECT_REASONS: tuple[str, ...] = (REJECT_DECREASE, REJECT_JUMP, REJECT_UNCONFIRMED)

#: Plausibility margin over the power limit: boost and transients overshoot the enforced limit briefly.
POWER_MARGIN = 1.5
#: Time slack (seconds of capped power) for the counter's update granularity and read-time jitter.
SLACK_S = 0.2
#: Power assumed when the GPU reports no power limit: above any single GPU sold today.
FALLBACK_POWER_W = 2000.0


@dataclass(frozen=True)
class _Point:
    raw_j: float
    t: float  # monotonic seconds, when the read had returned
    started: float  # monotonic seconds, when the read began (a slow driver can take seconds)
    stamp: float  # the caller's timestamp for the exposition (wall clock)


@dataclass(frozen=True)
class Verdict:
    """What one reading did: ``accepted`` (the exposed value moved to it), readings ``rejected`` by this
    update (this reading, or a held one it contradicted), ``reset`` (a reset was confirmed) and the
    ``credit_j`` that reset added to ``total_j``."""

    accepted: bool
    rejected: tuple[str, ...] = ()
    reset: bool = False
    credit_j: float = 0.0


@dataclass
class EnergyCounter:
    """The driver's energy counter, with every reading checked before it is trusted.

    A reading is **accepted** when it is plausible against the last accepted one: it did not go down, and
    it did not rise by more than the GPU could draw in the elapsed time (``cap``: ``POWER_MARGIN`` x the
    power limit, for the time plus ``SLACK_S``). A **reset** (driver reload, GPU reset) is a decrease to a
    value no larger than what the GPU could have drawn since the last accepted reading: that reading is
    held as a candidate and the reset is confirmed only if the next reading grows from it at a plausible
    power (and does not fit the old counter better). Anything else is a **bad reading**: held back (the
    counter keeps its last accepted value), counted per reason in ``rejected``. Until two consecutive
    readings agree nothing is exposed, so a bad first reading never becomes the baseline.

    ``exposed_j`` is the driver's own value (no base added): a confirmed reset makes it drop, which
    Prometheus' ``rate()``/``increase()`` treat as the counter reset it is, and an exporter restart
    changes nothing in it. ``total_j`` is monotonic across resets for in-process consumers (ledger, pod
    attribution): it adds the last value before each reset, plus a credit for the part of that interval
    the new counter does not cover, at most ``interval_s`` x the last measured average power.
    """

    interval_s: float = 1.0
    margin: float = POWER_MARGIN
    slack_s: float = SLACK_S
    fallback_power_w: float = FALLBACK_POWER_W
    resets: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    _accepted: _Point | None = None
    _candidate: _Point | None = None
    _base_j: float = 0.0
    _rate_w: float | None = None  # average power over the last accepted step of at least a quarter interval
    _power_w: float | None = None  # the most the GPU is known to draw (power limit or reading), highest seen

    # ---- what the counter shows

    @property
    def exposed_j(self) -> float | None:
        """The last accepted driver value (J), or None before two readings agreed."""
        return None if self._accepted is None else self._accepted.raw_j

    @property
    def exposed_stamp(self) -> float | None:
        """The caller's timestamp of the last accepted reading."""
        return None if self._accepted is None else self._accepted.stamp

    @property
    def total_j(self) -> float | None:
        """Monotonic energy since the first accepted reading's driver load, resets absorbed and credited."""
        return None if self._accepted is None else self._base_j + self._accepted.raw_j

    @property
    def awaiting_first(self) -> bool:
        """True while a first reading waits for a second one to confirm it."""
        return self._accepted is None and self._candidate is not None

    @property
    def holding(self) -> bool:
        """True while a candidate reset (or an unconfirmed first reading) is held."""
        return self._candidate is not None

    def cap_j(self, dt: float) -> float:
        """The most energy the GPU could plausibly have drawn in ``dt`` seconds."""
        power = self._power_w if self._power_w else self.fallback_power_w
        return self.margin * power * (max(dt, 0.0) + self.slack_s)

    # ---- readings

    def update(self, raw_j: float, t: float, *, started: float | None = None, stamp: float | None = None,
               max_power_w: float | None = None) -> Verdict:
        """Feed one reading: ``raw_j`` as the driver reports it; ``t`` when the read returned and ``started``
        when it began, on a monotonic clock (the counter was read somewhere in between: plausibility allows
        for the widest span, so a driver that turns slow does not make good readings look like jumps);
        ``stamp`` the caller's wall-clock time of the reading; ``max_power_w`` the most the GPU is known to
        draw (its enforced power limit, or a higher power reading); without one ``fallback_power_w``
        applies."""
        if max_power_w is not None and max_power_w > 0:
            self._power_w = max(self._power_w or 0.0, max_power_w)
        p = _Point(raw_j, t, t if started is None else min(started, t), t if stamp is None else stamp)
        rejected: list[str] = []
        c = self._candidate
        if c is not None:
            self._candidate = None
            if self._grows(c, p) and not (self._accepted is not None and self._grows(self._accepted, p)):
                if self._accepted is None:
                    self._accepted = p  # the first two readings agree
                    return Verdict(True)
                credit = self._credit(c)
                self._base_j += self._accepted.raw_j + credit
                self.resets += 1
                self._measure_rate(c, p)
                self._accepted = p
                return Verdict(True, reset=True, credit_j=credit)
            reason = REJECT_UNCONFIRMED if self._accepted is None else REJECT_DECREASE
            self.rejected[reason] += 1
            rejected.append(reason)
        a = self._accepted
        if a is None:
            self._candidate = p
            return Verdict(False, tuple(rejected))
        if self._grows(a, p):
            self._measure_rate(a, p)
            self._accepted = p
            return Verdict(True, tuple(rejected))
        if p.raw_j < a.raw_j and p.raw_j <= self.cap_j(p.t - a.started):
            self._candidate = p  # looks like a counter that restarted since a: confirm with the next one
            return Verdict(False, tuple(rejected))
        reason = REJECT_DECREASE if p.raw_j < a.raw_j else REJECT_JUMP
        self.rejected[reason] += 1
        rejected.append(reason)
        return Verdict(False, tuple(rejected))

    def _grows(self, a: _Point, b: _Point) -> bool:
        """b follows a: the counter did not go down and rose no faster than the GPU can draw."""
        return 0.0 <= b.raw_j - a.raw_j <= self.cap_j(b.t - a.started)

    def _measure_rate(self, a: _Point, b: _Point) -> None:
        # Not over an immediate re-read: the counter's update granularity would dominate a short step.
        if b.t - a.t >= 0.25 * self.interval_s:
            self._rate_w = (b.raw_j - a.raw_j) / (b.t - a.t)

    def _credit(self, c: _Point) -> float:
        """Energy of the part of the interval before the reset, which the new counter does not cover:
        the last average power over the interval minus what the new counter shows, within one interval."""
        a = self._accepted
        if a is None or self._rate_w is None or self._rate_w <= 0:
            return 0.0
        estimate = self._rate_w * max(0.0, c.t - a.t) - c.raw_j
        return min(max(0.0, estimate), self._rate_w * self.interval_s)


@dataclass
class TrapezoidIntegrator:
    """Integrate power samples (W, at unix times) into energy (J) with the trapezoid rule.

    Samples must arrive in time order; an out-of-order or duplicate timestamp is ignored. A gap longer
    than ``max_gap_s`` (the sampler was stalled, or the GPU did not answer) is bridged by holding the
    last power level rather than skipped: skipping would under-count, and ``gaps`` counts it so the
    approximation is visible.
    """

    max_gap_s: float = 5.0
    energy_j: float = 0.0
    last_t: float | None = None
    last_w: float | None = None
    samples: int = 0
    gaps: int = 0

    def add(self, t: float, watts: float) -> float:
        if self.last_t is not None and self.last_w is not None:
            dt = t - self.last_t
            if dt <= 0:
                return self.energy_j
            if dt > self.max_gap_s:
                self.gaps += 1
                self.energy_j += self.last_w * dt
            else:
                self.energy_j += 0.5 * (watts + self.last_w) * dt
        self.last_t, self.last_w = t, watts
        self.samples += 1
        return self.energy_j


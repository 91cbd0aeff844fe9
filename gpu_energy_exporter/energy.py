"""Energy accounting primitives: monotonic counters over resettable hardware counters, and trapezoid
integration of sampled power.

Pure arithmetic with explicit inputs (values and timestamps), no I/O and no clocks of their own, so every
edge (reset, wrap, gap) is unit-testable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MonotonicCounter:
    """Turn a raw counter that can go backwards (driver reload, GPU reset) into a monotonic one.

    The exposed value is ``base + raw``: it starts at the raw value (energy since the driver loaded, as
    NVML reports it) and, when raw drops, ``base`` absorbs the last raw value so the exposed counter keeps
    rising from where it was. Energy between the last sample before the reset and the reset itself is not
    covered by any reading: the caller may pass an estimate for the interval (``gap_estimate``), which is
    credited when larger than what the new counter shows; ``resets`` counts these events.
    """

    base: float = 0.0
    last_raw: float | None = None
    resets: int = 0

    def update(self, raw: float, gap_estimate: float | None = None) -> float:
        """``gap_estimate``: energy over the whole interval since the previous reading, estimated some
        other way (average power x time). On a reset the counter only covers the time since the reset, so
        the larger of the two is credited for the interval: the loss becomes an estimate, not a gap."""
        if self.last_raw is not None and raw < self.last_raw:
            credited = max(raw, gap_estimate) if gap_estimate is not None else raw
            self.base += self.last_raw + (credited - raw)
            self.resets += 1
        self.last_raw = raw
        return self.base + raw

    @property
    def value(self) -> float | None:
        return None if self.last_raw is None else self.base + self.last_raw


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


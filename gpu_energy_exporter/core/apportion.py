"""Energy between two reads of the driver's energy counter, apportioned by the power readings.

On a real driver one read of the energy counter costs about 4 ms of CPU (an H100 on driver 580,
docs/benchmarks.md), where the power readings cost microseconds; so the counter is read every
``--collector.energy-interval`` and the samples in between get their energy from the power the GPU reported.
``Apportioner`` keeps the exposed energy of one GPU on the collector's time grid:

- between two counter reads, each sample adds the power reading times the time since the previous sample
  (the driver's ~1 s average power, which integrates the power between samples the way the counter does:
  +0.15% against the counter on the H100; instant power, a 25 ms window every 100 ms, with the trapezoid rule
  only where the GPU has no average);
- at a counter read the exposed energy becomes the counter's total: the sample that reads it carries the
  difference, so over every span between two counter reads the apportioned energy sums exactly to the
  counter's delta;
- the exposed energy never goes down: when the estimate ran ahead of the counter (the GPU's power fell
  faster than the 1 s average showed), it is held until counter plus estimate catch up, and the sums are
  exact again from the read where they do.

Pure arithmetic on explicit inputs (joules, watts, seconds on one monotonic clock): no I/O, no clocks. It
must never decide whether a counter reading is plausible (``core.energy.EnergyCounter`` does, and feeds it
only its monotonic total).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: The power readings' scale against the counter is learned only within these bounds (a ratio outside them
#: is a span the readings did not cover, not a bias of the sensor).
SCALE_MIN, SCALE_MAX = 0.5, 2.0
#: ... and only over a span with at least this much estimated energy (J): the counter's granularity.
SCALE_MIN_J = 50.0
#: The scale is the ratio of the sums over this many recent spans: a sensor's bias persists, the random error
#: of one span's estimate (a 1 s average that sampled a burst or missed it) averages out.
SCALE_SPANS = 8


@dataclass
class Apportioner:
    """The exposed, monotonic energy of one GPU between counter reads. ``max_gap_s``: a gap between samples
    longer than this (a GPU that did not answer) adds no estimate; the next counter read covers it.

    The power readings are scaled by what the counter said of them over the last spans between two reads
    (``scale``: the counter's deltas over the power-integrated estimates, summed over ``SCALE_SPANS`` spans):
    a power sensor that reads high, or a 1 s average that aliases a periodic load, is then corrected by the
    counter it is measured against (on the H100 the driver's power-sample buffer read 695 W where the counter
    gave 619 W)."""

    max_gap_s: float = 10.0
    #: The exposed energy (J), None until the first counter total.
    value_j: float | None = None
    #: The power readings' scale learned from the last spans (1.0 until one was measured).
    scale: float = 1.0
    _spans: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=SCALE_SPANS))
    _anchor_j: float | None = None  # the counter's total at its last read
    _anchor_t: float | None = None  # ... and when it was read
    _estimate_j: float = 0.0  # scaled power-integrated energy since that read
    _raw_j: float = 0.0  # the same, unscaled, for learning the scale
    _whole: bool = True  # every step of the span since the last read was estimated (no gap)
    _last_t: float | None = None
    _last_w: float | None = None
    #: the span the last counter read closed: (start t, start total, raw estimate over it, whole); None when
    #: that read opened the first span or restarted the counter (settlement: ``core.settle``)
    closed: tuple[float, float, float, bool] | None = None

    @property
    def anchor(self) -> tuple[float, float] | None:
        """(time, total) of the last counter read, None before the first."""
        if self._anchor_j is None or self._anchor_t is None:
            return None
        return self._anchor_t, self._anchor_j

    @property
    def raw_j(self) -> float:
        """The unscaled power-integrated estimate since the last counter read (the span's shape so far)."""
        return self._raw_j

    @property
    def whole(self) -> bool:
        """Every step since the last counter read had a power reading (no gap)."""
        return self._whole

    def _step(self, t: float, watts: float | None, average: bool) -> float:
        """The unscaled energy estimate from the last sample to ``t`` (0 over a gap or without power)."""
        last_t, last_w = self._last_t, self._last_w
        self._last_t = t
        if watts is not None:
            self._last_w = watts
        if last_t is None or watts is None or watts < 0.0:
            self._whole = False
            return 0.0
        dt = t - last_t
        if not 0.0 < dt <= self.max_gap_s:
            self._whole = self._whole and dt == 0.0
            return 0.0
        # The average reading covers about the second before t; instant readings by the trapezoid rule.
        return watts * dt if average or last_w is None else 0.5 * (watts + last_w) * dt

    def counter(self, t: float, total_j: float, watts: float | None = None, *, average: bool = True,
                restart: bool = False) -> float:
        """A fresh counter total read at ``t`` with the power read beside it: the exposed energy moves to it
        (never down, unless ``restart``: the driver's counter itself restarted, and what it shows restarts
        with it), and the span that ends here teaches the power readings' scale."""
        raw = self._raw_j + self._step(t, watts, average)
        if self._anchor_j is not None and not restart and self._whole and raw >= SCALE_MIN_J:
            delta = total_j - self._anchor_j
            if SCALE_MIN <= delta / raw <= SCALE_MAX:
                self._spans.append((delta, raw))
                self.scale = sum(d for d, _ in self._spans) / sum(r for _, r in self._spans)
        self.closed = None
        if self._anchor_j is not None and self._anchor_t is not None and not restart and t > self._anchor_t:
            self.closed = (self._anchor_t, self._anchor_j, raw, self._whole)
        self._anchor_j, self._anchor_t, self._estimate_j, self._raw_j, self._whole = total_j, t, 0.0, 0.0, True
        self.value_j = total_j if self.value_j is None or restart else max(self.value_j, total_j)
        return self.value_j

    def power(self, t: float, watts: float, *, average: bool) -> float | None:
        """A power reading at ``t`` (``average``: the driver's ~1 s average, else an instant reading): the
        exposed energy grows by the scaled estimate since the last sample; None before the first counter
        read."""
        inc = self._step(t, watts, average)
        self.closed = None
        if self.value_j is None or self._anchor_j is None:
            return self.value_j
        self._raw_j += inc
        self._estimate_j += self.scale * inc
        self.value_j = max(self.value_j, self._anchor_j + self._estimate_j)
        return self.value_j

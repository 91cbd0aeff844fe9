"""One counter series of a run (a metric and a label set) as the run ledger keeps it: its baseline, its last
point, its value at the warm-up boundary and its recent points, from which its value at an earlier time is
interpolated (the counters /metrics serves as of a run's settled time: ``views``).

Plain data with one pure method: no clock, no lock, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: Points kept per counter series for ``SeriesState.value_at`` (a minute of exports every second).
SERIES_HISTORY = 64


@dataclass(slots=True)
class SeriesState:
    """One counter series (a metric + label set) of a run."""

    name: str
    rank: str
    baseline: float
    last_t: float
    last_v: float
    at_w: float | None = None  # value at the warm-up boundary, once a point at or after it arrived
    count: float = 0.0  # histograms: cumulative count (value is the cumulative sum)
    gpus: tuple[str, ...] = ()  # uuid keys of the series' gpu_uuid label (local or remote rank)
    #: the recent points (t, value), oldest first: the value at an earlier time (``value_at``), for the
    #: counters /metrics serves as of the run's settled time (``views``)
    hist: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=SERIES_HISTORY))

    def value_at(self, t: float) -> float:
        """The series' value at ``t`` (less its baseline): interpolated between the points around ``t``, the
        last one from ``t`` on, the oldest one kept before it."""
        if t >= self.last_t or not self.hist:
            return self.last_v - self.baseline
        after = None
        for pt, pv in reversed(self.hist):
            if pt <= t:
                if after is None or after[0] <= pt:
                    return pv - self.baseline
                return pv + (after[1] - pv) * (t - pt) / (after[0] - pt) - self.baseline
            after = (pt, pv)
        return self.hist[0][1] - self.baseline

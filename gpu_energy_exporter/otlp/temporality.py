"""Series folding: how a stream of OTLP points becomes the values a Prometheus series exposes.

How temporality becomes a Prometheus counter, and why (``rate()`` / ``increase()`` must be right):

- Delta sums and delta histograms are accumulated into a cumulative total here (spec: delta monotonic
  sums "SHOULD be converted to a cumulative temporality"). A delta point whose time is not after the
  series' last one is a retry or a duplicate and is dropped (``out_of_order``), so a retried export never
  counts twice.
- Cumulative points are exposed as ``base + value``. ``base`` starts at 0, so while one trainer process
  runs the exposed counter is exactly the value it sent, as with the Collector or Prometheus's receiver.
  When a trainer restarts (a new ``start_time_unix_nano``, or the value goes down) the last exposed
  total is folded into ``base`` and counting continues from there: the exposed counter never goes down.
  Exposing the trainer's raw value instead (what a scrape of the trainer would show) makes Prometheus see
  a reset, and its reset handling loses whatever happened between the last scrape and the restart plus
  the new process's count whenever that already exceeds the old value; folding loses neither, keeps
  ``rate()`` identical everywhere else, and gives the run ledger one monotonic total per run across
  restarts (``gpuenergy_otlp_stream_restarts_total`` counts them). Histograms are folded bucket by
  bucket the same way; a histogram whose layout changes (other bounds, or buckets appearing or going)
  cannot be folded and starts afresh, as a counter reset (Prometheus's ``rate()`` handles it).
- A point that would make a total non-finite (a delta sum overflowing) is rejected (``non_finite``) and
  leaves the series as it was (``Stream.state`` / ``restore``; the store checks ``totals_finite``).
- Gauges and cumulative non-monotonic sums expose the last value (older points are dropped); summaries
  are exposed as sent.
- A point's time orders its stream and nothing else: a cumulative point of the same stream dated before
  the last one but with more progress (a higher value or count), or any point dated more than
  ``CLOCK_STEP_NS`` before the last one, means the sender's clock stepped back; it is taken and orders the
  stream from then on. A retried export (no more progress, seconds old) is still ``out_of_order``.

Pure: ``update`` takes a ``Point`` and a ``Stream`` (plain values) and returns how many restarts it folded.
This module never takes a lock, never starts a thread, never reads a clock and never encodes a line; the
store (``otlp.store``) does all of that around it.
"""

from __future__ import annotations

import math
import operator
from itertools import accumulate

from gpu_energy_exporter.otlp.points import Kind, Point


class OutOfOrder(Exception):
    """The point is older than the series' last one, a retried delta, or from an earlier stream."""


#: What an update may change (``Stream.state``).
State = tuple[int, int, bool, float, float, tuple[float, ...], list[float], list[float], float, float, float, float,
              bool, tuple[tuple[float, float], ...]]


class Stream:
    """The folding state of one series. Counters and histograms keep ``base`` (folded earlier streams)
    apart from ``raw`` (the current cumulative stream), see the module docstring."""

    __slots__ = ("start_ns", "time_ns", "delta", "base", "raw", "bounds", "base_counts", "raw_counts", "base_sum",
                 "raw_sum", "base_count", "raw_count", "has_sum", "quantiles")

    def __init__(self) -> None:
        self.start_ns = 0
        self.time_ns = 0
        self.delta = False
        self.base = 0.0
        self.raw = 0.0
        self.bounds: tuple[float, ...] = ()
        self.base_counts: list[float] = []
        self.raw_counts: list[float] = []
        self.base_sum = 0.0
        self.raw_sum = 0.0
        self.base_count = 0.0
        self.raw_count = 0.0
        self.has_sum = False
        self.quantiles: tuple[tuple[float, float], ...] = ()

    def state(self) -> State:
        """What an update may change (lists are replaced, never mutated): restored when one fails."""
        return (self.start_ns, self.time_ns, self.delta, self.base, self.raw, self.bounds, self.base_counts,
                self.raw_counts, self.base_sum, self.raw_sum, self.base_count, self.raw_count, self.has_sum,
                self.quantiles)

    def restore(self, state: State) -> None:
        (self.start_ns, self.time_ns, self.delta, self.base, self.raw, self.bounds, self.base_counts,
         self.raw_counts, self.base_sum, self.raw_sum, self.base_count, self.raw_count, self.has_sum,
         self.quantiles) = state

    def totals_finite(self) -> bool:
        """Counter and histogram totals are finite (gauges may hold NaN or +-Inf)."""
        isfinite = math.isfinite
        return (isfinite(self.base) and isfinite(self.raw) and isfinite(self.base_sum) and isfinite(self.raw_sum)
                and isfinite(self.base_count) and isfinite(self.raw_count))


def update(p: Point, s: Stream, new: bool) -> int:
    """Fold ``p`` into ``s`` (``new``: the series has no point yet); returns the stream restarts folded.
    Raises ``OutOfOrder`` before changing anything."""
    kind = p.kind
    if kind == "counter":
        return _update_counter(p, s, new)
    if kind == "histogram":
        return _update_histogram(p, s, new)
    # gauge, unknown, summary: the last value wins
    if not new and p.time_ns < s.time_ns and not _clock_stepped_back(p, s):
        raise OutOfOrder("point older than the last one")
    s.raw = p.value if kind != "summary" else 0.0
    s.quantiles = p.quantiles
    s.raw_count = float(p.count)
    s.raw_sum = p.sum if p.sum is not None else 0.0
    s.time_ns = p.time_ns
    return 0


def _update_counter(p: Point, s: Stream, new: bool) -> int:
    if new:
        s.delta, s.start_ns, s.time_ns = p.delta, p.start_ns, p.time_ns
        s.base, s.raw = (p.value, 0.0) if p.delta else (0.0, p.value)
        return 0
    restarts = 0
    if p.delta:
        if p.time_ns <= s.time_ns:
            raise OutOfOrder("delta point not after the last one (a retry or duplicate)")
        if not s.delta:  # cumulative -> delta: keep the total, accumulate from here
            s.base += s.raw
            s.raw = 0.0
            s.delta = True
        s.base += p.value
    elif s.delta:  # delta -> cumulative: a new stream on top of what was counted
        s.delta, s.raw, s.start_ns = False, p.value, p.start_ns
    elif p.start_ns != s.start_ns:
        if p.start_ns < s.start_ns:
            raise OutOfOrder("point from an earlier stream (older start time)")
        restarts = _fold_counter(s, p.value)
        s.start_ns = p.start_ns
    elif p.time_ns < s.time_ns:
        if not (p.value > s.raw or _clock_stepped_back(p, s)):
            raise OutOfOrder("point older than the last one")
        # The same stream, more progress, an earlier time: the sender's clock stepped back. The point's
        # time orders the stream from now on.
        s.raw, s.time_ns = p.value, p.time_ns
        return 0
    elif p.value < s.raw:
        restarts = _fold_counter(s, p.value)  # went down without a new start time: still a restart
    else:
        s.raw = p.value
    s.time_ns = max(s.time_ns, p.time_ns)
    return restarts


#: A point this much older than its series' last one is not a retried export (an exporter retries for
#: seconds, never holds a point for minutes): the sender's clock stepped back.
CLOCK_STEP_NS = 120 * 10**9


def _clock_stepped_back(p: Point, s: Stream) -> bool:
    if s.time_ns - p.time_ns <= CLOCK_STEP_NS:
        return False
    s.time_ns = p.time_ns  # ordered by the sender's new clock from here on
    return True


def _fold_counter(s: Stream, value: float) -> int:
    s.base += s.raw
    s.raw = value
    return 1


def _update_histogram(p: Point, s: Stream, new: bool) -> int:
    counts = [float(c) for c in p.counts]
    psum = p.sum if p.sum is not None else 0.0
    restarts = 0
    if not new and (p.bounds != s.bounds or len(counts) != len(s.raw_counts)):
        if p.time_ns < s.time_ns:
            raise OutOfOrder("point older than the last one")
        new = True  # a different bucket layout cannot be folded: a reset, the series starts afresh
        restarts = 1
    if new:
        s.bounds = p.bounds
        s.delta, s.start_ns, s.time_ns = p.delta, p.start_ns, p.time_ns
        s.has_sum = p.sum is not None
        zero = [0.0] * len(counts)
        if p.delta:
            s.base_counts, s.base_sum, s.base_count = counts, psum, float(p.count)
            s.raw_counts, s.raw_sum, s.raw_count = zero, 0.0, 0.0
        else:
            s.base_counts, s.base_sum, s.base_count = zero, 0.0, 0.0
            s.raw_counts, s.raw_sum, s.raw_count = counts, psum, float(p.count)
        return restarts
    if p.delta:
        if p.time_ns <= s.time_ns:
            raise OutOfOrder("delta point not after the last one (a retry or duplicate)")
        if not s.delta:
            _fold_histogram(s, [0.0] * len(s.raw_counts), 0.0, 0.0)  # not a restart: the total carries on
            s.delta = True
        s.base_counts = [a + b for a, b in zip(s.base_counts, counts, strict=True)]
        s.base_sum += psum
        s.base_count += p.count
    elif s.delta:
        s.delta, s.start_ns = False, p.start_ns
        s.raw_counts, s.raw_sum, s.raw_count = counts, psum, float(p.count)
    elif p.start_ns != s.start_ns:
        if p.start_ns < s.start_ns:
            raise OutOfOrder("point from an earlier stream (older start time)")
        _fold_histogram(s, counts, psum, float(p.count))
        restarts = 1
        s.start_ns = p.start_ns
    elif p.time_ns < s.time_ns and not (p.count > s.raw_count or _clock_stepped_back(p, s)):
        raise OutOfOrder("point older than the last one")
    elif p.count < s.raw_count or any(map(operator.lt, counts, s.raw_counts)):  # same layout (else: above)
        _fold_histogram(s, counts, psum, float(p.count))
        restarts = 1
    else:
        s.raw_counts, s.raw_sum, s.raw_count = counts, psum, float(p.count)
    s.has_sum = s.has_sum and p.sum is not None
    s.time_ns = max(s.time_ns, p.time_ns)
    return restarts


def _fold_histogram(s: Stream, counts: list[float], psum: float, count: float) -> None:
    s.base_counts = [a + b for a, b in zip(s.base_counts, s.raw_counts, strict=True)]
    s.base_sum += s.raw_sum
    s.base_count += s.raw_count
    s.raw_counts, s.raw_sum, s.raw_count = counts, psum, count


def exposed(kind: Kind, s: Stream) -> tuple[float, ...]:
    """The exposed values, in the order of the series' sample lines (``layout``)."""
    if kind == "counter":
        return (s.base + s.raw,)
    if kind == "histogram":
        # the running sum of base + raw per bucket, the last (+Inf) bucket left out: it is the count
        base, raw = s.base_counts, s.raw_counts
        out = list(accumulate(map(operator.add, base[:-1], raw[:-1]), initial=0.0))[1:]
        total = s.base_count + s.raw_count
        out.append(total)
        out.append(total)
        if s.has_sum:
            out.append(s.base_sum + s.raw_sum)
        return tuple(out)
    if kind == "summary":
        return (*(v for _, v in s.quantiles), s.raw_count, s.raw_sum)
    return (s.raw,)


def reported(kind: Kind, s: Stream) -> tuple[float, float | None]:
    """(value, count) a listener is told (``store.AcceptedPoint``): the cumulative total for counters, the
    value for gauges, the cumulative ``_sum`` and ``_count`` for histograms and summaries."""
    if kind == "counter":
        return s.base + s.raw, None
    if kind == "histogram":
        return s.base_sum + s.raw_sum, s.base_count + s.raw_count
    if kind == "summary":
        return s.raw_sum, s.raw_count
    return s.raw, None


def layout(kind: Kind, s: Stream) -> object:
    """What the series' sample lines depend on besides its name and labels."""
    if kind == "histogram":
        return (s.bounds, s.has_sum)
    if kind == "summary":
        return tuple(q for q, _ in s.quantiles)
    return kind

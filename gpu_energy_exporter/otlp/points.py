"""What a translated request is: the ``Point`` and ``Batch`` the store applies, the per-point ``Limits``
and the estimated size of a series (``series_bytes``), which both the translation and the store bound; and
what the store answers (``ApplyResult``) and tells its listeners of each stored point (``AcceptedPoint``).

Plain data and arithmetic: this module never parses a request, never holds state and never imports
protobuf, the store or anything that does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["counter", "gauge", "unknown", "histogram", "summary"]
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-point bounds applied at translation (``otlp.translate``'s docstring); defaults are the flags'."""

    max_label_length: int = 2048
    max_labels_per_point: int = 32
    max_buckets_per_point: int = 256
    max_quantiles_per_point: int = 64
    max_series_bytes: int = 256 * 1024
    max_future_skew_ns: int = 86400 * 10**9  # a clock stepped by an hour loses nothing

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) <= 0 and name != "max_future_skew_ns":
                raise ValueError(f"{name} must be positive")
        if self.max_future_skew_ns < 0:
            raise ValueError("max_future_skew_ns must not be negative")


DEFAULT_LIMITS = Limits()

#: Fixed cost of one series in ``series_bytes`` (the objects that hold it, whatever its labels) and of
#: each of its samples (a ``Sample`` tuple and, for a bucket, its label dictionary), measured with
#: tracemalloc on helper-like series: the estimate is within a factor 1.5 of what the store holds.
SERIES_OVERHEAD_BYTES = 1024
SAMPLE_OVERHEAD_BYTES = 150


def series_bytes(name: str, labels: Labels, kind: str, buckets: int = 0, quantiles: int = 0) -> int:
    """Estimated memory a series costs the store: its exposition lines four times over (the sample heads
    built once per label set, the encoded lines, the family's encoded block they are joined into, and the
    label dictionary and values they are built from), and a fixed overhead. Used for
    ``--otlp.max-series-bytes`` and ``--otlp.max-bytes``; it grows linearly with what a push controls (label
    sizes, bucket and quantile counts), which is what matters for a bound."""
    return series_cost(name, label_chars(labels), kind, buckets, quantiles)


def label_chars(labels: Labels) -> int:
    return sum(len(k) + len(v) + 4 for k, v in labels)


def series_cost(name: str, label_chars: int, kind: str, buckets: int = 0, quantiles: int = 0) -> int:
    """``series_bytes`` with the labels' part already counted (``label_chars``)."""
    line = len(name) + label_chars + 32
    if kind == "histogram":
        samples = max(buckets, 1) + 2
        lines = (samples - 2) * (line + 20) + 2 * (line + 8)
    elif kind == "summary":
        samples = quantiles + 2
        lines = quantiles * (line + 24) + 2 * (line + 8)
    else:
        samples = 1
        lines = line
    return 4 * lines + SAMPLE_OVERHEAD_BYTES * samples + SERIES_OVERHEAD_BYTES


@dataclass(slots=True)
class Point:
    """One data point, translated and validated, ready for the store."""

    kind: Kind
    name: str  # Prometheus family name (counters end in _total)
    help: str
    unit: str  # Prometheus unit metadata, "" unless the name ends with it
    labels: Labels  # sorted by name, empty values dropped
    run_id: str
    start_ns: int
    time_ns: int
    delta: bool = False
    value: float = 0.0
    # cost, client and resource come before the distribution fields so that the translation of a scalar
    # point (nearly every point) passes all of its fields by position: keywords cost ~0.1 µs per point
    cost: int = 0  # series_bytes() of the series this point gives
    client: str = ""  # who pushed it (core.clientid): the peer address and the resource's process identity
    #: the translated attributes of the resource that carried the point (shared by its points; () when none):
    #: the run ledger reads which process pushed from it (core.contract LABEL_PROCESS_PID...)
    resource: Labels = ()
    bounds: tuple[float, ...] = ()  # histogram upper bounds (without +Inf)
    counts: tuple[int, ...] = ()  # histogram per-bucket counts, len(bounds) + 1 (or empty)
    count: int = 0  # histogram / summary count
    sum: float | None = None  # histogram / summary sum (None: not recorded)
    quantiles: tuple[tuple[float, float], ...] = ()  # summary (quantile, value)
    no_value: bool = False  # the sender marked the stream as ended
    admitted: bool = False  # the store's gate (the run ledger) admitted it: listeners need not check it again


@dataclass
class Batch:
    """Everything one request carried, after translation."""

    points: list[Point] = field(default_factory=list)
    received: int = 0  # data points in the request (accepted + rejected)
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    messages: dict[str, str] = field(default_factory=dict)  # reason -> first human-readable message
    resources: list[Labels] = field(default_factory=list)  # target_info label sets
    made: int = 0  # estimated bytes the translation made (otlp.census: POINT_MADE, LABEL_MADE, VALUE_MADE)

    def reject(self, reason: str, count: int, message: str) -> None:
        if count <= 0:
            return
        self.rejected[reason] = self.rejected.get(reason, 0) + count
        self.messages.setdefault(reason, message)


@dataclass(slots=True)
class AcceptedPoint:
    """What a listener (the run ledger) receives for every stored point (not frozen only because a frozen
    dataclass is three times slower to build, and one is built per stored point; do not modify one).

    ``value`` is what ``/metrics`` now exposes for the series: the cumulative total for counters, the
    value for gauges, the cumulative ``_sum`` for histograms and summaries (``count`` their ``_count``).
    ``time`` is the point's own timestamp in Unix seconds. ``labels`` is read-only. ``key`` is the same labels
    as the store's sorted tuple (``tuple(sorted(labels.items()))``), so a listener need not sort them again;
    ``None`` when the point was built elsewhere.
    """

    run_id: str
    name: str
    labels: Mapping[str, str]
    value: float
    time: float
    kind: Kind
    count: float | None = None
    key: Labels | None = None
    resource: Labels = ()  # the translated resource attributes of the request that carried it
    client: str = ""  # who pushed it (core.clientid)
    admitted: bool = False  # the gate (the run ledger) admitted it already: no need to check it again


Listener = Callable[[AcceptedPoint], None]
BatchListener = Callable[[list[AcceptedPoint]], None]
@dataclass
class ApplyResult:
    accepted: int
    rejected: dict[str, int]
    messages: dict[str, str]
    notices: list[str] = field(default_factory=list)  # accepted, but not as sent (a scoped run id)

"""The training store: Prometheus-ready series built from OTLP points, served on the scrape path.

``TrainingStore.apply(batch)`` folds translated points (``translate.Point``) into series;
``collect()`` returns fresh ``prometheus_client`` families for ``/metrics`` and ``render()`` the encoded
exposition. It is thread-safe (one lock; the receiver's request threads write, scrapes read).

Bounds (each a ``--otlp.*`` flag; every refusal is counted in ``gpuenergy_otlp_points_rejected_total`` by
reason and named, with its flag, in the request's ``partial_success``):

- Count and bytes: at most ``max_series`` series, ``max_series_per_run`` per run id and ``max_bytes``
  estimated bytes (``translate.series_bytes``: per-point size limits are applied at translation, so no
  single series is over ``--otlp.max-series-bytes``). ``target_info`` resources count in the bytes too.
- Fair admission: one request may create at most ``max_new_runs_per_request`` new run ids and
  ``max_new_series_per_request`` new series, and add at most a quarter of ``max_bytes`` in new series, so
  one client (a bug or a flood of made-up run ids) cannot take the whole store in one request; series
  that already exist always keep updating. When the store is full, series idle for ``evict_idle_after``
  (default 2 minutes, longer than a trainer's export interval) are evicted to make room
  (``gpuenergy_otlp_series_evicted_total``), so a one-off flood is gone minutes later rather than after the
  ``series_ttl``. A flood that keeps refreshing its series can still hold the room it got; the bearer
  token (``--otlp.bearer-token-file``) is the defence against a hostile client.
- Names: a pushed family must not produce a sample name that another family produces (``s`` summary
  gives ``s``, ``s_count``, ``s_sum``; ``x_total`` counter gives ``x``, ``x_total``, ``x_created``;
  histograms add ``_bucket``) or a reserved one (``target``, ``target_info``, ``up``, ``scrape_*``; the
  ``gpuenergy_`` prefix is refused at translation). The family pushed later is rejected
  (``name_collision``), so the exposition always parses.
- Lock hold: a batch is applied in chunks of ``APPLY_CHUNK`` points, the lock released in between, and a
  render encodes changed series after releasing the lock (it only builds the sample tuples under it), so
  a push of 100,000 series delays a scrape by one chunk, not by the whole push.

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
  leaves the series as it was.
- Gauges and cumulative non-monotonic sums expose the last value (older points are dropped); summaries
  are exposed as sent.

Resource attributes become one ``target_info`` series per resource (labels: the sanitised attributes,
``service.name`` as ``service_name``), never ``job`` / ``instance``, which are the exporter's own target
labels in Prometheus. Data-point attributes (the helper's ``run_id``, ``rank``, ``gpu_uuid``) are the
labels of every series. Series not updated for ``series_ttl`` seconds disappear.

This module never parses requests and never does I/O; ``collect`` is a plain loop over dicts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prometheus_client import exposition as text_exposition
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from gpu_energy_exporter import metrics
from gpu_energy_exporter.otlp.translate import DEFAULT_LIMITS, Batch, Kind, Labels, Limits, Point, series_bytes

log = logging.getLogger(__name__)

COLLECTOR = "otlp"

REJECT_REASONS: tuple[str, ...] = (
    "invalid_name", "invalid_label", "invalid_point", "unsupported_type", "unsupported_temporality",
    "type_conflict", "out_of_order", "series_limit", "run_series_limit",
    # byte bounds and junk (translate.Limits)
    "label_too_long", "too_many_labels", "too_many_buckets", "too_many_quantiles", "series_too_large",
    "non_finite", "future_timestamp",
    # store admission
    "bytes_limit", "new_runs_per_request", "new_series_per_request", "new_bytes_per_request", "name_collision",
)

REQUESTS = metrics.define(
    "otlp", "requests_total", "counter",
    "OTLP/HTTP export requests handled by the receiver, by HTTP status code.",
    ("status",), collector=COLLECTOR)
POINTS_RECEIVED = metrics.define(
    "otlp", "points_received_total", "counter",
    "Data points in decoded OTLP requests, accepted or rejected.", collector=COLLECTOR)
POINTS_REJECTED = metrics.define(
    "otlp", "points_rejected_total", "counter",
    "Data points not stored, by reason (" + ", ".join(REJECT_REASONS) + "; see docs/configuration.md).",
    ("reason",), collector=COLLECTOR)
SERIES = metrics.define(
    "otlp", "series", "gauge",
    "Training series currently held (one per metric and label set; a histogram counts once).",
    collector=COLLECTOR)
STORE_BYTES = metrics.define(
    "otlp", "store_bytes", "gauge",
    "Estimated memory held by the training series and target_info resources (bounded by --otlp.max-bytes).",
    collector=COLLECTOR, unit="bytes")
SERIES_EVICTED = metrics.define(
    "otlp", "series_evicted_total", "counter",
    "Training series idle for --otlp.evict-idle-after dropped to make room for new ones in a full store.",
    collector=COLLECTOR)
SERIES_EXPIRED = metrics.define(
    "otlp", "series_expired_total", "counter",
    "Training series dropped because they were not updated for --otlp.series-ttl.", collector=COLLECTOR)
REQUEST_DURATION = metrics.define(
    "otlp", "request_duration_seconds_total", "counter",
    "Time spent handling OTLP requests; divide its rate by the rate of requests for the mean.",
    collector=COLLECTOR, unit="seconds")
STREAM_RESTARTS = metrics.define(
    "otlp", "stream_restarts_total", "counter",
    "Cumulative streams that restarted (new start time or a decrease) and were folded into the exposed "
    "total.", collector=COLLECTOR)

#: Names no pushed family may produce: target_info is the resources' family (``target`` its OpenMetrics
#: name); ``up`` and ``scrape_*`` are written by Prometheus itself for every target.
RESERVED_NAMES = frozenset({"target", "target_info", "up"})
RESERVED_NAME_PREFIXES = ("scrape_",)
#: Points applied per lock acquisition (see the module docstring).
APPLY_CHUNK = 256
#: Status codes initialised at zero so every request outcome has a series before it first happens.
STATUS_CODES: tuple[str, ...] = ("200", "400", "401", "413", "415", "500")


@dataclass(frozen=True, slots=True)
class AcceptedPoint:
    """What a listener (the run ledger) receives for every stored point.

    ``value`` is what ``/metrics`` now exposes for the series: the cumulative total for counters, the
    value for gauges, the cumulative ``_sum`` for histograms and summaries (``count`` their ``_count``).
    ``time`` is the point's own timestamp in Unix seconds. ``labels`` is read-only.
    """

    run_id: str
    name: str
    labels: Mapping[str, str]
    value: float
    time: float
    kind: Kind
    count: float | None = None


Listener = Callable[[AcceptedPoint], None]


@dataclass
class ApplyResult:
    accepted: int
    rejected: dict[str, int]
    messages: dict[str, str]


class _Series:
    """One metric + label set. Counters and histograms keep ``base`` (folded earlier streams) apart from
    ``raw`` (the current cumulative stream), see the module docstring."""

    __slots__ = ("labels", "run_id", "last_seen", "start_ns", "time_ns", "delta", "base", "raw",
                 "bounds", "base_counts", "raw_counts", "base_sum", "raw_sum", "base_count", "raw_count",
                 "has_sum", "quantiles", "bucket_labels", "samples", "text", "cost")

    def __init__(self, labels: dict[str, str], run_id: str, cost: int) -> None:
        self.labels = labels
        self.run_id = run_id
        self.cost = cost
        self.last_seen = 0.0
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
        self.bucket_labels: list[dict[str, str]] = []
        self.samples: tuple[Sample, ...] | None = None
        # encoded exposition lines: [Prometheus text, OpenMetrics], each (the samples it encodes, bytes);
        # valid while those samples are still ``self.samples`` (compared by identity)
        self.text: list[tuple[tuple[Sample, ...], bytes] | None] = [None, None]

    _STATE = ("start_ns", "time_ns", "delta", "base", "raw", "bounds", "base_counts", "raw_counts",
              "base_sum", "raw_sum", "base_count", "raw_count", "has_sum", "quantiles", "bucket_labels")

    def state(self) -> tuple[object, ...]:
        """What an update may change (lists are replaced, never mutated): restored when one fails."""
        return tuple(getattr(self, name) for name in self._STATE)

    def restore(self, state: tuple[object, ...]) -> None:
        for name, value in zip(self._STATE, state, strict=True):
            setattr(self, name, value)

    def totals_finite(self) -> bool:
        """Counter and histogram totals are finite (gauges may hold NaN or +-Inf)."""
        return all(math.isfinite(x) for x in (self.base, self.raw, self.base_sum, self.raw_sum, self.base_count,
                                               self.raw_count))


class _Family:
    __slots__ = ("name", "kind", "help", "unit", "series", "claims", "header", "cost")

    def __init__(self, name: str, kind: Kind, help: str, unit: str) -> None:
        self.name = name
        self.kind = kind
        self.help = help
        self.unit = unit
        self.series: dict[Labels, _Series] = {}
        self.claims = _claimed_names(name, kind)
        self.header: list[bytes | None] = [None, None]  # encoded # HELP / # TYPE / # UNIT lines
        self.cost = _family_bytes(name, help)


def _family_bytes(name: str, help: str) -> int:
    """Estimated bytes of a family apart from its series (help and names, the cached headers)."""
    return 8 * (len(name) + 8) + 4 * len(help) + 1024


def _claimed_names(name: str, kind: Kind) -> tuple[str, ...]:
    """Every name a family's exposition uses, in either format (family names and sample names)."""
    if kind == "counter":
        base = name[: -len("_total")]
        return (base, name, base + "_created")
    if kind == "histogram":
        return (name, name + "_bucket", name + "_count", name + "_sum", name + "_created")
    if kind == "summary":
        return (name, name + "_count", name + "_sum", name + "_created")
    return (name,)


class _OutOfOrder(Exception):
    pass


class _NonFinite(Exception):
    pass


@dataclass
class _Request:
    """Admission state of one ``apply`` (one request): what it created so far."""

    new_runs: set[str]
    new_series: int = 0
    new_bytes: int = 0
    swept: bool = False


class TrainingStore:
    """Series from OTLP pushes, bounded and thread-safe.

    ``clock`` is monotonic seconds for the TTL (injected by tests). The bounds come from the ``--otlp.*``
    flags of the same names (see the module docstring); the per-point ones (label length, labels per point,
    buckets, quantiles, series bytes, future skew) are ``limits``, which the receiver applies at
    translation.
    """

    def __init__(
        self,
        *,
        series_ttl: float = 600.0,
        max_series: int = 20000,
        max_series_per_run: int = 2000,
        max_bytes: int = 64 * 1024 * 1024,
        max_new_series_per_request: int = 2000,
        max_new_runs_per_request: int = 16,
        evict_idle_after: float = 120.0,
        max_label_length: int = DEFAULT_LIMITS.max_label_length,
        max_labels_per_point: int = DEFAULT_LIMITS.max_labels_per_point,
        max_buckets_per_point: int = DEFAULT_LIMITS.max_buckets_per_point,
        max_quantiles_per_point: int = DEFAULT_LIMITS.max_quantiles_per_point,
        max_series_bytes: int = DEFAULT_LIMITS.max_series_bytes,
        max_future_skew: float = DEFAULT_LIMITS.max_future_skew_ns / 1e9,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(series_ttl, max_series, max_series_per_run, max_bytes, max_new_series_per_request,
               max_new_runs_per_request) <= 0 or evict_idle_after < 0 or max_future_skew < 0:
            raise ValueError("series_ttl and the series, run and byte limits must be positive, "
                             "evict_idle_after and max_future_skew not negative")
        self.series_ttl = series_ttl
        self.max_series = max_series
        self.max_series_per_run = max_series_per_run
        self.max_bytes = max_bytes
        self.max_new_series_per_request = max_new_series_per_request
        self.max_new_runs_per_request = max_new_runs_per_request
        self.evict_idle_after = evict_idle_after
        self.limits = Limits(max_label_length, max_labels_per_point, max_buckets_per_point,
                             max_quantiles_per_point, max_series_bytes, int(max_future_skew * 1e9))
        self._clock = clock
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        self._claims: dict[str, str] = {}  # exposed name -> family that uses it
        self._series_total = 0
        self._bytes = 0
        self._per_run: dict[str, int] = {}
        self._resources: dict[Labels, tuple[dict[str, str], float, int]] = {}  # labels, last seen, cost
        self._listeners: list[Listener] = []
        self._version = 0
        self._swept_at = -math.inf
        # self-metrics
        self._requests: dict[str, float] = dict.fromkeys(STATUS_CODES, 0.0)
        self._request_seconds = 0.0
        self._received = 0.0
        self._rejected: dict[str, float] = dict.fromkeys(REJECT_REASONS, 0.0)
        self._expired = 0.0
        self._evicted = 0.0
        self._resets = 0.0
        self._last_warning: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------
    # listeners and request accounting

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(AcceptedPoint)`` for every point stored from now on (after the store's lock is
        released, on the request thread). An exception in ``fn`` is logged, never propagated."""
        with self._lock:
            self._listeners = [*self._listeners, fn]

    def remove_listener(self, fn: Listener) -> None:
        with self._lock:
            # ==, not is: a bound method is a new object on every attribute access
            self._listeners = [f for f in self._listeners if f != fn]

    def record_request(self, status: int, seconds: float) -> None:
        """Count one handled request (the receiver calls this for every outcome)."""
        key = str(status)
        with self._lock:
            self._version += 1
            self._requests[key] = self._requests.get(key, 0.0) + 1
            self._request_seconds += max(seconds, 0.0)

    # ------------------------------------------------------------------------------------------------
    # writing

    def apply(self, batch: Batch) -> ApplyResult:
        """Store a translated batch. Rejections already counted in ``batch`` are added to the
        self-metrics; limits and ordering may reject more points (reported in the result).

        The batch is applied ``APPLY_CHUNK`` points per lock acquisition: a scrape waits for one chunk at
        most. Every point is applied atomically; a scrape in between sees some of the request's points."""
        rejected = dict(batch.rejected)
        messages = dict(batch.messages)
        accepted = 0
        events: list[AcceptedPoint] = []
        request = _Request(set())

        def reject(reason: str, message: str) -> None:
            rejected[reason] = rejected.get(reason, 0) + 1
            messages.setdefault(reason, message)

        points = batch.points
        with self._lock:
            self._received += batch.received
            now = self._clock()
            for labels in batch.resources:
                self._note_resource(labels, now)
            listeners = self._listeners
        for start in range(0, len(points), APPLY_CHUNK):
            if start:
                # Let a thread waiting for the lock (a scrape) take it: a released lock is otherwise
                # taken again at once by this thread, which still holds the GIL.
                time.sleep(0)
            with self._lock:
                self._version += 1
                now = self._clock()
                for p in points[start:start + APPLY_CHUNK]:
                    problem = self._apply_point(p, now, request, events if listeners else None)
                    if problem is None:
                        accepted += 1
                    else:
                        reject(*problem)
        with self._lock:
            self._version += 1
            for reason, count in rejected.items():
                self._rejected[reason] = self._rejected.get(reason, 0.0) + count

        for reason, count in rejected.items():
            self._warn(reason, f"rejected {count} OTLP data point(s) ({reason}): {messages.get(reason, '')}")
        for event in events:
            for fn in listeners:
                try:
                    fn(event)
                except Exception:  # a listener bug must never fail an export
                    log.exception("OTLP point listener %r failed", fn)
        return ApplyResult(accepted, rejected, messages)

    def _apply_point(self, p: Point, now: float, request: _Request,
                     events: list[AcceptedPoint] | None) -> tuple[str, str] | None:
        """Store one point (lock held); ``None`` or (reason, message) when it is rejected."""
        families = self._families
        fam = families.get(p.name)
        if fam is not None and fam.kind != p.kind:
            return ("type_conflict", f"{p.name} is already a {fam.kind}, got a {p.kind}")
        series = fam.series.get(p.labels) if fam is not None else None
        if p.no_value:
            if fam is not None and series is not None:
                self._remove(fam, p.labels, series)
            return None
        new = series is None
        if series is None:
            extra = 0
            if fam is None:
                problem = self._collision(p)
                if problem:
                    return problem
                extra = _family_bytes(p.name, p.help)
            problem = self._admit(p, now, request, extra)
            if problem:
                return problem
            fam = families.get(p.name)  # admitting may have evicted the family's last series
            if fam is None and not extra and self._bytes + p.cost + _family_bytes(p.name, p.help) > self.max_bytes:
                return self._bytes_full(p.cost + _family_bytes(p.name, p.help))
            series = _Series(dict(p.labels), p.run_id, p.cost)
        elif p.cost != series.cost and self._bytes - series.cost + p.cost > self.max_bytes:
            return self._bytes_full(p.cost - series.cost)
        saved = None if new else series.state()
        try:
            self._update(p, series, new)
            if p.kind in ("counter", "histogram") and not series.totals_finite():
                raise _NonFinite
        except _OutOfOrder as exc:
            if saved is not None:
                series.restore(saved)
            return ("out_of_order", f"{p.name}: {exc}")
        except _NonFinite:
            if saved is not None:
                series.restore(saved)
            return ("non_finite", f"{p.name}: the total would no longer be a finite number")
        if new:
            if fam is None:
                fam = self._add_family(p)
                request.new_bytes += fam.cost
            fam.series[p.labels] = series
            self._series_total += 1
            self._bytes += series.cost
            self._per_run[p.run_id] = self._per_run.get(p.run_id, 0) + 1
            request.new_series += 1
            request.new_bytes += series.cost
            request.new_runs.add(p.run_id)
        elif p.cost != series.cost:
            self._bytes += p.cost - series.cost
            series.cost = p.cost
        series.last_seen = now
        series.samples = None
        if events is not None:
            events.append(self._event(p, series))
        return None

    def _add_family(self, p: Point) -> _Family:
        fam = self._families[p.name] = _Family(p.name, p.kind, p.help, p.unit)
        for name in fam.claims:
            self._claims[name] = fam.name
        self._bytes += fam.cost
        return fam

    def _collision(self, p: Point) -> tuple[str, str] | None:
        """A new family must not use a name another family or the exporter uses."""
        for name in _claimed_names(p.name, p.kind):
            if name in RESERVED_NAMES or name.startswith(RESERVED_NAME_PREFIXES):
                return ("name_collision", f"{p.name} ({p.kind}) would expose {name!r}, a name reserved for "
                        "target_info or Prometheus; rename the metric")
            owner = self._claims.get(name)
            if owner is not None and owner != p.name:
                return ("name_collision", f"{p.name} ({p.kind}) would expose {name!r}, which the "
                        f"{self._families[owner].kind} {owner!r} already exposes; rename one of them")
        return None

    def _admit(self, p: Point, now: float, request: _Request, extra: int) -> tuple[str, str] | None:
        """Room for one more series (and ``extra`` bytes for its new family), or (reason, message).
        Per-request allowances first (they never need a sweep); when the store itself is full, expired and
        idle series are dropped once per request (a sweep is O(series)) before refusing."""
        run_id = p.run_id
        cost = p.cost + extra
        if run_id not in self._per_run and run_id not in request.new_runs and \
                len(request.new_runs) >= self.max_new_runs_per_request:
            return ("new_runs_per_request", f"this request already started {self.max_new_runs_per_request} "
                    "new run ids (--otlp.max-new-runs-per-request); send each run's points on its own")
        if request.new_series >= self.max_new_series_per_request:
            return ("new_series_per_request", f"this request already created {self.max_new_series_per_request} "
                    "new series (--otlp.max-new-series-per-request); the rest are accepted from the next one")
        if request.new_bytes + cost > self.max_bytes // 4:
            return ("new_bytes_per_request", f"this request already created {request.new_bytes} bytes of new "
                    f"series, the most one request may add is a quarter of --otlp.max-bytes ({self.max_bytes})")
        full = (self._series_total >= self.max_series or self._bytes + cost > self.max_bytes
                or self._per_run.get(run_id, 0) >= self.max_series_per_run)
        if full and not request.swept:
            request.swept = True
            self._expire_locked(now, evict=True)
        if self._series_total >= self.max_series:
            return ("series_limit", f"the receiver holds {self.max_series} series (--otlp.max-series)")
        if self._bytes + cost > self.max_bytes:
            return self._bytes_full(cost)
        if self._per_run.get(run_id, 0) >= self.max_series_per_run:
            return ("run_series_limit",
                    f"run_id {run_id[:200]!r} has {self.max_series_per_run} series (--otlp.max-series-per-run)")
        return None

    def _bytes_full(self, more: int) -> tuple[str, str]:
        return ("bytes_limit", f"the receiver holds {self._bytes} bytes of series, {more} more would pass "
                f"--otlp.max-bytes ({self.max_bytes})")

    def _update(self, p: Point, s: _Series, new: bool) -> None:
        kind = p.kind
        if kind == "counter":
            self._update_counter(p, s, new)
        elif kind == "histogram":
            self._update_histogram(p, s, new)
        else:  # gauge, unknown, summary: the last value wins
            if not new and p.time_ns < s.time_ns:
                raise _OutOfOrder("point older than the last one")
            s.raw = p.value if kind != "summary" else 0.0
            s.quantiles = p.quantiles
            s.raw_count = float(p.count)
            s.raw_sum = p.sum if p.sum is not None else 0.0
            s.time_ns = p.time_ns

    def _update_counter(self, p: Point, s: _Series, new: bool) -> None:
        if new:
            s.delta, s.start_ns, s.time_ns = p.delta, p.start_ns, p.time_ns
            s.base, s.raw = (p.value, 0.0) if p.delta else (0.0, p.value)
            return
        if p.delta:
            if p.time_ns <= s.time_ns:
                raise _OutOfOrder("delta point not after the last one (a retry or duplicate)")
            if not s.delta:  # cumulative -> delta: keep the total, accumulate from here
                s.base += s.raw
                s.raw = 0.0
                s.delta = True
            s.base += p.value
        elif s.delta:  # delta -> cumulative: a new stream on top of what was counted
            s.delta, s.raw, s.start_ns = False, p.value, p.start_ns
        elif p.start_ns != s.start_ns:
            if p.start_ns < s.start_ns:
                raise _OutOfOrder("point from an earlier stream (older start time)")
            self._fold_counter(s, p.value)
            s.start_ns = p.start_ns
        elif p.time_ns < s.time_ns:
            raise _OutOfOrder("point older than the last one")
        elif p.value < s.raw:
            self._fold_counter(s, p.value)  # went down without a new start time: still a restart
        else:
            s.raw = p.value
        s.time_ns = max(s.time_ns, p.time_ns)

    def _fold_counter(self, s: _Series, value: float) -> None:
        s.base += s.raw
        s.raw = value
        self._resets += 1

    def _update_histogram(self, p: Point, s: _Series, new: bool) -> None:
        counts = [float(c) for c in p.counts]
        psum = p.sum if p.sum is not None else 0.0
        if not new and (p.bounds != s.bounds or len(counts) != len(s.raw_counts)):
            if p.time_ns < s.time_ns:
                raise _OutOfOrder("point older than the last one")
            new = True  # a different bucket layout cannot be folded: a reset, the series starts afresh
            self._resets += 1
        if new:
            s.bounds = p.bounds
            s.bucket_labels = [{**s.labels, "le": floatToGoString(b)} for b in p.bounds]
            s.bucket_labels.append({**s.labels, "le": "+Inf"})
            s.delta, s.start_ns, s.time_ns = p.delta, p.start_ns, p.time_ns
            s.has_sum = p.sum is not None
            zero = [0.0] * len(counts)
            if p.delta:
                s.base_counts, s.base_sum, s.base_count = counts, psum, float(p.count)
                s.raw_counts, s.raw_sum, s.raw_count = zero, 0.0, 0.0
            else:
                s.base_counts, s.base_sum, s.base_count = zero, 0.0, 0.0
                s.raw_counts, s.raw_sum, s.raw_count = counts, psum, float(p.count)
            return
        if p.delta:
            if p.time_ns <= s.time_ns:
                raise _OutOfOrder("delta point not after the last one (a retry or duplicate)")
            if not s.delta:
                self._fold_histogram(s, [0.0] * len(s.raw_counts), 0.0, 0.0, count_reset=False)
                s.delta = True
            s.base_counts = [a + b for a, b in zip(s.base_counts, counts, strict=True)]
            s.base_sum += psum
            s.base_count += p.count
        elif s.delta:
            s.delta, s.start_ns = False, p.start_ns
            s.raw_counts, s.raw_sum, s.raw_count = counts, psum, float(p.count)
        elif p.start_ns != s.start_ns:
            if p.start_ns < s.start_ns:
                raise _OutOfOrder("point from an earlier stream (older start time)")
            self._fold_histogram(s, counts, psum, float(p.count))
            s.start_ns = p.start_ns
        elif p.time_ns < s.time_ns:
            raise _OutOfOrder("point older than the last one")
        elif p.count < s.raw_count or any(c < r for c, r in zip(counts, s.raw_counts, strict=True)):
            self._fold_histogram(s, counts, psum, float(p.count))
        else:
            s.raw_counts, s.raw_sum, s.raw_count = counts, psum, float(p.count)
        s.has_sum = s.has_sum and p.sum is not None
        s.time_ns = max(s.time_ns, p.time_ns)

    def _fold_histogram(self, s: _Series, counts: list[float], psum: float, count: float,
                        count_reset: bool = True) -> None:
        s.base_counts = [a + b for a, b in zip(s.base_counts, s.raw_counts, strict=True)]
        s.base_sum += s.raw_sum
        s.base_count += s.raw_count
        s.raw_counts, s.raw_sum, s.raw_count = counts, psum, count
        if count_reset:
            self._resets += 1

    def _event(self, p: Point, s: _Series) -> AcceptedPoint:
        labels = MappingProxyType(s.labels)
        t = p.time_ns / 1e9
        if p.kind == "counter":
            return AcceptedPoint(p.run_id, p.name, labels, s.base + s.raw, t, p.kind)
        if p.kind == "histogram":
            return AcceptedPoint(p.run_id, p.name, labels, s.base_sum + s.raw_sum, t, p.kind,
                                 s.base_count + s.raw_count)
        if p.kind == "summary":
            return AcceptedPoint(p.run_id, p.name, labels, s.raw_sum, t, p.kind, s.raw_count)
        return AcceptedPoint(p.run_id, p.name, labels, s.raw, t, p.kind)

    def _note_resource(self, labels: Labels, now: float) -> None:
        entry = self._resources.get(labels)
        if entry is not None:
            self._resources[labels] = (entry[0], now, entry[2])
            return
        cost = series_bytes("target_info", labels, "gauge")
        if len(self._resources) < self.max_series and self._bytes + cost <= self.max_bytes:
            self._resources[labels] = (dict(labels), now, cost)
            self._bytes += cost

    # ------------------------------------------------------------------------------------------------
    # expiry

    def _remove(self, fam: _Family, key: Labels, s: _Series) -> None:
        del fam.series[key]
        if not fam.series and self._families.get(fam.name) is fam:
            del self._families[fam.name]
            self._bytes -= fam.cost
            for name in fam.claims:
                if self._claims.get(name) == fam.name:
                    del self._claims[name]
        self._series_total -= 1
        self._bytes -= s.cost
        left = self._per_run.get(s.run_id, 0) - 1
        if left > 0:
            self._per_run[s.run_id] = left
        else:
            self._per_run.pop(s.run_id, None)

    def _expire_locked(self, now: float, evict: bool = False) -> int:
        """Drop series older than the TTL; with ``evict`` (a full store) also those idle for
        ``evict_idle_after``, counted apart."""
        cutoff = now - self.series_ttl
        idle = max(now - self.evict_idle_after, cutoff) if evict else cutoff
        stale = [(fam, key, s) for fam in list(self._families.values())
                 for key, s in fam.series.items() if s.last_seen < idle]
        expired = 0
        for fam, key, s in stale:
            self._remove(fam, key, s)
            expired += s.last_seen < cutoff
        self._expired += expired
        self._evicted += len(stale) - expired
        gone = [k for k, (_, seen, _) in self._resources.items() if seen < idle]
        for labels in gone:
            self._bytes -= self._resources.pop(labels)[2]
        if stale or gone:
            self._version += 1
        return len(stale)

    def _sweep(self, now: float) -> None:
        """TTL expiry on the scrape path, at most once a second (a sweep is O(series))."""
        if not now - self._swept_at < 1.0:
            self._swept_at = now
            self._expire_locked(now)

    @property
    def version(self) -> int:
        """Changes whenever ``collect()`` would return something different (exposition cache key).
        Expiry is time-driven: call ``expire()`` first to bring it up to date."""
        return self._version

    def expire(self) -> int:
        """Drop series older than the TTL now; returns how many. ``collect`` also does this."""
        with self._lock:
            return self._expire_locked(self._clock())

    # ------------------------------------------------------------------------------------------------
    # reading

    def series_count(self) -> int:
        with self._lock:
            return self._series_total

    def bytes_used(self) -> int:
        """Estimated bytes held (what ``--otlp.max-bytes`` bounds)."""
        with self._lock:
            return self._bytes

    def describe(self) -> list[Metric]:
        """Nothing to declare up front (names depend on what trainers push)."""
        return []

    def collect(self) -> list[Metric]:
        """Fresh families: every training series, ``target_info`` and the receiver's self-metrics."""
        with self._lock:
            self._sweep(self._clock())
            out = self._collect_training()
            out.extend(self._collect_self())
        return out

    def _collect_training(self) -> list[Metric]:
        out: list[Metric] = []
        for fam in self._families.values():
            if fam.kind == "counter":
                metric = Metric(fam.name[: -len("_total")], fam.help, "counter", fam.unit)
            else:
                metric = Metric(fam.name, fam.help, fam.kind, fam.unit)
            samples = metric.samples
            for s in fam.series.values():
                samples.extend(_built(fam, s))
            out.append(metric)
        out.extend(self._collect_target_info())
        return out

    def _collect_target_info(self) -> list[Metric]:
        if not self._resources:
            return []
        info = Metric("target", "Resource attributes of the processes pushing OTLP metrics "
                      "(one series per resource; never job/instance).", "info")
        for labels, _seen, _cost in self._resources.values():
            info.samples.append(Sample("target_info", labels, 1.0))
        return [info]

    def render(self, openmetrics: bool) -> bytes:
        """What ``collect()`` returns, already encoded (OpenMetrics without its ``# EOF``): the scrape fast
        path. Only series that changed since the last render are encoded again, so a push of one rank
        costs that rank's series, not all of them (prometheus_client encodes ~10 µs per sample). Under the
        lock only the changed series' samples are built; they are encoded after it is released."""
        k = 1 if openmetrics else 0
        parts: list[bytes | tuple[_Family, _Series, tuple[Sample, ...]]] = []
        with self._lock:
            self._sweep(self._clock())
            for fam in self._families.values():
                header = fam.header[k]
                if header is None:
                    header = fam.header[k] = _encode_header(fam, openmetrics)
                parts.append(header)
                for s in fam.series.values():
                    built = _built(fam, s)
                    cached = s.text[k]
                    parts.append(cached[1] if cached is not None and cached[0] is built else (fam, s, built))
            rest = self._collect_target_info()
            rest.extend(self._collect_self())
        out: list[bytes] = []
        for part in parts:
            if isinstance(part, tuple):
                fam, s, built = part
                text = _encode_lines(fam, built, openmetrics)
                s.text[k] = (built, text)  # one reference store: atomic; stale if the series changed since
                out.append(text)
            else:
                out.append(part)
        out.append(_encode(rest, openmetrics))
        return b"".join(out)

    def _collect_self(self) -> list[Metric]:
        requests = REQUESTS.family()
        for status, n in sorted(self._requests.items()):
            metrics.add(requests, (status,), n)
        received = POINTS_RECEIVED.family()
        metrics.add(received, (), self._received)
        rejected = POINTS_REJECTED.family()
        for reason, n in sorted(self._rejected.items()):
            metrics.add(rejected, (reason,), n)
        series = SERIES.family()
        metrics.add(series, (), self._series_total)
        store_bytes = STORE_BYTES.family()
        metrics.add(store_bytes, (), self._bytes)
        expired = SERIES_EXPIRED.family()
        metrics.add(expired, (), self._expired)
        evicted = SERIES_EVICTED.family()
        metrics.add(evicted, (), self._evicted)
        duration = REQUEST_DURATION.family()
        metrics.add(duration, (), self._request_seconds)
        resets = STREAM_RESTARTS.family()
        metrics.add(resets, (), self._resets)
        return [requests, received, rejected, series, store_bytes, expired, evicted, duration, resets]

    # ------------------------------------------------------------------------------------------------

    def _warn(self, key: str, message: str) -> None:
        """One warning per reason per minute: a misconfigured trainer must not flood the log."""
        now = self._clock()
        with self._lock:
            last = self._last_warning.get(key)
            if last is not None and now - last < 60.0:
                return
            self._last_warning[key] = now
        log.warning("%s", message[:1000])


def _built(fam: _Family, s: _Series) -> tuple[Sample, ...]:
    """The series' samples, rebuilt after it changed (its encoded text then no longer matches)."""
    built = s.samples
    if built is None:
        built = s.samples = _samples(fam, s)
    return built


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _encode(families: list[Metric], openmetrics: bool) -> bytes:
    if openmetrics:
        body = om_exposition.generate_latest(_Families(families))
        return body[: -len(b"# EOF\n")] if body.endswith(b"# EOF\n") else body
    return text_exposition.generate_latest(_Families(families))


def _metric(fam: _Family, samples: tuple[Sample, ...]) -> Metric:
    name = fam.name[: -len("_total")] if fam.kind == "counter" else fam.name
    metric = Metric(name, fam.help, fam.kind, fam.unit)
    metric.samples.extend(samples)
    return metric


def _encode_header(fam: _Family, openmetrics: bool) -> bytes:
    return _encode([_metric(fam, ())], openmetrics)


def _encode_lines(fam: _Family, samples: tuple[Sample, ...], openmetrics: bool) -> bytes:
    """The sample lines only (the family's # HELP / # TYPE / # UNIT lines are written once)."""
    body = _encode([_metric(fam, samples)], openmetrics)
    return b"".join(line + b"\n" for line in body.split(b"\n") if line and not line.startswith(b"# "))


def _samples(fam: _Family, s: _Series) -> tuple[Sample, ...]:
    name, kind, labels = fam.name, fam.kind, s.labels
    if kind == "counter":
        return (Sample(name, labels, s.base + s.raw),)
    if kind == "histogram":
        out: list[Sample] = []
        bucket = name + "_bucket"
        running = 0.0
        for i, blabels in enumerate(s.bucket_labels[:-1]):
            running += s.base_counts[i] + s.raw_counts[i]
            out.append(Sample(bucket, blabels, running))
        total = s.base_count + s.raw_count
        out.append(Sample(bucket, s.bucket_labels[-1], total))
        out.append(Sample(name + "_count", labels, total))
        if s.has_sum:
            out.append(Sample(name + "_sum", labels, s.base_sum + s.raw_sum))
        return tuple(out)
    if kind == "summary":
        out = [Sample(name, {**labels, "quantile": floatToGoString(q)}, v) for q, v in s.quantiles]
        out.append(Sample(name + "_count", labels, s.raw_count))
        out.append(Sample(name + "_sum", labels, s.raw_sum))
        return tuple(out)
    return (Sample(name, labels, s.raw),)

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
- Lock hold: a batch is applied in chunks of ``APPLY_CHUNK`` points, the lock released in between, so a
  push of 100,000 series delays a scrape by one chunk, not by the whole push.
- Encoded at ingest: every series keeps its sample-line heads (``name{labels} ``, built once per label set
  and bucket layout) and, after each change, its encoded lines (``encoder``: the bytes prometheus_client
  would write). The pushing thread encodes what its request changed after releasing the lock; a render
  only copies references under the lock and joins ready bytes, one cached block per family that did not
  change (a series whose encoding lost a race with a newer push is encoded by the render, outside the
  lock). The cached bytes (heads, lines, family block) are counted in ``series_bytes``.

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

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from gpu_energy_exporter.core import encoder, metrics
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


@dataclass(slots=True)
class AcceptedPoint:
    """What a listener (the run ledger) receives for every stored point (not frozen only because a frozen
    dataclass is three times slower to build, and one is built per stored point; do not modify one).

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
BatchListener = Callable[[list[AcceptedPoint]], None]


@dataclass
class ApplyResult:
    accepted: int
    rejected: dict[str, int]
    messages: dict[str, str]


#: What an update may change (``_Series.state``).
_State = tuple[int, int, bool, float, float, tuple[float, ...], list[float], list[float], float, float, float, float,
               bool, tuple[tuple[float, float], ...]]


class _Series:
    """One metric + label set. Counters and histograms keep ``base`` (folded earlier streams) apart from
    ``raw`` (the current cumulative stream), see the module docstring."""

    __slots__ = ("labels", "run_id", "last_seen", "start_ns", "time_ns", "delta", "base", "raw",
                 "bounds", "base_counts", "raw_counts", "base_sum", "raw_sum", "base_count", "raw_count",
                 "has_sum", "quantiles", "layout", "heads", "values", "enc", "cost", "view")

    def __init__(self, labels: dict[str, str], run_id: str, cost: int) -> None:
        self.labels = labels
        self.view = MappingProxyType(labels)  # read-only labels for listeners
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
        # What the sample lines look like: ``layout`` (bucket bounds and whether there is a _sum, quantiles)
        # gives ``heads``, [text, OpenMetrics] (one tuple twice unless the name has a ':'), each one
        # ``name{labels} `` per sample.
        self.layout: object = None
        self.heads: tuple[tuple[bytes, ...], tuple[bytes, ...]] = ((), ())
        # the exposed values (a new tuple at every change: the identity is the version) and the encoded
        # lines [text, OpenMetrics], each (the values it encodes, bytes), valid while ``enc[k][0] is values``
        self.values: tuple[float, ...] = ()
        self.enc: list[tuple[tuple[float, ...], bytes] | None] = [None, None]

    def state(self) -> _State:
        """What an update may change (lists are replaced, never mutated): restored when one fails."""
        return (self.start_ns, self.time_ns, self.delta, self.base, self.raw, self.bounds, self.base_counts,
                self.raw_counts, self.base_sum, self.raw_sum, self.base_count, self.raw_count, self.has_sum,
                self.quantiles)

    def restore(self, state: _State) -> None:
        (self.start_ns, self.time_ns, self.delta, self.base, self.raw, self.bounds, self.base_counts,
         self.raw_counts, self.base_sum, self.raw_sum, self.base_count, self.raw_count, self.has_sum,
         self.quantiles) = state

    def totals_finite(self) -> bool:
        """Counter and histogram totals are finite (gauges may hold NaN or +-Inf)."""
        isfinite = math.isfinite
        return (isfinite(self.base) and isfinite(self.raw) and isfinite(self.base_sum) and isfinite(self.raw_sum)
                and isfinite(self.base_count) and isfinite(self.raw_count))


class _Family:
    __slots__ = ("name", "kind", "help", "unit", "series", "claims", "header", "cost", "gen", "block")

    def __init__(self, name: str, kind: Kind, help: str, unit: str) -> None:
        self.name = name
        self.kind = kind
        self.help = help
        self.unit = unit
        self.series: dict[Labels, _Series] = {}
        self.claims = _claimed_names(name, kind)
        self.header: list[bytes | None] = [None, None]  # encoded # HELP / # TYPE / # UNIT lines
        self.cost = _family_bytes(name, help)
        # ``gen`` changes with any of its series (lock held); ``block`` [text, OpenMetrics]: (gen, the
        # family's encoded header and lines) for the render of an unchanged family
        self.gen = 0
        self.block: list[tuple[int, bytes] | None] = [None, None]


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
        # labels, last seen, cost, the encoded target_info line
        self._resources: dict[Labels, tuple[dict[str, str], float, int, bytes]] = {}
        self._listeners: list[Listener] = []
        self._batch_listeners: list[BatchListener] = []
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

    def add_batch_listener(self, fn: BatchListener) -> None:
        """Like ``add_listener``, with all the points one ``apply`` stored in one call (the run ledger: one
        lock acquisition per request rather than per point)."""
        with self._lock:
            self._batch_listeners = [*self._batch_listeners, fn]

    def remove_listener(self, fn: Listener) -> None:
        with self._lock:
            # ==, not is: a bound method is a new object on every attribute access
            self._listeners = [f for f in self._listeners if f != fn]
            self._batch_listeners = [f for f in self._batch_listeners if f != fn]

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
        changed: list[tuple[_Series, tuple[tuple[bytes, ...], tuple[bytes, ...]], tuple[float, ...]]] = []
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
            batch_listeners = self._batch_listeners
        for start in range(0, len(points), APPLY_CHUNK):
            if start:
                # Let a thread waiting for the lock (a scrape) take it: a released lock is otherwise
                # taken again at once by this thread, which still holds the GIL.
                time.sleep(0)
            with self._lock:
                self._version += 1
                now = self._clock()
                for p in points[start:start + APPLY_CHUNK]:
                    problem = self._apply_point(p, now, request, events if listeners or batch_listeners else None,
                                                changed)
                    if problem is None:
                        accepted += 1
                    else:
                        reject(*problem)
        with self._lock:
            self._version += 1
            for reason, count in rejected.items():
                self._rejected[reason] = self._rejected.get(reason, 0.0) + count

        _encode_changed(changed)
        for reason, count in rejected.items():
            self._warn(reason, f"rejected {count} OTLP data point(s) ({reason}): {messages.get(reason, '')}")
        if events:
            for batch_fn in batch_listeners:
                try:
                    batch_fn(events)
                except Exception:  # a listener bug must never fail an export
                    log.exception("OTLP point listener %r failed", batch_fn)
            for event in events:
                for fn in listeners:
                    try:
                        fn(event)
                    except Exception:  # a listener bug must never fail an export
                        log.exception("OTLP point listener %r failed", fn)
        return ApplyResult(accepted, rejected, messages)

    def _apply_point(self, p: Point, now: float, request: _Request, events: list[AcceptedPoint] | None,
                     changed: list[tuple[_Series, tuple[tuple[bytes, ...], tuple[bytes, ...]], tuple[float, ...]]],
                     ) -> tuple[str, str] | None:
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
        # gauges and summaries refuse a point before changing anything; totals are checked after
        saved = None if new or p.kind not in ("counter", "histogram") else series.state()
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
        assert fam is not None  # found with the series, or added with it
        _relayout(fam, series)
        series.values = values = _values(fam.kind, series)
        fam.gen += 1
        changed.append((series, series.heads, values))
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
        labels = s.view
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
            self._resources[labels] = (entry[0], now, entry[2], entry[3])
            return
        cost = series_bytes("target_info", labels, "gauge")
        if len(self._resources) < self.max_series and self._bytes + cost <= self.max_bytes:
            line = encoder.sample_head("target_info", labels, False) + b"1.0\n"
            self._resources[labels] = (dict(labels), now, cost, line)
            self._bytes += cost

    # ------------------------------------------------------------------------------------------------
    # expiry

    def _remove(self, fam: _Family, key: Labels, s: _Series) -> None:
        del fam.series[key]
        fam.gen += 1
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
        gone = [k for k, (_, seen, _, _) in self._resources.items() if seen < idle]
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
                samples.extend(_samples(fam, s))
            out.append(metric)
        out.extend(self._collect_target_info())
        return out

    def _collect_target_info(self) -> list[Metric]:
        if not self._resources:
            return []
        info = Metric("target", "Resource attributes of the processes pushing OTLP metrics "
                      "(one series per resource; never job/instance).", "info")
        for labels, _seen, _cost, _line in self._resources.values():
            info.samples.append(Sample("target_info", labels, 1.0))
        return [info]

    def render(self, openmetrics: bool) -> bytes:
        """What ``collect()`` returns, already encoded (OpenMetrics without its ``# EOF``): the scrape fast
        path. Series are encoded when a push changes them (``apply``), so under the lock a render only
        copies references: one ready block per unchanged family, the ready lines of each series of a
        changed one. After the lock is released it joins them (and encodes any series whose encoding a
        racing push has not stored yet)."""
        k = 1 if openmetrics else 0
        ready: list[bytes | tuple[_Family, int, bytes, list[_Part]]] = []
        with self._lock:
            self._sweep(self._clock())
            for fam in self._families.values():
                block = fam.block[k]
                if block is not None and block[0] == fam.gen:
                    ready.append(block[1])
                    continue
                header = fam.header[k]
                if header is None:
                    header = fam.header[k] = _encode_header(fam, openmetrics)
                parts: list[_Part] = []
                for s in fam.series.values():
                    enc = s.enc[k]
                    values = s.values
                    parts.append(enc[1] if enc is not None and enc[0] is values else (s, s.heads[k], values))
                ready.append((fam, fam.gen, header, parts))
            resources = [line for _labels, _seen, _cost, line in self._resources.values()]
            own = self._collect_self()
        out: list[bytes] = []
        for item in ready:
            if isinstance(item, bytes):
                out.append(item)
                continue
            fam, gen, header, parts = item
            lines: list[bytes] = [header]
            for part in parts:
                if isinstance(part, tuple):
                    s, heads, values = part
                    part = encoder.lines(heads, values)
                    s.enc[k] = (values, part)  # one reference store: atomic; stale if the series changed since
                lines.append(part)
            joined = b"".join(lines)
            fam.block[k] = (gen, joined)
            out.append(joined)
        if resources:
            out.append(encoder.header(_TARGET_INFO, openmetrics))
            out.extend(resources)
        out.append(encoder.encode_families(own, openmetrics))
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


#: a series' ready lines, or (series, its heads in the format, values) to encode them from
_Part = bytes | tuple[_Series, tuple[bytes, ...], tuple[float, ...]]

_TARGET_INFO = Metric("target", "Resource attributes of the processes pushing OTLP metrics "
                      "(one series per resource; never job/instance).", "info")


def _encode_changed(
        changed: list[tuple[_Series, tuple[tuple[bytes, ...], tuple[bytes, ...]], tuple[float, ...]]]) -> None:
    """Encode the series a request changed, from the heads and values taken under the lock (after it is
    released; a racing push stores its own encoding, and ``render`` checks which one is current)."""
    for s, heads, values in changed:
        text = encoder.lines(heads[0], values)
        entry = (values, text)
        if heads[1] is heads[0]:
            s.enc = [entry, entry]
        else:
            s.enc = [entry, (values, encoder.lines(heads[1], values))]


def _encode_header(fam: _Family, openmetrics: bool) -> bytes:
    return encoder.fallback([_metric(fam, ())], openmetrics)


def _metric(fam: _Family, samples: tuple[Sample, ...]) -> Metric:
    name = fam.name[: -len("_total")] if fam.kind == "counter" else fam.name
    metric = Metric(name, fam.help, fam.kind, fam.unit)
    metric.samples.extend(samples)
    return metric


def _layout(kind: Kind, s: _Series) -> object:
    """What the series' sample heads depend on besides its name and labels."""
    if kind == "histogram":
        return (s.bounds, s.has_sum)
    if kind == "summary":
        return tuple(q for q, _ in s.quantiles)
    return kind


def _relayout(fam: _Family, s: _Series) -> None:
    """Build the series' sample heads when they are new or its layout changed (lock held)."""
    layout = _layout(fam.kind, s)
    if layout == s.layout:
        return
    s.layout = layout
    text = _heads(fam, s, False)
    s.heads = (text, text if ":" not in fam.name else _heads(fam, s, True))


def _heads(fam: _Family, s: _Series, openmetrics: bool) -> tuple[bytes, ...]:
    name, kind = fam.name, fam.kind
    labels = tuple(s.labels.items())
    if kind == "histogram":
        bucket = name + "_bucket"
        heads = [encoder.sample_head(bucket, (*labels, ("le", encoder.go_float(b))), openmetrics)
                 for b in s.bounds]
        heads.append(encoder.sample_head(bucket, (*labels, ("le", "+Inf")), openmetrics))
        heads.append(encoder.sample_head(name + "_count", labels, openmetrics))
        if s.has_sum:
            heads.append(encoder.sample_head(name + "_sum", labels, openmetrics))
        return tuple(heads)
    if kind == "summary":
        heads = [encoder.sample_head(name, (*labels, ("quantile", encoder.go_float(q))), openmetrics)
                 for q, _ in s.quantiles]
        heads.append(encoder.sample_head(name + "_count", labels, openmetrics))
        heads.append(encoder.sample_head(name + "_sum", labels, openmetrics))
        return tuple(heads)
    return (encoder.sample_head(name, labels, openmetrics),)


def _values(kind: Kind, s: _Series) -> tuple[float, ...]:
    """The exposed values, in the order of the series' heads (lock held)."""
    if kind == "counter":
        return (s.base + s.raw,)
    if kind == "histogram":
        out: list[float] = []
        running = 0.0
        base, raw = s.base_counts, s.raw_counts
        for i in range(len(base) - 1):
            running += base[i] + raw[i]
            out.append(running)
        total = s.base_count + s.raw_count
        out.append(total)
        out.append(total)
        if s.has_sum:
            out.append(s.base_sum + s.raw_sum)
        return tuple(out)
    if kind == "summary":
        return (*(v for _, v in s.quantiles), s.raw_count, s.raw_sum)
    return (s.raw,)


def _samples(fam: _Family, s: _Series) -> tuple[Sample, ...]:
    """The series as prometheus_client samples (``collect()``; the scrape path uses the encoded lines)."""
    name, kind, labels = fam.name, fam.kind, s.labels
    values = s.values
    if kind == "histogram":
        bucket = name + "_bucket"
        out = [Sample(bucket, {**labels, "le": encoder.go_float(b)}, v)
               for b, v in zip(s.bounds, values, strict=False)]
        out.append(Sample(bucket, {**labels, "le": "+Inf"}, values[len(s.bounds)]))
        out.append(Sample(name + "_count", labels, values[len(s.bounds) + 1]))
        if s.has_sum:
            out.append(Sample(name + "_sum", labels, values[-1]))
        return tuple(out)
    if kind == "summary":
        out = [Sample(name, {**labels, "quantile": encoder.go_float(q)}, v)
               for (q, _), v in zip(s.quantiles, values, strict=False)]
        out.append(Sample(name + "_count", labels, s.raw_count))
        out.append(Sample(name + "_sum", labels, s.raw_sum))
        return tuple(out)
    return (Sample(name, labels, values[0]),)

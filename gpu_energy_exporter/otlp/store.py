"""The training store: Prometheus-ready series built from OTLP points, served on the scrape path.

``TrainingStore.apply(batch)`` folds translated points (``points.Point``) into series;
``collect()`` returns fresh ``prometheus_client`` families for ``/metrics`` and ``render()`` the encoded
exposition. It is thread-safe (one lock; the receiver's request threads write, scrapes read). The store is
the lock, the bookkeeping, eviction, expiry and the encoded-bytes cache around pure parts: how a point folds
into a series (``otlp.temporality``: temporality, restarts, layout changes), whether a new series fits
(``otlp.admission``: the bounds and the name rules), how a series is written (``otlp.series``) and what is
counted (``otlp.selfmetrics``).

Bounds (each a ``--otlp.*`` flag; every refusal is counted in ``gpuenergy_otlp_points_rejected_total`` by
reason and named, with its flag, in the request's ``partial_success``):

- Identity (docs/security.md): per-identity quotas (``admission.Holdings``); a series belongs to the principal
  that created it (``not_series_owner``); before anything is stored the gate (``set_gate``, ``otlp.gate``: the
  run ledger) admits, refuses or re-scopes each point, so a refused point is never stored, folded or exposed.
- Count, bytes, fair admission and names: ``otlp.admission``. Per-point size limits are applied at
  translation, so no single series is over ``--otlp.max-series-bytes``; ``target_info`` resources count in
  the bytes too. When the store is full, series idle for ``evict_idle_after`` (default 2 minutes, longer
  than a trainer's export interval) are evicted to make room (``gpuenergy_otlp_series_evicted_total``), so a
  one-off flood is gone minutes later rather than after the ``series_ttl``. A flood that keeps refreshing
  its series holds the room it got, within its identity's quota.
- Lock hold: a batch is applied in chunks of ``APPLY_CHUNK`` points, the lock released in between, so a
  push of 100,000 series delays a scrape by one chunk, not by the whole push.
- Encoded at ingest: each family keeps its series' encoded lines (``encoder``) in one list in series order
  (``series.SeriesMap``); the pushing thread encodes what it changed after releasing the lock and stores
  the lines under it (``_publish``). A render copies one list per changed family under the lock and joins
  it after (a series still being encoded shows its previous lines until published). The cached bytes
  (heads, lines, family block) are counted in ``series_bytes``.

Resource attributes become one ``target_info`` series per resource (labels: the sanitised attributes,
``service.name`` as ``service_name``), never ``job`` / ``instance``, which are the exporter's own target
labels in Prometheus. Data-point attributes (the helper's ``run_id``, ``rank``, ``gpu_uuid``) are the
labels of every series. Series not updated for ``series_ttl`` seconds disappear.

This module never parses requests, never does I/O and never folds a value itself; ``collect`` is a plain
loop over dicts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from prometheus_client.core import Metric

from gpu_energy_exporter.core import encoder
from gpu_energy_exporter.core.clientid import identity_of, principal_of
from gpu_energy_exporter.core.ratelog import RateLimitedLog
from gpu_energy_exporter.otlp import admission, temporality
from gpu_energy_exporter.otlp.gate import Gate, ask_gate
from gpu_energy_exporter.otlp.points import DEFAULT_LIMITS, Batch, Labels, Limits, Point, series_bytes
from gpu_energy_exporter.otlp.points import AcceptedPoint as AcceptedPoint  # the listeners' type, exported here
from gpu_energy_exporter.otlp.points import ApplyResult as ApplyResult
from gpu_energy_exporter.otlp.points import BatchListener as BatchListener
from gpu_energy_exporter.otlp.points import Listener as Listener
from gpu_energy_exporter.otlp.selfmetrics import Tally
from gpu_energy_exporter.otlp.series import (
    TARGET_INFO,
    Changed,
    Family,
    Series,
    encode_changed,
    family_bytes,
    join,
    metric,
    publish,
    ready,
    relayout,
    samples,
    target_info_families,
)

log = logging.getLogger(__name__)


#: Points applied per lock acquisition (see the module docstring).
APPLY_CHUNK = 256


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
        max_series_per_client: int = 5000,
        max_bytes_per_client: int = 16 * 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(series_ttl, max_series, max_series_per_run, max_bytes, max_new_series_per_request,
               max_new_runs_per_request, max_series_per_client, max_bytes_per_client) <= 0 \
                or evict_idle_after < 0 or max_future_skew < 0:
            raise ValueError("series_ttl and the series, run and byte limits must be positive, "
                             "evict_idle_after and max_future_skew not negative")
        self.series_ttl = series_ttl
        self.max_series = max_series
        self.max_series_per_run = max_series_per_run
        self.max_bytes = max_bytes
        self.max_new_series_per_request = max_new_series_per_request
        self.max_new_runs_per_request = max_new_runs_per_request
        self.evict_idle_after = evict_idle_after
        self.max_series_per_client = max_series_per_client
        self.max_bytes_per_client = max_bytes_per_client
        # what each identity holds (the anonymous "" is in-process callers: no quota)
        self._held = admission.Holdings(max_series_per_client, max_bytes_per_client)
        self._gate: Gate | None = None
        self.limits = Limits(max_label_length, max_labels_per_point, max_buckets_per_point,
                             max_quantiles_per_point, max_series_bytes, int(max_future_skew * 1e9))
        self._clock = clock
        self._lock = threading.Lock()
        self._families: dict[str, Family] = {}
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
        self._tally = Tally()  # self-metrics
        self._refusals_log = RateLimitedLog(log, clock=clock)  # a reason a minute, then how many were left out

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

    def set_gate(self, gate: Gate | None) -> None:
        """Ask ``gate`` about every request's points before any is stored (``otlp.gate``), lock released."""
        with self._lock:
            self._gate = gate

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
            tally = self._tally
            tally.requests[key] = tally.requests.get(key, 0.0) + 1
            tally.request_seconds += max(seconds, 0.0)

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
        changed: list[Changed] = []
        request = admission.Request(set())

        def reject(reason: str, message: str) -> None:
            rejected[reason] = rejected.get(reason, 0) + 1
            messages.setdefault(reason, message)

        points = batch.points
        notices: list[str] = []
        gate = self._gate
        points, collisions = ask_gate(gate, points, reject, notices) if gate is not None and points else (points, 0)
        n = len(points)
        apply_point = self._apply_point
        for start in range(0, n or 1, APPLY_CHUNK):  # one pass at least: the request's counts, resources
            if start:
                # Let a thread waiting for the lock (a scrape) take it: a released lock is otherwise
                # taken again at once by this thread, which still holds the GIL.
                time.sleep(0)
            with self._lock:
                self._version += 1
                now = self._clock()
                if not start:
                    self._tally.received += batch.received
                    for labels in batch.resources:
                        self._note_resource(labels, now)
                    listeners = self._listeners
                    batch_listeners = self._batch_listeners
                    told = events if listeners or batch_listeners else None
                for p in points[start:start + APPLY_CHUNK] if n > APPLY_CHUNK else points:
                    problem = apply_point(p, now, request, told, changed)
                    if problem is None:
                        accepted += 1
                    else:
                        reject(*problem)
                if start + APPLY_CHUNK >= n:  # the last pass: every rejection is known
                    self._tally.collisions += collisions
                    counted = self._tally.rejected
                    for reason, count in rejected.items():
                        counted[reason] = counted.get(reason, 0.0) + count

        self._publish(changed)
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
        return ApplyResult(accepted, rejected, messages, notices)

    def _apply_point(self, p: Point, now: float, request: admission.Request, events: list[AcceptedPoint] | None,
                     changed: list[Changed]) -> admission.Refusal | None:
        """Store one point (lock held); ``None`` or (reason, message) when it is rejected."""
        families = self._families
        name, kind, labels = p.name, p.kind, p.labels
        fam = families.get(name)
        if fam is not None and fam.kind != kind:
            return ("type_conflict", f"{name} is already a {fam.kind}, got a {kind}")
        series = fam.series.get(labels) if fam is not None else None
        if series is not None and series.principal and p.client and series.principal != principal_of(p.client):
            return ("not_series_owner", f"{name}: the series is another identity's ({series.principal})")
        if p.no_value:
            if fam is not None and series is not None:
                self._remove(fam, labels, series)
            return None
        new = series is None
        if series is None:
            extra = 0
            if fam is None:
                problem = admission.name_collision(name, kind, self._claims, families)
                if problem:
                    return problem
                extra = family_bytes(name, p.help)
            problem = self._admit(p, now, request, extra)
            if problem:
                return problem
            fam = families.get(name)  # admitting may have evicted the family's last series
            if fam is None and not extra and self._bytes + p.cost + family_bytes(name, p.help) > self.max_bytes:
                return admission.bytes_refusal(self._bytes, p.cost + family_bytes(name, p.help), self.max_bytes)
            series = Series(dict(labels), p.run_id, p.cost, identity_of(p.client), principal_of(p.client))
        elif p.cost != series.cost:
            if self._bytes - series.cost + p.cost > self.max_bytes:
                return admission.bytes_refusal(self._bytes, p.cost - series.cost, self.max_bytes)
            problem = self._held.grow_refusal(series.identity, p.cost - series.cost)
            if problem:
                return problem
        # gauges and summaries refuse a point before changing anything; totals are checked after
        totals = kind == "counter" or kind == "histogram"
        saved = series.state() if totals and not new else None
        try:
            restarts = temporality.update(p, series, new)
        except temporality.OutOfOrder as exc:
            if saved is not None:
                series.restore(saved)
            return ("out_of_order", f"{name}: {exc}")
        if restarts:
            self._tally.resets += restarts
        if totals and not series.totals_finite():
            if saved is not None:
                series.restore(saved)
            return ("non_finite", f"{name}: the total would no longer be a finite number")
        if new:
            if fam is None:
                fam = self._add_family(p)
                request.new_bytes += fam.cost
            fam.series[labels] = series
            self._series_total += 1
            self._bytes += series.cost
            self._held.add(series.identity, 1, series.cost)
            self._per_run[p.run_id] = self._per_run.get(p.run_id, 0) + 1
            request.new_series += 1
            request.new_bytes += series.cost
            request.new_runs.add(p.run_id)
        elif p.cost != series.cost:
            self._bytes += p.cost - series.cost
            self._held.add(series.identity, 0, p.cost - series.cost)
            series.cost = p.cost
        series.last_seen = now
        assert fam is not None  # found with the series, or added with it
        if series.layout != kind:  # a scalar series' layout is its kind (temporality.layout): set once
            relayout(fam, series)
        series.values = values = temporality.exposed(kind, series)
        fam.gen += 1
        changed.append((series, series.heads, values))
        if events is not None:
            value, count = (values[0], None) if len(values) == 1 else temporality.reported(kind, series)  # scalar kinds
            events.append(AcceptedPoint(p.run_id, name, series.view, value, p.time_ns / 1e9, kind, count, labels,
                                        p.resource, p.client, p.admitted))
        return None

    def _add_family(self, p: Point) -> Family:
        fam = self._families[p.name] = Family(p.name, p.kind, p.help, p.unit)
        for name in fam.claims:
            self._claims[name] = fam.name
        self._bytes += fam.cost
        return fam

    def _admit(self, p: Point, now: float, request: admission.Request, extra: int) -> admission.Refusal | None:
        """Room for one more series (and ``extra`` bytes for its new family), or a refusal. Per-request
        allowances first (they never need a sweep); when the store itself is full, expired and idle series
        are dropped once per request (a sweep is O(series)) before refusing."""
        run_id = p.run_id
        cost = p.cost + extra
        problem = request.refusal(run_id, run_id in self._per_run, cost, max_new_runs=self.max_new_runs_per_request,
                                  max_new_series=self.max_new_series_per_request, max_bytes=self.max_bytes)
        if problem is None:
            identity = identity_of(p.client)
            problem = self._store_refusal(run_id, cost, identity)
            if problem is not None and not request.swept:
                request.swept = True
                self._expire_locked(now, evict=True)
                problem = self._store_refusal(run_id, cost, identity)
        return problem

    def _store_refusal(self, run_id: str, cost: int, identity: str = "") -> admission.Refusal | None:
        problem = self._held.refusal(identity, cost)
        if problem is not None:
            return problem
        return admission.store_refusal(run_id, cost, series=self._series_total, used_bytes=self._bytes,
                                       run_series=self._per_run.get(run_id, 0), max_series=self.max_series,
                                       max_bytes=self.max_bytes, max_series_per_run=self.max_series_per_run)

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

    def _remove(self, fam: Family, key: Labels, s: Series) -> None:
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
        self._held.add(s.identity, -1, -s.cost)
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
        self._tally.expired += expired
        self._tally.evicted += len(stale) - expired
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
        Expiry is time-driven: call ``sweep()`` (or ``expire()``) first to bring it up to date."""
        return self._version

    def sweep(self) -> None:
        """TTL expiry as the scrape path does it: at most once a second, shared with ``render``'s own."""
        with self._lock:
            self._sweep(self._clock())

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
            out.extend(self._tally.families(self._series_total, self._bytes))
        return out

    def _collect_training(self) -> list[Metric]:
        out = [metric(fam, tuple(sample for s in fam.series.values() for sample in samples(fam, s)))
               for fam in self._families.values()]
        return out + target_info_families(entry[0] for entry in self._resources.values())

    def _publish(self, changed: list[Changed]) -> None:
        """Encode what a request changed (lock released), then store the lines (lock held; ``series.publish``)."""
        encoded = encode_changed(changed)
        with self._lock:
            publish(encoded)
            self._version += 1

    def render(self, openmetrics: bool) -> bytes:
        """What ``collect()`` returns, already encoded (OpenMetrics without its ``# EOF``): the scrape fast
        path. Under the lock only references are copied (a block per unchanged family, the list of lines of
        a changed one); they are joined after."""
        with self._lock:
            self._sweep(self._clock())
            taken = [ready(fam, openmetrics) for fam in self._families.values()]
            resources = [line for _labels, _seen, _cost, line in self._resources.values()]
            tally, held, used = self._tally.copy(), self._series_total, self._bytes
        out = [join(item, openmetrics) for item in taken]
        if resources:
            out += (encoder.header(TARGET_INFO, openmetrics), *resources)
        out.append(tally.encode(held, used, openmetrics))
        return b"".join(out)

    # ------------------------------------------------------------------------------------------------

    def _warn(self, key: str, message: str) -> None:
        """One warning per reason per minute, and the count of those left out (``core.ratelog``): a
        misconfigured trainer or a neighbour must not flood the log."""
        self._refusals_log.warning(key, "%s", message[:1000])


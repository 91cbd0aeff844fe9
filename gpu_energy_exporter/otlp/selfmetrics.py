"""The OTLP receiver's self-metrics: what is counted about requests, points, series and restarts, and how
it is exposed (``gpuenergy_otlp_*``, collector ``otlp``).

``Tally`` is plain counters; the store changes them under its own lock and copies them under it (``copy``)
for a scrape to encode after (``encode``: the bytes of ``families``, written from cached sample heads). This
module never decides whether a point is accepted, never takes a lock and never reads a clock.
"""

from __future__ import annotations

from prometheus_client.core import Metric

from gpu_energy_exporter.core import encoder, metrics

COLLECTOR = "otlp"

REJECT_REASONS: tuple[str, ...] = (
    "invalid_name", "invalid_label", "invalid_point", "unsupported_type", "unsupported_temporality",
    "type_conflict", "out_of_order", "series_limit", "run_series_limit",
    # byte bounds and junk (points.Limits, applied by translate)
    "label_too_long", "too_many_labels", "too_many_buckets", "too_many_quantiles", "series_too_large",
    "non_finite", "future_timestamp",
    # store admission
    "bytes_limit", "new_runs_per_request", "new_series_per_request", "new_bytes_per_request", "name_collision",
    # the training contract's names (otlp.reserved)
    "contract_violation",
    # identity (core.clientid, docs/security.md): claims the kernel contradicts, per-identity quotas, another
    # principal's series; and the run ledger's gate (ledger.clients, ledger.process_claims): who may change which run
    "identity_mismatch", "foreign_gpu", "client_series_limit", "client_bytes_limit", "not_series_owner",
    "not_run_owner", "foreign_rank", "not_run_client", "client_active_runs", "client_new_runs",
    "client_finished_runs", "job_mismatch", "world_size", "rank_taken",
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

RUN_ID_COLLISIONS = metrics.define(
    "otlp", "run_id_collisions_total", "counter",
    "Data points pushed under a run id another identity holds, stored under the pusher's scoped run id "
    "(<run id>~<identity>) instead of being refused or mixed into the other identity's run (docs/security.md).",
    collector=COLLECTOR)

#: Status codes initialised at zero so every request outcome has a series before it first happens.
STATUS_CODES: tuple[str, ...] = ("200", "400", "401", "413", "415", "500")


class Tally:
    """The receiver's counters (the store's lock guards them)."""

    __slots__ = ("requests", "request_seconds", "received", "rejected", "expired", "evicted", "resets",
                 "collisions")

    def __init__(self) -> None:
        self.requests: dict[str, float] = dict.fromkeys(STATUS_CODES, 0.0)
        self.request_seconds = 0.0
        self.received = 0.0
        self.rejected: dict[str, float] = dict.fromkeys(REJECT_REASONS, 0.0)
        self.expired = 0.0
        self.evicted = 0.0
        self.resets = 0.0
        self.collisions = 0.0

    def families(self, series: int, store_bytes: int) -> list[Metric]:
        """The self-metrics, with the store's current series count and estimated bytes."""
        requests = REQUESTS.family()
        for status, n in sorted(self.requests.items()):
            metrics.add(requests, (status,), n)
        received = POINTS_RECEIVED.family()
        metrics.add(received, (), self.received)
        rejected = POINTS_REJECTED.family()
        for reason, n in sorted(self.rejected.items()):
            metrics.add(rejected, (reason,), n)
        held = SERIES.family()
        metrics.add(held, (), series)
        used = STORE_BYTES.family()
        metrics.add(used, (), store_bytes)
        expired = SERIES_EXPIRED.family()
        metrics.add(expired, (), self.expired)
        evicted = SERIES_EVICTED.family()
        metrics.add(evicted, (), self.evicted)
        duration = REQUEST_DURATION.family()
        metrics.add(duration, (), self.request_seconds)
        resets = STREAM_RESTARTS.family()
        metrics.add(resets, (), self.resets)
        collisions = RUN_ID_COLLISIONS.family()
        metrics.add(collisions, (), self.collisions)
        return [requests, received, rejected, held, used, expired, evicted, duration, resets, collisions]

    def copy(self) -> Tally:
        """A copy to encode outside the store's lock (two dict copies)."""
        out = Tally.__new__(Tally)
        out.requests, out.rejected = dict(self.requests), dict(self.rejected)
        out.request_seconds, out.received, out.expired = self.request_seconds, self.received, self.expired
        out.evicted, out.resets, out.collisions = self.evicted, self.resets, self.collisions
        return out

    def encode(self, series: int, store_bytes: int, openmetrics: bool) -> bytes:
        """``encoder.encode_families(self.families(series, store_bytes), openmetrics)``, the same bytes."""
        spec = encoder.encode_spec
        return b"".join([
            spec(REQUESTS, [((status,), n) for status, n in sorted(self.requests.items())], openmetrics),
            spec(POINTS_RECEIVED, [((), self.received)], openmetrics),
            spec(POINTS_REJECTED, [((reason,), n) for reason, n in sorted(self.rejected.items())], openmetrics),
            spec(SERIES, [((), series)], openmetrics),
            spec(STORE_BYTES, [((), store_bytes)], openmetrics),
            spec(SERIES_EXPIRED, [((), self.expired)], openmetrics),
            spec(SERIES_EVICTED, [((), self.evicted)], openmetrics),
            spec(REQUEST_DURATION, [((), self.request_seconds)], openmetrics),
            spec(STREAM_RESTARTS, [((), self.resets)], openmetrics),
            spec(RUN_ID_COLLISIONS, [((), self.collisions)], openmetrics),
        ])

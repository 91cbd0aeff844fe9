"""A histogram's or a summary's data point checked and copied into a ``Point`` (buckets and bounds, or
quantiles, with their count and sum), for ``otlp.translate``: what OTLP allows and Prometheus can expose, one
``Rejected`` reason for anything else. Pure: no I/O, no store, no clock."""

from __future__ import annotations

import math
import operator
from typing import Any

from gpu_energy_exporter.otlp.points import Limits, Point, series_cost


class Rejected(Exception):
    """A data point not stored, for ``reason`` (a ``points_rejected_total`` reason)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def fill_distribution(point: Point, dp: Any, limits: Limits, label_chars: int) -> None:
    """A histogram's or summary's buckets or quantiles, and the series' cost."""
    if point.kind == "histogram":
        _fill_histogram(point, dp, limits)
        point.cost = series_cost(point.name, label_chars, "histogram", buckets=len(point.counts))
    else:
        _fill_summary(point, dp, limits)
        point.cost = series_cost(point.name, label_chars, "summary", quantiles=len(point.quantiles))


def _fill_histogram(point: Point, dp: Any, limits: Limits) -> None:
    if len(dp.bucket_counts) > limits.max_buckets_per_point or \
            len(dp.explicit_bounds) >= limits.max_buckets_per_point:
        raise Rejected("too_many_buckets", f"histogram with {max(len(dp.bucket_counts), len(dp.explicit_bounds) + 1)} "
                        f"buckets, more than {limits.max_buckets_per_point} (--otlp.max-buckets-per-point)")
    bounds = tuple(dp.explicit_bounds)
    counts = tuple(dp.bucket_counts)
    if counts and len(counts) != len(bounds) + 1:
        raise Rejected("invalid_point", f"{len(counts)} bucket counts for {len(bounds)} bounds (want bounds + 1)")
    if not all(map(math.isfinite, bounds)):
        raise Rejected("invalid_point", "histogram bounds must be finite")
    if not all(map(operator.lt, bounds, bounds[1:])):  # finite: not b1 < b2 is b2 <= b1
        raise Rejected("invalid_point", "histogram bounds must be strictly increasing")
    count = dp.count
    if counts and sum(counts) != count:
        raise Rejected("invalid_point", f"bucket counts add up to {sum(counts)}, count is {count}")
    total = dp.sum if dp.HasField("sum") else None
    if total is not None and not math.isfinite(total):
        raise Rejected("non_finite", f"histogram sum {total!r}: the sum must be finite")
    if not counts:
        bounds = ()
    point.bounds = bounds
    point.counts = counts
    point.count = count
    point.sum = total


def _fill_summary(point: Point, dp: Any, limits: Limits) -> None:
    if len(dp.quantile_values) > limits.max_quantiles_per_point:
        raise Rejected("too_many_quantiles", f"summary with {len(dp.quantile_values)} quantiles, more than "
                        f"{limits.max_quantiles_per_point} (--otlp.max-quantiles-per-point)")
    quantiles = tuple(sorted((q.quantile, q.value) for q in dp.quantile_values))
    if any(not 0.0 <= q <= 1.0 for q, _ in quantiles):
        raise Rejected("invalid_point", "summary quantiles must be between 0 and 1")
    if any(a[0] == b[0] for a, b in zip(quantiles, quantiles[1:], strict=False)):
        raise Rejected("invalid_point", "summary quantiles must be distinct")
    if not math.isfinite(dp.sum):
        raise Rejected("non_finite", f"summary sum {dp.sum!r}: the sum must be finite")
    point.quantiles = quantiles
    point.count = dp.count
    point.sum = dp.sum

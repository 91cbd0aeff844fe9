"""Series folding and store admission on plain values: no store, no lock, no request (``otlp.temporality``,
``otlp.admission``). The store-level behaviour is in test_otlp_receiver.py and test_otlp_limits.py."""

from __future__ import annotations

import math

import pytest

from gpu_energy_exporter.otlp import admission, temporality
from gpu_energy_exporter.otlp.points import Point
from gpu_energy_exporter.otlp.series import Family


def counter(value: float, t: int, start: int = 1, delta: bool = False) -> Point:
    return Point("counter", "c_total", "h", "", (), "r", start, t, delta, value=value)


def histogram(counts: tuple[int, ...], bounds: tuple[float, ...], t: int, start: int = 1, total: float = 1.0,
              delta: bool = False) -> Point:
    return Point("histogram", "h", "h", "", (), "r", start, t, delta, bounds=bounds, counts=counts,
                 count=sum(counts), sum=total)


def fold(points: list[Point]) -> tuple[temporality.Stream, int]:
    s = temporality.Stream()
    restarts = 0
    for i, p in enumerate(points):
        restarts += temporality.update(p, s, i == 0)
    return s, restarts


def test_cumulative_counter_restarts_fold_into_the_total() -> None:
    # a new start time, then a decrease without one: both restarts, and the exposed total never goes down
    s, restarts = fold([counter(10, 1), counter(15, 2), counter(4, 3, start=2), counter(1, 4, start=2)])
    assert restarts == 2
    assert temporality.exposed("counter", s) == (15 + 4 + 1,)
    assert temporality.reported("counter", s) == (20.0, None)


def test_delta_counter_accumulates_and_drops_a_retry_before_changing_anything() -> None:
    s, restarts = fold([counter(3, 1, delta=True), counter(4, 2, delta=True)])
    assert (restarts, temporality.exposed("counter", s)) == (0, (7.0,))
    before = s.state()
    with pytest.raises(temporality.OutOfOrder, match="retry or duplicate"):
        temporality.update(counter(4, 2, delta=True), s, False)
    assert s.state() == before
    with pytest.raises(temporality.OutOfOrder, match="earlier stream"):
        fold([counter(1, 5, start=9), counter(2, 6, start=8)])


def test_histogram_layout_change_starts_afresh_as_one_restart() -> None:
    s, restarts = fold([histogram((1, 2, 3), (1.0, 2.0), 1), histogram((2, 2, 3), (1.0, 2.0), 2),
                        histogram((5, 0), (9.0,), 3)])
    assert restarts == 1
    assert s.bounds == (9.0,)
    assert temporality.exposed("histogram", s) == (5.0, 5.0, 5.0, 1.0)  # le=9, +Inf, _count, _sum
    assert temporality.layout("histogram", s) == ((9.0,), True)


def test_histogram_decrease_folds_bucket_by_bucket() -> None:
    s, restarts = fold([histogram((1, 2), (1.0,), 1, total=2.0), histogram((0, 1), (1.0,), 2, total=0.5)])
    assert restarts == 1
    assert temporality.exposed("histogram", s) == (1.0, 4.0, 4.0, 2.5)
    assert temporality.reported("histogram", s) == (2.5, 4.0)


def test_a_non_finite_total_is_seen_and_the_state_restored() -> None:
    s, _ = fold([counter(1e308, 1, delta=True)])
    saved = s.state()
    temporality.update(counter(1e308, 2, delta=True), s, False)
    assert not s.totals_finite() and math.isinf(temporality.exposed("counter", s)[0])
    s.restore(saved)
    assert s.totals_finite() and temporality.exposed("counter", s) == (1e308,)


def test_admission_refusals_name_their_flag() -> None:
    request = admission.Request({"a", "b"})
    refusal = request.refusal("c", False, 10, max_new_runs=2, max_new_series=100, max_bytes=1000)
    assert refusal is not None and refusal[0] == "new_runs_per_request"
    assert "--otlp.max-new-runs-per-request" in refusal[1]
    assert request.refusal("a", False, 10, max_new_runs=2, max_new_series=100, max_bytes=1000) is None
    assert admission.store_refusal("r", 10, series=5, used_bytes=0, run_series=0, max_series=5, max_bytes=100,
                                   max_series_per_run=9) == (
        "series_limit", "the receiver holds 5 series (--otlp.max-series)")
    refusal = admission.store_refusal("r", 10, series=0, used_bytes=95, run_series=0, max_series=5, max_bytes=100,
                                      max_series_per_run=9)
    assert refusal == admission.bytes_refusal(95, 10, 100) and refusal[0] == "bytes_limit"


def test_name_collisions_between_families_and_with_reserved_names() -> None:
    fam = Family("x_total", "counter", "h", "")
    claims = dict.fromkeys(fam.claims, fam.name)
    refusal = admission.name_collision("x", "gauge", claims, {fam.name: fam})
    assert refusal is not None and "the counter 'x_total' already exposes" in refusal[1]
    refusal = admission.name_collision("up", "gauge", {}, {})
    assert refusal is not None and refusal[0] == "name_collision"
    assert admission.name_collision("y", "histogram", claims, {fam.name: fam}) is None


S = 10**9  # ns


def gauge(value: float, t: int) -> Point:
    return Point("gauge", "g", "h", "", (), "r", 0, t, False, value=value)


def test_a_sender_clock_stepped_back_is_followed_and_a_retry_still_refused() -> None:
    """Issue 20: the node's clock stepped back 1 h mid-run and every later push was refused (out_of_order),
    freezing the run. A point's time orders its stream; more progress at an earlier time is a step."""
    hour = 3600 * S
    s, _ = fold([counter(100, hour + 10 * S), counter(200, hour + 11 * S)])
    temporality.update(counter(300, 12 * S), s, False)  # the clock went back an hour, the count went on
    temporality.update(counter(400, 13 * S), s, False)
    assert temporality.exposed("counter", s) == (400.0,)
    with pytest.raises(temporality.OutOfOrder):  # a retried export: older and no more progress
        temporality.update(counter(300, 12 * S), s, False)
    g, _ = fold([gauge(0.0, hour + 10 * S), gauge(0.0, hour + 11 * S)])
    with pytest.raises(temporality.OutOfOrder):  # seconds older: a retry, dropped as before
        temporality.update(gauge(1.0, hour + 5 * S), g, False)
    temporality.update(gauge(1.0, 12 * S), g, False)  # an hour older: the clock stepped back
    assert temporality.exposed("gauge", g) == (1.0,)
    h, _ = fold([histogram((1, 1), (1.0,), hour + 10 * S)])
    temporality.update(histogram((2, 1), (1.0,), 12 * S), h, False)
    assert temporality.exposed("histogram", h)[-2] == 3.0  # _count

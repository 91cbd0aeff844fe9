"""The ledger's billing rules (``ledger.billing``), one table per rule, each case named after what it states:
plain values in, figures out. How the rules add up over a snapshot interval is tests/test_ledger_accounting.py
and tests/test_billing_rules.py; over a whole run, with a real ledger, tests/test_ledger_billing.py."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest

from gpu_energy_exporter.ledger.billing import (
    Carbon,
    CarbonPiece,
    Cut,
    Grid,
    Progress,
    Window,
    carbon_figures,
    carbon_pieces,
    charged_j,
    counter_delta_j,
    dynamic_j,
    efficiency_window,
    energy_coverage,
    idle_j,
    idle_total,
    interval_cut,
    interval_peak_w,
    max_opt,
    mfu,
    not_finite,
    per_gpu_byte_s,
    progress,
    ratio,
    step_time_s,
    window_count,
)

INF, NAN = math.inf, math.nan


def table(cases: Mapping[str, tuple[Any, Any]]) -> pytest.MarkDecorator:
    """``{rule: (arguments, expected)}`` as a parametrisation whose ids are the rules."""
    return pytest.mark.parametrize(("args", "want"), list(cases.values()), ids=list(cases))


# ----------------------------------------------------------------------------------------------------
# window: the part of a snapshot interval (t0, t1] a run [lo, hi] is charged; warm-up ends at window_start

CUTS = {
    "a_run_alone_for_the_whole_interval_is_charged_all_of_it": (
        (0.0, 10.0, -INF, INF, 0.0), Cut(10.0, 0.0, 10.0, 0.0, 10.0, 10.0)),
    "a_run_starting_inside_the_interval_is_charged_from_its_start": (
        (0.0, 10.0, 4.0, INF, 4.0), Cut(10.0, 4.0, 10.0, 4.0, 6.0, 6.0)),
    "a_run_ending_inside_the_interval_is_charged_up_to_its_end": (
        (0.0, 10.0, -5.0, 7.0, 0.0), Cut(10.0, 0.0, 7.0, 0.0, 7.0, 7.0)),
    "the_warm_up_cuts_the_window_not_the_overlap": (
        (0.0, 10.0, 0.0, INF, 6.0), Cut(10.0, 0.0, 10.0, 6.0, 10.0, 4.0)),
    "an_interval_all_in_the_warm_up_has_no_window": (
        (0.0, 10.0, 0.0, INF, 20.0), Cut(10.0, 0.0, 10.0, 20.0, 10.0, 0.0)),
    "an_interval_before_the_run_starts_charges_nothing": ((0.0, 10.0, 10.0, INF, 10.0), None),
    "an_interval_after_the_run_ended_charges_nothing": ((0.0, 10.0, -5.0, 0.0, 0.0), None),
    "an_interval_of_no_length_charges_nothing": ((5.0, 5.0, 0.0, INF, 0.0), None),
    "an_interval_running_backwards_charges_nothing": ((10.0, 5.0, 0.0, INF, 0.0), None),
}


@table(CUTS)
def test_interval_cut(args: tuple[float, float, float, float, float], want: Cut | None) -> None:
    assert interval_cut(*args) == want


WINDOWS = {
    "the_warm_up_is_taken_off_a_run_longer_than_it": ((100.0, 30.0), (Window(100.0, 30.0, True), 70.0)),
    "a_run_shorter_than_the_warm_up_is_all_window": ((20.0, 30.0), (Window(20.0, 0.0, False), 20.0)),
    "a_run_exactly_as_long_as_the_warm_up_is_all_window": ((30.0, 30.0), (Window(30.0, 0.0, False), 30.0)),
    "no_warm_up_means_the_whole_run_is_the_window": ((100.0, 0.0), (Window(100.0, 0.0, False), 100.0)),
}


@table(WINDOWS)
def test_efficiency_window(args: tuple[float, float], want: tuple[Window, float]) -> None:
    win = efficiency_window(*args)
    assert (win, win.window_s) == want


WINDOW_COUNTS = {
    "a_counter_over_the_window_is_its_total_less_its_value_at_the_warm_ups_end": ((1000.0, 300.0), 700.0),
    "a_counter_with_no_value_at_the_warm_ups_end_counts_whole": ((1000.0, None), 1000.0),
    "a_counter_never_pushed_has_no_window_count": ((None, 300.0), None),
}


@table(WINDOW_COUNTS)
def test_window_count(args: tuple[float | None, float | None], want: float | None) -> None:
    assert window_count(*args) == want


# ----------------------------------------------------------------------------------------------------
# energy

DELTAS = {
    "the_counters_increase_is_the_intervals_energy": ((100.0, 350.0), 250.0),
    "a_counter_that_did_not_move_measured_zero": ((100.0, 100.0), 0.0),
    "a_counter_that_went_back_measures_nothing": ((350.0, 100.0), None),
    "no_read_at_the_start_measures_nothing": ((None, 100.0), None),
    "no_read_at_the_end_measures_nothing": ((100.0, None), None),
}


@table(DELTAS)
def test_counter_delta(args: tuple[float | None, float | None], want: float | None) -> None:
    assert counter_delta_j(*args) == want


CHARGES = {
    "a_run_holding_the_gpu_all_interval_gets_the_whole_delta": ((1000.0, 10.0, 10.0), 1000.0),
    "half_the_gpu_all_interval_is_half_the_delta": ((1000.0, 5.0, 10.0), 500.0),
    "the_whole_gpu_for_a_quarter_of_the_interval_is_a_quarter_of_the_delta": ((1000.0, 2.5, 10.0), 250.0),
    "no_share_is_no_energy": ((1000.0, 0.0, 10.0), 0.0),
}


@table(CHARGES)
def test_energy_charged_is_the_delta_spread_evenly_times_the_runs_share(args: tuple[float, float, float],
                                                                        want: float) -> None:
    assert charged_j(*args) == want


COVERAGES = {
    "every_gpu_second_read_is_full_coverage": ((10.0, 10.0), 1.0),
    "half_the_gpu_time_read_is_half_coverage": ((5.0, 10.0), 0.5),
    "no_gpu_time_expected_has_no_coverage": ((0.0, 0.0), None),
}


@table(COVERAGES)
def test_energy_coverage(args: tuple[float, float], want: float | None) -> None:
    assert energy_coverage(*args) == want


def test_the_vram_average_is_per_gpu_not_summed_over_them() -> None:
    assert per_gpu_byte_s(float(2 << 30), 2, 10.0) == float(10 << 30)


PEAKS = {
    "the_power_read_inside_the_run_is_a_peak": ((None, 1000.0, 10.0, 250.0, True, True), 250.0),
    "a_power_read_after_the_run_ended_is_no_peak_of_it": ((None, 1000.0, 10.0, 250.0, True, False), None),
    "without_power_readings_the_intervals_mean_is_the_peak": ((None, 1000.0, 10.0, None, True, True), 100.0),
    "the_mean_counts_even_when_the_snapshot_is_after_the_run": ((None, 1000.0, 10.0, None, True, False), 100.0),
    "the_mean_counts_only_when_every_counter_was_read": ((None, 1000.0, 10.0, None, False, True), None),
    "an_interval_that_drew_no_energy_sets_no_peak": ((None, 0.0, 10.0, None, True, True), None),
    "the_mean_is_never_used_beside_a_power_reading": ((None, 5000.0, 10.0, 250.0, True, True), 250.0),
    "a_lower_reading_keeps_the_earlier_peak": ((300.0, 1000.0, 10.0, 250.0, True, True), 300.0),
    "a_higher_reading_is_the_new_peak": ((200.0, 1000.0, 10.0, 250.0, True, True), 250.0),
}


@table(PEAKS)
def test_interval_peak_power(args: tuple[float | None, float, float, float | None, bool, bool],
                             want: float | None) -> None:
    peak, joules, overlap, power, every_read, inside = args
    assert interval_peak_w(peak, joules, overlap, power, every_counter_read=every_read, inside=inside) == want


# ----------------------------------------------------------------------------------------------------
# idle and dynamic energy

IDLE = {
    "idle_energy_of_a_run_alone_is_the_idle_power_over_the_interval": ((60.0, 10.0), 600.0),
    "idle_energy_on_a_shared_gpu_is_the_runs_share_not_the_overlap": ((60.0, 5.0), 300.0),
    "idle_energy_of_a_third_of_the_gpu_is_a_third": ((60.0, 2.5), 150.0),
}


@table(IDLE)
def test_idle_energy(args: tuple[float, float], want: float) -> None:
    assert idle_j(*args) == want


IDLE_TOTALS = {
    "known_idle_energy_stands_alone": ((5.0, {}, {}), 5.0),
    "seconds_before_the_baseline_was_learned_are_priced_at_it_now": ((5.0, {"a": 10.0}, {"a": 40.0}), 405.0),
    "each_gpus_unpriced_seconds_at_its_own_baseline": ((0.0, {"a": 10.0, "b": 2.0}, {"a": 40.0, "b": 50.0}), 500.0),
    "a_gpu_whose_baseline_is_still_unknown_makes_idle_unknown": ((5.0, {"a": 10.0}, {"a": None}), None),
    "a_gpu_never_seen_again_makes_idle_unknown": ((5.0, {"a": 10.0}, {}), None),
    "a_gpu_with_no_unpriced_seconds_needs_no_baseline": ((5.0, {"a": 0.0}, {}), 5.0),
}


@table(IDLE_TOTALS)
def test_idle_total(args: tuple[float, dict[str, float], dict[str, float | None]], want: float | None) -> None:
    assert idle_total(*args) == want


DYNAMIC = {
    "dynamic_energy_is_the_energy_above_idle": ((1000.0, 400.0), 600.0),
    "below_idle_is_kept_negative_not_clamped": ((300.0, 400.0), -100.0),
    "unknown_idle_means_unknown_dynamic_energy": ((1000.0, None), None),
    "unknown_energy_means_unknown_dynamic_energy": ((None, 400.0), None),
}


@table(DYNAMIC)
def test_dynamic_energy(args: tuple[float | None, float | None], want: float | None) -> None:
    assert dynamic_j(*args) == want


# ----------------------------------------------------------------------------------------------------
# carbon: (energy J, a, b, grid now, grid before, when the intensity changed)

KWH = 3.6e6
PIECES = {
    "one_intensity_prices_the_whole_interval": (
        (KWH, 0.0, 10.0, Grid(400.0, 1.5), Grid(None, None), None), [CarbonPiece(1.0, 400.0, 1.5)]),
    "a_pue_not_known_is_1": (
        (KWH, 0.0, 10.0, Grid(400.0, None), Grid(None, None), None), [CarbonPiece(1.0, 400.0, 1.0)]),
    "an_intensity_change_inside_splits_the_energy_at_the_change": (
        (KWH, 0.0, 10.0, Grid(400.0, 1.5), Grid(200.0, 1.2), 2.5),
        [CarbonPiece(0.25, 200.0, 1.2), CarbonPiece(0.75, 400.0, 1.5)]),
    "the_pue_before_a_change_falls_back_to_the_pue_now": (
        (KWH, 0.0, 10.0, Grid(400.0, 1.5), Grid(200.0, None), 5.0),
        [CarbonPiece(0.5, 200.0, 1.5), CarbonPiece(0.5, 400.0, 1.5)]),
    "a_change_at_the_cuts_start_prices_all_at_the_new_value": (
        (KWH, 0.0, 10.0, Grid(400.0, 1.5), Grid(200.0, 1.2), 0.0), [CarbonPiece(1.0, 400.0, 1.5)]),
    "a_change_at_the_cuts_end_prices_all_at_the_new_value": (
        (KWH, 0.0, 10.0, Grid(400.0, 1.5), Grid(200.0, 1.2), 10.0), [CarbonPiece(1.0, 400.0, 1.5)]),
    "a_change_while_the_intensity_is_unknown_is_no_change": (
        (KWH, 0.0, 10.0, Grid(None, 1.5), Grid(200.0, 1.2), 5.0), [CarbonPiece(1.0, None, 1.5)]),
}


@table(PIECES)
def test_carbon_pieces(args: tuple[float, float, float, Grid, Grid, float | None], want: list[CarbonPiece]) -> None:
    assert carbon_pieces(*args) == want


CO2 = {
    "co2_is_kwh_times_pue_times_intensity": (CarbonPiece(2.0, 400.0, 1.5), 1200.0),
    "energy_at_an_unknown_intensity_emits_no_counted_co2": (CarbonPiece(2.0, None, 1.5), 0.0),
}


@table(CO2)
def test_co2_of_a_piece(args: CarbonPiece, want: float) -> None:
    assert args.co2_g == want


# (co2 g, priced kWh, kWh x intensity, kWh x PUE, measured, energy J, a carbon source configured)
CARBON = {
    "priced_energy_gives_co2_and_its_weighted_intensity_and_pue": (
        (1200.0, 2.0, 1000.0, 3.0, True, 7.2e6, True), Carbon(1200.0, 500.0, 1.5)),
    "no_measured_energy_has_no_co2": ((1200.0, 2.0, 1000.0, 3.0, False, 7.2e6, True), Carbon(None, None, None)),
    "a_run_that_drew_no_energy_emitted_0_g_where_carbon_is_configured": (
        (0.0, 0.0, 0.0, 0.0, True, 0.0, True), Carbon(0.0, None, None)),
    "a_run_that_drew_no_energy_has_no_co2_where_no_carbon_source_is": (
        (0.0, 0.0, 0.0, 0.0, True, 0.0, False), Carbon(None, None, None)),
    "energy_never_priced_has_unknown_co2": ((0.0, 0.0, 0.0, 0.0, True, 100.0, True), Carbon(None, None, None)),
}


@table(CARBON)
def test_carbon_figures(args: tuple[float, float, float, float, bool, float, bool], want: Carbon) -> None:
    co2, kwh, kwh_i, kwh_p, measured, energy, configured = args
    assert carbon_figures(co2, kwh, kwh_i, kwh_p, measured=measured, energy_j=energy, configured=configured) == want


# ----------------------------------------------------------------------------------------------------
# progress: (steps done, steps planned, seconds a step, J a step, the run still going)

PROGRESS = {
    "halfway_through_the_plan_half_remains_at_the_pace_so_far": ((50.0, 100.0, 2.0, 10.0, True),
                                                                Progress(0.5, 50.0, 100.0, 500.0)),
    "past_the_plan_is_done_with_nothing_remaining": ((120.0, 100.0, 2.0, 10.0, True), Progress(1.0, 0.0, 0.0, 0.0)),
    "a_run_no_longer_going_has_no_eta_but_still_its_energy_left": (
        (50.0, 100.0, 2.0, 10.0, False), Progress(0.5, 50.0, None, 500.0)),
    "without_a_pace_there_is_no_eta": ((50.0, 100.0, None, 10.0, True), Progress(0.5, 50.0, None, 500.0)),
    "without_energy_per_step_there_is_no_energy_to_finish": ((50.0, 100.0, 2.0, None, True),
                                                             Progress(0.5, 50.0, 100.0, None)),
    "without_a_plan_there_is_no_progress": ((50.0, None, 2.0, 10.0, True), Progress(None, None, None, None)),
    "a_plan_of_no_steps_is_no_plan": ((50.0, 0.0, 2.0, 10.0, True), Progress(None, None, None, None)),
    "no_step_done_yet_is_no_progress": ((None, 100.0, 2.0, 10.0, True), Progress(None, None, None, None)),
}


@table(PROGRESS)
def test_progress(args: tuple[float | None, float | None, float | None, float | None, bool], want: Progress) -> None:
    done, total, step_s, j_per_step, going = args
    assert progress(done, total, step_s=step_s, j_per_step=j_per_step, going=going) == want


STEP_TIMES = {
    "the_mean_step_is_the_histograms_sum_over_its_count": ((30.0, 10.0), 3.0),
    "no_step_measured_has_no_mean": ((0.0, 0.0), None),
}


@table(STEP_TIMES)
def test_step_time(args: tuple[float, float], want: float | None) -> None:
    assert step_time_s(*args) == want


MFU = {
    "mfu_is_the_flops_per_second_over_the_peak": ((4e15, 10.0, 1e15), 0.4),
    "no_flops_pushed_has_no_mfu": ((None, 10.0, 1e15), None),
    "no_window_has_no_mfu": ((4e15, 0.0, 1e15), None),
    "a_gpu_without_a_known_peak_has_no_mfu": ((4e15, 10.0, None), None),
}


@table(MFU)
def test_mfu(args: tuple[float | None, float, float | None], want: float | None) -> None:
    assert mfu(*args) == want


# ----------------------------------------------------------------------------------------------------
# figures that may be unknown

RATIOS = {
    "a_ratio_of_known_figures": ((10.0, 4.0), 2.5),
    "nothing_over_no_time_is_unknown_not_infinite": ((10.0, 0.0), None),
    "a_negative_denominator_is_unknown": ((10.0, -1.0), None),
    "an_unknown_numerator_is_unknown": ((None, 4.0), None),
    "an_unknown_denominator_is_unknown": ((10.0, None), None),
}


@table(RATIOS)
def test_ratio(args: tuple[float | None, float | None], want: float | None) -> None:
    assert ratio(*args) == want


MAXIMA = {
    "the_larger_of_two_known_figures": ((3.0, 5.0), 5.0),
    "an_unknown_first_gives_the_second": ((None, 5.0), 5.0),
    "an_unknown_second_gives_the_first": ((3.0, None), 3.0),
    "both_unknown_is_unknown": ((None, None), None),
}


@table(MAXIMA)
def test_max_of_figures_that_may_be_unknown(args: tuple[float | None, float | None], want: float | None) -> None:
    assert max_opt(*args) == want


def test_figures_that_are_not_finite_are_named_in_order_and_nothing_else() -> None:
    figures = {"a": INF, "b": 1.0, "c": NAN, "d": "inf", "e": None, "f": -INF, "g": 2}
    assert not_finite(figures) == ["a", "c", "f"]

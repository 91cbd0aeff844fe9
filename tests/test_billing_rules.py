"""The arithmetic edges of billing (issue 28 item 7): the rules a mutation pass found untested, one table per
rule, each case named after what it states. Plain values in, figures out: the splitter (``core.sharing``),
settlement (``core.settle``), one snapshot interval's accounting (``ledger.accounting``), the energy counter's
reset rule (``core.energy``) and the run's notes (``ledger``)."""

from __future__ import annotations

import math

import pytest
from test_ledger import T0, UUID_A, Clock, Harness, constant, summary_of, trainer
from test_ledger_accounting import frame, gpu

from gpu_energy_exporter.collectors.kubernetes.attribution import UNOWNED, PodRef, Slot
from gpu_energy_exporter.collectors.kubernetes.attribution import split as pod_split
from gpu_energy_exporter.core import sharing
from gpu_energy_exporter.core.energy import EnergyCounter
from gpu_energy_exporter.core.settle import fractions, sample_weights, spread
from gpu_energy_exporter.core.state import ProcessSample
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.accounting import Acc, integrate
from gpu_energy_exporter.ledger.split import Holding, Proc, piece_shares

NAN, INF = float("nan"), float("inf")

# ----------------------------------------------------------------------------------------------------
# a weight that is no measurement falls back to an even split: never a negative or NaN part

UNUSABLE = {
    "nan_weight_falls_back_to_even": [0.7, NAN],
    "negative_weight_falls_back_to_even": [0.7, -0.2],
    "infinite_weight_falls_back_to_even": [0.7, INF],
    "all_zero_weights_fall_back_to_even": [0.0, 0.0],
    "unknown_weight_falls_back_to_even": [0.7, None],
}


@pytest.mark.parametrize("weights", list(UNUSABLE.values()), ids=list(UNUSABLE))
def test_the_splitter(weights: list[float | None]) -> None:
    parts = sharing.split(100.0, [sharing.Member(f"o{i}", weight=w) for i, w in enumerate(weights)])
    assert [(o, rule) for o, rule, _ in parts] == [("o0", sharing.RULE_EVEN), ("o1", sharing.RULE_EVEN)]
    assert [p for _, _, p in parts] == [50.0, 50.0]


def test_the_splitter_splits_finite_weights_in_proportion() -> None:
    parts = sharing.split(90.0, [sharing.Member("a", weight=70.0), sharing.Member("b", weight=20.0)])
    assert parts == [("a", sharing.RULE_SM_UTIL, 70.0), ("b", sharing.RULE_SM_UTIL, 20.0)]


@pytest.mark.parametrize("sm", [NAN, -5.0, INF], ids=["nan", "negative", "infinite"])
def test_the_ledgers_process_weights_fall_back_to_even_and_pods_likewise(sm: float) -> None:
    shares = piece_shares([Holding("a", 0.0, pids=frozenset({1})), Holding("b", 0.0, pids=frozenset({2}))],
                          [Proc(1, 70.0), Proc(2, sm)], 1.0)
    assert shares == {"a": (0.5, sharing.RULE_EVEN), "b": (0.5, sharing.RULE_EVEN)}
    x, y = PodRef("ns", "x", "c"), PodRef("ns", "y", "c")
    parts = pod_split(10.0, [Slot("GPU-a", x), Slot("GPU-a", y)], {x: 70.0, y: sm})
    assert all(part >= 0 and math.isfinite(part) for _, _, part in parts)
    assert sum(part for _, _, part in parts) == pytest.approx(10.0)
    assert UNOWNED not in [pod for pod, _, _ in parts]


# ----------------------------------------------------------------------------------------------------
# settlement: the parts of a span sum to the counter's delta, by the shape where it is known

SPREADS = {
    "by_the_shape_where_it_is_known": ((300.0, [1.0, 3.0], [1.0, 1.0], True), [75.0, 225.0]),
    "by_time_where_the_shape_is_not_whole": ((300.0, [1.0, 3.0], [1.0, 2.0], False), [100.0, 200.0]),
    "by_time_where_no_power_was_read": ((300.0, [0.0, 0.0], [1.0, 2.0], True), [100.0, 200.0]),
    "a_nan_or_negative_shape_weighs_nothing": ((300.0, [NAN, -1.0, 2.0], [1.0, 1.0, 1.0], True), [0.0, 0.0, 300.0]),
    "evenly_where_nothing_has_length": ((300.0, [0.0, 0.0], [0.0, 0.0], True), [150.0, 150.0]),
}


@pytest.mark.parametrize(("args", "want"), list(SPREADS.values()), ids=list(SPREADS))
def test_a_span_is_spread(args: tuple[float, list[float], list[float], bool], want: list[float]) -> None:
    delta, shape, durations, shaped = args
    parts = spread(delta, shape, durations, shaped=shaped)
    assert parts == pytest.approx(want)
    assert sum(parts) == delta
    assert fractions(shape, durations, shaped=shaped)[-1] == 1.0


WEIGHTS = {
    "a_sample_covering_the_piece_is_its_weight": ((0.0, 10.0, [(1, 70.0, -5.0, 20.0)]), {1: 70.0}),
    "two_samples_in_a_piece_weigh_by_their_time": (
        (0.0, 10.0, [(1, 60.0, 0.0, 4.0), (1, 10.0, 4.0, 10.0)]), {1: 30.0}),
    "no_sample_covering_the_piece_is_no_weight": ((0.0, 10.0, [(1, 70.0, 10.0, 20.0)]), None),
    "a_nan_sample_is_no_weight": ((0.0, 10.0, [(1, NAN, 0.0, 10.0), (2, 50.0, 0.0, 10.0)]), {2: 50.0}),
}


@pytest.mark.parametrize(("args", "want"), list(WEIGHTS.values()), ids=list(WEIGHTS))
def test_sample_weights(args: tuple[float, float, list[tuple[int, float, float, float]]],
                        want: dict[int, float] | None) -> None:
    t0, t1, samples = args
    got = sample_weights(t0, t1, [ProcessSample(*s) for s in samples])
    assert got == (None if want is None else pytest.approx(want))


# ----------------------------------------------------------------------------------------------------
# one interval's accounting


def _charge(holders: list[Holding], f0_power: float | None, f1_power: float | None, lo: float, hi: float,
            idle_w: float | None = None) -> Acc:
    acc = Acc(t=lo)
    integrate(acc, frame(0.0, gpu(0.0, power_w=f0_power, idle_w=idle_w)),
              frame(10.0, gpu(4000.0, power_w=f1_power, idle_w=idle_w)), lo, hi, run_id="r", window_start=lo,
              keys=["a"], holders={"a": holders})
    return acc


def test_idle_energy_of_a_run_on_a_shared_gpu_is_its_share_not_the_overlap() -> None:
    acc = _charge([Holding("r", 0.0), Holding("other", 0.0)], None, None, 0.0, math.inf, idle_w=60.0)
    assert acc.idle_j == pytest.approx(60.0 * 10.0 * 0.5)
    assert acc.energy_j == pytest.approx(2000.0)


PEAKS = {
    "f1_inside_the_run_gives_the_power_it_reported": (([Holding("r", 6.0)], 500.0, 600.0, 6.0, math.inf), 600.0),
    "f1_after_the_run_ended_gives_no_peak_of_the_run": (([Holding("r", 0.0, 4.0)], 500.0, 600.0, 0.0, 4.0), None),
    "a_shared_gpus_power_is_the_runs_share": (
        ([Holding("r", 0.0), Holding("o", 0.0)], 500.0, 600.0, 0.0, math.inf), 300.0),
    "without_power_readings_the_mean_of_the_overlap": (([Holding("r", 6.0)], None, None, 6.0, math.inf), 400.0),
}


@pytest.mark.parametrize(("args", "want"), list(PEAKS.values()), ids=list(PEAKS))
def test_peak_power_over_a_partial_overlap(args: tuple[list[Holding], float | None, float | None, float, float],
                                           want: float | None) -> None:
    holders, p0, p1, lo, hi = args
    assert _charge(holders, p0, p1, lo, hi).peak_power_w == (None if want is None else pytest.approx(want))


# ----------------------------------------------------------------------------------------------------
# the energy counter: a reset seen through a slow read is a reset, and is credited at most one interval


def test_a_counter_reset_after_a_slow_read_is_confirmed_and_credited_at_most_one_interval() -> None:
    c = EnergyCounter(interval_s=1.0)
    c.update(1_000_000.0, 9.0, started=8.99, max_power_w=700.0)
    c.update(1_000_400.0, 10.0, started=9.99, max_power_w=700.0)  # 400 W
    # The driver reloaded during a read that took 5 s: the reading is small (a restarted counter), not a
    # decrease to reject; the cap allows for the whole time since the last read began.
    v = c.update(2_000.0, 15.5, started=10.5, max_power_w=700.0)
    assert not v.accepted and c.holding and c.rejected["decrease"] == 0
    v = c.update(2_400.0, 16.5, started=16.49, max_power_w=700.0)
    assert v.accepted and v.reset and c.resets == 1
    assert 0.0 <= v.credit_j <= 400.0 * 1.0  # at most one interval at the last measured power
    assert c.total_j == pytest.approx(1_000_400.0 + v.credit_j + 2_400.0)


# ----------------------------------------------------------------------------------------------------
# the run's notes


def test_co2_is_a_lower_bound_when_the_intensity_was_missing_for_part_of_the_run() -> None:
    clock = Clock()

    def carbon() -> tuple[float, float]:
        if clock.t < T0 + 10:
            raise OSError("intensity source not reachable")
        return 400.0, 1.0

    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock, carbon=carbon)
    h = Harness(ledger, clock, {UUID_A: constant(300.0)})
    pushes = trainer(h, "r", T0 + 1.0, T0 + 20.0, rate=100.0, every=1.0)
    h.run_until(T0 + 22.0, pushes)
    s = summary_of(ledger, "r")
    assert "CO2 is a lower bound" in s["ledger_notes"]
    # priced only for the intervals whose end had an intensity (the snapshot at 10 s prices 9-10 s): 11 of the
    # run's 19 s at 300 W, 400 g/kWh
    assert s["co2_g"] == pytest.approx(300.0 * 11.0 / 3.6e6 * 400.0)


def test_an_ask_the_driver_answers_with_no_sample_keeps_the_last_weights() -> None:
    """NVML answers NOT_FOUND when asked again within its sampling period (1/6 s to 1 s): nothing was measured,
    so the weights last measured hold. Before, that ask read as 'no weight' and split the GPU evenly for the
    sample: a trainer at 10% of the SMs was charged +7% (tests/test_attribution_e2e.py under load)."""
    from gpu_energy_exporter.collectors.gpu_processes import ProcessTable, UtilizationCadence
    from gpu_energy_exporter.core.state import GPUProcess, GPUReading

    cadence = UtilizationCadence(0.2, lambda: 0.0)
    table = ProcessTable(None)

    def reading(a: float | None, b: float | None) -> GPUReading:
        return GPUReading(timestamp=0.0, processes=(GPUProcess(1, None, a), GPUProcess(2, None, b)))

    first = cadence.apply(0, reading(90.0, 10.0), table, asked=True)
    assert [p.sm_util_pct for p in first.processes or ()] == [90.0, 10.0]
    again = cadence.apply(0, reading(None, None), table, asked=True)  # NOT_FOUND: no sample since
    assert [p.sm_util_pct for p in again.processes or ()] == [90.0, 10.0]
    later = cadence.apply(0, reading(30.0, 0.0), table, asked=True)
    assert [p.sm_util_pct for p in later.processes or ()] == [30.0, 0.0]

"""Energy accounting primitives: monotonic rebasing and trapezoid integration."""

from __future__ import annotations

import pytest

from gpu_energy_exporter.energy import MonotonicCounter, TrapezoidIntegrator


def test_monotonic_counter_rebases_across_a_reset_and_counts_it() -> None:
    c = MonotonicCounter()
    assert c.value is None
    assert c.update(1000.0) == 1000.0
    assert c.update(1500.0) == 1500.0
    # driver reload: the raw counter restarts near zero
    assert c.update(20.0) == 1520.0
    assert c.update(120.0) == 1620.0
    assert c.resets == 1
    assert c.update(5.0) == 1625.0 and c.resets == 2


def test_trapezoid_exact_for_linear_power() -> None:
    integ = TrapezoidIntegrator()
    # power ramps 100 W -> 300 W over 2 s: exact energy 400 J
    for k in range(21):
        integ.add(1000.0 + k * 0.1, 100.0 + k * 10.0)
    assert integ.energy_j == pytest.approx(400.0)
    assert integ.samples == 21 and integ.gaps == 0


def test_trapezoid_ignores_out_of_order_and_bridges_gaps() -> None:
    integ = TrapezoidIntegrator(max_gap_s=1.0)
    integ.add(0.0, 100.0)
    integ.add(0.5, 100.0)
    integ.add(0.4, 999.0)  # out of order: ignored
    assert integ.energy_j == pytest.approx(50.0)
    integ.add(3.5, 300.0)  # 3 s gap: held at the last level (100 W), counted
    assert integ.energy_j == pytest.approx(350.0)
    assert integ.gaps == 1


def test_a_reset_credits_the_power_estimate_for_the_uncovered_part_of_the_interval() -> None:
    c = MonotonicCounter()
    c.update(1000.0)
    # reset 6 s into a 10 s interval at 100 W: the counter shows 400 J, the interval really used 1000 J
    assert c.update(400.0, gap_estimate=1000.0) == pytest.approx(2000.0)
    assert c.update(500.0, gap_estimate=100.0) == pytest.approx(2100.0)  # no reset: estimate unused
    # an estimate below what the counter shows is ignored
    assert c.update(50.0, gap_estimate=10.0) == pytest.approx(2150.0)
    assert c.resets == 2

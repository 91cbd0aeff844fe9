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

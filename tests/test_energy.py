"""Energy accounting primitives on plain values: the energy counter's plausibility rules and trapezoid
integration. The rules tested here are the ones docs/measurement.md states."""

from __future__ import annotations

import pytest

from gpu_energy_exporter.core.energy import EnergyCounter, TrapezoidIntegrator


def feed(c: EnergyCounter, readings_mj: list[float], *, dt: float = 1.0, power_w: float = 700.0,
         t0: float = 0.0) -> list[float | None]:
    """Feed mJ readings one ``dt`` apart; the exposed value (mJ) after each."""
    out = []
    for k, mj in enumerate(readings_mj):
        c.update(mj / 1000.0, t0 + k * dt, max_power_w=power_w)
        out.append(None if c.exposed_j is None else round(c.exposed_j * 1000.0, 6))
    return out


def test_a_single_low_reading_is_held_back_and_the_counter_ends_exactly_at_the_truth() -> None:
    # Issue 10: 1e9, 1e9+700, 0, 1e9+2100 mJ used to expose 2e9+2801 mJ (278 kWh out of nowhere).
    c = EnergyCounter()
    exposed = feed(c, [1e9, 1e9 + 700, 0, 1e9 + 2100])
    assert exposed == [None, 1e9 + 700, 1e9 + 700, 1e9 + 2100]
    assert c.total_j == pytest.approx((1e9 + 2100) / 1000.0, abs=1e-9)
    assert c.resets == 0
    assert c.rejected == {"decrease": 1, "jump": 0, "unconfirmed": 0}


def test_a_single_implausible_jump_is_held_back() -> None:
    c = EnergyCounter()
    # 700 W GPU, 1 s apart: +5e11 mJ in a second is 500 MW
    exposed = feed(c, [1e9, 1e9 + 700, 1e9 + 5e11, 1e9 + 2100, 1e9 + 2800])
    assert exposed == [None, 1e9 + 700, 1e9 + 700, 1e9 + 2100, 1e9 + 2800]
    assert c.rejected["jump"] == 1 and c.resets == 0


def test_an_increase_up_to_the_cap_is_accepted_and_above_it_rejected() -> None:
    c = EnergyCounter(margin=1.5, slack_s=0.2)
    c.update(1000.0, 0.0, max_power_w=400.0)
    c.update(1000.0, 0.0, max_power_w=400.0)
    cap = 1.5 * 400.0 * (10.0 + 0.2)  # 10 s at 1.5x the limit, plus 0.2 s slack
    assert c.cap_j(10.0) == pytest.approx(cap)
    assert c.update(1000.0 + cap + 1.0, 10.0).rejected == ("jump",)
    assert c.update(1000.0 + cap - 1.0, 10.0).accepted


def test_without_a_power_limit_the_fallback_power_bounds_the_increase() -> None:
    c = EnergyCounter(fallback_power_w=2000.0)
    assert c.cap_j(1.0) == pytest.approx(1.5 * 2000.0 * 1.2)
    c.update(0.0, 0.0, max_power_w=None)
    c.update(0.0, 0.0, max_power_w=None)
    assert c.update(5000.0, 1.0).rejected == ("jump",)


def test_a_decrease_that_is_not_a_restarted_counter_is_rejected() -> None:
    c = EnergyCounter()
    feed(c, [1e9, 1e9 + 700])
    c.update(5e5, 2.0, max_power_w=700.0)  # 500 kJ: far more than 700 W could draw in 1 s
    assert c.exposed_j == pytest.approx(1e6 + 0.7)
    assert c.rejected["decrease"] == 1 and not c.holding


def test_a_genuine_reset_is_confirmed_by_the_next_reading_and_exposes_the_drivers_value() -> None:
    c = EnergyCounter(interval_s=1.0)
    # 300 W steady; the driver reloads between t=2 and t=3: the new counter reads 150 J at t=3
    for k in range(3):
        c.update(1e6 + 300.0 * k, float(k), max_power_w=700.0)
    assert c.exposed_j == pytest.approx(1e6 + 600.0)
    v = c.update(150.0, 3.0, max_power_w=700.0)
    assert not v.accepted and c.holding and c.exposed_j == pytest.approx(1e6 + 600.0)  # held, not shown yet
    v = c.update(450.0, 4.0, max_power_w=700.0)
    assert v.accepted and v.reset and c.resets == 1
    assert c.exposed_j == pytest.approx(450.0)  # the driver's counter as it is: Prometheus sees the reset
    # in-process total: the old value, plus the 150 J the new counter missed in the reset interval
    assert v.credit_j == pytest.approx(150.0)
    assert c.total_j == pytest.approx(1e6 + 600.0 + 150.0 + 450.0)
    assert sum(c.rejected.values()) == 0


def test_reset_credit_is_at_most_one_interval_of_the_last_average_power_even_after_an_outage() -> None:
    c = EnergyCounter(interval_s=1.0)
    for k in range(3):
        c.update(1e9 + 700.0 * k, float(k), max_power_w=700.0)
    # the driver reloads at t=2.5 and the counter is unreadable for an hour while the GPU idles at 60 W
    c.update(60.0 * 3600.0, 3602.5, max_power_w=700.0)
    v = c.update(60.0 * 3601.0, 3603.5, max_power_w=700.0)
    assert v.reset
    # last average power x the hour, minus what the new counter shows, would credit 2.3 MJ (0.64 kWh):
    # the credit stops at one interval of the last average power
    assert v.credit_j == pytest.approx(700.0)
    assert c.total_j == pytest.approx(1e9 + 1400.0 + 700.0 + 60.0 * 3601.0)


def test_reset_credit_covers_the_uncovered_part_of_the_interval() -> None:
    c = EnergyCounter(interval_s=1.0)
    for k in range(3):
        c.update(1e9 + 700.0 * k, float(k), max_power_w=700.0)
    c.update(700.0 * 0.5, 3.0, max_power_w=700.0)  # reset at t=2.5: the new counter covers half the interval
    v = c.update(700.0 * 1.5, 4.0, max_power_w=700.0)
    assert v.reset and v.credit_j == pytest.approx(350.0)


def test_a_reset_hidden_by_an_outage_is_plausible_growth() -> None:
    # A small counter, reset, then unreadable long enough that the new counter passes the old value: no
    # reading can tell, and the increase is within what the GPU could draw, so it is accepted (the part
    # before the reset is lost: an under-count, never an over-count).
    c = EnergyCounter()
    feed(c, [1e6, 1.7e6])
    assert c.update(700.0 * 3600.0, 3602.5, max_power_w=700.0).accepted
    assert c.resets == 0


def test_a_small_decrease_is_a_reset_once_the_next_reading_grows_from_it() -> None:
    c = EnergyCounter()
    feed(c, [2e6, 2e6 + 300_000])  # 2.0 kJ, 2.3 kJ
    c.update(0.1, 2.0, max_power_w=700.0)  # small: could be a reset ...
    assert c.holding and c.resets == 0
    c.update(300.1, 3.0, max_power_w=700.0)  # ... and the next one grows from it at 300 W, below the old value
    assert c.resets == 1 and c.exposed_j == pytest.approx(300.1)
    assert sum(c.rejected.values()) == 0


def test_a_low_glitch_on_a_small_counter_is_not_taken_for_a_reset() -> None:
    # Just after a driver load the counter is small: a glitch to 0 then a normal reading fits both a reset
    # and the old counter; the old counter wins and nothing is credited twice.
    c = EnergyCounter()
    feed(c, [500_000, 800_000])  # 500 J, 800 J
    c.update(0.0, 2.0, max_power_w=700.0)
    c.update(1100.0, 3.0, max_power_w=700.0)  # 1100 J above 0 is plausible in 1 s, and so is 300 J above 800
    assert c.resets == 0 and c.exposed_j == pytest.approx(1100.0) and c.total_j == pytest.approx(1100.0)
    assert c.rejected["decrease"] == 1


def test_the_first_reading_is_exposed_only_once_a_second_one_agrees() -> None:
    c = EnergyCounter()
    c.update(0.0, 0.0, max_power_w=700.0)  # a bad first reading
    assert c.exposed_j is None and c.awaiting_first
    c.update(1e6, 0.001, max_power_w=700.0)  # contradicts it: nothing trusted yet
    assert c.exposed_j is None and c.rejected["unconfirmed"] == 1
    c.update(1e6 + 300.0, 1.0, max_power_w=700.0)
    assert c.exposed_j == pytest.approx(1e6 + 300.0) and not c.awaiting_first
    assert c.total_j == pytest.approx(1e6 + 300.0)


def test_an_outage_without_reset_accepts_the_energy_drawn_meanwhile() -> None:
    c = EnergyCounter()
    feed(c, [1e9, 1e9 + 300_000])
    # unreadable for 10 minutes at 300 W, then readable: 180 kJ more, plausible over 600 s
    v = c.update(1e6 + 300.0 + 600.0 * 300.0, 601.0, max_power_w=700.0)
    assert v.accepted and c.resets == 0


def test_plausibility_allows_for_the_whole_span_of_a_slow_read() -> None:
    # The previous read began at t=10.0 and returned at 10.0; this one began at 10.1 and took 0.6 s: the
    # counter may have been read as late as 10.7, 0.7 s after the previous one.
    c = EnergyCounter(slack_s=0.0)
    c.update(1000.0, 10.0, max_power_w=700.0)
    c.update(1000.0, 10.0, max_power_w=700.0)
    assert c.update(1000.0 + 700.0 * 0.7, 10.7, started=10.1).accepted
    c2 = EnergyCounter(slack_s=0.0)
    c2.update(1000.0, 10.0, max_power_w=700.0)
    c2.update(1000.0, 10.0, max_power_w=700.0)
    assert c2.update(1000.0 + 700.0 * 0.7, 10.1).rejected == ("jump",)  # judged from the start alone


def test_time_going_nowhere_allows_only_the_slack() -> None:
    c = EnergyCounter(slack_s=0.2)
    c.update(100.0, 5.0, max_power_w=500.0)
    assert c.update(100.0, 5.0).accepted  # an immediate re-read
    assert c.update(100.0 + 1.5 * 500 * 0.2 + 1, 5.0).rejected == ("jump",)


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

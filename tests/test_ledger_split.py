"""The ledger's split of one GPU's energy between runs (``ledger_split``): pure arithmetic, no ledger."""

from __future__ import annotations

import math
import random

import pytest

from gpu_energy_exporter.ledger.split import Holding, charge, shares, unattributed


def test_one_run_alone_is_charged_the_whole_gpu() -> None:
    assert shares([Holding("a", 0.0)]) == {"a": (1.0, "exclusive")}


def test_two_runs_on_one_gpu_share_it_evenly_and_weights_split_it_by_sm_utilisation() -> None:
    both = [Holding("a", 0.0), Holding("b", 0.0)]
    assert shares(both) == {"a": (0.5, "even"), "b": (0.5, "even")}
    assert shares(both, {"a": 30.0, "b": 90.0}) == {"a": (0.25, "sm_util"), "b": (0.75, "sm_util")}
    # A run counted twice (two ranks on one GPU) is still one run.
    assert shares([Holding("a", 0.0), Holding("a", 0.0)]) == {"a": (1.0, "exclusive")}


def test_mig_instances_split_the_parent_gpu_once() -> None:
    seven = [Holding(f"r{i}", 0.0, mig_uuid=f"MIG-{i}") for i in range(7)]
    got = shares(seven)
    assert {r: rule for r, (_, rule) in got.items()} == {f"r{i}": "mig" for i in range(7)}
    assert sum(frac for frac, _ in got.values()) == pytest.approx(1.0)
    assert got["r3"][0] == pytest.approx(1 / 7)
    # Two runs on one instance share it; a run on a 3-slice instance weighs 3 (the hook).
    got = shares([Holding("a", 0.0, mig_uuid="MIG-0"), Holding("b", 0.0, mig_uuid="MIG-0"),
                  Holding("c", 0.0, mig_uuid="MIG-1", slices=3)])
    assert got["a"][0] == pytest.approx(1 / 8) and got["b"][0] == pytest.approx(1 / 8)
    assert got["c"][0] == pytest.approx(6 / 8)


def test_a_run_starting_inside_an_interval_gets_half_of_the_rest_of_it() -> None:
    hs = [Holding("a", 0.0), Holding("b", 4.0)]
    a = charge("a", 0.0, 10.0, -math.inf, math.inf, hs)
    b = charge("b", 0.0, 10.0, -math.inf, math.inf, hs)
    assert a.share_s == pytest.approx(4.0 + 3.0) and b.share_s == pytest.approx(3.0)
    assert a.splits == {"exclusive", "even"} and b.splits == {"even"}
    assert a.sharers == {"b"} and b.sharers == {"a"}
    # Cut to the run's own window [lo, hi].
    assert charge("a", 0.0, 10.0, 5.0, 8.0, hs).share_s == pytest.approx(1.5)
    assert unattributed(0.0, 10.0, [Holding("a", 2.0, 5.0)]) == pytest.approx(7.0)


def test_charged_time_plus_unattributed_time_is_the_interval_for_any_holdings() -> None:
    rnd = random.Random(7)
    for _ in range(300):
        t0, t1 = 0.0, rnd.uniform(0.1, 5.0)
        hs = []
        for i in range(rnd.randint(0, 5)):
            a = rnd.uniform(-1.0, t1 + 1.0)
            b = a + rnd.uniform(0.0, 3.0) if rnd.random() < 0.7 else math.inf
            mig = f"MIG-{rnd.randint(0, 2)}" if rnd.random() < 0.3 else ""
            hs.append(Holding(f"r{i}", a, b, mig))
        total = sum(charge(r, t0, t1, -math.inf, math.inf, hs).share_s for r in {h.run_id for h in hs})
        assert total + unattributed(t0, t1, hs) == pytest.approx(t1 - t0)
        for h in hs:  # nobody is charged outside its own time
            own = charge(h.run_id, t0, t1, -math.inf, math.inf, hs).share_s
            alive = sum(max(0.0, min(t1, x.end) - max(t0, x.start)) for x in hs if x.run_id == h.run_id)
            assert own <= alive + 1e-9

"""GPM at its cadence (``--collector.gpm-interval``): the second GPM sample 2 s after the first (the first
figures), then one every 30 s of the schedule's clock, and at
every sample between the last GPM sample's figures served on /metrics, unchanged, with no GPM call.

The production path against the fake library (``tests/test_gpu_collector.py``'s rig): the schedule's clock is
the scenario's frozen time the test steps; NVML's own spacing of two GPM samples (100 ms) is real time.
"""

from __future__ import annotations

import time

import pytest
from fakenvml import h100
from test_gpu_collector import T0, L, frozen, rig  # noqa: F401 - rig is the fixture

GPM = {2: 62.5, 3: 30.0, 5: 41.0, 10: 55.0, 1: 90.0}
LATER = {2: 20.0, 3: 10.0, 5: 5.0, 10: 15.0, 1: 25.0}


def test_the_last_gpm_figures_are_served_between_gpm_samples(rig) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    gpus = [h100(0, gpm=GPM)]
    r = rig(frozen(T0 + 100, gpus), interval=1.0, gpm_interval=30.0)
    lab = L(0, gpus)

    def gpm_calls() -> int:
        return r.collector.backend.call_costs().get("nvmlGpmMetricsGet", (0, 0.0))[0]

    r.sample()  # the first GPM sample: one sample is not a rate
    assert r.value("gpuenergy_gpu_sm_active_ratio", **lab) is None
    served = []
    for k in range(1, 63):
        if k in (2, 32, 62):
            time.sleep(0.15)  # NVML's own spacing of two GPM samples is real time
        r.rewrite(frozen(T0 + 100 + k, [h100(0, gpm=GPM if k < 35 else LATER)]))
        r.sample()
        served.append(r.value("gpuenergy_gpu_sm_active_ratio", **lab))
        if k == 2:
            assert gpm_calls() == 1  # the second GPM sample, 2 s after the first: the first figures
        if k == 31:
            assert gpm_calls() == 1  # then one every 30 s, none between
        if k == 32:
            assert gpm_calls() == 2
    assert served[:1] == [None]  # until the second GPM sample: no rate yet
    assert served[1:61] == [pytest.approx(0.625)] * 60  # 102..161: the last GPM sample's figures, every sample
    assert r.value("gpuenergy_gpu_tensor_active_ratio", **lab) == pytest.approx((3 * 0.41 + 27 * 0.05) / 30)
    assert gpm_calls() == 3  # 162: the fourth GPM sample
    # over 132..162 the SM activity was 62.5% for 3 s and 20% for 27 s
    assert served[61] == pytest.approx((3 * 0.625 + 27 * 0.20) / 30)

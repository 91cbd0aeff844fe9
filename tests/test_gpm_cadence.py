"""GPM at its cadence (``--collector.gpm-interval``): a GPM sample every 30 s of the schedule's clock, and at
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
    for k in range(1, 61):
        if k in (30, 60):
            time.sleep(0.15)  # NVML's own spacing of two GPM samples is real time
        r.rewrite(frozen(T0 + 100 + k, [h100(0, gpm=GPM if k < 35 else LATER)]))
        r.sample()
        served.append(r.value("gpuenergy_gpu_sm_active_ratio", **lab))
        if k == 30:
            assert gpm_calls() == 1  # the second GPM sample, 30 s after the first
        if k == 59:
            assert gpm_calls() == 1  # none between
    assert served[:29] == [None] * 29  # until the second GPM sample: no rate yet
    assert served[29:59] == [pytest.approx(0.625)] * 30  # 130..159: that sample's figures, every sample
    assert r.value("gpuenergy_gpu_tensor_active_ratio", **lab) == pytest.approx((5 * 0.41 + 25 * 0.05) / 30)
    assert gpm_calls() == 2  # 160: the third GPM sample
    # over 130..160 the SM activity was 62.5% for 5 s and 20% for 25 s
    assert served[59] == pytest.approx((5 * 0.625 + 25 * 0.20) / 30)

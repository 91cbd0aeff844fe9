"""GPM (GPU performance monitoring, Hopper and later) sampling for the NVML backend (``devices.nvml``): SM,
tensor, graphics activity, occupancy and DRAM bandwidth over the span between two GPM samples.

Two sample buffers per GPU, allocated once and reused, so a sample costs two NVML calls (get, metrics) instead
of four (alloc, get, metrics, free). Every call goes through ``nvml_calls.NVMLCalls`` (a failed call loses its
reading only; a lost GPU raises ``GPULost``). Sampler thread only, like the backend.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pynvml

from gpu_energy_exporter.core.errors import GPULost
from gpu_energy_exporter.devices.base import ratio
from gpu_energy_exporter.devices.nvml_calls import NVMLCalls

log = logging.getLogger("gpu_energy_exporter.devices.nvml")

#: GPM metrics we expose (name used in GPUReading.gpm -> NVML metric id).
GPM_METRICS: dict[str, int] = {
    "graphics_active": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "sm_active": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "tensor_active": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_bandwidth": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
}
#: NVML requires GPM samples at least 100 ms apart for meaningful metrics.
GPM_MIN_INTERVAL_S = 0.1


class GPMSampler:
    """GPM samples and metrics per GPU (see the module docstring)."""

    def __init__(self, nvml: NVMLCalls) -> None:
        self._nvml = nvml
        self._supported: dict[int, bool] = {}
        self._prev: dict[int, tuple[float, Any]] = {}  # the last GPM sample per GPU, and when it was taken
        self._spare: dict[int, Any] = {}  # an allocated GPM sample buffer per GPU, free to be filled
        self._requests: dict[int, Any] = {}  # the nvmlGpmMetricsGet_t request per GPU, reused

    def read(self, i: int, h: Any) -> dict[str, float]:
        """GPU ``i``'s GPM metrics over the span since its previous sample (empty for the first, or when GPM
        is not supported or the last sample is under ``GPM_MIN_INTERVAL_S`` old)."""
        supported = self._supported.get(i)
        if supported is None:
            support = self._nvml.field(i, "gpm_support", "nvmlGpmQueryDeviceSupport", h)
            supported = bool(support is not None and support.isSupportedDevice)
            self._supported[i] = supported
            if not supported:
                log.debug("GPU %d: GPM not supported (pre-Hopper GPU, older driver or vGPU); no GPM metrics", i)
        if not supported:
            return {}
        now = time.monotonic()
        prev = self._prev.get(i)
        if prev is not None and now - prev[0] < GPM_MIN_INTERVAL_S:
            return {}
        # Two buffers per GPU, allocated once and reused: the previous sample and the one filled now (a
        # sample buffer is the caller's memory that nvmlGpmSampleGet overwrites), so a sample costs two NVML
        # calls (get, metrics) instead of four (alloc, get, metrics, free).
        sample = self._spare.pop(i, None)
        if sample is None:
            sample = self._nvml.field(i, "gpm_sample_alloc", "nvmlGpmSampleAlloc")
            if sample is None:
                return {}
        try:
            got = self._nvml.field(i, "gpm_sample", "nvmlGpmSampleGet", h, sample)
        except GPULost:
            self._free(i, sample)
            raise
        if got is None:
            self._spare[i] = sample
            return {}
        self._prev[i] = (now, sample)
        if prev is None:
            return {}
        out: dict[str, float] = {}
        try:
            req = self._requests.get(i)
            if req is None:  # built once per GPU: the metric ids are inputs NVML leaves as they are
                req = self._requests[i] = pynvml.c_nvmlGpmMetricsGet_t()
                req.version = pynvml.NVML_GPM_METRICS_GET_VERSION
                req.numMetrics = len(GPM_METRICS)
                for n, metric_id in enumerate(GPM_METRICS.values()):
                    req.metrics[n].metricId = metric_id
            req.sample1 = prev[1]
            req.sample2 = sample
            result = self._nvml.field(i, "gpm_metrics", "nvmlGpmMetricsGet", req)
            if result is not None:
                for n, name in enumerate(GPM_METRICS):
                    m = result.metrics[n]
                    if m.nvmlReturn == pynvml.NVML_SUCCESS:
                        out[name] = ratio(float(m.value))
        finally:
            self._spare[i] = prev[1]
        return out

    def _free(self, i: int, sample: Any) -> None:
        try:
            pynvml.nvmlGpmSampleFree(sample)
        except Exception as exc:  # noqa: BLE001 - a leak of one buffer is not worth a GPU
            log.debug("GPU %d: nvmlGpmSampleFree failed: %s", i, exc)

    def close(self) -> None:
        """Free every sample buffer (before ``nvmlShutdown``)."""
        for i, sample in [*((i, s) for i, (_, s) in self._prev.items()), *self._spare.items()]:
            self._free(i, sample)
        self._prev.clear()
        self._spare.clear()

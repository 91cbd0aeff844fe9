"""The ``carbon`` collector: the inputs PromQL needs for CO2 and MFU, as gauges.

- ``gpuenergy_carbon_intensity_grams_per_kilowatt_hour{source, region}``: the grid intensity chosen at
  start-up by ``carbon.resolve_intensity``. With ``--carbon.intensity-file`` the file is re-read whenever
  it changes (mtime, size or inode), so PromQL can integrate a time-varying intensity; content that is
  not one number keeps the last good value and is logged once per bad version of the file.
- ``gpuenergy_datacenter_pue``: ``--carbon.pue``.
- ``gpuenergy_carbon_info{source, region, year, reference}``: where the figure comes from.
- ``gpuenergy_gpu_peak_flops_per_second{gpu, gpu_uuid, precision}``: dense tensor peak of each GPU's
  model from the bundled table (``gpu_specs``), the denominator of MFU. Unknown models get no series and
  one info log.

CO2 (g) = energy (kWh) x PUE x intensity (g/kWh) is computed in PromQL, never here. This module never
calls NVML: the GPU identities come from a callable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import Collector
from gpu_energy_exporter.core import metrics
from gpu_energy_exporter.core.config import Config
from gpu_energy_exporter.core.state import GPUIdentity
from gpu_energy_exporter.reference.carbon import (
    SOURCE_FILE,
    IntensityResolution,
    parse_intensity_text,
    reference_for,
    resolve_intensity,
)
from gpu_energy_exporter.reference.gpu_specs import PRECISIONS, PeakFlops, lookup_peak_flops

log = logging.getLogger(__name__)

NAME = "carbon"

INTENSITY = metrics.define(
    "carbon", "intensity_grams_per_kilowatt_hour", "gauge",
    "Grid carbon intensity in grams CO2-equivalent per kWh. source is file (--carbon.intensity-file, "
    "re-read on change), flag (--carbon.intensity), table (--carbon.region from the bundled table) or "
    "default (world average; see gpuenergy_carbon_info for its reference and year).",
    ("source", "region"), collector=NAME,
)
PUE = metrics.define(
    "datacenter", "pue", "gauge",
    "Power usage effectiveness of the data centre (facility energy / IT energy, >= 1), from --carbon.pue.",
    collector=NAME, unit="ratio",
)
INFO = metrics.define(
    "carbon", "info", "info",
    "Where the carbon intensity figure comes from: source, region, year of the figure and its publisher.",
    ("source", "region", "year", "reference"), collector=NAME,
)
PEAK_FLOPS = metrics.define(
    "gpu", "peak_flops_per_second", "gauge",
    "Dense (no sparsity) peak tensor FLOP/s of the GPU's model for one precision, from the vendor "
    "datasheet (bundled table): the denominator of MFU.",
    (*metrics.GPU_LABELS, "precision"), collector=NAME,
)


class CarbonCollector(Collector):
    """Carbon intensity, PUE and per-GPU peak FLOP/s.

    ``intensity`` is the start-up resolution (``carbon.resolve_intensity``); when its source is the
    file, ``intensity_file`` is watched for changes. ``gpus`` returns the GPUs to label (may be empty).
    """

    name = NAME

    def __init__(
        self,
        *,
        intensity: IntensityResolution,
        pue: float = 1.0,
        intensity_file: str | None = None,
        gpus: Callable[[], Sequence[GPUIdentity]] = tuple,
        lookup_peak: Callable[[str], PeakFlops | None] = lookup_peak_flops,
    ) -> None:
        if intensity.source == SOURCE_FILE and not intensity_file:
            raise ValueError("an intensity read from a file needs intensity_file")
        self._intensity = intensity
        self._value = intensity.value
        self._pue = pue
        self._file = intensity_file if intensity.source == SOURCE_FILE else None
        self._reference = reference_for(intensity, intensity_file)
        self._gpus = gpus
        self._lookup_peak = lookup_peak
        self._peaks: dict[str, PeakFlops | None] = {}  # model -> its row, looked up once (not every sample)
        # None: the first update re-reads the file, closing the gap since resolve_intensity read it.
        self._file_key: tuple[int, int, int] | None = None
        self._bad_key: tuple[int, int, int] | None = None
        self._missing_logged = False
        self._unknown_models: set[str] = set()

    @classmethod
    def from_config(cls, config: Config, gpus: Callable[[], Sequence[GPUIdentity]] = tuple) -> CarbonCollector:
        """Build from the configuration; raises ConfigError (bad region, unreadable file)."""
        return cls(
            intensity=resolve_intensity(config),
            pue=config.carbon_pue,
            intensity_file=config.carbon_intensity_file,
            gpus=gpus,
        )

    # -- the intensity file ---------------------------------------------------------------------------

    def _stat_key(self) -> tuple[int, int, int] | None:
        assert self._file is not None
        try:
            st = os.stat(self._file)
        except OSError:
            return None
        # Inode too: tools that replace the file atomically (write + rename) may keep mtime and size.
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _refresh_from_file(self) -> None:
        assert self._file is not None
        key = self._stat_key()
        if key is None:
            if not self._missing_logged:
                log.warning("carbon intensity file %s is gone; keeping the last value %g g/kWh",
                            self._file, self._value)
                self._missing_logged = True
            return
        self._missing_logged = False
        if key == self._file_key:
            return
        try:
            with open(self._file, encoding="utf-8") as f:
                value = parse_intensity_text(f.read(4096))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            if key != self._bad_key:
                log.warning("carbon intensity file %s: %s; keeping the last good value %g g/kWh",
                            self._file, exc, self._value)
                self._bad_key = key
            # Remember the bad version too, so it is not re-read and re-logged every interval.
            self._file_key = key
            return
        if value != self._value:
            log.info("carbon intensity from %s: %g g/kWh (was %g)", self._file, value, self._value)
        self._value = value
        self._file_key = key
        self._bad_key = None

    @property
    def intensity_g_per_kwh(self) -> float:
        """The intensity in force now (follows the file when the source is a file)."""
        return self._value

    @property
    def pue(self) -> float:
        return self._pue

    # -- the collector contract -----------------------------------------------------------------------

    def update(self) -> list[Metric]:
        if self._file is not None:
            self._refresh_from_file()
        intensity = INTENSITY.family()
        metrics.add(intensity, (self._intensity.source, self._intensity.region), self._value)
        pue = PUE.family()
        metrics.add(pue, (), self._pue)
        info = INFO.family()
        res = self._intensity
        metrics.add(info, (res.source, res.region, res.year, self._reference), {})
        out: list[Metric] = [intensity, pue, info]

        peak = PEAK_FLOPS.family()
        for gpu in self._gpus():
            try:
                row = self._peaks[gpu.name]
            except KeyError:
                row = self._peaks[gpu.name] = self._lookup_peak(gpu.name)
            if row is None or not row.flops:
                self._log_unknown(gpu.name, row)
                continue
            for precision in PRECISIONS:
                if precision in row.flops:
                    metrics.add(peak, (str(gpu.index), gpu.uuid, precision), row.flops[precision])
        out.append(peak)
        return out

    def _log_unknown(self, model: str, row: PeakFlops | None) -> None:
        if model in self._unknown_models:
            return
        self._unknown_models.add(model)
        if row is None:
            log.info("no peak FLOP/s figure for GPU model %r; MFU is not available for it", model)
        else:
            log.info("GPU model %r (%s) has no trusted peak FLOP/s figure (%s); MFU is not available for it",
                     model, row.model, row.note or "see data/SOURCES.md")

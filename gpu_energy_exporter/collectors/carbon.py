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
- ``gpuenergy_gpu_co2_grams_total{gpu, gpu_uuid}``: CO2 of each GPU's energy, kept here interval by
  interval: each update adds the energy the GPU collector counted since the previous one (kWh) x the
  PUE x the intensity in force now (``CO2Meter``). PromQL then needs no integration: an ``increase()`` of
  grams is right across a change of intensity, where power x the intensity now re-prices up to a rate
  window of energy at the new intensity (issue 19 item 5).

``IntensityWatch`` follows ``--carbon.intensity-file``; the run ledger reads the same watch, and with
``--no-collector.carbon`` the exporter runs it as ``IntensityFileCollector`` (no series of its own) so the
ledger still prices each interval at the intensity in force. This module never calls NVML: the GPU
identities and states come from callables.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import Collector
from gpu_energy_exporter.collectors.registry import CollectorSpec, Wiring, register
from gpu_energy_exporter.core import metrics
from gpu_energy_exporter.core.state import GPUIdentity, GPUState
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

GPU_CO2 = metrics.define(
    "gpu", "co2_grams_total", "counter",
    "CO2-equivalent of the GPU's energy since the exporter started: every sampling interval, the energy the "
    "GPU's counter gained (kWh) x PUE x the grid intensity in force then (g/kWh). An increase() over any "
    "window is right across a change of intensity (no integration of power x intensity in PromQL). A "
    "counter reset (driver reload) adds nothing for its interval.",
    metrics.GPU_LABELS, collector=NAME, unit="grams",
)

#: Joules per kWh.
J_PER_KWH = 3.6e6


class CO2Meter:
    """Per-GPU grams of CO2, accumulated interval by interval. Pure: plain values in, no clock, no I/O.

    ``add`` takes each GPU's energy counter (J) as the GPU collector holds it and the intensity and PUE in
    force now; the energy gained since the previous ``add`` is priced at them. The first reading of a GPU
    only sets its baseline; a counter that went backwards (driver reload) is rebased and adds nothing,
    as the run ledger and pod attribution do."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._grams: dict[str, tuple[str, float]] = {}  # uuid -> (gpu index, grams)

    def add(self, energy_j: Sequence[tuple[str, str, float | None]], intensity: float, pue: float,
            before: tuple[float, float] | None = None) -> None:
        """``energy_j``: (gpu index, uuid, counter J or None when the GPU is down or has no counter).
        ``before``: (fraction of the interval since the previous ``add``, intensity then) when the intensity
        changed inside the interval: that part is priced at the intensity then, the rest at ``intensity``."""
        price = pue * intensity
        if before is not None:
            f = min(1.0, max(0.0, before[0]))
            price = pue * (f * before[1] + (1.0 - f) * intensity)
        for index, uuid, joules in energy_j:
            grams = self._grams.get(uuid, (index, 0.0))[1]
            self._grams[uuid] = (index, grams)  # the series exists from the GPU's first update
            if joules is None:
                continue  # the next reading's delta covers the gap, at the intensity then
            last = self._last.get(uuid)
            self._last[uuid] = joules
            if last is None or joules < last:
                continue
            self._grams[uuid] = (index, grams + (joules - last) / J_PER_KWH * price)

    def grams(self) -> list[tuple[str, str, float]]:
        """(gpu index, uuid, grams) of every GPU seen, by index."""
        return sorted(((i, u, g) for u, (i, g) in self._grams.items()), key=lambda x: (len(x[0]), x[0], x[1]))


class IntensityWatch:
    """The grid intensity in force: the start-up resolution, followed in ``--carbon.intensity-file`` when
    that is its source (``refresh``: re-read when the file changes by mtime, size or inode; content that is
    not one number keeps the last good value and is logged once per bad version of the file).

    ``refresh`` does file I/O: call it from a collector's thread, never from the sampler thread."""

    def __init__(self, intensity: IntensityResolution, intensity_file: str | None = None) -> None:
        if intensity.source == SOURCE_FILE and not intensity_file:
            raise ValueError("an intensity read from a file needs intensity_file")
        self.resolution = intensity
        self._value = intensity.value
        #: when the value in force took effect (wall clock: the file's modification time; None: always) and
        #: the value before it, so an interval that straddles the change is priced part at each (issue 28)
        self.since: float | None = None
        self.previous: float | None = None
        self.file = intensity_file if intensity.source == SOURCE_FILE else None
        # None: the first refresh re-reads the file, closing the gap since resolve_intensity read it.
        self._file_key: tuple[int, int, int] | None = None
        self._bad_key: tuple[int, int, int] | None = None
        self._missing_logged = False

    @property
    def value(self) -> float:
        """The intensity in force now, g/kWh."""
        return self._value

    def _stat_key(self) -> tuple[int, int, int] | None:
        assert self.file is not None
        try:
            st = os.stat(self.file)
        except OSError:
            return None
        # Inode too: tools that replace the file atomically (write + rename) may keep mtime and size.
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def refresh(self) -> None:
        """Follow the file (nothing to do for the other sources)."""
        if self.file is None:
            return
        key = self._stat_key()
        if key is None:
            if not self._missing_logged:
                log.warning("carbon intensity file %s is gone; keeping the last value %g g/kWh",
                            self.file, self._value)
                self._missing_logged = True
            return
        self._missing_logged = False
        if key == self._file_key:
            return
        try:
            with open(self.file, encoding="utf-8") as f:
                value = parse_intensity_text(f.read(4096))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            if key != self._bad_key:
                log.warning("carbon intensity file %s: %s; keeping the last good value %g g/kWh",
                            self.file, exc, self._value)
                self._bad_key = key
            # Remember the bad version too, so it is not re-read and re-logged every interval.
            self._file_key = key
            return
        if value != self._value:
            log.info("carbon intensity from %s: %g g/kWh (was %g)", self.file, value, self._value)
            if self._file_key is not None:  # not the first read: the file changed at its mtime
                self.previous, self.since = self._value, key[0] / 1e9
        self._value = value
        self._file_key = key
        self._bad_key = None


class IntensityFileCollector(Collector):
    """Follows ``--carbon.intensity-file`` for the run ledger while the carbon collector is off: no series
    of its own (only its ``gpuenergy_collector_success``), so the ledger's CO2 uses the intensity in force
    at each interval rather than the start-up one for ever."""

    name = "carbon_intensity_file"

    def __init__(self, watch: IntensityWatch) -> None:
        self.watch = watch

    def update(self) -> list[Metric]:
        self.watch.refresh()
        return []


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
        gpu_states: Callable[[], Sequence[GPUState]] | None = None,
        watch: IntensityWatch | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``gpu_states``: the GPU collector's latest states (``GPUCollector.states``), for the per-GPU CO2
        counters (none without it); the collector then runs after the GPU collector. ``watch``: an
        intensity watch shared with the run ledger (one is made from ``intensity`` otherwise)."""
        self._watch = watch if watch is not None else IntensityWatch(intensity, intensity_file)
        self._intensity = self._watch.resolution
        self._pue = pue
        self._reference = reference_for(self._intensity, intensity_file)
        self._gpus = gpus
        self._lookup_peak = lookup_peak
        self._peaks: dict[str, PeakFlops | None] = {}  # model -> its row, looked up once (not every sample)
        self._unknown_models: set[str] = set()
        self._gpu_states = gpu_states
        self._co2 = CO2Meter()
        self._clock = clock
        self._last_update: float | None = None  # wall time of the last update (the CO2 interval's start)
        self._static: tuple[object, list[Metric]] | None = None  # (what they show, the families)
        if gpu_states is not None:
            self.depends_on = ("gpu",)  # prices the energy the gpu collector just read
        # in memory, unless a file is watched (a stat of a user's file could block on a hung mount)
        self.never_blocks = intensity_file is None

    @classmethod
    def from_config(cls, config: Any, gpus: Callable[[], Sequence[GPUIdentity]] = tuple,
                    **kwargs: object) -> CarbonCollector:
        """Build from the configuration; raises ConfigError (bad region, unreadable file)."""
        return cls(
            intensity=resolve_intensity(config),
            pue=config.carbon_pue,
            intensity_file=config.carbon_intensity_file,
            gpus=gpus,
            **kwargs,  # type: ignore[arg-type]
        )

    @property
    def watch(self) -> IntensityWatch:
        return self._watch

    @property
    def intensity_g_per_kwh(self) -> float:
        """The intensity in force now (follows the file when the source is a file)."""
        return self._watch.value

    @property
    def pue(self) -> float:
        return self._pue

    # -- the collector contract -----------------------------------------------------------------------

    def update(self) -> list[Metric]:
        self._watch.refresh()
        value = self._watch.value
        # The intensity, PUE, reference and peak FLOP/s families change only with the intensity or the GPUs:
        # built again only then, and shared by the snapshots between (no one mutates a published family).
        key = (value, tuple((g.index, g.uuid, g.name) for g in self._gpus()))
        if self._static is None or self._static[0] != key:
            self._static = (key, self._static_families(value))
        out = list(self._static[1])
        if self._gpu_states is not None:
            # The intensity read just now prices the interval that ends now, as the run ledger does; where it
            # changed inside the interval (the file's mtime), the part before is priced at the value before.
            now = self._clock()
            w = self._watch
            before = None
            if self._last_update is not None and w.since is not None and w.previous is not None \
                    and self._last_update < w.since < now:
                before = ((w.since - self._last_update) / (now - self._last_update), w.previous)
            self._last_update = now
            self._co2.add([(str(g.identity.index), g.identity.uuid, g.energy_j if g.up else None)
                           for g in self._gpu_states()], value, self._pue, before)
            co2 = GPU_CO2.family()
            for index, uuid, grams in self._co2.grams():
                metrics.add(co2, (index, uuid), grams)
            out.append(co2)
        return out

    def _static_families(self, value: float) -> list[Metric]:
        intensity = INTENSITY.family()
        metrics.add(intensity, (self._intensity.source, self._intensity.region), value)
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


def _build(w: Wiring) -> CarbonCollector:
    gpu = w.built.get("gpu")
    states = getattr(gpu, "states", None)
    identities = getattr(gpu, "identities", tuple)
    config: Any = w.config  # has the --carbon.* flags
    intensity = w.intensity if w.intensity is not None else resolve_intensity(config)
    return CarbonCollector(intensity=intensity, pue=w.config.carbon_pue,
                           intensity_file=w.config.carbon_intensity_file, gpus=identities, gpu_states=states,
                           watch=w.intensity_watch, clock=w.clock)


# Its flags (--carbon.*) are the daemon's: the ledger prices CO2 with them whatever this collector.
register(CollectorSpec(NAME, True, "Carbon intensity, PUE and per-GPU peak FLOP/s inputs for PromQL.", order=30,
                       build=_build, title="Carbon and efficiency inputs (collector `carbon`)"))

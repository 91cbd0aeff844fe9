"""The ``health`` collector: GPU health next to its energy (ECC, row remapping, retired pages, PCIe, NVLink,
Xid and ECC events).

It runs after the ``gpu`` collector (``depends_on``) on its own collector thread and uses that collector's
backend and GPUs. Health changes slowly, so the NVML readings are taken every ``--collector.health.interval``
(default 30s), not at every sample: in between, each update serves the last reading's families again and
makes no NVML call. Xid and ECC events are counted by the backend's event thread (``devices.nvml_events``);
each update copies its counts (no NVML call either). One GPU's failing health read loses only that GPU's
health series; one failing or unsupported reading loses only itself (``gpuenergy_nvml_field_errors_total``).
Nothing here converts a unit or calls NVML directly, and it never runs on the scrape path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import Collector, NoData
from gpu_energy_exporter.collectors.gpu import GPUCollector
from gpu_energy_exporter.collectors.health.metrics import (
    EVENT_SPECS,
    HEALTH_READ_DURATION,
    HEALTH_READ_TIME,
    READ_SPECS,
    emit_events,
    emit_health,
)
from gpu_energy_exporter.collectors.registry import CollectorSpec, Settings, Wiring, register
from gpu_energy_exporter.core.errors import ConfigError, GPULost
from gpu_energy_exporter.core.flagtypes import Flag, parse_duration
from gpu_energy_exporter.core.health import XidEvent
from gpu_energy_exporter.core.metrics import add
from gpu_energy_exporter.devices.base import GPUBackend, HealthReader

log = logging.getLogger(__name__)


class HealthCollector(Collector):
    name = "health"
    depends_on = ("gpu",)

    def __init__(self, gpu: GPUCollector, *, interval: float = 30.0, events: bool = True,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        """``interval``: seconds between health reads; ``events``: watch Xid and ECC events."""
        self._gpu = gpu
        self._interval = interval
        self._events = events
        self._clock = clock
        self._monotonic = monotonic
        self._backend: GPUBackend | None = None
        self._reader: HealthReader | None = None
        self._next_read = 0.0
        self._read_families: list[Metric] = []
        self._failed: dict[int, str] = {}  # GPU index -> why its last health read failed (logged once)
        self._event_cache: tuple[int, list[Metric]] | None = None  # (counts version, their families)

    def _attach(self, backend: GPUBackend) -> None:
        if self._reader is not None:
            self._reader.close()
        self._backend = backend
        self._reader = backend.health_reader()
        self._next_read = 0.0
        self._read_families = []
        self._event_cache = None
        if self._reader is None:
            log.info("the %s backend has no GPU health readings; health series are not served", backend.kind)
            return
        if self._events:
            self._reader.start_events(self._gpu.identities())

    def runs_inline(self) -> bool:
        """Between two reads an update serves the last read's families and the event thread's counts (memory
        only): on the sampler's thread, the health thread woken only when a read is due."""
        return (self._reader is not None and self._gpu.backend is self._backend
                and self._monotonic() < self._next_read)

    def update(self) -> list[Metric]:
        backend = self._gpu.backend
        if backend is None:
            raise NoData("no GPU backend (NVML unavailable)")
        if backend is not self._backend:
            self._attach(backend)
        reader = self._reader
        if reader is None:
            raise NoData(f"the {backend.kind} backend has no health readings")
        now = self._monotonic()
        if now >= self._next_read:
            self._read_families = self._read_all(reader)
            self._next_read = now + self._interval
        return [*self._read_families, *self._event_families(reader)]

    def _read_all(self, reader: HealthReader) -> list[Metric]:
        fams = {spec.name: spec.family() for spec in READ_SPECS}
        started = self._monotonic()
        for g in self._gpu.identities():
            try:
                h = reader.read(g)
            except Exception as exc:  # noqa: BLE001 - one GPU never takes the others' health down
                message = str(exc) if isinstance(exc, GPULost) else f"{type(exc).__name__}: {exc}"
                if self._failed.get(g.index) != message:
                    log.warning("GPU %d: health read failed (%s); its health series are left out until it "
                                "answers", g.index, message)
                    self._failed[g.index] = message
                continue
            if self._failed.pop(g.index, None) is not None:
                log.info("GPU %d: health read answers again", g.index)
            emit_health(fams, h, [str(g.index), g.uuid])
        duration = HEALTH_READ_DURATION.family()
        add(duration, [], self._monotonic() - started)
        stamp = HEALTH_READ_TIME.family()
        add(stamp, [], self._clock())
        return [*(f for f in fams.values() if f.samples), stamp, duration]

    def _event_families(self, reader: HealthReader) -> list[Metric]:
        counts = reader.events()
        if counts is None:
            return []
        # Built again only when an event arrived: between events every update serves the same families.
        if self._event_cache is not None and self._event_cache[0] == counts.version:
            return self._event_cache[1]
        fams = {spec.name: spec.family() for spec in EVENT_SPECS}
        emit_events(fams, counts, {g.index: g.uuid for g in self._gpu.identities()})
        families = [f for f in fams.values() if f.samples]
        self._event_cache = (counts.version, families)
        return families

    def critical_xids(self) -> tuple[XidEvent, ...]:
        """The most recent critical Xids of every GPU (oldest first), for the run ledger; any thread."""
        reader = self._reader
        counts = reader.events() if reader is not None else None
        return counts.critical if counts is not None else ()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


def _check(config: Settings) -> None:
    if config.collector_health_interval < 1.0:
        raise ConfigError(f"--collector.health.interval must be at least 1s, got {config.collector_health_interval:g}s")


def _build(w: Wiring) -> HealthCollector | None:
    gpu = w.built.get("gpu")
    if not isinstance(gpu, GPUCollector):
        return None  # nothing to watch without the gpu collector
    health = HealthCollector(gpu, interval=w.config.collector_health_interval, clock=w.clock)
    w.sampler_hooks["xid_events"] = health.critical_xids
    return health


register(CollectorSpec(
    "health", True, "GPU health: Xid and ECC events, ECC counts, row remapping, retired pages, PCIe and NVLink "
    "(NVML; see --collector.health.interval).", order=40, build=_build, check=_check,
    title="GPU health: Xid, ECC, row remapping, PCIe, NVLink (collector `health`)",
    flags=(Flag("collector.health.interval", parse_duration, "30s",
                "How often the health collector reads ECC, row remapping, retired pages, PCIe and NVLink (they "
                "change slowly; each read costs NVML calls per GPU, see docs/health.md). Xid and ECC events are "
                "counted as they happen, whatever this is.", "DURATION"),),
))

"""The exporter process: wires configuration to collectors, the sampler, the HTTP servers, the OTLP
receiver and the run ledger.

Construction validates everything that can be validated (web config, carbon region, bearer token file)
and raises ``ConfigError`` before anything starts; ``start()`` binds the ports and starts the threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import ProcessCollector

from gpu_energy_exporter.carbon import resolve_intensity
from gpu_energy_exporter.collectors.base import Collector
from gpu_energy_exporter.collectors.carbon import CarbonCollector
from gpu_energy_exporter.collectors.gpu import GPUCollector
from gpu_energy_exporter.collectors.host import HostCollector
from gpu_energy_exporter.collectors.rapl import RaplCollector
from gpu_energy_exporter.config import Config
from gpu_energy_exporter.devices.base import GPUBackend
from gpu_energy_exporter.errors import ExporterError
from gpu_energy_exporter.exposition import SnapshotCollector, new_registry
from gpu_energy_exporter.sampler import Sampler

log = logging.getLogger(__name__)


def nvml_backend_factory(config: Config) -> Callable[[], GPUBackend]:
    def factory() -> GPUBackend:
        from gpu_energy_exporter.devices.nvml import NVMLBackend

        return NVMLBackend(config.nvml_library)

    return factory


class Exporter:
    """One exporter: ``Exporter(config).start()``, later ``stop()``."""

    def __init__(
        self,
        config: Config,
        *,
        backend_factory: Callable[[], GPUBackend] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._clock = clock
        self._started = False
        collectors: list[Collector] = []
        self.gpu: GPUCollector | None = None
        if config.enabled("gpu"):
            self.gpu = GPUCollector(
                backend_factory or nvml_backend_factory(config),
                processes=config.enabled("processes"),
                gpm=config.enabled("gpm"),
                power_interval=config.collector_power_interval,
                idle_power_w=config.gpu_idle_power,
                clock=clock,
            )
            collectors.append(self.gpu)
        if config.enabled("host"):
            collectors.append(HostCollector(memory_critical_bytes=config.host_memory_critical))
        if config.enabled("rapl"):
            collectors.append(RaplCollector(sysfs=config.path_sysfs))
        # Resolved even with --no-collector.carbon: the ledger's CO2 figures need it, and a bad region
        # must fail at start-up either way.
        self.intensity = resolve_intensity(config)
        self.carbon: CarbonCollector | None = None
        if config.enabled("carbon"):
            self.carbon = CarbonCollector.from_config(config, gpus=self._identities)
            collectors.append(self.carbon)
        self.collectors = collectors
        self.sampler = Sampler(
            collectors, config.collector_interval, gpu_states=self.gpu.states if self.gpu else None, clock=clock
        )
        self.snapshot_collector = SnapshotCollector(self.sampler, clock=clock)
        self.registry = new_registry(self.snapshot_collector)
        ProcessCollector(namespace="gpuenergy", registry=self.registry)
        self._build_servers()

    def _identities(self) -> tuple:  # type: ignore[type-arg]
        return self.gpu.identities() if self.gpu else ()

    def _build_servers(self) -> None:
        """Bound later; see web.py / otlp."""
        self.web = None
        self.otlp = None

    # ------------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        return self.sampler.snapshot is not None

    def start(self) -> None:
        self.sampler.start()
        self._started = True

    def stop(self) -> None:
        self.sampler.stop()


__all__ = ["Exporter", "ExporterError"]

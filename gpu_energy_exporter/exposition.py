"""The scrape-side view: a prometheus_client collector that serves the latest snapshot.

``SnapshotCollector.collect`` yields the families the sampler already built, plus a few values that must
be computed at scrape time (sample ages) and the live in-memory sources (training series pushed over
OTLP, per-run series of the ledger). It never calls NVML, never reads sysfs and never blocks on the
sampler: a slow or hung driver cannot make a scrape slow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector as PromCollector
from prometheus_client.registry import CollectorRegistry

from gpu_energy_exporter.collectors.gpu import GPU_SAMPLE_AGE, build_info_family
from gpu_energy_exporter.metrics import add
from gpu_energy_exporter.sampler import Sampler

log = logging.getLogger(__name__)

LiveSource = Callable[[], Iterable[Metric]]


class SnapshotCollector(PromCollector):
    def __init__(self, sampler: Sampler, live_sources: Iterable[LiveSource] = (),
                 clock: Callable[[], float] = time.time) -> None:
        self._sampler = sampler
        self._live = list(live_sources)
        self._clock = clock
        self._build_info = build_info_family()

    def add_live_source(self, source: LiveSource) -> None:
        self._live.append(source)

    def describe(self) -> Iterable[Metric]:
        # Registration must not touch hardware or the snapshot; names are checked by the catalogue tests.
        return []

    def collect(self) -> Iterator[Metric]:
        yield self._build_info
        snap = self._sampler.snapshot
        if snap is not None:
            yield from snap.families
            if snap.gpus:
                age = GPU_SAMPLE_AGE.family()
                now = self._clock()
                for g in snap.gpus:
                    if g.last_good is not None:
                        add(age, [str(g.identity.index), g.identity.uuid], max(0.0, now - g.last_good))
                yield age
        for source in self._live:
            try:
                yield from source()
            except Exception:  # noqa: BLE001 - a broken live source must not fail the scrape
                log.exception("live metrics source %r failed", source)


def new_registry(collector: SnapshotCollector) -> CollectorRegistry:
    """A registry with only our collector (no global state, no process/platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry

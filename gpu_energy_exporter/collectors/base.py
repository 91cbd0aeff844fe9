"""The collector contract.

A collector gathers one concern (GPUs, host, RAPL, carbon inputs, ...) and returns fresh metric
families. Collectors run on the sampler thread, never on the scrape path: the HTTP handler only
serialises the last published snapshot. The framework (``sampler.Sampler``) times every ``update`` and
publishes ``gpuenergy_collector_success`` / ``gpuenergy_collector_duration_seconds`` for it, so one
failing collector loses only its own series.

Rules for implementations:
- ``update`` raises on a real failure (the framework logs it, rate-limited, and exposes success 0);
  "no data here" (no powercap tree, unsupported reading) is not a failure: return fewer families and
  log once at debug/info.
- Every environmental dependency (paths, clocks, the device backend) comes in through the constructor.
- ``describe`` is answered from the catalogue, never from hardware.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

from prometheus_client.core import Metric

from gpu_energy_exporter.core.metrics import CATALOGUE, MetricSpec


class NoData(Exception):
    """Raised by ``update`` when there is nothing to read (no driver, no powercap tree).

    The framework reports the collector as unsuccessful but logs only at debug level (the collector logs
    the cause itself, once); ``families`` are still exposed, e.g. an availability gauge with its reason.
    """

    def __init__(self, message: str, families: list[Metric] | None = None) -> None:
        super().__init__(message)
        self.families = families or []


class Collector(abc.ABC):
    """One concern's metrics. Subclasses set ``name`` (the ``--collector.<name>`` flag)."""

    name: str = ""
    #: collectors whose update must finish before this one's starts (it reads their state)
    depends_on: tuple[str, ...] = ()
    #: ``update`` can never block: it reads memory, /proc or /sys only (no driver call, no network, no file a
    #: user names, which could sit on a hung NFS mount). See ``runs_inline``.
    never_blocks: bool = False

    @abc.abstractmethod
    def update(self) -> list[Metric]:
        """Gather and return fresh metric families. Called on the sampler thread."""

    def runs_inline(self) -> bool:
        """Whether this sample's update may run on the sampler's own thread, while the other collectors run
        on theirs, instead of being handed to a thread of its own and back: on a two-vCPU VM those two
        hand-offs cost more CPU than a light collector's work (docs/benchmarks.md, issue 28). True for a
        collector that ``never_blocks``; a collector whose blocking reads are due only now and then may say
        True between them (it is asked at every sample, never while an update of it still runs)."""
        return self.never_blocks

    def specs(self) -> Iterable[MetricSpec]:
        """The catalogue entries this collector can produce (for ``describe`` and the docs)."""
        return [s for s in CATALOGUE.values() if s.collector == self.name]

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (file handles, NVML). Called once at shutdown."""

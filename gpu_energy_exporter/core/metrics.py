"""The metric catalogue: every series the exporter can expose, declared once.

Collectors build their metric families from these specs, and ``docs/metrics.md`` is generated from
``CATALOGUE`` (``python -m gpu_energy_exporter.tools.docgen``), so a name, type, unit, help text or label set
is written in exactly one place. Names follow the Prometheus conventions: base units, ``_total`` for
counters, ``_ratio`` for 0..1 values, ``_info`` for info series.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

NAMESPACE = "gpuenergy"

#: Labels that identify a GPU on every per-GPU series.
GPU_LABELS: tuple[str, ...] = ("gpu", "gpu_uuid")

Kind = Literal["gauge", "counter", "info"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric as exposed. ``name`` is the full exposed name (counters end in ``_total``, info
    series in ``_info``)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    collector: str
    unit: str = ""

    def family(self) -> Metric:
        """A fresh, empty family for one collection."""
        labels = list(self.labels)
        if self.kind == "counter":
            return CounterMetricFamily(self.name[: -len("_total")], self.help, labels=labels)
        if self.kind == "info":
            return InfoMetricFamily(self.name[: -len("_info")], self.help, labels=labels)
        return GaugeMetricFamily(self.name, self.help, labels=labels)


CATALOGUE: dict[str, MetricSpec] = {}


def define(
    subsystem: str,
    name: str,
    kind: Kind,
    help: str,
    labels: Sequence[str] = (),
    *,
    collector: str,
    unit: str = "",
) -> MetricSpec:
    """Declare a metric ``<namespace>_<subsystem>_<name>`` and add it to the catalogue.

    Raises ``ValueError`` at import time on a duplicate or on a name that breaks the conventions, so a
    mistake fails the test suite rather than reaching a dashboard.
    """
    full = "_".join(p for p in (NAMESPACE, subsystem, name) if p)
    if kind == "counter" and not full.endswith("_total"):
        raise ValueError(f"counter {full} must end in _total")
    if kind == "info" and not full.endswith("_info"):
        raise ValueError(f"info metric {full} must end in _info")
    if kind != "counter" and full.endswith("_total"):
        raise ValueError(f"{full} ends in _total but is not a counter")
    if full in CATALOGUE:
        raise ValueError(f"metric {full} defined twice")
    spec = MetricSpec(full, kind, help, tuple(labels), collector, unit)
    CATALOGUE[full] = spec
    return spec


def add(family: Metric, labels: Sequence[str], value: float | dict[str, str], *,
        timestamp: float | None = None) -> None:
    """Add one sample to a family built by ``MetricSpec.family``. ``timestamp`` (unix seconds) is exposed
    with the sample: only for values whose measurement time matters to ``rate()`` (energy counters)."""
    if isinstance(family, InfoMetricFamily):
        assert isinstance(value, dict)
        family.add_metric(list(labels), value)
    else:
        assert not isinstance(value, dict)
        family.add_metric(list(labels), float(value), timestamp=timestamp)  # type: ignore[attr-defined]

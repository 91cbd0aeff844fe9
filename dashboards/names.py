"""The metric names the dashboards and rules may select: exactly those the code produces.

Nothing here is a second, hand-kept catalogue. Exporter names come from ``gpu_energy_exporter.core.metrics.
CATALOGUE`` after every module of the package that could define one is imported; training names come from
the training helper's instrument table (``gpu_energy_exporter.core.contract``) translated by the
OTLP receiver's own naming function, exactly as they appear on /metrics. The only hand-written list is
``PENDING``: names agreed with another part of the project that the code does not produce yet.

Importing this module imports the exporter package but never the training frameworks (torch,
transformers, lightning) and never touches NVML.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

#: Series Prometheus itself adds to every scrape target.
PROMETHEUS_SERIES: frozenset[str] = frozenset({"up"})

#: Names agreed with another part of the project but not produced by the code yet, with who adds them.
#: The tests accept these while they are missing and fail once they exist, so the entry gets deleted.
PENDING: dict[str, str] = {}

_PACKAGE = "gpu_energy_exporter"
# Training modules may import torch/transformers/lightning; their names come from the instrument table.
_SKIP_PREFIXES = (f"{_PACKAGE}.training.", f"{_PACKAGE}.__main__")


def _package_modules() -> list[str]:
    """Every module of the exporter package, namespace sub-packages included (pkgutil skips those)."""
    root = Path(importlib.import_module(_PACKAGE).__file__ or "").parent
    modules = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if not name.startswith(_SKIP_PREFIXES):
            modules.append(name)
    return modules


@functools.cache
def exporter_metric_names() -> frozenset[str]:
    """Names in the exporter's metric catalogue (as exposed: counters with ``_total``)."""
    for module in _package_modules():
        importlib.import_module(module)
    from gpu_energy_exporter.core.metrics import CATALOGUE

    return frozenset(CATALOGUE)


@functools.cache
def training_metric_names() -> frozenset[str]:
    """Names of the training series as the exporter's OTLP receiver exposes them (histograms as their
    ``_bucket``, ``_sum`` and ``_count`` series)."""
    from gpu_energy_exporter.core.contract import ALL
    from gpu_energy_exporter.otlp.naming import metric_name

    names: set[str] = set()
    for instrument in ALL:
        base = metric_name(instrument.name, instrument.unit, instrument.kind)
        if instrument.kind == "histogram":
            names.update(f"{base}_{suffix}" for suffix in ("bucket", "sum", "count"))
        else:
            names.add(base)
    return frozenset(names)


def produced_metric_names() -> frozenset[str]:
    """Every name a scrape of the exporter (plus Prometheus's own ``up``) can return."""
    return exporter_metric_names() | training_metric_names() | PROMETHEUS_SERIES

"""The metric names the dashboards and rules may select: exactly those the code produces.

Nothing here is a second, hand-kept catalogue. Exporter names come from ``gpu_energy_exporter.core.metrics.
CATALOGUE`` after every module of the package that could define one is imported; training names are the
Prometheus names of the training contract (``gpu_energy_exporter.core.contract``, ``Instrument.prometheus``,
which tests/test_otlp_translate.py checks against the OTLP receiver's own naming function), exactly as they
appear on /metrics; the inference servers' names are the engines' own (``dashboards/engines.py``, each cited
from the engine's source). The only hand-written list of our own names is
``PENDING``: names agreed with another part of the project that the code does not produce yet.

Importing this module imports the exporter package but never the training frameworks (torch,
transformers, lightning) and never touches NVML.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

#: The series a Prometheus histogram is exposed as, after its base name.
HISTOGRAM_SUFFIXES: tuple[str, ...] = ("bucket", "sum", "count")

#: Series Prometheus itself adds to every scrape target.
PROMETHEUS_SERIES: frozenset[str] = frozenset({"up"})

#: Names agreed with another part of the project but not produced by the code yet, with who adds them.
#: The tests accept these while they are missing and fail once they exist, so the entry gets deleted.
PENDING: dict[str, str] = {}

_PACKAGE = "gpu_energy_exporter"
# Training modules may import torch/transformers/lightning; their names come from the training contract.
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

    names: set[str] = set()
    for instrument in ALL:
        if instrument.kind == "histogram":
            names.update(f"{instrument.prometheus}_{suffix}" for suffix in HISTOGRAM_SUFFIXES)
        else:
            names.add(instrument.prometheus)
    return frozenset(names)


def inference_metric_names() -> frozenset[str]:
    """Names the inference servers' own /metrics expose and the inference rules read (``dashboards/engines.py``,
    each cited from the engine's source)."""
    from dashboards.engines import engine_metric_names

    return engine_metric_names()


def produced_metric_names() -> frozenset[str]:
    """Every name a scrape can return: of the exporter, of the inference servers the inference rules read,
    plus Prometheus's own ``up``."""
    return exporter_metric_names() | training_metric_names() | inference_metric_names() | PROMETHEUS_SERIES

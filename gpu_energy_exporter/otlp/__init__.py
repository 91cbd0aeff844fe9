"""The OTLP/HTTP receiver inside the exporter: training processes push, ``/metrics`` exposes.

- ``translate``: OpenTelemetry names, units and attributes to Prometheus names and labels.
- ``store``: ``TrainingStore``, the bounded series the pushes build, collected on the scrape path.
- ``receiver``: ``POST /v1/metrics`` handling (``ExportHandler``) and a standalone server
  (``OTLPReceiver``).

Importing this package starts nothing and never touches NVML.
"""

from __future__ import annotations

from gpu_energy_exporter.otlp.receiver import ExportHandler, OTLPReceiver, load_bearer_token
from gpu_energy_exporter.otlp.store import AcceptedPoint, TrainingStore
from gpu_energy_exporter.otlp.translate import label_name, metric_name, unit_name

__all__ = [
    "AcceptedPoint",
    "ExportHandler",
    "OTLPReceiver",
    "TrainingStore",
    "label_name",
    "load_bearer_token",
    "metric_name",
    "unit_name",
]

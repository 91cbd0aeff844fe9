"""gpu-energy-exporter: GPU energy, joules per token, compute utilisation and carbon for ML training.

The package is the exporter daemon (``gpu-energy-exporter``), its OTLP receiver and run ledger, and the
training-side helper (``gpu_energy_exporter.training``). Importing the package never touches NVML.
"""

from __future__ import annotations

__version__ = "0.1.0"

"""The training-side helper: a training process reports what it did to gpu-energy-exporter over OTLP.

A plain loop::

    from gpu_energy_exporter.training import count_tokens, start_run

    with start_run(model="llama-3-8b", backend="unsloth", batch_size=8, seq_len=2048) as run:
        for batch in loader:
            loss = train_step(batch)
            run.step(tokens=count_tokens(batch), samples=len(batch["input_ids"]), loss=loss)

The same metadata as one object, shared by scripts and callbacks: ``start_run(metadata=RunMetadata(
model="llama-3-8b", backend="unsloth", batch_size=8, seq_len=2048))``; where the run reports (endpoint,
export interval, GPUs, rank) is an ``ExportSettings`` (``export=``) or its fields by name.

``count_tokens`` counts the non-padding tokens (the attention mask) without a device synchronisation;
``flops_per_token(model)`` gives the model FLOPs per token position for ``step(flops=...)``.

Hugging Face ``Trainer``: ``callbacks=[gpu_energy_exporter.training.hf.EnergyCallback()]``; Lightning:
``callbacks=[gpu_energy_exporter.training.lightning.EnergyCallback()]`` (both optional extras, imported
only from those submodules).

Every point carries ``run_id``, ``rank`` and ``gpu_uuid`` (the GPUs this process uses), so PromQL can
join tokens to the energy of exactly those GPUs. Each token and sample is counted once across ranks:
every rank reports its own work (see ``run.py`` for the rules and ``hf.py`` for counts a framework has
already summed over ranks).

Importing this package never imports torch, transformers or lightning, and never touches NVML.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpu_energy_exporter.core.contract import GPU_NONE, GPU_UNKNOWN

if TYPE_CHECKING:
    from gpu_energy_exporter.training.batch import count_batch, count_tokens
    from gpu_energy_exporter.training.endpoint import DEFAULT_ENDPOINT, resolve_endpoint
    from gpu_energy_exporter.training.export_settings import ExportSettings
    from gpu_energy_exporter.training.flops import flops_per_token
    from gpu_energy_exporter.training.gpus import GPUResolution, resolve_gpus
    from gpu_energy_exporter.training.metadata import RunMetadata
    from gpu_energy_exporter.training.run import TrainingRun, start_run

# Resolved on first use, so that importing the package (or the plain-data training contract,
# ``gpu_energy_exporter.core.contract``) never loads the OpenTelemetry SDK or torch.
_EXPORTS = {
    "DEFAULT_ENDPOINT": "endpoint",
    "ExportSettings": "export_settings",
    "GPUResolution": "gpus",
    "RunMetadata": "metadata",
    "TrainingRun": "run",
    "count_batch": "batch",
    "count_tokens": "batch",
    "flops_per_token": "flops",
    "resolve_endpoint": "endpoint",
    "resolve_gpus": "gpus",
    "start_run": "run",
}

__all__ = [
    "DEFAULT_ENDPOINT",
    "ExportSettings",
    "GPU_NONE",
    "GPU_UNKNOWN",
    "GPUResolution",
    "RunMetadata",
    "TrainingRun",
    "count_batch",
    "count_tokens",
    "flops_per_token",
    "resolve_endpoint",
    "resolve_gpus",
    "start_run",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

"""Model FLOPs per token of a training step, for MFU.

MFU is the model's useful FLOPs per second over the GPUs' peak FLOP/s. The useful FLOPs of one token's
forward and backward pass through a dense model with ``N`` (non-embedding) parameters:

- forward: ``2 N`` (one multiply and one add per weight);
- backward, gradients with respect to the activations: ``2 N``, for every layer above the lowest trainable
  parameter (with adapters on every layer, that is every layer);
- backward, gradients with respect to the weights: ``2 N_trainable``: a frozen weight gets no gradient.

Full training: ``6 N`` per token, the usual figure and what Hugging Face's ``Trainer`` counts
(``floating_point_ops``: 6 x tokens x non-embedding parameters, into ``state.total_flos``). A frozen base
with adapters (LoRA, QLoRA): ``4 N + 2 N_trainable``, where ``N`` includes the adapters; with adapters of a
fraction of a percent that is about 2/3 of ``6 N``, so counting ``6 N`` overstates the executed FLOPs, and
MFU, by about 1.5x. ``flops="trainable"`` (the default of the callbacks) counts ``4 N + 2 N_trainable``,
which is ``6 N`` when everything trains; ``flops="total"`` counts ``6 N`` whatever is frozen, to compare
with Hugging Face's ``total_flos``.

Conventions, the same as Hugging Face's: embedding lookups are not matrix multiplications, so embedding
weights are left out of ``N`` (a tied output head goes with them); attention's ``seq_len``-dependent
FLOPs are not counted; activation recomputation (gradient checkpointing) is not counted, as model FLOPs
exclude it by definition. FLOPs are counted on every position the model computes, padding included.
This module never imports torch.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from gpu_energy_exporter.core.contract import FLOPS_TOTAL, FLOPS_TRAINABLE

log = logging.getLogger("gpu_energy_exporter.training")

FLOPS_MODES: tuple[str, ...] = (FLOPS_TRAINABLE, FLOPS_TOTAL)


def check_flops_mode(value: str) -> str:
    """``value`` if it is a FLOPs mode, else ValueError saying which are."""
    if value not in FLOPS_MODES:
        raise ValueError(f"flops must be {FLOPS_TRAINABLE!r} or {FLOPS_TOTAL!r}, got {value!r}")
    return value


def parameter_counts(model: Any) -> tuple[int, int] | None:
    """``(N, N_trainable)``: the non-embedding parameters of a torch module, and those of them with
    ``requires_grad``; shared parameters once. None when ``model`` is not a module we can read."""
    if model is None:
        return None
    try:
        num_parameters = getattr(model, "num_parameters", None)
        if callable(num_parameters) and not any(hasattr(p, "ds_numel") for p in model.parameters()):
            # Hugging Face: counts 4-bit quantised weights as the parameters they stand for.
            total = int(num_parameters(exclude_embeddings=True))
            trainable = int(num_parameters(only_trainable=True, exclude_embeddings=True))
            return total, trainable
        torch = sys.modules.get("torch")
        embedding = getattr(getattr(torch, "nn", None), "Embedding", None)
        skip = {id(m.weight) for m in model.modules() if embedding is not None and isinstance(m, embedding)}
        total = trainable = 0
        for p in model.parameters():
            if id(p) in skip:
                continue
            n = int(getattr(p, "ds_numel", 0) or p.numel())  # DeepSpeed ZeRO-3 keeps the full size there
            total += n
            if p.requires_grad:
                trainable += n
        return total, trainable
    except Exception:  # noqa: BLE001 - an odd model must not stop the run from being reported
        log.debug("cannot count the parameters of %r", type(model), exc_info=True)
        return None


def flops_per_token(model: Any, flops: str = FLOPS_TRAINABLE) -> float | None:
    """Model FLOPs of one token's forward and backward pass (see the module docstring): ``4 N +
    2 N_trainable`` for ``flops="trainable"``, ``6 N`` for ``flops="total"``. None when the model cannot be
    read."""
    check_flops_mode(flops)
    counts = parameter_counts(model)
    if counts is None:
        return None
    total, trainable = counts
    return float(6 * total if flops == FLOPS_TOTAL else 4 * total + 2 * trainable)

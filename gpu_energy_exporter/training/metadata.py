"""What a run says about itself: ``RunMetadata``, the compute precision's normalisation and the model's
parameter count.

``RunMetadata`` is the one description of a run (model, backend, optimizer, batch size, gradient
accumulation, sequence length, precision, seed, notes, its steps, parameter count and counting
conventions) that ``start_run`` and the Hugging Face and Lightning callbacks all take, as an object or as
keywords of the same names (``export_settings.run_keywords``). The callbacks fill its gaps from the framework
(``RunMetadata.over``: what the caller gave wins) and hand it to ``start_run``, which turns it into the
attributes of ``training.run.info`` (``RunMetadata.attributes``, names from
``core.contract.RUN_INFO_ATTRIBUTES`` and ``COUNTING_ATTRIBUTES``) and its progress and parameter gauges.

Plain values only: this module never imports torch or the OpenTelemetry SDK (``fp32_matmul_precision``
reads torch only when the training script has already imported it), never touches the network and never
raises into the training loop because of an odd model.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any

from gpu_energy_exporter.core.contract import PADDING_EXCLUDED, PADDING_INCLUDED
from gpu_energy_exporter.training.flops import check_flops_mode

log = logging.getLogger("gpu_energy_exporter.training")


@dataclass(frozen=True)
class RunMetadata:
    """What describes a run: the attributes of ``training.run.info``, the columns of the run ledger, the
    run's progress and its parameter count. None: not known (or, in a callback, read from the framework).

    - ``model``, ``backend``, ``optimizer``, ``batch_size``, ``grad_accum``, ``seq_len``, ``seed``,
      ``notes``: label the run as given.
    - ``precision``: what the caller or the framework said (``"bf16-mixed"``, ``torch.bfloat16``...),
      normalised by ``attributes`` to one of ``bf16``, ``fp16``, ``fp8``, ``tf32``, ``fp32``
      (``normalize_precision``); ``precision_raw``: what a framework said when ``precision`` was derived from
      it. What was given goes to the ``precision_raw`` attribute when it differs; an unknown value goes only
      there.
    - ``total_steps``: the optimizer steps of the whole training; ``start_step``: the step a resumed run
      starts from (``training.global_step`` counts on from there, so progress and the energy still to spend
      are right after a resume; None: 0).
    - ``parameters``: the whole model's parameter count (``count_parameters(model)``), for TT and ST; pass
      the whole count also where each rank holds a shard.
    - ``padding`` (``"excluded"`` or ``"included"``) and ``flops`` (``"trainable"`` or ``"total"``): how the
      run's tokens and FLOPs are counted (``count_tokens``, ``flops_per_token``); they label
      ``training.run.info`` so figures are never compared across conventions unawares. The callbacks count
      with them (None: ``excluded`` and ``trainable``).
    """

    model: str | None = None
    backend: str | None = None
    optimizer: str | None = None
    batch_size: int | None = None
    grad_accum: int | None = None
    seq_len: int | None = None
    precision: str | None = None
    seed: int | None = None
    notes: str | None = None
    precision_raw: str | None = None
    total_steps: int | None = None
    start_step: int | None = None
    parameters: int | None = None
    padding: str | None = None
    flops: str | None = None

    def __post_init__(self) -> None:
        if self.padding not in (None, PADDING_EXCLUDED, PADDING_INCLUDED):
            raise ValueError(f"padding must be {PADDING_EXCLUDED!r} or {PADDING_INCLUDED!r}, got {self.padding!r}")
        if self.flops is not None:
            check_flops_mode(self.flops)

    def over(self, detected: RunMetadata) -> RunMetadata:
        """This metadata (what the caller gave) with its gaps filled from ``detected`` (what the framework
        says). A precision the caller gave replaces the framework's, ``precision_raw`` included."""
        merged = {name: getattr(detected, name) if given is None else given
                  for name, given in self.keywords().items()}
        if self.precision is not None:
            merged["precision_raw"] = self.precision_raw
        return RunMetadata(**merged)

    def keywords(self) -> dict[str, Any]:
        """The fields by name: the keyword arguments of ``start_run`` that carry this metadata."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def attributes(self) -> dict[str, Any]:
        """The attributes of ``training.run.info``, in the order of ``RUN_INFO_ATTRIBUTES`` then
        ``COUNTING_ATTRIBUTES``: ``precision`` normalised and ``precision_raw`` as ``precision_attributes``
        says; None where not known."""
        return {
            "model": self.model, "backend": self.backend, "optimizer": self.optimizer,
            "batch_size": self.batch_size, "grad_accum": self.grad_accum, "seq_len": self.seq_len,
            **precision_attributes(self.precision, self.precision_raw),
            "seed": self.seed,
            "notes": self.notes,
            "padding": self.padding,
            "flops": self.flops,
        }


# -- precision --------------------------------------------------------------------------------------

# What frameworks and people write for a compute precision, lower-cased, to the name the peak-FLOP/s
# table uses. Lightning: "bf16-mixed", "bf16-true", "16-mixed", "16-true", "32-true", "64-true",
# "transformer-engine" (FP8 through NVIDIA Transformer Engine); Accelerate: "bf16", "fp16", "fp8", "no";
# torch dtypes: "torch.bfloat16"...
_PRECISION_ALIASES: dict[str, str] = {
    **dict.fromkeys(("bf16", "bf16-mixed", "bf16-true", "bfloat16", "torch.bfloat16", "amp_bf16"), "bf16"),
    **dict.fromkeys(("fp16", "16", "16-mixed", "16-true", "float16", "half", "torch.float16", "torch.half",
                     "f16", "amp", "amp_fp16"), "fp16"),
    **dict.fromkeys(("fp8", "float8", "fp8-mixed", "transformer-engine", "torch.float8_e4m3fn",
                     "torch.float8_e5m2", "e4m3", "e5m2"), "fp8"),
    **dict.fromkeys(("tf32", "tensorfloat32", "tensorfloat-32"), "tf32"),
    **dict.fromkeys(("fp32", "32", "32-true", "float32", "float", "torch.float32", "torch.float", "f32",
                     "full", "no"), "fp32"),
}


def normalize_precision(value: Any) -> str | None:
    """The run's compute precision as one of ``contract.PRECISIONS`` (``bf16``, ``fp16``, ``fp8``,
    ``tf32``, ``fp32``), or None when ``value`` names none of them (fp64, int8 or 4-bit weights, a typo):
    a label the MFU rule cannot match is better absent than guessed."""
    if value is None:
        return None
    text = str(value).strip().lower()
    return _PRECISION_ALIASES.get(text) or _PRECISION_ALIASES.get(text.replace("_", "-"))


def precision_attributes(value: Any, raw: Any = None) -> dict[str, Any]:
    """``precision`` (``value`` normalised) and ``precision_raw`` (``raw``, else ``value`` as given, only
    when it differs from the normalised name) for the run's metadata; empty when ``value`` is None."""
    if value is None:
        return {}
    norm = normalize_precision(value)
    text = str(value if raw is None else raw).strip()
    out: dict[str, Any] = {"precision": norm}
    if text and text.lower() != norm:
        out["precision_raw"] = text
    return out


def fp32_matmul_precision(device: Any = None) -> str:
    """``tf32`` where float32 matrix multiplications run on TF32 tensor cores (a CUDA device with
    ``torch.backends.cuda.matmul.allow_tf32``, which ``torch.set_float32_matmul_precision("high")`` and
    the Trainer's ``tf32=True`` set), else ``fp32``. Never imports torch: without it loaded, ``fp32``."""
    torch = sys.modules.get("torch")
    if torch is None or device is None:
        return "fp32"
    try:
        on_cuda = str(getattr(device, "type", device)).startswith("cuda")
        return "tf32" if on_cuda and bool(torch.backends.cuda.matmul.allow_tf32) else "fp32"
    except Exception:  # noqa: BLE001 - an old or stripped-down torch
        return "fp32"


# -- parameters -------------------------------------------------------------------------------------


def count_parameters(model: Any) -> int | None:
    """Parameters of a torch module (every parameter, trainable or not, shared ones once), or None.

    A Hugging Face model's own ``num_parameters()`` is used when it has one: it counts 4-bit quantised
    weights (bitsandbytes packs two in a byte) as the parameters they stand for. DeepSpeed ZeRO-3 keeps
    each parameter's full size in ``ds_numel``. Other sharding (FSDP, tensor parallelism) leaves only this
    rank's shard in ``parameters()``: pass the whole model's count to ``start_run(parameters=)`` instead.
    """
    if model is None:
        return None
    try:
        num_parameters = getattr(model, "num_parameters", None)
        if callable(num_parameters) and not any(hasattr(p, "ds_numel") for p in model.parameters()):
            return parameter_count(num_parameters())
        return parameter_count(sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in model.parameters()))
    except Exception:  # noqa: BLE001 - an odd model must not stop the run from being reported
        log.debug("cannot count the parameters of %r", type(model), exc_info=True)
        return None


def parameter_count(value: Any) -> int | None:
    """``value`` as a positive parameter count, else None (with a warning for what is not a number)."""
    if value is None:
        return None
    try:
        count = int(value)
    except (TypeError, ValueError):
        log.warning("gpu_energy_exporter.training: ignoring parameters=%r (a whole number expected)", value)
        return None
    return count if count > 0 else None

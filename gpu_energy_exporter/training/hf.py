"""Hugging Face ``Trainer`` integration: ``EnergyCallback``.

    from gpu_energy_exporter.training.hf import EnergyCallback
    trainer = Trainer(..., callbacks=[EnergyCallback(backend="unsloth", seq_len=2048)])

What is reported, and from where (each rank runs its own callback and reports its own share):

- steps: ``on_step_end`` (one per optimizer step, all gradient-accumulation micro-batches included);
  the step duration from ``on_step_begin`` to ``on_step_end``. Progress: ``training.global_step`` is
  ``state.global_step`` and ``total_steps`` is ``state.max_steps``, both counted from the start of
  training, so a run resumed from a checkpoint (``resume_from_checkpoint``) shows its true progress and
  the energy still to spend is projected from the steps really left.
- samples: counted on this rank from the training micro-batches themselves, through a forward pre-hook
  on the model (callbacks never see the batch); shapes only, no device synchronisation.
- tokens, ``padding="excluded"`` (the default): the pre-hook counts the non-padding positions of each
  micro-batch's ``attention_mask`` (``attention_mask.sum()`` kept on the device, read at export time: no
  synchronisation per step); a batch without a mask counts every position. ``padding="included"``: every
  position of the token ids. If the Trainer counts tokens itself (``include_num_input_tokens_seen``
  ``"non_padding"`` or ``"all"``) and ``padding`` is not set to the other convention, its count is used
  instead: ``state.num_input_tokens_seen`` is **gathered over all processes**, a global count, so each
  rank reports an even integer share of each increase (rank r gets ``d // W`` plus one of the ``d % W``
  remainder tokens when ``r < d % W``); the shares add up exactly to the Trainer's count, so
  ``sum by (run_id)`` is right, while the per-rank split is even rather than measured.
- FLOPs: counted per micro-batch by the pre-hook, so the counter rises with every step (a rate over any
  window of a few steps is right): every position of the token ids (padding is computed too) times the
  model FLOPs per token (``flops.py``): ``flops="trainable"`` (default) ``4 N + 2 N_trainable``,
  ``flops="total"`` ``6 N``, exactly what the Trainer's ``total_flos`` counts (``N``: non-embedding
  parameters, counted at ``on_train_begin``). The Trainer's own ``total_flos`` is only updated at logging
  and saving steps (``store_flos``), so a rate of it alternates between 0 and several times the truth; it
  is used only for a model whose parameters cannot be read (then as deltas, ``delta / W`` per rank,
  since the Trainer sums it over processes).
- ``padding`` and ``flops`` label ``training.run.info`` with the conventions used.
- loss and learning rate: ``on_log`` (every ``logging_steps``); the learning rate also from the
  scheduler at every step. Validation loss: ``on_evaluate`` (``eval_loss``). Epochs: ``state.epoch``.
- metadata: model name, optimizer, per-device batch size, gradient accumulation, precision and seed from
  the ``TrainingArguments``, unless given to the constructor; ``backend``, ``seq_len`` and ``notes`` only
  from the constructor. Precision: ``bf16`` / ``fp16`` from those flags, else ``tf32`` where float32
  matmuls run on TF32 tensor cores (``tf32=True``, or torch's ``allow_tf32`` on a CUDA device), else
  ``fp32``.
- parameters (``training.model.parameters``, for TT and ST): counted from the model at
  ``on_train_begin`` (``count_parameters``), unless given to the constructor (do that where the model is
  sharded: FSDP leaves each rank only its shard).

The run starts at ``on_train_begin`` (every rank; the run id is agreed over the process group) and
finishes at ``on_train_end``. This module needs ``transformers``; it must never change what the Trainer
does (no control flags touched, nothing raised into the training loop).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "gpu_energy_exporter.training.hf needs Hugging Face transformers: "
        "pip install transformers accelerate (or, in a checkout of gpu-energy-exporter, pip install '.[hf]')"
    ) from exc

from gpu_energy_exporter.core.contract import FLOPS_TRAINABLE, PADDING_EXCLUDED, PADDING_INCLUDED
from gpu_energy_exporter.training.batch import (
    add_count,
    attention_mask,
    count_batch,
    main_tensor,
    non_padding_tokens,
)
from gpu_energy_exporter.training.export_settings import ExportSettings, run_keywords
from gpu_energy_exporter.training.flops import flops_per_token
from gpu_energy_exporter.training.metadata import RunMetadata, count_parameters, fp32_matmul_precision
from gpu_energy_exporter.training.run import TrainingRun, start_run

log = logging.getLogger("gpu_energy_exporter.training")


def even_share(delta: int, rank: int, world_size: int) -> int:
    """Rank ``rank``'s integer share of a global count increase ``delta``; the shares sum to ``delta``."""
    if world_size <= 1:
        return delta
    base, rest = divmod(delta, world_size)
    return base + (1 if rank < rest else 0)


class _BatchCounter:
    """Forward pre-hook counting this rank's training micro-batches: samples and token positions from
    shapes, non-padding tokens from the attention mask (a device tensor, no synchronisation), FLOPs from
    the positions.

    Thread-safe because ``nn.DataParallel`` runs replicas' forwards in threads."""

    def __init__(self, input_key: str, count: Callable[[Any, str], tuple[int, int]], *,
                 exclude_padding: bool = False, flops_per_token: float | None = None) -> None:
        self.input_key = input_key
        self.count = count
        self.exclude_padding = exclude_padding
        self.flops_per_token = flops_per_token
        self.samples = 0
        self.tokens: Any = 0
        self.flops = 0.0
        self._lock = threading.Lock()

    def __call__(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not getattr(module, "training", True):
            return None  # evaluation and prediction forwards are not training work
        try:
            batch: Any = kwargs if self.input_key in kwargs or not args else args[0]
            samples, positions = self.count(batch, self.input_key)
            tokens: Any = positions
            if self.exclude_padding and positions:
                mask = attention_mask(batch, main_tensor(batch, self.input_key))
                if mask is not None:
                    tokens = non_padding_tokens(mask)
            flops = positions * self.flops_per_token if self.flops_per_token else 0.0
        except Exception:  # noqa: BLE001 - counting must never break a forward
            log.debug("cannot count this batch", exc_info=True)
            return None
        with self._lock:
            self.samples += samples
            self.tokens = add_count(self.tokens, tokens)
            self.flops += flops
        return None

    def take(self) -> tuple[int, Any, float]:
        with self._lock:
            out = (self.samples, self.tokens, self.flops)
            self.samples = self.tokens = 0
            self.flops = 0.0
        return out


class EnergyCallback(TrainerCallback):
    """Reports a Hugging Face ``Trainer`` run to gpu-energy-exporter (see the module docstring).

    Takes what ``start_run`` takes, as ``metadata`` (a ``RunMetadata``) and ``export`` (an
    ``ExportSettings``) or their fields by name: what is given overrides what is read from the
    ``TrainingArguments``, the model and the Trainer's state. ``padding``: ``"excluded"`` (default:
    non-padding tokens, from the attention mask) or ``"included"``; ``flops``: ``"trainable"`` (default:
    ``4 N + 2 N_trainable`` per token, right for LoRA and for full training) or ``"total"`` (``6 N``, as the
    Trainer's ``total_flos``). ``flops_per_token`` replaces the figure counted from the model (give it where
    the model is sharded, FSDP). ``count_batch`` replaces the shape-based ``(samples, token positions)``
    counter for unusual inputs.
    ``run`` is the current ``TrainingRun`` (None outside ``train()``).
    """

    def __init__(
        self,
        run_id: str | None = None,
        *,
        metadata: RunMetadata | None = None,
        export: ExportSettings | None = None,
        flops_per_token: float | None = None,
        count_batch: Callable[[Any, str], tuple[int, int]] = count_batch,
        **fields: Any,
    ) -> None:
        self.run_id = run_id
        self.metadata, self.export = run_keywords(type(self).__init__, metadata, export, fields)
        self.padding = self.metadata.padding  # None: the Trainer's own count's convention, else excluded
        self.flops = self.metadata.flops or FLOPS_TRAINABLE
        self.flops_per_token = flops_per_token
        self._count_batch = count_batch
        self.run: TrainingRun | None = None
        self._counter: _BatchCounter | None = None
        self._hook: Any = None
        self._step_started: float | None = None
        self._tokens_seen = 0
        self._flos_seen = 0.0
        self._rank = 0
        self._world_size = 1
        self._trainer_counts_tokens = False
        self._flops_from_trainer = False

    # -- lifecycle ----------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._close()  # a previous train() that never reached on_train_end
        self._rank = int(getattr(args, "process_index", 0))
        self._world_size = max(int(getattr(args, "world_size", 1)), 1)
        counting = getattr(args, "include_num_input_tokens_seen", "no")
        trainer_padding = PADDING_EXCLUDED if counting == "non_padding" else PADDING_INCLUDED
        self._trainer_counts_tokens = counting not in ("no", False, None) and self.padding in (None, trainer_padding)
        padding = trainer_padding if self._trainer_counts_tokens else (self.padding or PADDING_EXCLUDED)
        # State is restored from the checkpoint before on_train_begin: on a resume these are its totals.
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._flos_seen = float(getattr(state, "total_flos", 0.0) or 0.0)
        per_token = self.flops_per_token or flops_per_token(model, self.flops)
        self._flops_from_trainer = not per_token
        try:
            detected = dataclasses.replace(
                self._from_args(args, model),
                total_steps=int(state.max_steps) if state.max_steps else None,
                start_step=int(getattr(state, "global_step", 0) or 0),
                parameters=count_parameters(model) if self.metadata.parameters is None else None,
            )
            metadata = dataclasses.replace(
                self.metadata.over(detected), padding=padding,
                flops=None if self._flops_from_trainer or self.flops_per_token else self.flops,
            )
            export = self.export.over(ExportSettings(device=getattr(args, "device", None), rank=self._rank,
                                                     world_size=self._world_size))
            self.run = start_run(self.run_id, metadata=metadata, export=export)
        except Exception:  # noqa: BLE001 - reporting must never stop training
            log.warning("gpu_energy_exporter.training: could not start the run; training continues "
                        "without reporting", exc_info=True)
            self.run = None
            return
        if model is not None and hasattr(model, "register_forward_pre_hook"):
            self._counter = _BatchCounter(getattr(model, "main_input_name", "input_ids"), self._count_batch,
                                          exclude_padding=padding == PADDING_EXCLUDED,
                                          flops_per_token=per_token)
            self._hook = model.register_forward_pre_hook(self._counter, with_kwargs=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self.run
        if run is not None:
            # Pending micro-batches (none normally) go with the final totals.
            self._report(state, count_step=False)
        self._close()

    def _close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._counter = None
        run, self.run = self.run, None
        if run is not None:
            run.finish()

    # -- per step -----------------------------------------------------------------------------------

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.run is None:
            return
        lr = None
        if lr_scheduler is not None:
            try:
                lr = lr_scheduler.get_last_lr()[0]
            except Exception:  # noqa: BLE001 - schedulers without get_last_lr
                lr = None
        self._report(state, count_step=True, lr=lr)

    def _report(self, state: Any, *, count_step: bool, lr: Any = None) -> None:
        run = self.run
        assert run is not None
        samples, tokens, flops = self._counter.take() if self._counter is not None else (0, 0, 0.0)
        if self._trainer_counts_tokens:
            seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
            tokens = even_share(max(seen - self._tokens_seen, 0), self._rank, self._world_size)
            self._tokens_seen = seen
        if self._flops_from_trainer:
            flops = self._take_flops(state)
        if count_step:
            started, self._step_started = self._step_started, None
            duration = time.perf_counter() - started if started is not None else None
            global_step = getattr(state, "global_step", None)
            run.step(tokens=tokens, samples=samples, flops=flops, lr=lr, duration_s=duration,
                     global_step=int(global_step) if global_step is not None else None)
            if state.epoch is not None:
                run.epoch(state.epoch)
        else:
            run.add(tokens=tokens, samples=samples, flops=flops)

    def _take_flops(self, state: Any) -> float:
        total = float(getattr(state, "total_flos", 0.0) or 0.0)
        delta = max(total - self._flos_seen, 0.0)
        self._flos_seen = total
        return delta / self._world_size if delta else 0.0

    # -- logs, evaluation, epochs -------------------------------------------------------------------

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
               **kwargs: Any) -> None:
        run = self.run
        if run is None or not logs:
            return
        run.log(loss=logs.get("loss"), lr=logs.get("learning_rate"))
        if logs.get("eval_loss") is not None:
            run.evaluate(logs["eval_loss"])
        if self._flops_from_trainer:
            # store_flos runs right before a log: report the FLOPs now rather than a step later.
            run.add(flops=self._take_flops(state))

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Mapping[str, Any] | None = None,
                    **kwargs: Any) -> None:
        if self.run is not None and metrics and metrics.get("eval_loss") is not None:
            self.run.evaluate(metrics["eval_loss"])

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None and state.epoch is not None:
            self.run.epoch(state.epoch)

    # -- metadata -----------------------------------------------------------------------------------

    @staticmethod
    def _from_args(args: Any, model: Any) -> RunMetadata:
        name = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
        if not name and model is not None:
            name = type(model).__name__
        if getattr(args, "bf16", False):
            precision = "bf16"
        elif getattr(args, "fp16", False):
            precision = "fp16"
        elif getattr(args, "tf32", None):
            precision = "tf32"
        else:
            precision = fp32_matmul_precision(getattr(args, "device", None))
        optim = getattr(args, "optim", None)
        return RunMetadata(
            model=name or None,
            optimizer=getattr(optim, "value", optim),
            batch_size=getattr(args, "per_device_train_batch_size", None),
            grad_accum=getattr(args, "gradient_accumulation_steps", None),
            precision=precision,
            seed=getattr(args, "seed", None),
        )

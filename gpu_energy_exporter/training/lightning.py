"""PyTorch Lightning integration: ``EnergyCallback``.

    from gpu_energy_exporter.training.lightning import EnergyCallback
    trainer = L.Trainer(..., callbacks=[EnergyCallback(backend="fsdp", seq_len=2048)])

Works with ``lightning.pytorch`` (Lightning 2.x) or the older ``pytorch_lightning`` package, whichever is
installed. What is reported, and from where (each rank reports its own work: Lightning hands every rank
its own batches, so nothing here is a global count):

- samples and token positions: from each training batch this rank sees (``on_train_batch_end``), by
  shape (``count_batch``: the ``input_ids`` entry of a dict batch, else the first tensor; token ids are
  2-D int32/int64 tensors); pass ``count_batch=`` for other layouts.
- tokens, ``padding="excluded"`` (default): the non-padding positions of the batch's
  ``attention_mask`` (kept on the device, read at export time), every position when the batch has no
  mask; ``padding="included"``: every position.
- steps: optimizer steps, i.e. increases of ``trainer.global_step`` (micro-batches of a gradient
  accumulation are added to the step that consumes them); step duration from the first micro-batch
  start to the step. Progress: ``training.global_step`` is ``trainer.global_step`` and ``total_steps``
  ``trainer.max_steps`` or ``trainer.estimated_stepping_batches``, both counted from the start of
  training, so a run resumed from a checkpoint (``fit(ckpt_path=...)``) shows its true progress.
- FLOPs: Lightning has no FLOP counter: FLOPs are token positions (padding included: it is computed)
  times the model FLOPs per token, ``flops_per_token`` if given, else counted from the LightningModule at
  ``on_train_start`` (``flops.py``): ``flops="trainable"`` (default) ``4 N + 2 N_trainable``,
  ``flops="total"`` ``6 N``.
- loss: the ``loss`` the ``training_step`` returned for the step's last micro-batch (kept as a tensor,
  converted at export time, no synchronisation); learning rate: the first optimizer's first parameter
  group; validation loss: ``trainer.callback_metrics[val_loss_key]`` after validation; epochs completed
  at each epoch end.
- metadata: the LightningModule's class name, the optimizer's class, ``accumulate_grad_batches``, the
  precision setting and the seed from ``seed_everything``, unless given to the constructor. The precision
  setting is normalised (``"bf16-mixed"`` -> ``bf16``, ``"16-mixed"`` -> ``fp16``, ``"32-true"`` -> ``fp32``,
  or ``tf32`` where float32 matmuls run on TF32 tensor cores) and kept as given in ``precision_raw``.
- parameters (``training.model.parameters``, for TT and ST): counted from the LightningModule at
  ``on_train_start``, unless given to the constructor (do that where the strategy shards the model: FSDP
  leaves each rank only its shard).

The run starts at ``on_train_start`` (the run id is broadcast by the strategy so every rank agrees) and
finishes at ``on_train_end`` or ``on_exception``. It must never change what the Trainer does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Type-checked against Lightning 2.x, what the `lightning` extra installs (Any where it is not
    # installed). The older pytorch_lightning's Callback below is the same API but another class: a checker
    # seeing both imports needs a `type: ignore[assignment]` there, which warn_unused_ignores then flags
    # wherever lightning is not installed (both imports are Any).
    from lightning.pytorch import Callback
else:
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise ImportError(
                "gpu_energy_exporter.training.lightning needs PyTorch Lightning: "
                "pip install lightning (or, in a checkout of gpu-energy-exporter, pip install '.[lightning]')"
            ) from exc

from gpu_energy_exporter.core.contract import FLOPS_TRAINABLE, PADDING_EXCLUDED
from gpu_energy_exporter.training.batch import (
    add_count,
    attention_mask,
    count_batch,
    main_tensor,
    non_padding_tokens,
)
from gpu_energy_exporter.training.distributed import new_run_id
from gpu_energy_exporter.training.export_settings import ExportSettings, run_keywords
from gpu_energy_exporter.training.flops import flops_per_token as model_flops_per_token
from gpu_energy_exporter.training.metadata import (
    RunMetadata,
    count_parameters,
    fp32_matmul_precision,
    normalize_precision,
)
from gpu_energy_exporter.training.run import TrainingRun, start_run

log = logging.getLogger("gpu_energy_exporter.training")


class EnergyCallback(Callback):
    """Reports a Lightning training run to gpu-energy-exporter (see the module docstring).

    Takes what ``start_run`` takes, as ``metadata`` (a ``RunMetadata``) and ``export`` (an
    ``ExportSettings``) or their fields by name: what is given overrides what is read from the Trainer and
    the LightningModule. ``flops_per_token`` replaces the figure counted from the model; ``val_loss_key``
    names the validation loss in ``trainer.callback_metrics``; ``input_key`` and ``count_batch`` say where
    a batch's token ids are and how to count them.
    ``run`` is the current ``TrainingRun`` (None outside ``fit``).
    """

    def __init__(
        self,
        run_id: str | None = None,
        *,
        metadata: RunMetadata | None = None,
        export: ExportSettings | None = None,
        flops_per_token: float | None = None,
        val_loss_key: str = "val_loss",
        input_key: str = "input_ids",
        count_batch: Callable[[Any, str], tuple[int, int]] = count_batch,
        **fields: Any,
    ) -> None:
        self.run_id = run_id
        self.metadata, self.export = run_keywords(type(self).__init__, metadata, export, fields)
        self.flops_per_token = flops_per_token
        self.flops = self.metadata.flops or FLOPS_TRAINABLE
        self.padding = self.metadata.padding or PADDING_EXCLUDED
        self._flops_per_token: float | None = flops_per_token
        self.val_loss_key = val_loss_key
        self.input_key = input_key
        self._count_batch = count_batch
        self.run: TrainingRun | None = None
        self._last_global_step = 0
        self._pending_samples = 0
        self._pending_tokens: Any = 0
        self._pending_positions = 0
        self._step_started: float | None = None

    # -- lifecycle ----------------------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        try:
            # The strategy's broadcast works for every strategy (a no-op on one device), so the ranks
            # agree on the id without start_run needing torch.distributed.
            run_id = self.run_id or os.environ.get("GPU_ENERGY_RUN_ID") or trainer.strategy.broadcast(new_run_id())
            self._flops_per_token = self.flops_per_token
            if self._flops_per_token is None:
                self._flops_per_token = model_flops_per_token(pl_module, self.flops)
            detected = dataclasses.replace(
                self._from_trainer(trainer, pl_module),
                total_steps=self._total_steps(trainer), start_step=int(trainer.global_step),
                parameters=count_parameters(pl_module) if self.metadata.parameters is None else None,
            )
            metadata = dataclasses.replace(
                self.metadata.over(detected), padding=self.padding,
                flops=self.flops if self.flops_per_token is None and self._flops_per_token else None,
            )
            export = self.export.over(ExportSettings(device=pl_module.device, rank=int(trainer.global_rank),
                                                     world_size=int(trainer.world_size)))
            self.run = start_run(run_id, metadata=metadata, export=export)
        except Exception:  # noqa: BLE001 - reporting must never stop training
            log.warning("gpu_energy_exporter.training: could not start the run; training continues "
                        "without reporting", exc_info=True)
            self.run = None
        self._last_global_step = int(trainer.global_step)
        self._pending_samples = self._pending_tokens = self._pending_positions = 0
        self._step_started = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        run.add(tokens=self._pending_tokens, samples=self._pending_samples,
                flops=self._flops(self._pending_positions))
        self._pending_samples = self._pending_tokens = self._pending_positions = 0
        run.finish()

    # -- per batch ----------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._step_started is None:
            self._step_started = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        run = self.run
        if run is None:
            return
        try:
            samples, positions = self._count_batch(batch, self.input_key)
            tokens: Any = positions
            if self.padding == PADDING_EXCLUDED and positions:
                mask = attention_mask(batch, main_tensor(batch, self.input_key))
                if mask is not None:
                    tokens = non_padding_tokens(mask)
        except Exception:  # noqa: BLE001 - counting must never break training
            log.debug("cannot count this batch", exc_info=True)
            samples, positions, tokens = 0, 0, 0
        self._pending_samples += samples
        self._pending_positions += positions
        self._pending_tokens = add_count(self._pending_tokens, tokens)
        global_step = int(trainer.global_step)
        if global_step == self._last_global_step:
            return  # a gradient-accumulation micro-batch: its work goes with the coming step
        steps = global_step - self._last_global_step
        self._last_global_step = global_step
        started, self._step_started = self._step_started, None
        duration = time.perf_counter() - started if started is not None else None
        tokens, samples, positions = self._pending_tokens, self._pending_samples, self._pending_positions
        self._pending_samples = self._pending_tokens = self._pending_positions = 0
        run.step(tokens=tokens, samples=samples, flops=self._flops(positions),
                 loss=_loss(outputs, trainer, pl_module), lr=_learning_rate(trainer), duration_s=duration,
                 global_step=global_step - steps + 1)
        if steps > 1:  # manual optimisation with several optimizer steps per batch
            for i in range(steps - 1):
                run.step(duration_s=0.0, global_step=global_step - steps + 2 + i)

    def _flops(self, positions: int) -> float:
        return positions * self._flops_per_token if self._flops_per_token and positions else 0.0

    # -- epochs and validation ----------------------------------------------------------------------

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.run is not None:
            self.run.epoch(int(trainer.current_epoch) + 1)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        run = self.run
        if run is None or getattr(trainer, "sanity_checking", False):
            return
        value = trainer.callback_metrics.get(self.val_loss_key)
        if value is not None:
            run.evaluate(value.detach() if hasattr(value, "detach") else value)

    # -- metadata -----------------------------------------------------------------------------------

    @staticmethod
    def _total_steps(trainer: Any) -> int | None:
        if getattr(trainer, "max_steps", -1) and trainer.max_steps > 0:
            return int(trainer.max_steps)
        try:
            estimated = float(trainer.estimated_stepping_batches)
        except Exception:  # noqa: BLE001 - iterable datasets without a length
            return None
        return int(estimated) if math.isfinite(estimated) else None

    @staticmethod
    def _from_trainer(trainer: Any, pl_module: Any) -> RunMetadata:
        optimizers = getattr(trainer, "optimizers", None) or []
        seed = os.environ.get("PL_GLOBAL_SEED")  # set by seed_everything
        batch_size = None
        loader = getattr(trainer, "train_dataloader", None)
        if loader is not None:
            batch_size = getattr(loader, "batch_size", None)
        raw = str(getattr(trainer, "precision", "") or "") or None
        precision = raw
        if normalize_precision(raw) == "fp32":
            precision = fp32_matmul_precision(getattr(pl_module, "device", None))
        return RunMetadata(
            model=type(pl_module).__name__,
            optimizer=type(optimizers[0]).__name__ if optimizers else None,
            batch_size=batch_size,
            grad_accum=getattr(trainer, "accumulate_grad_batches", None),
            precision=precision,
            precision_raw=raw,
            seed=int(seed) if seed and seed.lstrip("-").isdigit() else None,
        )


def _loss(outputs: Any, trainer: Any, pl_module: Any) -> Any:
    """The step's last micro-batch loss, as ``training_step`` returned it."""
    value = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach()
    # With automatic optimisation Lightning hands callbacks the loss already divided by
    # accumulate_grad_batches (the value it back-propagates); undo that to report the real loss.
    factor = getattr(trainer, "accumulate_grad_batches", 1) or 1
    if factor != 1 and getattr(pl_module, "automatic_optimization", True):
        value = value * factor
    return value


def _learning_rate(trainer: Any) -> float | None:
    try:
        return float(trainer.optimizers[0].param_groups[0]["lr"])
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None

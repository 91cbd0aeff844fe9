"""Hugging Face ``Trainer`` integration: ``EnergyCallback``.

    from gpu_energy_exporter.training.hf import EnergyCallback
    trainer = Trainer(..., callbacks=[EnergyCallback(backend="unsloth", seq_len=2048)])

What is reported, and from where (each rank runs its own callback and reports its own share):

- steps: ``on_step_end`` (one per optimizer step, all gradient-accumulation micro-batches included);
  ``total_steps`` from ``state.max_steps``; the step duration from ``on_step_begin`` to ``on_step_end``.
- samples: counted on this rank from the training micro-batches themselves, through a forward pre-hook
  on the model (callbacks never see the batch); shapes only, no device synchronisation.
- tokens: if the Trainer counts them (``include_num_input_tokens_seen`` not ``"no"``), from
  ``state.num_input_tokens_seen``, which the Trainer **gathers over all processes**: it is already a
  global count, so each rank reports an even integer share of each increase (rank r gets
  ``d // W`` plus one of the ``d % W`` remainder tokens when ``r < d % W``). The shares add up exactly to
  the Trainer's count, so ``sum by (run_id)`` is right, while the per-rank split is even rather than
  measured. Otherwise the forward pre-hook counts the token-id elements of this rank's micro-batches
  (padding included), which is exact per rank.
- FLOPs: ``state.total_flos`` deltas. The Trainer sums its per-process counts over all processes before
  storing them (``store_flos``, at logging and saving steps), so FLOPs too are a global count: each rank
  reports ``delta / W``. They arrive in lumps at logging steps.
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

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "gpu_energy_exporter.training.hf needs Hugging Face transformers: "
        "pip install gpu-energy-exporter[hf]"
    ) from exc

from gpu_energy_exporter.training.batch import count_batch
from gpu_energy_exporter.training.run import TrainingRun, count_parameters, fp32_matmul_precision, start_run

log = logging.getLogger("gpu_energy_exporter.training")


def even_share(delta: int, rank: int, world_size: int) -> int:
    """Rank ``rank``'s integer share of a global count increase ``delta``; the shares sum to ``delta``."""
    if world_size <= 1:
        return delta
    base, rest = divmod(delta, world_size)
    return base + (1 if rank < rest else 0)


class _BatchCounter:
    """Forward pre-hook counting this rank's training micro-batches (samples, tokens) from shapes.

    Thread-safe because ``nn.DataParallel`` runs replicas' forwards in threads."""

    def __init__(self, input_key: str, count: Callable[[Any, str], tuple[int, int]]) -> None:
        self.input_key = input_key
        self.count = count
        self.samples = 0
        self.tokens = 0
        self._lock = threading.Lock()

    def __call__(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not getattr(module, "training", True):
            return None  # evaluation and prediction forwards are not training work
        try:
            batch: Any = kwargs if self.input_key in kwargs or not args else args[0]
            samples, tokens = self.count(batch, self.input_key)
        except Exception:  # noqa: BLE001 - counting must never break a forward
            log.debug("cannot count this batch", exc_info=True)
            return None
        with self._lock:
            self.samples += samples
            self.tokens += tokens
        return None

    def take(self) -> tuple[int, int]:
        with self._lock:
            out = (self.samples, self.tokens)
            self.samples = self.tokens = 0
        return out


class EnergyCallback(TrainerCallback):
    """Reports a Hugging Face ``Trainer`` run to gpu-energy-exporter (see the module docstring).

    Metadata keywords override what is read from the ``TrainingArguments``; the other keywords are
    passed to ``start_run`` (``endpoint``, ``export_interval``, ``gpu_uuids``, ``headers``...).
    ``count_batch`` replaces the shape-based ``(samples, tokens)`` counter for unusual inputs.
    ``run`` is the current ``TrainingRun`` (None outside ``train()``).
    """

    def __init__(
        self,
        run_id: str | None = None,
        *,
        model: str | None = None,
        backend: str | None = None,
        optimizer: str | None = None,
        batch_size: int | None = None,
        grad_accum: int | None = None,
        seq_len: int | None = None,
        precision: str | None = None,
        seed: int | None = None,
        notes: str | None = None,
        parameters: int | None = None,
        endpoint: str | None = None,
        export_interval: float | None = None,
        gpu_uuids: Sequence[str] | None = None,
        count_batch: Callable[[Any, str], tuple[int, int]] = count_batch,
        **run_kwargs: Any,
    ) -> None:
        self.run_id = run_id
        self.metadata: dict[str, Any] = {
            "model": model, "backend": backend, "optimizer": optimizer, "batch_size": batch_size,
            "grad_accum": grad_accum, "seq_len": seq_len, "precision": precision, "seed": seed,
            "notes": notes,
        }
        self.run_kwargs: dict[str, Any] = {
            "endpoint": endpoint, "export_interval": export_interval, "gpu_uuids": gpu_uuids, **run_kwargs,
        }
        self.parameters = parameters
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

    # -- lifecycle ----------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._close()  # a previous train() that never reached on_train_end
        self._rank = int(getattr(args, "process_index", 0))
        self._world_size = max(int(getattr(args, "world_size", 1)), 1)
        counting = getattr(args, "include_num_input_tokens_seen", "no")
        self._trainer_counts_tokens = counting not in ("no", False, None)
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._flos_seen = float(getattr(state, "total_flos", 0.0) or 0.0)
        metadata = {**self._from_args(args, model), **{k: v for k, v in self.metadata.items() if v is not None}}
        parameters = self.parameters if self.parameters is not None else count_parameters(model)
        try:
            self.run = start_run(
                self.run_id, **metadata, total_steps=int(state.max_steps) if state.max_steps else None,
                parameters=parameters,
                device=getattr(args, "device", None), rank=self._rank, world_size=self._world_size,
                **{k: v for k, v in self.run_kwargs.items() if v is not None},
            )
        except Exception:  # noqa: BLE001 - reporting must never stop training
            log.warning("gpu_energy_exporter.training: could not start the run; training continues "
                        "without reporting", exc_info=True)
            self.run = None
            return
        if model is not None and hasattr(model, "register_forward_pre_hook"):
            self._counter = _BatchCounter(getattr(model, "main_input_name", "input_ids"), self._count_batch)
            self._hook = model.register_forward_pre_hook(self._counter, with_kwargs=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self.run
        if run is not None:
            # store_flos ran just before on_train_end; pending micro-batches (none normally) go with it.
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
        samples, tokens = self._counter.take() if self._counter is not None else (0, 0)
        if self._trainer_counts_tokens:
            seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
            tokens = even_share(max(seen - self._tokens_seen, 0), self._rank, self._world_size)
            self._tokens_seen = seen
        flops = self._take_flops(state)
        if count_step:
            started, self._step_started = self._step_started, None
            duration = time.perf_counter() - started if started is not None else None
            run.step(tokens=tokens, samples=samples, flops=flops, lr=lr, duration_s=duration)
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
    def _from_args(args: Any, model: Any) -> dict[str, Any]:
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
        return {
            "model": name or None,
            "optimizer": getattr(optim, "value", optim),
            "batch_size": getattr(args, "per_device_train_batch_size", None),
            "grad_accum": getattr(args, "gradient_accumulation_steps", None),
            "precision": precision,
            "seed": getattr(args, "seed", None),
        }

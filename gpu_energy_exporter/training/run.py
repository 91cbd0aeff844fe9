"""The plain training API: ``start_run``, ``TrainingRun.step`` / ``epoch`` / ``evaluate`` / ``finish``.

The hot path (``step``) only adds to plain Python numbers: about half a microsecond. The run's
OpenTelemetry side (its own ``MeterProvider``, the instruments that read these numbers at export time, the
step-duration histogram) is ``meter.py``; what describes the run (``RunMetadata``, precision, parameters)
is ``metadata.py``; where it exports to (``ExportSettings``, and ``start_run``'s keyword form) is
``export_settings.py``, resolved by ``endpoint.py`` and ``gpus.py``.

Counting once across ranks: each rank reports what IT processed (its ``rank`` and its GPUs on every
point); the exporter, PromQL and the ledger sum over ranks. In data parallelism every rank sees distinct
tokens, so pass each rank's own counts. Where several ranks process the same tokens (tensor or pipeline
parallel groups) report tokens from one rank per data-parallel replica and 0 on the others. Where a
framework hands you a count already summed over ranks, report only your share (the Hugging Face
callback does this; see ``hf.py``). Steps are different: in data parallelism every rank takes every
optimizer step, so ``training.steps`` is per rank and is aggregated over ranks with ``max``, not ``sum``.

``step`` is meant to be called from one thread (the training loop): it takes no lock. Nothing here may
raise into the training loop because of the network, and nothing may block it: export errors are counted
in ``run.dropped_exports`` with one warning, and ``finish`` is bounded by ``finish_timeout``. This module
never calls the OpenTelemetry SDK on the hot path and never imports torch.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from gpu_energy_exporter.core import contract as I  # noqa: N812 - a namespace of constants
from gpu_energy_exporter.training.batch import add_count, number
from gpu_energy_exporter.training.distributed import rank_and_world_size, shared_run_id
from gpu_energy_exporter.training.endpoint import (
    HTTP_PROTOBUF,
    export_interval_seconds,
    resolve_endpoint,
    resolve_protocol,
)
from gpu_energy_exporter.training.export_settings import ExportSettings, run_keywords
from gpu_energy_exporter.training.gpus import resolve_gpus
from gpu_energy_exporter.training.metadata import RunMetadata, parameter_count
from gpu_energy_exporter.training.meter import RunMeter, StepDurations

log = logging.getLogger("gpu_energy_exporter.training")


class TrainingRun:
    """One training run as seen by one rank. Create it with ``start_run``."""

    def __init__(
        self,
        *,
        run_id: str,
        rank: int,
        world_size: int,
        gpu_uuids: Sequence[str],
        gpu_label: str,
        metadata: Mapping[str, Any],
        total_steps: int | None,
        start_step: int = 0,
        endpoint: str,
        headers: Mapping[str, str] | None,
        export_interval: float,
        export_timeout: float,
        finish_timeout: float,
        protocol: str = HTTP_PROTOBUF,
    ) -> None:
        """``metadata``: the attributes of ``training.run.info`` (``RunMetadata.attributes()`` and the
        counting conventions); None values are left out."""
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.gpu_uuids: tuple[str, ...] = tuple(gpu_uuids)
        self.endpoint = endpoint
        # OpenTelemetry attributes must be str, bool, int or float (a torch.dtype or numpy int is not).
        self.metadata = {k: v if isinstance(v, (str, bool, int, float)) else str(v)
                         for k, v in metadata.items() if v is not None}
        self.finish_timeout = finish_timeout
        self._pid = os.getpid()
        self._started = time.monotonic()

        # Hot-path state: plain numbers, read by the meter's callbacks at export time.
        self._tokens: int | float = 0
        self._samples: int | float = 0
        self._steps = 0
        self._flops: int | float = 0
        self._loss: Any = None
        self._lr: Any = None
        self._val_loss: Any = None
        self._epoch: Any = None
        self._total_steps = total_steps
        self._global_step = int(start_step)
        self._parameters: int | None = None
        self._finished = False
        self._last_step_at: float | None = None
        self._durations = StepDurations()

        self._attrs: dict[str, Any] = {I.ATTR_RUN_ID: run_id, I.ATTR_RANK: rank, I.ATTR_GPU_UUID: gpu_label}
        gpu_points = self.gpu_uuids or (gpu_label,)
        self._meter = RunMeter(
            readings={
                I.TOKENS: lambda: self._tokens,
                I.SAMPLES: lambda: self._samples,
                I.STEPS: lambda: self._steps,
                I.FLOPS: lambda: self._flops,
                I.LOSS: lambda: self._loss,
                I.VALIDATION_LOSS: lambda: self._val_loss,
                I.LEARNING_RATE: lambda: self._lr,
                I.EPOCH: lambda: self._epoch,
                I.GLOBAL_STEP: lambda: self._global_step,
                I.RUN_TOTAL_STEPS: lambda: self._total_steps,
                I.RUN_FINISHED: lambda: 1 if self._finished else 0,
                I.MODEL_PARAMETERS: lambda: self._parameters,
            },
            durations=self._durations,
            attributes=self._attrs,
            info_attributes={**self.metadata, "world_size": world_size, **self._attrs},
            gpu_attributes=[{**self._attrs, I.ATTR_GPU_UUID: g} for g in gpu_points],
            endpoint=endpoint,
            headers=headers,
            export_interval=export_interval,
            export_timeout=export_timeout,
            protocol=protocol,
            world_size=world_size,
        )
        self._exporter = self._meter.exporter
        # A script that never calls finish() still flushes at exit (bounded like finish()).
        atexit.register(self._at_exit)
        # Export once right away, in the background: the exporter's ledger dates the run from its first
        # point, so a first export only after export_interval would count that interval's tokens in a
        # run that, for the ledger, started later (J/token too low for short runs). Never blocks step().
        self._meter.export_soon()

    # -- the hot path -------------------------------------------------------------------------------

    def step(
        self,
        tokens: Any = 0,
        samples: int = 0,
        loss: Any = None,
        lr: Any = None,
        flops: float = 0,
        duration_s: float | None = None,
        global_step: int | None = None,
    ) -> None:
        """Record one optimizer step of this rank: the tokens and samples it processed (all micro-batches
        of the step), the FLOPs it did, and optionally the loss and learning rate.

        ``tokens`` may be an int or a 0-d integer tensor (``count_tokens(batch)``, the non-padding count):
        a tensor is summed on its device and read only at export time. ``loss`` / ``lr`` may be floats or
        0-d tensors; a tensor is detached here and converted only at export time, in the background, so
        passing one adds no device synchronisation to the step. ``duration_s`` defaults to the time since
        the previous ``step()`` (the first step then has none). ``global_step``: the trainer's step count
        after this step (progress and ETA), default one more than before (``start_run(start_step=)``).
        """
        if self._finished:
            return
        now = time.perf_counter()
        if duration_s is None:
            last = self._last_step_at
            self._last_step_at = now
            if last is not None:
                self._durations.observe(now - last)
        else:
            self._last_step_at = now
            self._durations.observe(duration_s)
        self._steps += 1
        self._global_step = self._global_step + 1 if global_step is None else global_step
        if tokens.__class__ is not int or tokens:  # never bool() a tensor: that is a device sync
            try:
                self._tokens += tokens
            except Exception:  # noqa: BLE001 - tensors on different devices; never raise into the loop
                self._tokens = add_count(self._tokens, tokens)
        if samples:
            self._samples += samples
        if flops:
            self._flops += flops
        if loss is not None:
            # Detaching (0.4 µs) keeps us from holding the step's autograd graph until the next step.
            detach = getattr(loss, "detach", None)
            self._loss = loss if detach is None else detach()
        if lr is not None:
            self._lr = lr


    def add(self, tokens: Any = 0, samples: int = 0, flops: float = 0) -> None:
        """Count work that is not a whole step (a final partial gradient accumulation, FLOPs a trainer
        reports late): added to the totals, the step count is unchanged."""
        if self._finished:
            return
        self._tokens = add_count(self._tokens, tokens)
        if samples:
            self._samples += samples
        if flops:
            self._flops += flops

    def log(self, loss: Any = None, lr: Any = None) -> None:
        """Update the latest loss and/or learning rate without counting a step."""
        if loss is not None:
            detach = getattr(loss, "detach", None)
            self._loss = loss if detach is None else detach()
        if lr is not None:
            self._lr = lr

    def epoch(self, epoch: float, val_loss: Any = None) -> None:
        """Record the epochs completed so far (may be fractional) and optionally a validation loss."""
        self._epoch = epoch
        if val_loss is not None:
            self._val_loss = val_loss

    def evaluate(self, val_loss: Any) -> None:
        """Record a validation loss."""
        self._val_loss = val_loss

    def set_total_steps(self, total_steps: int | None) -> None:
        """The number of optimizer steps the training plans to take in all, steps before a resume
        included (progress is ``global_step / total_steps``)."""
        self._total_steps = total_steps

    def set_global_step(self, global_step: int) -> None:
        """The trainer's optimizer step count, steps before a resume included (``training.global_step``)."""
        self._global_step = int(global_step)

    def set_parameters(self, parameters: int | None) -> None:
        """The whole model's parameter count (``training.model.parameters``, for TT and ST); pass the same
        value on every rank, also where each rank holds only a shard (FSDP, ZeRO-3, tensor parallelism)."""
        self._parameters = parameter_count(parameters)

    @property
    def parameters(self) -> int | None:
        return self._parameters

    # -- totals -------------------------------------------------------------------------------------

    @property
    def tokens(self) -> int | float:
        """Tokens so far (reading a device-side total synchronises with the device)."""
        return number(self._tokens)

    @property
    def samples(self) -> int | float:
        return self._samples

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def global_step(self) -> int:
        return self._global_step

    @property
    def flops(self) -> int | float:
        return self._flops

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def dropped_exports(self) -> int:
        """Exports that did not reach the endpoint (unreachable, refused, timed out)."""
        return self._exporter.dropped

    @property
    def delivered_exports(self) -> int:
        """Exports the endpoint accepted."""
        return self._exporter.delivered

    @property
    def rejected_points(self) -> int:
        """Data points the endpoint rejected from exports it otherwise accepted (OTLP partial success)."""
        return self._exporter.rejected_points

    # -- ending -------------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Export now, in the calling thread (blocks up to ``timeout``, default ``finish_timeout``).
        Returns whether the export reached the endpoint."""
        if self._finished or os.getpid() != self._pid:
            return False
        before = self._exporter.delivered
        self._meter.flush(self.finish_timeout if timeout is None else timeout)
        return self._exporter.delivered > before

    def finish(self, timeout: float | None = None) -> None:
        """Mark the run finished, push the final totals and stop the background exporter.

        Returns within about ``timeout`` seconds (default ``finish_timeout``) even when the endpoint is
        unreachable. Idempotent; ``step()`` calls after it are ignored.
        """
        if self._finished or os.getpid() != self._pid:
            return
        self._finished = True
        atexit.unregister(self._at_exit)
        limit = self.finish_timeout if timeout is None else timeout
        if self._exporter.failing:
            # The endpoint did not answer the last export: give the final one a short chance only,
            # rather than the whole bound spent waiting between the SDK's retries.
            limit = min(limit, 1.0)
        # The reader collects once more on shutdown: that export carries training.run.finished = 1.
        self._meter.shutdown(limit)
        log.info(
            "gpu_energy_exporter.training: run %s rank %d finished after %.1fs: %s steps, %s tokens, "
            "%s samples (%d exports delivered, %d dropped)", self.run_id, self.rank,
            time.monotonic() - self._started, self._steps, self.tokens, self._samples,
            self._exporter.delivered, self._exporter.dropped,
        )

    def _at_exit(self) -> None:
        self.finish()

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish()

    def __repr__(self) -> str:
        return (f"TrainingRun(run_id={self.run_id!r}, rank={self.rank}, world_size={self.world_size}, "
                f"gpu_uuids={self.gpu_uuids!r}, endpoint={self.endpoint!r}, finished={self._finished})")


def start_run(
    run_id: str | None = None,
    *,
    metadata: RunMetadata | None = None,
    export: ExportSettings | None = None,
    **fields: Any,
) -> TrainingRun:
    """Start reporting a training run to the exporter (or any OTLP endpoint).

    ``run_id``: shared by all ranks; generated when omitted (see ``distributed.py``; in a multi-rank run
    with an initialised process group, call this on every rank). ``metadata``: what describes the run
    (``RunMetadata``: model, backend ... notes become the attributes of ``training.run.info`` and the
    columns of the exporter's run ledger; total and start steps, parameter count, counting conventions).
    ``export``: where it reports and what placement labels its points (``ExportSettings``: endpoint,
    headers, export interval and timeouts, GPUs, rank, world size). Any field of either may be given by
    name instead, replacing the object's: ``start_run(model="x", endpoint=url)`` is
    ``start_run(metadata=RunMetadata(model="x"), export=ExportSettings(endpoint=url))``.
    """
    meta, settings = run_keywords(start_run, metadata, export, fields)
    env = os.environ if settings.environ is None else settings.environ
    detected_rank, detected_world = rank_and_world_size(env)
    rank = detected_rank if settings.rank is None else int(settings.rank)
    world_size = detected_world if settings.world_size is None else int(settings.world_size)
    resolution = resolve_gpus(settings.gpu_uuids, device=settings.device, world_size=world_size, environ=env)
    protocol = resolve_protocol(env)
    run = TrainingRun(
        run_id=shared_run_id(run_id, world_size, env),
        rank=rank,
        world_size=world_size,
        gpu_uuids=resolution.uuids,
        gpu_label=resolution.label,
        metadata=meta.attributes(),
        total_steps=meta.total_steps,
        start_step=int(meta.start_step or 0),
        endpoint=resolve_endpoint(settings.endpoint, env, protocol),
        protocol=protocol,
        headers=settings.headers,
        export_interval=export_interval_seconds(settings.export_interval, env),
        export_timeout=settings.export_timeout,
        finish_timeout=settings.finish_timeout,
    )
    run.set_parameters(meta.parameters)
    log.info("gpu_energy_exporter.training: run %s rank %d/%d on GPUs %s (%s) reporting to %s",
             run.run_id, rank, world_size, resolution.label, resolution.source, run.endpoint)
    return run

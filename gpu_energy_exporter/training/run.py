"""The plain training API: ``start_run``, ``TrainingRun.step`` / ``epoch`` / ``evaluate`` / ``finish``.

A run owns an OpenTelemetry ``MeterProvider`` (never the global one, so it cannot clash with the
application's own telemetry) whose periodic reader exports over OTLP/HTTP protobuf in a background
thread. The hot path (``step``) only adds to plain Python numbers: about half a microsecond, where an
SDK synchronous instrument costs about 9 µs per call. Observable instruments read those numbers when the
reader collects, and the step-duration histogram is aggregated here and appended to each export (see
``export.py``). Everything is cumulative, so a dropped export loses nothing.

Counting once across ranks: each rank reports what IT processed (its ``rank`` and its GPUs on every
point); the exporter, PromQL and the ledger sum over ranks. In data parallelism every rank sees distinct
tokens, so pass each rank's own counts. Where several ranks process the same tokens (tensor or pipeline
parallel groups) report tokens from one rank per data-parallel replica and 0 on the others. Where a
framework hands you a count already summed over ranks, report only your share (the Hugging Face
callback does this; see ``hf.py``). Steps are different: in data parallelism every rank takes every
optimizer step, so ``training.steps`` is per rank and is aggregated over ranks with ``max``, not ``sum``.

``step`` is meant to be called from one thread (the training loop): it takes no lock. Nothing here may
raise into the training loop because of the network, and nothing may block it: export errors are counted
in ``run.dropped_exports`` with one warning, and ``finish`` is bounded by ``finish_timeout``.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

try:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Histogram,
        HistogramDataPoint,
        Metric,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "gpu_energy_exporter.training needs the OpenTelemetry SDK and OTLP/HTTP exporter: "
        "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http (both come with the base install of "
        "gpu-energy-exporter: pip install . in a checkout)"
    ) from exc

from gpu_energy_exporter import __version__
from gpu_energy_exporter.core import contract as I  # noqa: N812 - a namespace of constants
from gpu_energy_exporter.training.batch import add_count, number
from gpu_energy_exporter.training.distributed import rank_and_world_size, shared_run_id
from gpu_energy_exporter.training.export import GuardedExporter, ObservedSession
from gpu_energy_exporter.training.gpus import resolve_gpus

log = logging.getLogger("gpu_energy_exporter.training")

DEFAULT_ENDPOINT = "http://localhost:4318"
METRICS_PATH = "/v1/metrics"
#: Default seconds between exports: live enough for a 15 s Prometheus scrape, cheap for the trainer.
DEFAULT_EXPORT_INTERVAL = 10.0
#: Default seconds one export may take, retries included (the SDK retries transient errors). Short on
#: purpose: every export carries cumulative totals, so the next periodic export is the real retry.
DEFAULT_EXPORT_TIMEOUT = 3.0
#: Default bound on ``finish()``: the final export gets this long, then the run is closed regardless.
DEFAULT_FINISH_TIMEOUT = 5.0


def resolve_endpoint(endpoint: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The full ``.../v1/metrics`` URL, from the argument or the standard OpenTelemetry variables.

    ``endpoint`` and ``OTEL_EXPORTER_OTLP_ENDPOINT`` are base URLs (``/v1/metrics`` is appended unless
    already there); ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` is used as is, as the specification says.
    """
    env = os.environ if environ is None else environ
    if endpoint:
        return _with_path(endpoint)
    if env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"].strip()
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _with_path(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return DEFAULT_ENDPOINT + METRICS_PATH


def _with_path(base: str) -> str:
    base = base.strip()
    if "://" not in base:
        base = "http://" + base
    if base.rstrip("/").endswith(METRICS_PATH):
        return base.rstrip("/")
    return base.rstrip("/") + METRICS_PATH


def _export_interval(value: float | None, environ: Mapping[str, str]) -> float:
    if value is not None:
        if not value > 0:
            raise ValueError(f"export_interval must be a positive number of seconds, got {value!r}")
        return float(value)
    raw = environ.get("OTEL_METRIC_EXPORT_INTERVAL")  # milliseconds, per the specification
    if raw:
        try:
            ms = float(raw)
            if ms > 0:
                return ms / 1000.0
        except ValueError:
            pass
        log.warning("gpu_energy_exporter.training: ignoring OTEL_METRIC_EXPORT_INTERVAL=%r (milliseconds "
                    "expected)", raw)
    return DEFAULT_EXPORT_INTERVAL


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
    ) -> None:
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
        self._started_ns = time.time_ns()
        self._started = time.monotonic()

        # Hot-path state: plain numbers, read by the SDK's callbacks at export time.
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
        self._bounds = I.STEP_DURATION_BOUNDS
        self._buckets = [0] * (len(self._bounds) + 1)
        self._duration_sum = 0.0
        self._duration_min = math.inf
        self._duration_max = -math.inf

        self._attrs: dict[str, Any] = {I.ATTR_RUN_ID: run_id, I.ATTR_RANK: rank, I.ATTR_GPU_UUID: gpu_label}
        self._info_attrs = {**self.metadata, "world_size": world_size, **self._attrs}
        gpu_points = self.gpu_uuids or (gpu_label,)
        self._gpu_attrs = [{**self._attrs, I.ATTR_GPU_UUID: g} for g in gpu_points]

        self._resource = Resource.create({
            "service.name": I.SERVICE_NAME,
            "service.instance.id": str(uuid.uuid4()),
            "service.version": __version__,
            "host.name": socket.gethostname(),
            "process.pid": self._pid,
        })
        self._scope = InstrumentationScope(I.SCOPE_NAME, __version__)
        self._export_timeout = export_timeout
        session = ObservedSession()
        inner = OTLPMetricExporter(endpoint=endpoint, headers=dict(headers) if headers else None,
                                   timeout=export_timeout, session=session)
        self._exporter = GuardedExporter(inner, endpoint=endpoint, resource=self._resource,
                                         scope=self._scope, extra=self._extra_metrics, session=session,
                                         timeout=export_timeout)
        reader = PeriodicExportingMetricReader(
            self._exporter,
            export_interval_millis=export_interval * 1000.0,
            export_timeout_millis=max(export_timeout, export_interval) * 1000.0,
        )
        self._provider = MeterProvider(metric_readers=[reader], resource=self._resource, shutdown_on_exit=False)
        meter = self._provider.get_meter(I.SCOPE_NAME, __version__)
        observers = {
            I.TOKENS: self._observe_tokens,
            I.SAMPLES: self._observe_samples,
            I.STEPS: self._observe_steps,
            I.FLOPS: self._observe_flops,
            I.LOSS: self._observe_loss,
            I.VALIDATION_LOSS: self._observe_val_loss,
            I.LEARNING_RATE: self._observe_lr,
            I.EPOCH: self._observe_epoch,
            I.RUN_INFO: self._observe_info,
            I.RUN_GPU_INFO: self._observe_gpu_info,
            I.GLOBAL_STEP: self._observe_global_step,
            I.RUN_TOTAL_STEPS: self._observe_total_steps,
            I.RUN_FINISHED: self._observe_finished,
            I.MODEL_PARAMETERS: self._observe_parameters,
        }
        for inst, callback in observers.items():
            create = meter.create_observable_counter if inst.kind == "counter" else meter.create_observable_gauge
            create(inst.name, callbacks=[callback], unit=inst.unit, description=inst.description)
        # A script that never calls finish() still flushes at exit (bounded like finish()).
        atexit.register(self._at_exit)
        # Export once right away, in the background: the exporter's ledger dates the run from its first
        # point, so a first export only after export_interval would count that interval's tokens in a
        # run that, for the ledger, started later (J/token too low for short runs). Never blocks step().
        threading.Thread(target=self._first_export, name="gpu-energy-first-export", daemon=True).start()

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
                self._observe_duration(now - last)
        else:
            self._last_step_at = now
            self._observe_duration(duration_s)
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

    def _observe_duration(self, seconds: float) -> None:
        if not seconds >= 0:  # negative or NaN: a caller's clock mistake must not poison the sum
            return
        self._buckets[bisect_left(self._bounds, seconds)] += 1
        self._duration_sum += seconds
        if seconds < self._duration_min:
            self._duration_min = seconds
        if seconds > self._duration_max:
            self._duration_max = seconds

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
        self._parameters = _parameter_count(parameters)

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

    def _first_export(self) -> None:
        try:
            self._provider.force_flush(timeout_millis=self._export_timeout * 1000.0)
        except Exception:  # noqa: BLE001 - best effort; the periodic export follows anyway
            log.debug("first export failed", exc_info=True)

    def flush(self, timeout: float | None = None) -> bool:
        """Export now, in the calling thread (blocks up to ``timeout``, default ``finish_timeout``).
        Returns whether the export reached the endpoint."""
        if self._finished or os.getpid() != self._pid:
            return False
        before = self._exporter.delivered
        limit = self.finish_timeout if timeout is None else timeout
        try:
            self._provider.force_flush(timeout_millis=limit * 1000.0)
        except Exception:  # noqa: BLE001 - flushing is best effort
            log.debug("flush failed", exc_info=True)
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
        try:
            # The reader collects once more on shutdown: that export carries training.run.finished = 1.
            self._provider.shutdown(timeout_millis=max(limit, 0.001) * 1000.0)
        except Exception:  # noqa: BLE001 - a failed final export is already counted
            log.debug("meter provider shutdown failed", exc_info=True)
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

    # -- SDK callbacks (background thread) ----------------------------------------------------------

    def _alive(self) -> bool:
        # After a fork (DataLoader workers) the child's copy must stay silent.
        return os.getpid() == self._pid

    def _counter(self, value: Any) -> Iterable[Observation]:
        if not self._alive():
            return ()
        if value.__class__ not in (int, float):
            try:
                value = number(value)  # a device tensor is synchronised here, in the export thread
            except Exception:  # noqa: BLE001 - a value we cannot read is skipped, never raised
                log.debug("cannot convert %r to a number", type(value), exc_info=True)
                return ()
        return (Observation(value, self._attrs),)

    def _gauge(self, value: Any) -> Iterable[Observation]:
        if value is None or not self._alive():
            return ()
        try:
            if hasattr(value, "detach"):
                value = value.detach()  # float() of a tensor that requires grad warns
            number = float(value)  # a device tensor is synchronised here, in the export thread
        except Exception:  # noqa: BLE001 - a value we cannot read is skipped, never raised
            log.debug("cannot convert %r to a number", type(value), exc_info=True)
            return ()
        return (Observation(number, self._attrs),)

    def _observe_tokens(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._counter(self._tokens)

    def _observe_samples(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._counter(self._samples)

    def _observe_steps(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._counter(self._steps)

    def _observe_flops(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._counter(self._flops)

    def _observe_loss(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(self._loss)

    def _observe_val_loss(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(self._val_loss)

    def _observe_lr(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(self._lr)

    def _observe_epoch(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(self._epoch)

    def _observe_global_step(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(self._global_step)

    def _observe_total_steps(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(self._total_steps)

    def _observe_finished(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(1 if self._finished else 0)

    def _observe_parameters(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._gauge(self._parameters)

    def _observe_info(self, options: CallbackOptions) -> Iterable[Observation]:
        return (Observation(1, self._info_attrs),) if self._alive() else ()

    def _observe_gpu_info(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1, a) for a in self._gpu_attrs] if self._alive() else ()

    def _extra_metrics(self) -> list[Metric]:
        """The step-duration histogram, cumulative since the run started."""
        buckets = list(self._buckets)  # one consistent snapshot: count is derived from it
        count = sum(buckets)
        if count == 0:
            return []
        point = HistogramDataPoint(
            attributes=self._attrs,
            start_time_unix_nano=self._started_ns,
            time_unix_nano=time.time_ns(),
            count=count,
            sum=self._duration_sum,
            bucket_counts=buckets,
            explicit_bounds=list(self._bounds),
            min=self._duration_min,
            max=self._duration_max,
        )
        data = Histogram(data_points=[point], aggregation_temporality=AggregationTemporality.CUMULATIVE)
        inst = I.STEP_DURATION
        return [Metric(name=inst.name, description=inst.description, unit=inst.unit, data=data)]


def start_run(
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
    total_steps: int | None = None,
    start_step: int = 0,
    parameters: int | None = None,
    padding: str | None = None,
    flops: str | None = None,
    precision_raw: str | None = None,
    endpoint: str | None = None,
    headers: Mapping[str, str] | None = None,
    export_interval: float | None = None,
    export_timeout: float = DEFAULT_EXPORT_TIMEOUT,
    finish_timeout: float = DEFAULT_FINISH_TIMEOUT,
    gpu_uuids: Sequence[str] | None = None,
    device: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> TrainingRun:
    """Start reporting a training run to the exporter (or any OTLP/HTTP endpoint).

    ``run_id``: shared by all ranks; generated when omitted (see ``distributed.py``; in a multi-rank run
    with an initialised process group, call this on every rank). Metadata (``model`` ... ``notes``)
    becomes the attributes of ``training.run.info`` and the columns of the exporter's run ledger;
    ``precision`` is normalised to one of ``bf16``, ``fp16``, ``fp8``, ``tf32``, ``fp32`` (see
    ``normalize_precision``; what was given, or ``precision_raw`` (what a framework said, when ``precision``
    was derived from it), goes to the ``precision_raw`` attribute when it differs; an unknown value goes only
    there). ``parameters``: the whole model's parameter count (``count_parameters(model)``), for TT and ST.
    ``total_steps``: the optimizer steps of the whole training; ``start_step``: the step a resumed run
    starts from (``training.global_step`` counts on from there, so progress and the energy still to spend
    are right after a resume). ``padding`` (``"excluded"`` or ``"included"``) and ``flops``
    (``"trainable"`` or ``"total"``) say how your ``step()`` counts tokens and FLOPs (``count_tokens``,
    ``flops_per_token``); they label ``training.run.info`` so figures are never compared across
    conventions unawares.
    ``endpoint``: base URL of the receiver; default ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT``, else ``http://localhost:4318``. ``headers``: extra HTTP headers
    (e.g. ``{"Authorization": "Bearer ..."}``); default ``OTEL_EXPORTER_OTLP_HEADERS``.
    ``export_interval`` seconds between background exports (default ``OTEL_METRIC_EXPORT_INTERVAL`` or
    10 s). ``gpu_uuids`` / ``device`` pin the GPUs (see ``gpus.py``); ``rank`` / ``world_size`` override
    what ``torch.distributed`` or ``RANK`` / ``WORLD_SIZE`` say.
    """
    env = os.environ if environ is None else environ
    if padding is not None and padding not in (I.PADDING_EXCLUDED, I.PADDING_INCLUDED):
        raise ValueError(f"padding must be {I.PADDING_EXCLUDED!r} or {I.PADDING_INCLUDED!r}, got {padding!r}")
    if flops is not None and flops not in (I.FLOPS_TRAINABLE, I.FLOPS_TOTAL):
        raise ValueError(f"flops must be {I.FLOPS_TRAINABLE!r} or {I.FLOPS_TOTAL!r}, got {flops!r}")
    detected_rank, detected_world = rank_and_world_size(env)
    rank = detected_rank if rank is None else int(rank)
    world_size = detected_world if world_size is None else int(world_size)
    resolution = resolve_gpus(gpu_uuids, device=device, world_size=world_size, environ=env)
    run = TrainingRun(
        run_id=shared_run_id(run_id, world_size, env),
        rank=rank,
        world_size=world_size,
        gpu_uuids=resolution.uuids,
        gpu_label=resolution.label,
        metadata={
            "model": model, "backend": backend, "optimizer": optimizer, "batch_size": batch_size,
            "grad_accum": grad_accum, "seq_len": seq_len, **precision_attributes(precision, precision_raw),
            "seed": seed,
            "notes": notes,
            "padding": padding,
            "flops": flops,
        },
        total_steps=total_steps,
        start_step=int(start_step or 0),
        endpoint=resolve_endpoint(endpoint, env),
        headers=headers,
        export_interval=_export_interval(export_interval, env),
        export_timeout=export_timeout,
        finish_timeout=finish_timeout,
    )
    run.set_parameters(parameters)
    log.info("gpu_energy_exporter.training: run %s rank %d/%d on GPUs %s (%s) reporting to %s",
             run.run_id, rank, world_size, resolution.label, resolution.source, run.endpoint)
    return run


# -- precision and parameters -----------------------------------------------------------------------

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
    """The run's compute precision as one of ``instruments.PRECISIONS`` (``bf16``, ``fp16``, ``fp8``,
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
            return _parameter_count(num_parameters())
        return _parameter_count(sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in model.parameters()))
    except Exception:  # noqa: BLE001 - an odd model must not stop the run from being reported
        log.debug("cannot count the parameters of %r", type(model), exc_info=True)
        return None


def _parameter_count(value: Any) -> int | None:
    if value is None:
        return None
    try:
        count = int(value)
    except (TypeError, ValueError):
        log.warning("gpu_energy_exporter.training: ignoring parameters=%r (a whole number expected)", value)
        return None
    return count if count > 0 else None

"""A run's OpenTelemetry side: its own ``MeterProvider``, the observable instruments of the training
contract and the step-duration histogram, exported over OTLP/HTTP protobuf by a background reader.

A run owns its ``MeterProvider`` (never the global one, so it cannot clash with the application's own
telemetry); the periodic reader exports in a background thread through ``export.GuardedExporter``.
Observable instruments read the run's plain numbers (the ``readings`` callables) when the reader
collects, so the training loop never calls the SDK: an SDK synchronous instrument costs about 9 µs per
call. The step-duration histogram is aggregated by ``StepDurations`` (a bucket increment in the loop) and
appended to each export. Everything is cumulative, so a dropped export loses nothing.

Names, kinds, units and attributes come from ``core.contract``. This module must never raise into the
training loop or the SDK's reader thread (a value that cannot be read is skipped), never block the loop
(exports run in the reader's thread), and never export from a forked child (DataLoader workers).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
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
        MetricExporter,
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
from gpu_energy_exporter.core.procinfo import parse_cgroup
from gpu_energy_exporter.training.batch import number
from gpu_energy_exporter.training.endpoint import GRPC, HTTP_PROTOBUF, METRICS_PATH, UNIX, unix_path
from gpu_energy_exporter.training.export import GuardedExporter, ObservedSession
from gpu_energy_exporter.training.unixsock import UNIX_URL, UnixAdapter

log = logging.getLogger("gpu_energy_exporter.training")

#: The observable instruments, in the order they are created (and exported). ``RUN_INFO`` and
#: ``RUN_GPU_INFO`` are always 1 and carry the run's attributes; the others read the run's numbers.
OBSERVED: tuple[I.Instrument, ...] = (
    I.TOKENS, I.SAMPLES, I.STEPS, I.FLOPS, I.LOSS, I.VALIDATION_LOSS, I.LEARNING_RATE, I.EPOCH, I.RUN_INFO,
    I.RUN_GPU_INFO, I.GLOBAL_STEP, I.RUN_TOTAL_STEPS, I.RUN_FINISHED, I.MODEL_PARAMETERS,
)


class StepDurations:
    """The cumulative step-duration histogram, aggregated here (a bucket increment per step) because an
    SDK histogram ``record()`` costs more than the whole per-step budget. Written by the training loop,
    read by the export thread without a lock: the buckets are copied once per export."""

    def __init__(self, bounds: Sequence[float] = I.STEP_DURATION_BOUNDS) -> None:
        self.bounds = tuple(bounds)
        self.buckets = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    def observe(self, seconds: float) -> None:
        if not seconds >= 0:  # negative or NaN: a caller's clock mistake must not poison the sum
            return
        self.buckets[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds
        if seconds < self.min:
            self.min = seconds
        if seconds > self.max:
            self.max = seconds

    def metrics(self, attributes: Mapping[str, Any], start_time_unix_nano: int) -> list[Metric]:
        """``training.step.duration`` as one cumulative histogram point, or nothing before the first step."""
        buckets = list(self.buckets)  # one consistent snapshot: count is derived from it
        count = sum(buckets)
        if count == 0:
            return []
        point = HistogramDataPoint(
            attributes=attributes,
            start_time_unix_nano=start_time_unix_nano,
            time_unix_nano=time.time_ns(),
            count=count,
            sum=self.sum,
            bucket_counts=buckets,
            explicit_bounds=list(self.bounds),
            min=self.min,
            max=self.max,
        )
        data = Histogram(data_points=[point], aggregation_temporality=AggregationTemporality.CUMULATIVE)
        inst = I.STEP_DURATION
        return [Metric(name=inst.name, description=inst.description, unit=inst.unit, data=data)]


def _grpc_exporter(endpoint: str, headers: Mapping[str, str] | None, timeout: float) -> MetricExporter:
    """The SDK's OTLP/gRPC metric exporter (``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``): plain text for ``http://``,
    TLS for ``https://`` (the SDK reads ``OTEL_EXPORTER_OTLP_CERTIFICATE``); its failures are reported from the
    SDK's own messages, and partial success is not read (the SDK's gRPC exporter does not hand it over)."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GRPCExporter
    except ImportError as exc:  # pragma: no cover - depends on the installed packages
        raise ImportError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc "
                          "(in the base install of gpu-energy-exporter): pip install "
                          "opentelemetry-exporter-otlp-proto-grpc, or push over HTTP (unset it)") from exc
    # gRPC metadata keys are lower case
    metadata = {k.lower(): v for k, v in headers.items()} if headers else None
    if endpoint.startswith(UNIX):  # grpcio takes unix: targets as they are (unix:///path)
        return GRPCExporter(endpoint="unix://" + unix_path(endpoint), insecure=True, headers=metadata, timeout=timeout)
    return GRPCExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"), headers=metadata,
                        timeout=timeout)


class RunMeter:
    """The ``MeterProvider`` of one run and its instruments.

    ``readings`` maps each instrument of ``OBSERVED`` but the two info instruments to a callable returning
    the run's current value (a number, a tensor read here in the export thread, or None: no point).
    ``attributes`` go on every point; ``info_attributes`` on ``training.run.info``; ``gpu_attributes``
    one ``training.run.gpu.info`` point each.
    """

    def __init__(
        self,
        *,
        readings: Mapping[I.Instrument, Callable[[], Any]],
        durations: StepDurations,
        attributes: Mapping[str, Any],
        info_attributes: Mapping[str, Any],
        gpu_attributes: Sequence[Mapping[str, Any]],
        endpoint: str,
        headers: Mapping[str, str] | None,
        export_interval: float,
        export_timeout: float,
        protocol: str = HTTP_PROTOBUF,
        world_size: int = 1,
    ) -> None:
        self._pid = os.getpid()
        self._started_ns = time.time_ns()
        self._durations = durations
        self._attrs = attributes
        self._info_attrs = info_attributes
        self._gpu_attrs = gpu_attributes
        self._export_timeout = export_timeout
        self.resource = Resource.create({
            "service.name": I.SERVICE_NAME,
            "service.instance.id": str(uuid.uuid4()),
            "service.version": __version__,
            "host.name": socket.gethostname(),
            "process.pid": self._pid,
            **process_identity(world_size),
        })
        self.scope = InstrumentationScope(I.SCOPE_NAME, __version__)
        session: ObservedSession | None = None
        inner: MetricExporter
        if protocol == GRPC:
            inner = _grpc_exporter(endpoint, headers, export_timeout)
        else:
            session = ObservedSession()
            url = endpoint
            if endpoint.startswith(UNIX):  # the exporter's Unix socket: identified by the kernel (docs/security.md)
                session.mount(UNIX_URL, UnixAdapter(unix_path(endpoint)))
                url = UNIX_URL + METRICS_PATH
            inner = OTLPMetricExporter(endpoint=url, headers=dict(headers) if headers else None,
                                       timeout=export_timeout, session=session)
        self.exporter = GuardedExporter(inner, endpoint=endpoint, resource=self.resource, scope=self.scope,
                                        extra=self._extra_metrics, session=session, timeout=export_timeout)
        reader = PeriodicExportingMetricReader(
            self.exporter,
            export_interval_millis=export_interval * 1000.0,
            export_timeout_millis=max(export_timeout, export_interval) * 1000.0,
        )
        self._provider = MeterProvider(metric_readers=[reader], resource=self.resource, shutdown_on_exit=False)
        meter = self._provider.get_meter(I.SCOPE_NAME, __version__)
        for inst in OBSERVED:
            callback: Callable[[CallbackOptions], Iterable[Observation]]
            if inst is I.RUN_INFO:
                callback = self._observe_info
            elif inst is I.RUN_GPU_INFO:
                callback = self._observe_gpu_info
            else:
                callback = self._observer(readings[inst], counter=inst.kind == "counter")
            create = meter.create_observable_counter if inst.kind == "counter" else meter.create_observable_gauge
            create(inst.name, callbacks=[callback], unit=inst.unit, description=inst.description)

    # -- exporting ----------------------------------------------------------------------------------

    def export_soon(self) -> None:
        """Export once right away, in a background thread (never blocks the caller)."""
        threading.Thread(target=self._first_export, name="gpu-energy-first-export", daemon=True).start()

    def _first_export(self) -> None:
        try:
            self._provider.force_flush(timeout_millis=self._export_timeout * 1000.0)
        except Exception:  # noqa: BLE001 - best effort; the periodic export follows anyway
            log.debug("first export failed", exc_info=True)

    def flush(self, timeout: float) -> None:
        """Export now, in the calling thread, for at most ``timeout`` seconds."""
        try:
            self._provider.force_flush(timeout_millis=timeout * 1000.0)
        except Exception:  # noqa: BLE001 - flushing is best effort
            log.debug("flush failed", exc_info=True)

    def shutdown(self, timeout: float) -> None:
        """Collect and export a last time, then stop the reader (bounded by ``timeout`` seconds)."""
        try:
            self._provider.shutdown(timeout_millis=max(timeout, 0.001) * 1000.0)
        except Exception:  # noqa: BLE001 - a failed final export is already counted
            log.debug("meter provider shutdown failed", exc_info=True)

    # -- SDK callbacks (background thread) ----------------------------------------------------------

    def _alive(self) -> bool:
        # After a fork (DataLoader workers) the child's copy must stay silent.
        return os.getpid() == self._pid

    def _observer(self, read: Callable[[], Any], *, counter: bool) -> Callable[[CallbackOptions],
                                                                                  Iterable[Observation]]:
        convert = self._counter if counter else self._gauge

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return convert(read())

        return observe

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
            as_float = float(value)  # a device tensor is synchronised here, in the export thread
        except Exception:  # noqa: BLE001 - a value we cannot read is skipped, never raised
            log.debug("cannot convert %r to a number", type(value), exc_info=True)
            return ()
        return (Observation(as_float, self._attrs),)

    def _observe_info(self, options: CallbackOptions) -> Iterable[Observation]:
        return (Observation(1, self._info_attrs),) if self._alive() else ()

    def _observe_gpu_info(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1, a) for a in self._gpu_attrs] if self._alive() else ()

    def _extra_metrics(self) -> list[Metric]:
        """The step-duration histogram, cumulative since the run started."""
        return self._durations.metrics(self._attrs, self._started_ns)


def process_identity(world_size: int, environ: Mapping[str, str] | None = None,
                     cgroup_path: str = "/proc/self/cgroup") -> dict[str, Any]:
    """Resource attributes that tie this process's pushes to what NVML lists and to its job: the container
    and pod it runs in (its own cgroup; absent where the cgroup namespace hides them), and the job identity
    every rank of one job shares (Slurm's job id, torchrun's rendezvous id or master address, world size).
    The exporter charges a run only for GPUs on which NVML lists one of its processes, and merges a new
    process into a run only when this identity agrees (docs/ledger.md)."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {I.RESOURCE_WORLD_SIZE: int(world_size)}
    try:
        with open(cgroup_path, encoding="utf-8", errors="replace") as f:
            pod, container = parse_cgroup(f.read(16384))
    except OSError:
        pod = container = ""
    if container:
        out[I.RESOURCE_CONTAINER_ID] = container
    if pod:
        out[I.RESOURCE_POD_UID] = pod
    if env.get("SLURM_JOB_ID"):
        out[I.RESOURCE_SLURM_JOB_ID] = env["SLURM_JOB_ID"]
    job = env.get("TORCHELASTIC_RUN_ID") or (
        f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '')}" if env.get("MASTER_ADDR") and int(world_size) > 1 else "")
    if job:
        out[I.RESOURCE_JOB_ID] = job
    return out

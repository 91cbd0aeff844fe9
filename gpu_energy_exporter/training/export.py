"""The exporter between the OpenTelemetry SDK's periodic reader and the OTLP/HTTP exporter.

It exists so that an unreachable endpoint never disturbs training:

- every failed export is counted (``dropped``) and the first one is reported with ONE warning that says
  what to do; recovery is logged at info, later failures at debug;
- the SDK's own log records for our exports (one error per export plus one warning per retry) are
  captured, not printed: a filter on the SDK loggers drops records emitted by the thread that is running
  one of our exports, so other OpenTelemetry exporters in the same process keep their logs;
- after a ``fork`` (DataLoader workers) the child never exports: its copy of the run holds stale totals
  that would make the cumulative counters jump backwards at the receiver;
- metrics the SDK cannot produce cheaply are appended to each batch (``extra``): the step-duration
  histogram, which the run aggregates itself because an SDK histogram ``record()`` costs about 9 µs,
  more than the whole per-step budget.

Every instrument is exported with cumulative temporality whatever
``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`` says: with cumulative totals an export that is
dropped loses nothing, the next one carries the totals.

This module must never raise into the SDK's reader thread and never log more than the one warning.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

log = logging.getLogger("gpu_energy_exporter.training")

CUMULATIVE: dict[type, AggregationTemporality] = {
    kind: AggregationTemporality.CUMULATIVE
    for kind in (Counter, UpDownCounter, Histogram, ObservableCounter, ObservableUpDownCounter, ObservableGauge)
}

# Loggers the SDK uses on the export path (the HTTP client logs through the metric exporter's logger).
_SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder",
    "opentelemetry.exporter.otlp.proto.common._internal",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.sdk.metrics._internal.export",
    "urllib3.connectionpool",
)

_exporting = threading.local()
_filter_lock = threading.Lock()
_filter_installed = False


class _CaptureOurExports(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        guard: GuardedExporter | None = getattr(_exporting, "guard", None)
        if guard is None:
            return True
        guard._note(record)
        return False


def _install_filter() -> None:
    global _filter_installed
    with _filter_lock:
        if _filter_installed:
            return
        capture = _CaptureOurExports()
        for name in _SDK_LOGGERS:
            logging.getLogger(name).addFilter(capture)
        _filter_installed = True


class GuardedExporter(MetricExporter):
    """Wraps an OTLP metric exporter: counts failures, logs once, adds ``extra`` metrics to each batch."""

    def __init__(
        self,
        inner: MetricExporter,
        *,
        endpoint: str,
        resource: Resource,
        scope: InstrumentationScope,
        extra: Callable[[], Sequence[Metric]] = lambda: (),
    ) -> None:
        super().__init__(preferred_temporality=CUMULATIVE)
        self._inner = inner
        self._endpoint = endpoint
        self._resource = resource
        self._scope = scope
        self._extra = extra
        self._pid = os.getpid()
        self._shut = False
        self._warned = False
        self._failing = False
        self._reasons: list[str] = []
        #: Exports that did not reach the endpoint (each a whole batch of this run's points).
        self.dropped = 0
        #: Exports the endpoint accepted.
        self.delivered = 0
        _install_filter()

    @property
    def failing(self) -> bool:
        """Whether the last export failed (the endpoint is unreachable right now)."""
        return self._failing

    # -- the SDK calls these ------------------------------------------------------------------------

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if os.getpid() != self._pid:
            return MetricExportResult.SUCCESS  # a forked child: the parent owns this run's series
        if self._shut:
            self.dropped += 1
            return MetricExportResult.FAILURE
        self._reasons = []
        _exporting.guard = self
        try:
            result = self._inner.export(self._with_extra(metrics_data), timeout_millis=timeout_millis)
        except Exception as exc:  # noqa: BLE001 - the reader thread must survive anything
            self._reasons.append(repr(exc))
            result = MetricExportResult.FAILURE
        finally:
            _exporting.guard = None
        self._account(result)
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True  # nothing buffered here

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        if self._shut or os.getpid() != self._pid:
            return
        self._shut = True
        _exporting.guard = self
        try:
            self._inner.shutdown(timeout_millis=timeout_millis)
        except Exception:  # noqa: BLE001
            log.debug("OTLP exporter shutdown failed", exc_info=True)
        finally:
            _exporting.guard = None

    # -- internals ----------------------------------------------------------------------------------

    def _note(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            # The SDK is retrying or giving up: treat the endpoint as failing now, so that finish() does
            # not wait out the retries (a success sets this back).
            self._failing = True
        if len(self._reasons) < 4:
            try:
                self._reasons.append(record.getMessage())
            except Exception:  # noqa: BLE001 - a badly formatted SDK record
                self._reasons.append(str(record.msg))

    def _account(self, result: MetricExportResult) -> None:
        if result is MetricExportResult.SUCCESS:
            self.delivered += 1
            if self._failing:
                self._failing = False
                log.info("gpu_energy_exporter.training: %s is reachable again (%d exports were dropped; "
                         "cumulative totals are complete again)", self._endpoint, self.dropped)
            return
        self.dropped += 1
        self._failing = True
        reason = self._reasons[0] if self._reasons else "no reason given"
        if self._warned:
            log.debug("gpu_energy_exporter.training: export to %s failed: %s", self._endpoint, reason)
            return
        self._warned = True
        log.warning(
            "gpu_energy_exporter.training: cannot push training metrics to %s (%s). Training continues; "
            "exports are dropped while the endpoint is unreachable (run.dropped_exports counts them) and the "
            "cumulative totals catch up once it answers. Is gpu-energy-exporter running on that node with "
            "--otlp.listen-address matching? (Set OTEL_EXPORTER_OTLP_ENDPOINT or endpoint=... otherwise.) "
            "This warning is shown once per run.", self._endpoint, reason[:300],
        )

    def _with_extra(self, data: MetricsData) -> MetricsData:
        extra = list(self._extra())
        if not extra:
            return data
        resource_metrics = list(data.resource_metrics)
        for i, rm in enumerate(resource_metrics):
            for j, sm in enumerate(rm.scope_metrics):
                if sm.scope.name == self._scope.name:
                    scopes = list(rm.scope_metrics)
                    scopes[j] = ScopeMetrics(scope=sm.scope, metrics=[*sm.metrics, *extra],
                                             schema_url=sm.schema_url)
                    resource_metrics[i] = ResourceMetrics(resource=rm.resource, scope_metrics=scopes,
                                                          schema_url=rm.schema_url)
                    return MetricsData(resource_metrics=resource_metrics)
        resource_metrics.append(ResourceMetrics(
            resource=self._resource,
            scope_metrics=[ScopeMetrics(scope=self._scope, metrics=extra, schema_url="")],
            schema_url="",
        ))
        return MetricsData(resource_metrics=resource_metrics)

"""The exporter between the OpenTelemetry SDK's periodic reader and the OTLP/HTTP exporter.

It exists so that an unreachable endpoint never disturbs training:

- every failed export is counted (``dropped``) and the first one is reported with ONE warning that names
  the cause and what to do about it (401/403: the bearer token; connection refused: nothing listening at
  the URL; a certificate error: the CA to trust; a timeout; another HTTP status); recovery is logged at
  info, later failures at debug. The cause is read from the HTTP response or the exception itself, seen
  through the ``requests.Session`` handed to the OTLP exporter (``ObservedSession``), not parsed from the
  SDK's log lines;
- an export the endpoint accepted only in part (OTLP ``partial_success``: some data points rejected, with
  a message) is counted (``rejected_points``) and reported with one warning per run quoting the message;
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

import json
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import requests
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

from gpu_energy_exporter.core.ports import OTLP_GRPC_PORT, OTLP_HTTP_PORT, is_http2_frame

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


class ObservedSession(requests.Session):
    """The HTTP session of the OTLP exporter, keeping the last response or exception of an export so the
    guard can say precisely what went wrong (the SDK only logs it). Used by one export at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.response: requests.Response | None = None
        self.error: BaseException | None = None
        self.sent_authorization = False

    def reset(self) -> None:
        self.response, self.error = None, None

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> requests.Response:  # type: ignore[override]
        headers = kwargs.get("headers") or {}
        self.sent_authorization = any(str(k).lower() == "authorization" for k in headers)
        try:
            response = super().request(method, url, *args, **kwargs)
        except BaseException as exc:
            self.error, self.response = exc, None
            raise
        self.response, self.error = response, None
        return response


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and what caused it (``__cause__``, ``__context__``, urllib3's ``reason``, exception args)."""
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < 16:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend([e.__cause__, e.__context__, getattr(e, "reason", None) if isinstance(
            getattr(e, "reason", None), BaseException) else None])
        todo.extend(a for a in e.args if isinstance(a, BaseException))


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return text[: cut if cut > limit // 2 else limit] + " ..."


def _server_message(response: requests.Response) -> str:
    """The message of an OTLP error body (``google.rpc.Status`` in protobuf or JSON), or ''."""
    body = response.content or b""
    if not body:
        return ""
    try:
        if "json" in response.headers.get("Content-Type", ""):
            doc = json.loads(body)
            return _short(str(doc.get("message", ""))) if isinstance(doc, dict) else ""
        from google.rpc import status_pb2  # noqa: PLC0415 - a dependency of the OTLP exporter

        status = status_pb2.Status()
        status.ParseFromString(body)
        return _short(status.message)
    except Exception:  # noqa: BLE001 - a body we cannot read says nothing
        return ""


def describe_failure(endpoint: str, response: requests.Response | None, error: BaseException | None,
                     sent_authorization: bool = False, timeout: float | None = None) -> str:
    """What went wrong with an export to ``endpoint`` (one cause, named precisely) and what to do about it;
    meant to follow "cannot push training metrics to <endpoint>: "."""
    where = urlsplit(endpoint)
    hostport = where.netloc or endpoint
    if response is not None:
        code = response.status_code
        said = _server_message(response)
        said = f" ({said})" if said else ""
        if code in (401, 403):
            token = ("the bearer token this process sent was refused" if sent_authorization
                     else "the exporter requires a bearer token and this process sent none")
            return (f"it answered HTTP {code} {response.reason}{said}: {token}. Set "
                    "OTEL_EXPORTER_OTLP_HEADERS=\"Authorization=Bearer <token>\" (or "
                    "headers={\"Authorization\": \"Bearer <token>\"}) with the token in the exporter's "
                    "--otlp.bearer-token-file.")
        if code == 404:
            return (f"it answered HTTP 404 Not Found: nothing receives OTLP at {where.path or '/'} "
                    "there. Give the receiver's base URL (http://host:4318; /v1/metrics is appended) in "
                    "OTEL_EXPORTER_OTLP_ENDPOINT or endpoint=..., or the full URL in "
                    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT.")
        return f"it answered HTTP {code} {response.reason}{said}."
    chain = list(_chain(error))
    for e in chain:
        if isinstance(e, ssl.SSLCertVerificationError):
            detail = e.verify_message or str(e)
            return (f"the TLS certificate of {hostport} is not trusted ({_short(detail)}). Set "
                    "OTEL_EXPORTER_OTLP_CERTIFICATE to the CA file that signed the exporter's certificate "
                    "(or use http:// if the exporter does not serve TLS).")
    for e in chain:
        if isinstance(e, (ssl.SSLError, requests.exceptions.SSLError)):
            return (f"the TLS handshake with {hostport} failed ({_short(str(e))}). Check that the exporter "
                    "serves TLS on that port (else use http://) and that OTEL_EXPORTER_OTLP_CERTIFICATE "
                    "names the CA that signed its certificate.")
    for e in chain:
        if isinstance(e, ConnectionRefusedError):
            return (f"connection refused at {hostport}: nothing is listening there. Is gpu-energy-exporter "
                    "running on this node with --otlp.listen-address on that port? (Otherwise point "
                    "OTEL_EXPORTER_OTLP_ENDPOINT or endpoint=... at it.)")
    for e in chain:
        # an HTTP/2 frame where an HTTP/1.1 status line belongs: the OTLP/gRPC port (4317), not OTLP/HTTP
        if type(e).__name__ == "BadStatusLine" and is_http2_frame(str(e)):
            return (f"{hostport} speaks HTTP/2 (gRPC), not OTLP/HTTP: it is {OTLP_GRPC_PORT}. Point "
                    f"OTEL_EXPORTER_OTLP_ENDPOINT or endpoint=... at {OTLP_HTTP_PORT}, or set "
                    "OTEL_EXPORTER_OTLP_PROTOCOL=grpc.")
    for e in chain:
        if isinstance(e, (requests.exceptions.Timeout, TimeoutError)):
            within = f" within {timeout:g} s" if timeout else ""
            return (f"{hostport} did not answer{within}: the exporter is overloaded or hung, or a firewall "
                    "drops the packets.")
    for e in chain:
        text = str(e)
        if isinstance(e, socket.gaierror) or "Name or service not known" in text:
            return (f"cannot resolve the host name {where.hostname!r}: check OTEL_EXPORTER_OTLP_ENDPOINT or "
                    "endpoint=....")
    if error is not None:
        inner = chain[-1] if chain else error
        return f"cannot reach {hostport} ({type(inner).__name__}: {_short(str(inner))})."
    return "the export failed (no response and no error recorded)."


def partial_success(response: requests.Response | None) -> tuple[int, str]:
    """``(rejected data points, message)`` of an OTLP success response's ``partial_success``."""
    if response is None or not response.content:
        return 0, ""
    try:
        if "json" in response.headers.get("Content-Type", ""):
            doc = json.loads(response.content)
            part = doc.get("partialSuccess") or doc.get("partial_success") or {}
            rejected = part.get("rejectedDataPoints", part.get("rejected_data_points", 0))
            return int(rejected or 0), str(part.get("errorMessage", part.get("error_message", "")) or "")
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (  # noqa: PLC0415
            ExportMetricsServiceResponse,
        )

        message = ExportMetricsServiceResponse()
        message.ParseFromString(response.content)
        return int(message.partial_success.rejected_data_points), message.partial_success.error_message
    except Exception:  # noqa: BLE001 - an unreadable body is no rejection we can report
        log.debug("cannot read the OTLP response body", exc_info=True)
        return 0, ""


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
        session: ObservedSession | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(preferred_temporality=CUMULATIVE)
        self._inner = inner
        self._endpoint = endpoint
        self._resource = resource
        self._scope = scope
        self._extra = extra
        self._session = session
        self._timeout = timeout
        self._warned_rejection = False
        self._pid = os.getpid()
        self._shut = False
        self._warned = False
        self._failing = False
        self._reasons: list[str] = []
        #: Exports that did not reach the endpoint (each a whole batch of this run's points).
        self.dropped = 0
        #: Exports the endpoint accepted.
        self.delivered = 0
        #: Data points the endpoint accepted the export of but rejected (OTLP partial success).
        self.rejected_points = 0
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
        if self._session is not None:
            self._session.reset()
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
            self._check_partial_success()
            if self._failing:
                self._failing = False
                log.info("gpu_energy_exporter.training: %s is reachable again (%d exports were dropped; "
                         "cumulative totals are complete again)", self._endpoint, self.dropped)
            return
        self.dropped += 1
        self._failing = True
        cause = self._cause()
        if self._warned:
            log.debug("gpu_energy_exporter.training: export to %s failed: %s", self._endpoint, cause)
            return
        self._warned = True
        log.warning(
            "gpu_energy_exporter.training: cannot push training metrics to %s: %s Training continues; "
            "exports are dropped until one succeeds (run.dropped_exports counts them), and then the "
            "cumulative totals are complete again. This warning is shown once per run.", self._endpoint, cause,
        )

    def _cause(self) -> str:
        session = self._session
        if session is not None and (session.response is not None or session.error is not None):
            return describe_failure(self._endpoint, session.response, session.error,
                                    session.sent_authorization, self._timeout)
        reason = self._reasons[0] if self._reasons else "no reason given"
        return f"the export failed ({_short(reason, 300)})."

    def _check_partial_success(self) -> None:
        if self._session is None:
            return
        rejected, message = partial_success(self._session.response)
        if not rejected and not message:
            return
        self.rejected_points += rejected
        if self._warned_rejection:
            log.debug("gpu_energy_exporter.training: %s rejected %d data points: %s", self._endpoint, rejected,
                      message)
            return
        self._warned_rejection = True
        log.warning(
            "gpu_energy_exporter.training: %s accepted the export but rejected %d data point(s): %s. The "
            "rest was stored; the rejected series are missing from /metrics and the run ledger "
            "(run.rejected_points counts them). This warning is shown once per run.",
            self._endpoint, rejected, _short(message or "no message given", 400),
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

"""Push the node's own readings over OTLP/HTTP (``--otlp.push-endpoint``): the pushing thread, the
OpenTelemetry SDK exporter under it, and the push's self-metrics.

The pusher reads only the snapshot the sampler has published (never NVML, never a lock held by the
scrape path), on a thread of its own, and hands the points to the OpenTelemetry SDK's OTLP/HTTP exporter
(protobuf, gzip). Every point carries the time of the reading it comes from and cumulative temporality,
so a push that fails loses nothing: the next one carries the same totals. Failed pushes are retried with
exponential back-off; neither sampling nor scraping ever waits for a push.

What is pushed and under which names (the hardware semantic conventions) is ``otlp.conventions``, pure;
this module is the I/O around it and must never decide a name or a mapping itself.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from gpu_energy_exporter import __version__
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.core.metrics import add, define
from gpu_energy_exporter.otlp.conventions import OTLPPoint, snapshot_points

if TYPE_CHECKING:  # requests (and urllib3 under it) are imported only when a push endpoint is set: several MB
    import requests

log = logging.getLogger(__name__)

SCOPE_NAME = "gpu_energy_exporter"

PUSH_POINTS = define(
    "otlp", "push_points_total", "counter",
    "Data points pushed to --otlp.push-endpoint and accepted by it.", collector="otlp_push",
)
PUSH_REJECTED = define(
    "otlp", "push_points_rejected_total", "counter",
    "Data points that --otlp.push-endpoint answered as rejected (OTLP partial success).", collector="otlp_push",
)
PUSH_FAILURES = define(
    "otlp", "push_failures_total", "counter",
    "Pushes to --otlp.push-endpoint that failed (retried with back-off; cumulative values lose nothing).",
    collector="otlp_push",
)
PUSH_LAST_SUCCESS = define(
    "otlp", "push_last_success_timestamp_seconds", "gauge",
    "Unix time of the last push that --otlp.push-endpoint accepted (0 before the first).",
    collector="otlp_push", unit="seconds",
)

# ---------------------------------------------------------------------------------------------------
# the SDK side: OTLPPoint (otlp.conventions) -> opentelemetry.sdk.metrics.export data -> OTLPMetricExporter


def resource_attributes(environ: Mapping[str, str]) -> dict[str, str]:
    """host.name, service.*, and the Kubernetes node/pod when the DaemonSet's downward API sets them."""
    attrs = {
        "service.name": "gpu-energy-exporter",
        "service.version": __version__,
        "host.name": socket.gethostname(),
    }
    for key, env in (("k8s.node.name", "NODE_NAME"), ("k8s.pod.name", "POD_NAME"),
                     ("k8s.namespace.name", "POD_NAMESPACE")):
        if environ.get(env):
            attrs[key] = environ[env]
    return attrs


@dataclass
class _StartTimes:
    """Start time of each cumulative series: when it was first pushed, moved forward when the value
    drops (a counter reset, which OTLP signals with a new start time)."""

    starts: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[int, float]] = field(default_factory=dict)

    def start_ns(self, p: OTLPPoint) -> int:
        key = (p.name, p.attributes)
        now_ns = int(p.time_s * 1e9)
        known = self.starts.get(key)
        if known is None or (p.kind == "counter" and p.value < known[1]):
            start = now_ns if known is None else now_ns - 1
            self.starts[key] = (start, p.value)
            return start
        self.starts[key] = (known[0], p.value)
        return known[0]

    def keep_only(self, live: set[tuple[str, tuple[tuple[str, str], ...]]]) -> None:
        for key in [k for k in self.starts if k not in live]:
            del self.starts[key]


def build_metrics_data(points: list[OTLPPoint], resource: Mapping[str, str], starts: _StartTimes) -> Any:
    """SDK ``MetricsData`` for ``points`` (cumulative temporality; counters monotonic)."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.metrics.export import Metric as OTelMetric
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    grouped: dict[tuple[str, str, str], tuple[str, list[Any]]] = {}
    live = set()
    for p in points:
        t_ns = int(p.time_s * 1e9)
        start = starts.start_ns(p) if p.kind != "gauge" else 0
        live.add((p.name, p.attributes))
        dp = NumberDataPoint(attributes=dict(p.attributes), start_time_unix_nano=start, time_unix_nano=t_ns,
                             value=p.value)
        grouped.setdefault((p.name, p.unit, p.kind), (p.description, []))[1].append(dp)
    starts.keep_only(live)
    metrics = []
    for (name, unit, kind), (description, dps) in grouped.items():
        data: Any
        if kind == "gauge":
            data = Gauge(data_points=dps)
        else:
            data = Sum(data_points=dps, aggregation_temporality=AggregationTemporality.CUMULATIVE,
                       is_monotonic=kind == "counter")
        metrics.append(OTelMetric(name=name, description=description, unit=unit, data=data))
    scope = InstrumentationScope(SCOPE_NAME, __version__)
    return MetricsData(resource_metrics=[ResourceMetrics(
        resource=Resource.create(dict(resource)), schema_url="",
        scope_metrics=[ScopeMetrics(scope=scope, metrics=metrics, schema_url="")],
    )])


_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 field-name


def load_headers_file(path: str) -> dict[str, str]:
    """``Name: value`` per line (blank lines and ``#`` comments skipped; UTF-8 with or without a byte
    order mark): secrets stay out of argv and the environment."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read --otlp.push-headers-file {path!r}: {exc.strerror or exc}") from None
    try:
        lines = raw.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--otlp.push-headers-file {path!r} is not UTF-8 text (byte {exc.start})") from None
    headers: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        name, sep, value = text.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not _TOKEN.match(name):
            raise ConfigError(f"--otlp.push-headers-file {path!r} line {n}: expected 'Name: value' with a header "
                              "name of letters, digits and -")
        if any(ord(c) < 0x20 or ord(c) == 0x7F or ord(c) > 0xFF for c in value):
            raise ConfigError(f"--otlp.push-headers-file {path!r} line {n}: the value of {name} has control or "
                              "non-Latin-1 characters, which HTTP headers cannot carry")
        headers[name] = value
    return headers


@dataclass(frozen=True)
class PushSettings:
    endpoint: str
    interval_s: float = 10.0
    headers: Mapping[str, str] = field(default_factory=dict)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure_skip_verify: bool = False
    timeout_s: float = 10.0


def _push_session(verify: bool | str) -> Any:
    """The requests session under the SDK's exporter. It pins certificate verification per request
    (requests lets ``REQUESTS_CA_BUNDLE`` override a session's CA file, and the SDK resets
    ``session.verify``), and keeps the last response (``last_response``) so that a redirect or an OTLP
    partial success is not taken for an accepted push. requests is imported here, only where a push
    endpoint is set: the daemon without one never loads it (about 4 MB of resident memory)."""
    import requests
    from urllib3.exceptions import InsecureRequestWarning

    class PushSession(requests.Session):
        def __init__(self, verify: bool | str) -> None:
            super().__init__()
            self.pinned_verify = verify
            self.last_response: requests.Response | None = None

        def request(self, method: str | bytes, url: str | bytes, *args: Any,
                    **kwargs: Any) -> requests.Response:
            kwargs["verify"] = self.pinned_verify
            self.last_response = None
            with warnings.catch_warnings():
                if self.pinned_verify is False:  # asked for with --otlp.push-insecure-skip-verify, said at start
                    warnings.simplefilter("ignore", InsecureRequestWarning)
                response = super().request(method, url, *args, **kwargs)  # type: ignore[arg-type]
            self.last_response = response
            return response

    return PushSession(verify)


def rejected_points(response: requests.Response) -> tuple[int, str]:
    """(rejected data points, message) from an OTLP/HTTP response's ``partial_success``; (0, "") when the
    body is empty or not a response message."""
    body = response.content
    if not body:
        return 0, ""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

    msg = ExportMetricsServiceResponse()
    try:
        if "json" in response.headers.get("Content-Type", ""):
            from google.protobuf import json_format

            json_format.Parse(body, msg, ignore_unknown_fields=True)
        else:
            msg.ParseFromString(body)
    except Exception:  # noqa: BLE001 - an unparseable answer is not a rejection we can count
        return 0, ""
    ps = msg.partial_success
    return int(ps.rejected_data_points), ps.error_message


def new_sdk_exporter(settings: PushSettings) -> Any:
    """The OpenTelemetry SDK's OTLP/HTTP metric exporter (protobuf, gzip) for ``settings``."""
    try:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    except ImportError as exc:  # pragma: no cover - the base install has them
        raise ConfigError(
            f"--otlp.push-endpoint needs the OpenTelemetry SDK and OTLP exporter ({exc.name} is missing): "
            "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
        ) from None
    if settings.insecure_skip_verify:
        log.warning("--otlp.push-insecure-skip-verify: the certificate of %s is not verified (testing only)",
                    settings.endpoint)
    session = _push_session(False if settings.insecure_skip_verify else (settings.ca_file or True))
    exporter = OTLPMetricExporter(
        endpoint=settings.endpoint,
        certificate_file=None if settings.insecure_skip_verify else settings.ca_file,
        client_certificate_file=settings.cert_file, client_key_file=settings.key_file,
        headers=dict(settings.headers), timeout=settings.timeout_s, compression=Compression.Gzip,
        session=session,
    )
    exporter.push_session = session  # type: ignore[attr-defined]  # read back by OTLPPusher (redirects, partial success)
    return exporter


SnapshotSource = Callable[[], Any]  # -> Snapshot | None


class OTLPPusher:
    """Pushes the latest snapshot every ``interval_s`` on a daemon thread; ``close()`` stops it."""

    MAX_BACKOFF_S = 300.0

    def __init__(self, settings: PushSettings, snapshot: SnapshotSource, *, exporter: Any = None,
                 environ: Mapping[str, str] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._snapshot = snapshot
        self._exporter = exporter if exporter is not None else new_sdk_exporter(settings)
        self._resource = resource_attributes(os.environ if environ is None else environ)
        self._starts = _StartTimes()
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.points_pushed = 0
        self.points_rejected = 0
        self._warned_partial = False
        self.failures = 0
        self.consecutive_failures = 0
        self.last_success = 0.0
        self._version = 0
        self._warned = False

    def version(self) -> int:
        return self._version

    def start(self) -> OTLPPusher:
        self._thread = threading.Thread(target=self._loop, name="otlp-push", daemon=True)
        self._thread.start()
        return self

    def push_once(self) -> bool:
        """Push the latest snapshot now; True when the endpoint accepted it (or there was nothing yet)."""
        snap = self._snapshot()
        if snap is None:
            return True
        gpu_times = {g.identity.uuid: g.reading.timestamp for g in snap.gpus if g.reading is not None}
        points = snapshot_points(snap.families, taken_at=snap.timestamp, gpu_times=gpu_times)
        data = build_metrics_data(points, self._resource, self._starts)
        session = getattr(self._exporter, "push_session", None)
        rejected, rejected_why = 0, ""
        try:
            result = self._exporter.export(data, timeout_millis=self.settings.timeout_s * 1000)
            ok = getattr(result, "name", str(result)) == "SUCCESS"
        except Exception as exc:  # noqa: BLE001 - a push must never take the exporter down
            log.debug("OTLP push raised", exc_info=True)
            ok, why = False, f"{type(exc).__name__}: {exc}"
        else:
            why = "the endpoint refused or did not answer (see the OpenTelemetry exporter's log line)"
            response = session.last_response if session is not None else None
            if ok and response is not None and 300 <= response.status_code < 400:
                # The SDK takes any status below 400 as accepted, and never follows a redirect.
                ok, why = False, (f"the endpoint answered {response.status_code} (a redirect to "
                                  f"{response.headers.get('Location', '?')}): set --otlp.push-endpoint to the final "
                                  "URL; nothing was stored")
            elif ok and response is not None:
                rejected, rejected_why = rejected_points(response)
        if ok:
            self.points_pushed += max(0, len(points) - rejected)
            self.points_rejected += rejected
            if rejected and not self._warned_partial:
                log.warning("OTLP push to %s: the endpoint rejected %d of %d points: %s (logged once; counted in "
                            "gpuenergy_otlp_push_points_rejected_total)", self.settings.endpoint, rejected,
                            len(points), rejected_why or "no reason given")
                self._warned_partial = True
            self.last_success = self._clock()
            if self.consecutive_failures:
                log.info("OTLP push to %s works again", self.settings.endpoint)
            self.consecutive_failures = 0
            self._warned = False
        else:
            self.failures += 1
            self.consecutive_failures += 1
            if not self._warned:
                log.warning("OTLP push to %s failed: %s; retrying with back-off (check --otlp.push-endpoint, "
                            "its TLS and headers flags, and that the endpoint is up)", self.settings.endpoint, why)
                self._warned = True
        self._version += 1
        return ok

    def next_delay(self) -> float:
        """The interval after a success; after n failures in a row, interval x 2^n up to 5 minutes (or the
        interval, if longer)."""
        interval = self.settings.interval_s
        if not self.consecutive_failures:
            return interval
        return min(interval * 2 ** min(self.consecutive_failures, 10), max(interval, self.MAX_BACKOFF_S))

    def _loop(self) -> None:
        while not self._stop.wait(self.next_delay()):
            self.push_once()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self._exporter.shutdown()
        except Exception:  # noqa: BLE001
            log.debug("OTLP push exporter shutdown failed", exc_info=True)

    def collect(self) -> list[Metric]:
        """Self-metrics for /metrics."""
        out = []
        for spec, value in ((PUSH_POINTS, self.points_pushed), (PUSH_REJECTED, self.points_rejected),
                            (PUSH_FAILURES, self.failures),
                            (PUSH_LAST_SUCCESS, self.last_success)):
            fam = spec.family()
            add(fam, [], float(value))
            out.append(fam)
        return out


__all__ = [
    "OTLPPusher", "PushSettings", "build_metrics_data", "load_headers_file", "rejected_points", "resource_attributes",
]

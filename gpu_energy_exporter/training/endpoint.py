"""Where a run exports to and how often: the protocol (``OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL``: OTLP/HTTP
protobuf, or gRPC), the metrics URL and the export interval, from the arguments of ``start_run`` or the
standard OpenTelemetry environment variables.

With no endpoint given anywhere, the exporter's Unix socket is used when it exists
(``DEFAULT_UNIX_SOCKET``, or the path in ``GPU_ENERGY_EXPORTER_OTLP_UNIX_SOCKET``, the variable that sets the
exporter's ``--otlp.unix-socket`` too): the exporter then knows this process by the kernel's word, not by its
attributes (docs/security.md). Such an endpoint reads ``unix:/path``; ``unix:`` endpoints may be given too.

Pure but for one ``stat`` of that socket: reads only the mapping it is given (``os.environ`` by default). It
must never open a connection, import the OpenTelemetry SDK or raise for a malformed environment variable
(one warning, then the default).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping

log = logging.getLogger("gpu_energy_exporter.training")

DEFAULT_ENDPOINT = "http://localhost:4318"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
HTTP_PROTOBUF = "http/protobuf"
GRPC = "grpc"
METRICS_PATH = "/v1/metrics"
#: The exporter's OTLP Unix socket on a node (``--otlp.unix-socket`` in the shipped deployments).
DEFAULT_UNIX_SOCKET = "/run/gpu-energy-exporter/otlp.sock"
UNIX_SOCKET_ENV = "GPU_ENERGY_EXPORTER_OTLP_UNIX_SOCKET"
UNIX = "unix:"
#: Default seconds between exports: live enough for a 15 s Prometheus scrape, cheap for the trainer.
DEFAULT_EXPORT_INTERVAL = 10.0
#: Default seconds one export may take, retries included (the SDK retries transient errors). Short on
#: purpose: every export carries cumulative totals, so the next periodic export is the real retry.
DEFAULT_EXPORT_TIMEOUT = 3.0
#: Default bound on ``finish()``: the final export gets this long, then the run is closed regardless.
DEFAULT_FINISH_TIMEOUT = 5.0


def resolve_protocol(environ: Mapping[str, str] | None = None) -> str:
    """``GRPC`` or ``HTTP_PROTOBUF`` (the default), from ``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL``, else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``; another value (``http/json``) gets one warning and OTLP/HTTP protobuf."""
    env = os.environ if environ is None else environ
    for name in ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        raw = env.get(name, "").strip()
        if raw:
            if raw.lower() in (GRPC, HTTP_PROTOBUF):
                return raw.lower()
            log.warning("gpu_energy_exporter.training: ignoring %s=%r: the helper pushes %s or %s; using %s",
                        name, raw, HTTP_PROTOBUF, GRPC, HTTP_PROTOBUF)
            break
    return HTTP_PROTOBUF


def resolve_endpoint(endpoint: str | None, environ: Mapping[str, str] | None = None,
                     protocol: str = HTTP_PROTOBUF) -> str:
    """The full ``.../v1/metrics`` URL, from the argument or the standard OpenTelemetry variables.

    ``endpoint`` and ``OTEL_EXPORTER_OTLP_ENDPOINT`` are base URLs (``/v1/metrics`` is appended unless
    already there); ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` is used as is, as the specification says.
    With ``protocol`` ``GRPC``: the first of them as given (gRPC has no path; ``http://`` is plain text,
    ``https://`` TLS), else ``http://localhost:4317``.
    """
    env = os.environ if environ is None else environ
    given = endpoint or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if given and given.strip().startswith(UNIX):
        return UNIX + unix_path(given.strip())
    if not given:
        path = env.get(UNIX_SOCKET_ENV, "").strip() or DEFAULT_UNIX_SOCKET
        if _is_socket(path):
            return UNIX + path
    if protocol == GRPC:
        chosen = (given or DEFAULT_GRPC_ENDPOINT).strip().rstrip("/")
        return chosen if "://" in chosen else "http://" + chosen
    if endpoint:
        return _with_path(endpoint)
    if env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"].strip()
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _with_path(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return DEFAULT_ENDPOINT + METRICS_PATH


def unix_path(endpoint: str) -> str:
    """The socket path of a ``unix:/path`` or ``unix:///path`` endpoint."""
    rest = endpoint[len(UNIX):]
    return "/" + rest.lstrip("/") if rest.startswith("//") else rest


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _with_path(base: str) -> str:
    base = base.strip()
    if "://" not in base:
        base = "http://" + base
    if base.rstrip("/").endswith(METRICS_PATH):
        return base.rstrip("/")
    return base.rstrip("/") + METRICS_PATH


def export_interval_seconds(value: float | None, environ: Mapping[str, str]) -> float:
    """Seconds between exports: ``value``, else ``OTEL_METRIC_EXPORT_INTERVAL`` (milliseconds), else
    ``DEFAULT_EXPORT_INTERVAL``. A ``value`` that is not positive is a ValueError."""
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

"""The one HTTP client of the workstation commands (``top``, ``runs --url``, ``report``) for an exporter's
JSON API (``api.py``) or a Prometheus server's HTTP API.

``ExporterClient`` GETs JSON with basic auth and TLS options; ``add_client_flags`` gives every command the
same ``--url``, ``--user``, ``--password-file``, ``--ca-file`` and ``--insecure`` (``--url`` defaults to
``$GPU_ENERGY_EXPORTER_URL``, then ``http://localhost:9863``). Every failure is one ``ExporterUnreachable``
whose message names one cause and the flag to change, and whose ``cause`` says which:
``not_running`` (connection refused), ``credentials`` (401), ``tls`` (certificate or protocol, or the
wrong scheme: https against plain HTTP and the reverse), ``wrong_port`` (one of the exporter's OTLP ports,
where trainers push), ``unreachable`` (timeout, name that does not resolve), ``answer`` (an unexpected HTTP
answer). A failure that points at the wrong port or scheme is checked by one short probe of the same host
and port (``probe.py``), so the message names the port or scheme to use instead of the symptom.

This module only reads: it never writes to the exporter and never contacts anything but the given URL.
"""

from __future__ import annotations

import argparse
import base64
import errno
import http.client
import json
import os
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpu_energy_exporter.client import probe
from gpu_energy_exporter.core.errors import ExporterError
from gpu_energy_exporter.core.ports import (
    DEFAULT_METRICS_PORT,
    METRICS_PORT,
    OTLP_GRPC_PORT,
    OTLP_HTTP_PORT,
    is_http2_frame,
)

DEFAULT_URL = f"http://localhost:{DEFAULT_METRICS_PORT}"
#: Where ``--url`` comes from when not given (``top``, ``runs`` and ``report`` alike).
URL_ENV = "GPU_ENERGY_EXPORTER_URL"

#: The exporter's JSON API (``daemon/api.py``) that the workstation commands read.
STATUS_PATH = "/api/v1/status"
RUNS_PATH = "/api/v1/runs"
RUN_PATH = "/api/v1/run"

NOT_RUNNING = "not_running"
CREDENTIALS = "credentials"
TLS = "tls"
UNREACHABLE = "unreachable"
WRONG_PORT = "wrong_port"
ANSWER = "answer"

#: Bound on each of the (at most two) connections of a probe after a failure (``probe.py``).
PROBE_TIMEOUT_S = 2.0
#: Where an OTLP/HTTP receiver takes pushes: it answers a GET there with 405 and ``Allow: POST``.
OTLP_METRICS_PATH = "/v1/metrics"


class ExporterUnreachable(ExporterError):
    """The exporter did not answer usefully; the message says why and what to try, ``cause`` which of
    the module's causes it is."""

    def __init__(self, message: str, cause: str = ANSWER) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass
class ExporterClient:
    """GET JSON documents from an exporter's API. ``url`` is the exporter's base URL (``http://host:9863``);
    credentials may also be embedded in it (``http://user:pass@host:9863``)."""

    url: str = DEFAULT_URL
    user: str | None = None
    password: str | None = None
    ca_file: str | None = None
    insecure: bool = False
    timeout: float = 5.0
    _base: str = field(init=False, default="")
    _host: str = field(init=False, default="")
    _port: int = field(init=False, default=0)
    _path: str = field(init=False, default="")
    _auth: str | None = field(init=False, default=None)
    _ssl: ssl.SSLContext | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        text = self.url.strip()
        parts = urllib.parse.urlsplit(text if "://" in text else "http://" + text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ExporterUnreachable(f"--url {self.url!r} must look like http://host:{DEFAULT_METRICS_PORT}")
        host = parts.hostname
        if ":" in host:
            host = f"[{host}]"
        try:
            port = parts.port
        except ValueError:
            raise ExporterUnreachable(f"--url {self.url!r} has an invalid port") from None
        netloc = host + (f":{port}" if port else "")
        self._host, self._path = parts.hostname, parts.path.rstrip("/")
        self._port = port or (443 if parts.scheme == "https" else 80)
        self._base = urllib.parse.urlunsplit((parts.scheme, netloc, self._path, "", ""))
        user, password = self.user, self.password
        if user is None and parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "") if password is None else password
        if user is not None:
            token = f"{user}:{password or ''}".encode()
            self._auth = "Basic " + base64.b64encode(token).decode()
        if parts.scheme == "https":
            try:
                ctx = ssl.create_default_context(cafile=self.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ExporterUnreachable(f"cannot use --ca-file {self.ca_file!r}: {exc}", TLS) from None
            if self.insecure:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self._ssl = ctx

    @property
    def base_url(self) -> str:
        """The URL without credentials (safe to print)."""
        return self._base

    def get(self, path: str, query: dict[str, str] | None = None) -> Any:
        """``GET base + path`` and decode JSON. Raises ExporterUnreachable with what to do; an HTTP error
        whose body is a JSON object with ``error`` raises with that message."""
        target = self._base + path + ("?" + urllib.parse.urlencode(query) if query else "")
        request = urllib.request.Request(target, headers={"Accept": "application/json"})
        if self._auth:
            request.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._ssl) as resp:  # noqa: S310
                body = resp.read()
        except urllib.error.HTTPError as exc:
            raise self._http_error(target, exc) from None
        except (urllib.error.URLError, OSError) as exc:
            raise self._connection_error(exc) from None
        except http.client.HTTPException as exc:
            # Not HTTP/1.1 on the other end (BadStatusLine, a truncated answer): an HTTP/2 frame is a gRPC port
            raise self._not_http_error(exc) from None
        try:
            return json.loads(body)
        except ValueError:
            raise ExporterUnreachable(f"{target} did not answer with JSON: is {self._base} a "
                                      "gpu-energy-exporter (check --url)?") from None

    def _http_error(self, target: str, exc: urllib.error.HTTPError) -> ExporterUnreachable:
        detail = _error_detail(exc)
        if exc.code == 401:
            if self._auth:
                return ExporterUnreachable(
                    f"{self._base} refused the credentials (401 Unauthorized): check --user and --password-file "
                    "against the basic_auth_users of the exporter's --web.config.file", CREDENTIALS)
            return ExporterUnreachable(
                f"{self._base} needs credentials (401 Unauthorized): pass --user and --password-file "
                "(a user of the exporter's --web.config.file basic_auth_users)", CREDENTIALS)
        if exc.code == 404 and detail:
            return ExporterUnreachable(detail)
        if exc.code == 404 and self._is_otlp_http_receiver():
            return self._wrong_port(f"takes OTLP pushes (POST {OTLP_METRICS_PATH})", OTLP_HTTP_PORT, self._scheme)
        if exc.code == 404:
            return ExporterUnreachable(f"{target} answered 404: is {self._base} a gpu-energy-exporter "
                                       "(the JSON API needs version 0.1 or newer; check --url)?")
        return ExporterUnreachable(f"{target} answered HTTP {exc.code} {exc.reason}"
                                   + (f": {detail}" if detail else ""))

    @property
    def _scheme(self) -> str:
        return "https" if self._base.startswith("https://") else "http"

    def _url(self, scheme: str, port: int | None = None) -> str:
        """This URL with another scheme or port (what the messages suggest for --url)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{scheme}://{host}:{port or self._port}{self._path}"

    def _wrong_port(self, seen: str, which: str, scheme: str) -> ExporterUnreachable:
        return ExporterUnreachable(
            f"{self._base} {seen}: it is {which}, where trainers push. top, runs and report read {METRICS_PORT}: "
            f"try --url {self._url(scheme, DEFAULT_METRICS_PORT)}", WRONG_PORT)

    def _wrong_scheme(self, kind: str) -> ExporterUnreachable | None:
        """The message for what a probe found at this host and port, when it is not what the URL says."""
        if kind == probe.PLAIN_H2:
            return self._wrong_port("answered in HTTP/2 (gRPC)", OTLP_GRPC_PORT, "http")
        if kind == probe.TLS_H2:
            return self._wrong_port("answered in HTTP/2 over TLS (gRPC)", OTLP_GRPC_PORT, "https")
        if kind == probe.PLAIN_HTTP and self._scheme == "https":
            if self._is_otlp_http_receiver(self._url("http")):
                return self._wrong_port(f"takes OTLP pushes (POST {OTLP_METRICS_PATH}) in plain HTTP",
                                        OTLP_HTTP_PORT, "http")
            return ExporterUnreachable(
                f"{self._base} speaks plain HTTP, not TLS: the exporter serves http there (no "
                f"tls_server_config in its --web.config.file); use --url {self._url('http')}", TLS)
        if kind == probe.TLS_HTTP and self._scheme == "http":
            return ExporterUnreachable(
                f"{self._base} expects TLS: the exporter serves https there (tls_server_config in its "
                f"--web.config.file); use --url {self._url('https')} (with --ca-file, or --insecure)", TLS)
        return None

    def _probe(self) -> ExporterUnreachable | None:
        # its own bound, not the request's: a short --interval must not make a slow probe say nothing
        return self._wrong_scheme(probe.listener_kind(self._host, self._port, PROBE_TIMEOUT_S))

    def _is_otlp_http_receiver(self, base: str | None = None) -> bool:
        """An OTLP/HTTP receiver answers a GET of /v1/metrics with 405 Method Not Allowed, Allow: POST."""
        base = base or self._base
        request = urllib.request.Request(base + OTLP_METRICS_PATH)
        context = self._ssl if base.startswith("https://") else None
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=context):  # noqa: S310
                return False
        except urllib.error.HTTPError as exc:
            return exc.code == 405 and "POST" in (exc.headers.get("Allow") or "")
        except (OSError, http.client.HTTPException):
            return False

    def _not_http_error(self, exc: http.client.HTTPException) -> ExporterUnreachable:
        if is_http2_frame(getattr(exc, "line", "")):
            return self._wrong_port("answered in HTTP/2 (gRPC)", OTLP_GRPC_PORT, "http")
        return self._probe() or ExporterUnreachable(
            f"{self._base} did not answer in HTTP/1.1 ({type(exc).__name__}): --url must be {METRICS_PORT}")

    def _connection_error(self, exc: OSError) -> ExporterUnreachable:
        reason: Any = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLCertVerificationError):
            return ExporterUnreachable(
                f"cannot verify the TLS certificate of {self._base} ({reason.verify_message}): pass --ca-file "
                "with the CA that signed it, or --insecure", TLS)
        # RemoteDisconnected is a ConnectionResetError
        if isinstance(reason, (ssl.SSLError, TimeoutError, socket.timeout, ConnectionResetError)):
            # the wrong scheme or an OTLP port, answered by a handshake error, silence or a closed connection
            found = self._probe()
            if found is not None:
                return found
        if isinstance(reason, ssl.SSLError):
            if self._base.startswith("http://"):
                return ExporterUnreachable(f"{self._base}: TLS error ({reason}); does the exporter use https? "
                                           "then use an https:// --url", TLS)
            return ExporterUnreachable(f"TLS handshake with {self._base} failed ({reason}): is it an https "
                                       "exporter? otherwise use an http:// --url", TLS)
        if isinstance(reason, ConnectionRefusedError) or getattr(reason, "errno", None) == errno.ECONNREFUSED:
            return ExporterUnreachable(
                f"nothing listens at {self._base} (connection refused): is the exporter running? start it "
                "(gpu-energy-exporter, or gpu-energy-exporter demo) or pass --url with its --web.listen-address",
                NOT_RUNNING)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            return ExporterUnreachable(f"{self._base} did not answer within {self.timeout:g}s (timed out): "
                                       "check --url and the network", UNREACHABLE)
        if isinstance(reason, socket.gaierror):
            return ExporterUnreachable(f"cannot resolve the host of {self._base} ({reason.strerror}): "
                                       "check --url", UNREACHABLE)
        text = str(getattr(reason, "strerror", None) or reason)
        if self._base.startswith("http://") and "Remote end closed" in text:
            return ExporterUnreachable(f"{self._base} closed the connection without answering: the exporter "
                                       "may serve https (use an https:// --url)", TLS)
        return ExporterUnreachable(f"cannot reach the exporter at {self._base}: {text} (check --url)", UNREACHABLE)


def _error_detail(exc: urllib.error.HTTPError) -> str:
    try:
        doc = json.loads(exc.read() or b"null")
    except (ValueError, OSError):
        return ""
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return str(doc["error"])
    return ""


def read_password_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\r\n")
    except OSError as exc:
        raise ExporterUnreachable(f"cannot read --password-file {path!r}: {exc.strerror or exc}") from None


def add_client_flags(parser: argparse.ArgumentParser, url_help: str | None = None) -> None:
    """``--url``, ``--user``, ``--password-file``, ``--ca-file``, ``--insecure`` (``top``, ``runs``, ``report``)."""
    parser.add_argument("--url", default=None, metavar="URL",
                        help=url_help or f"the exporter's web address (default: ${URL_ENV} or {DEFAULT_URL}); "
                                         "http://user:password@host:port also works")
    parser.add_argument("--user", default=None, help="basic auth user (the exporter's --web.config.file)")
    parser.add_argument("--password-file", default=None, metavar="FILE",
                        help="file whose first line is the basic auth password")
    parser.add_argument("--ca-file", default=None, metavar="FILE",
                        help="CA certificate(s) to verify an https exporter with")
    parser.add_argument("--insecure", action="store_true", help="do not verify the exporter's TLS certificate")


def client_url(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str:
    """``--url``, else ``$GPU_ENERGY_EXPORTER_URL``, else ``http://localhost:9863``."""
    env = os.environ if environ is None else environ
    return str(args.url or env.get(URL_ENV) or DEFAULT_URL)


def client_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
                     timeout: float = 5.0) -> ExporterClient:
    password = read_password_file(args.password_file) if args.password_file else None
    if password is not None and args.user is None:
        raise ExporterUnreachable("--password-file needs --user")
    return ExporterClient(client_url(args, environ), user=args.user, password=password,
                          ca_file=args.ca_file, insecure=args.insecure, timeout=timeout)


__all__ = [
    "ANSWER", "CREDENTIALS", "DEFAULT_URL", "NOT_RUNNING", "RUNS_PATH", "RUN_PATH", "STATUS_PATH", "TLS", "UNREACHABLE",
    "URL_ENV", "WRONG_PORT", "ExporterClient", "ExporterUnreachable", "add_client_flags", "client_from_args",
    "client_url", "read_password_file",
]

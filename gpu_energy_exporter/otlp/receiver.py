"""The OTLP/HTTP metrics receiver: ``POST /v1/metrics`` from training processes into the store.

``ExportHandler.handle_export(headers, body) -> (status, content_type, body)`` is the whole request
logic as a function of bytes, so it plugs into any HTTP server; ``OTLPReceiver`` mounts it on a
``http.server.HTTPServer`` of its own (``--otlp.listen-address``).

Protocol (OTLP specification, "OTLP/HTTP"):

- Bodies are ``ExportMetricsServiceRequest`` in binary protobuf (``application/x-protobuf``) or the OTLP
  JSON mapping (``application/json``); ``Content-Encoding: gzip`` or ``deflate``. The response uses the
  request's content type: ``ExportMetricsServiceResponse``, with ``partial_success`` (count and reason)
  when some data points were not stored.
- Errors carry a ``google.rpc.Status`` body: 400 for a body that cannot be decoded (with a
  ``google.rpc.BadRequest`` detail), 401 for a missing or wrong bearer token, 413 when the body exceeds
  ``--otlp.max-body-bytes`` before or after decompression (decompression stops at the limit, so a gzip
  bomb costs at most that much memory), 415 for another content type or encoding. None of these is
  retryable for an OTLP client, which is right: a retry would fail the same way.
- A request is decoded and translated completely before the store is touched: a rejected request stores
  nothing. Within a decoded request, points that cannot be used are counted and reported, the rest stored:
  the response's ``partial_success`` gives ``rejected_data_points`` and, per reason, the first message,
  which names the limit and its ``--otlp.*`` flag (bounds: ``points.Limits`` per point, ``admission`` and the store's
  module docstring for bytes, fair admission and name collisions).

This module must never let a request crash the server: every failure becomes a response.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceResponse,
)

from gpu_energy_exporter.core.clientid import Peer
from gpu_energy_exporter.http.messages import HTTPError, Request
from gpu_energy_exporter.http.messages import Response as WebResponse
from gpu_energy_exporter.http.peers import PeerResolver
from gpu_energy_exporter.http.server import DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_TIMEOUT, HTTPServer
from gpu_energy_exporter.http.splice import Splice
from gpu_energy_exporter.otlp import census
from gpu_energy_exporter.otlp.census import DEFAULT_REQUEST_LIMITS, RequestLimits
from gpu_energy_exporter.otlp.decoding import DecodeFailure, decode, decode_wire, decompress
from gpu_energy_exporter.otlp.decoding import _parse_json as _parse_json  # its former home (tests call it)
from gpu_energy_exporter.otlp.identify import Identities
from gpu_energy_exporter.otlp.identify import load_bearer_token as load_bearer_token
from gpu_energy_exporter.otlp.identify import load_bearer_tokens as load_bearer_tokens
from gpu_energy_exporter.otlp.status import JSON, PROTOBUF, status_body
from gpu_energy_exporter.otlp.store import TrainingStore
from gpu_energy_exporter.otlp.translate import translate_request
from gpu_energy_exporter.otlp.wire import Undecodable

log = logging.getLogger(__name__)

_Failure = DecodeFailure
#: A request refused with an HTTP status and one message (400 for a body that does not decode); the
#: OTLP/gRPC receiver (``otlp.grpcreceiver``) answers the same message with the matching gRPC code.
ExportFailure = DecodeFailure

PATH = "/v1/metrics"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
#: Bodies larger than ``census.SMALL_BODY`` (or compressed) decoded at once, both ports together: the worst
#: concurrent case is this many worst single requests, plus the bodies the servers hold meanwhile.
DECODING_AT_ONCE = 2

Response = tuple[int, str, bytes]

_PROTOBUF_TYPES = frozenset({"application/x-protobuf", "application/protobuf"})
_ENCODINGS = frozenset({"", "identity", "gzip", "x-gzip", "deflate"})


def _response_body(rejected: int, message: str, content_type: str) -> bytes:
    if not rejected and not message:
        return _FULL_SUCCESS[content_type]
    return _encode_response(rejected, message, content_type)


def _encode_response(rejected: int, message: str, content_type: str) -> bytes:
    response = ExportMetricsServiceResponse()
    if rejected or message:
        response.partial_success.CopyFrom(
            ExportMetricsPartialSuccess(rejected_data_points=rejected, error_message=message))
    if content_type == JSON:
        return json_format.MessageToJson(response, indent=None).encode()
    return response.SerializeToString()


#: The answer to a request whose every point was stored, by content type (the same bytes every time).
_FULL_SUCCESS = {ct: _encode_response(0, "", ct) for ct in (PROTOBUF, JSON)}


# ----------------------------------------------------------------------------------------------------
# the handler


class ExportHandler:
    """OTLP export requests in, ``(status, content_type, body)`` out. Thread-safe; holds no per-request
    state."""

    def __init__(
        self,
        store: TrainingStore,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        bearer_token: str | None = None,
        tokens: Mapping[str, str] | None = None,
        resolver: PeerResolver | None = None,
        forwarders: tuple[str, ...] = (),
        request_limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
    ) -> None:
        if max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
        self.store = store
        self.max_body_bytes = max_body_bytes
        self.request_limits = request_limits
        # Large bodies decoded at once, over both ports: each may hold what census allows, and the GIL runs one
        # at a time anyway, so waiting costs no throughput (and a reentrant lock would not bound anything).
        self._decoding = threading.BoundedSemaphore(DECODING_AT_ONCE)
        #: who a push is: tokens and tenants, the kernel's view of a connection, trusted forwarders
        self.identities = Identities(tokens=tokens, bearer_token=bearer_token, resolver=resolver,
                                     forwarders=forwarders)

    @property
    def bearer_required(self) -> bool:
        """Whether pushes must carry a ``--otlp.bearer-token-file`` token."""
        return self.identities.bearer_required

    @property
    def resolver(self) -> PeerResolver | None:
        return self.identities.resolver

    def bearer_ok(self, authorization: str) -> bool:
        """Whether an ``Authorization`` value (HTTP header or gRPC metadata) carries a token, or none is
        required."""
        return self.identities.authenticate(authorization) is not None

    def identify(self, peer: Peer, authorization: str) -> Peer:
        """``Identities.identify``: the identity of a push from ``peer`` carrying ``authorization``."""
        return self.identities.identify(peer, authorization)

    @staticmethod
    def _lower(headers: Mapping[str, str]) -> dict[str, str]:
        return {k.lower(): v for k, v in headers.items()}

    @staticmethod
    def response_type(headers: Mapping[str, str]) -> str:
        """The content type errors are answered in: the request's when it is one we speak."""
        ct = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        return JSON if ct == JSON else PROTOBUF

    def _check(self, h: Mapping[str, str], length: int) -> str:
        """Auth, content type, encoding and size; returns the body's content type or raises."""
        if not self.bearer_ok(h.get("authorization", "")):
            raise _Failure(401, "missing or wrong bearer token (Authorization: Bearer <token> "
                                "from --otlp.bearer-token-file)")
        ct = h.get("content-type", "").split(";", 1)[0].strip().lower()
        if ct in _PROTOBUF_TYPES:
            content_type = PROTOBUF
        elif ct == JSON:
            content_type = JSON
        else:
            raise _Failure(415, f"unsupported Content-Type {ct or '(none)'!r}; send "
                                f"{PROTOBUF} or {JSON}")
        encoding = h.get("content-encoding", "").strip().lower()
        if encoding not in _ENCODINGS:
            raise _Failure(415, f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
        if length > self.max_body_bytes:
            raise _Failure(413, f"request body of {length} bytes exceeds {self.max_body_bytes} bytes "
                                "(--otlp.max-body-bytes)")
        return content_type

    def preflight(self, headers: Mapping[str, str], content_length: int) -> Response | None:
        """Checks a server can make before reading the body (auth, type, declared size). Returns the
        error response (already counted) or ``None``."""
        early = self._preflight(self._lower(headers), headers, content_length)
        return None if isinstance(early, str) else early

    def _preflight(self, h: Mapping[str, str], headers: Mapping[str, str], content_length: int) -> Response | str:
        """``preflight``: the error response, or the body's content type (``_check``)."""
        try:
            return self._check(h, content_length)
        except _Failure as exc:
            return self.fail(exc.status, exc.message, headers)

    def fail(
        self, status: int, message: str, headers: Mapping[str, str], field: str | None = None,
    ) -> Response:
        """An error response in the request's content type, counted in the self-metrics."""
        content_type = self.response_type(self._lower(headers))
        self.store.record_request(status, 0.0)
        return status, content_type, status_body(status, message, content_type, field)

    def handle_export(self, headers: Mapping[str, str], body: bytes) -> Response:
        """Handle one ``POST /v1/metrics``. Never raises."""
        return self._export(self._lower(headers), body)

    def _export(self, h: Mapping[str, str], body: bytes, checked: str = "", peer: Peer | str = "") -> Response:
        """``handle_export`` with the header names already lower-cased (``_lower``); ``checked``: the content
        type ``_check`` gave for these headers and a body of this size or more (``route``'s preflight);
        ``peer``: the sender's address (``core.clientid``)."""
        started = time.perf_counter()
        try:
            status, content_type, out = self._handle(h, body, checked, peer)
        except _Failure as exc:
            content_type = self.response_type(h)
            status = exc.status
            field = (exc.field or "body") if status == 400 else None
            out = status_body(status, exc.message, content_type, field)
        except Exception:
            log.exception("OTLP request handling failed")
            content_type = self.response_type(h)
            status = 500
            out = status_body(500, "internal error while handling the request; see the exporter log",
                              content_type)
        self.store.record_request(status, time.perf_counter() - started)
        return status, content_type, out

    def _handle(self, h: Mapping[str, str], body: bytes, checked: str, peer: Peer | str = "") -> Response:
        content_type = checked or self._check(h, len(body))
        encoding = h.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            try:  # a push of a few KiB inflates here; a larger one waits its turn before it inflates further
                body = decompress(body, encoding, min(census.SMALL_BODY, self.max_body_bytes))
            except _Failure as exc:
                if exc.status != 413:
                    raise
                with self._decoding:
                    data = decompress(body, encoding, self.max_body_bytes)
                    return 200, content_type, self._store_body(data, content_type, peer)
        return 200, content_type, self.store_body(body, content_type, peer)

    def store_body(self, data: bytes, content_type: str, peer: Peer | str = "") -> bytes:
        """One export request's decompressed body decoded, translated and stored; returns the
        ``ExportMetricsServiceResponse`` body (``partial_success`` when points were refused). The one path
        after the body is read, for OTLP/HTTP and OTLP/gRPC alike. Raises ``ExportFailure(400)`` for a body
        that does not decode, ``ExportFailure(413)`` for one that would make more than ``request_limits``
        allow (``otlp.census``); the store is then untouched. Counts nothing in ``requests_total``. ``peer``:
        the sender's address (``core.clientid``). Bodies over ``census.SMALL_BODY`` are decoded
        ``DECODING_AT_ONCE`` at a time (whichever thread and port they came from)."""
        if len(data) <= census.SMALL_BODY:
            return self._store_body(data, content_type, peer)
        with self._decoding:
            return self._store_body(data, content_type, peer)

    def _store_body(self, data: bytes, content_type: str, peer: Peer | str) -> bytes:
        request = decode_wire(data, content_type, self.request_limits)
        try:
            batch = translate_request(request, time.time_ns(), self.store.limits, peer, self.request_limits)
        except Undecodable:
            decode(data, content_type)  # raises the 400 OTLP's own parser gives this body
            raise
        except census.TooMuch as exc:
            raise _Failure(413, str(exc)) from None
        del request  # what the parse made is not needed while the store applies the batch
        result = self.store.apply(batch)
        rejected = sum(result.rejected.values())
        message = ""
        if rejected:
            # each reason's message is cut on its own, so that every reason and its flag stay readable
            parts = [f"{n} {reason}: {result.messages.get(reason, '')[:400]}"
                     for reason, n in sorted(result.rejected.items())]
            message = ("rejected data points - " + "; ".join(parts))[:8000]
        if result.notices:  # accepted, but not as sent (a run id taken by another identity, scoped)
            message = ("; ".join(m[:400] for m in result.notices[:4]) + ("; " + message if message else ""))[:8000]
        return _response_body(rejected, message, content_type)


# ----------------------------------------------------------------------------------------------------
# the server


class OTLPReceiver:
    """``POST /v1/metrics`` on its own listening socket (a ``http.server.HTTPServer``), feeding ``store``.

    The address is bound when ``start()`` is called (``ConfigError`` when it cannot be used); serving runs
    on a daemon thread until ``shutdown()``. ``handle_export`` works without starting, for mounting the
    receiver on another server.
    """

    def __init__(
        self,
        address: tuple[str, int],
        store: TrainingStore,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        bearer_token: str | None = None,
        path: str = PATH,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        request_limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
        handler: ExportHandler | None = None,  # (its own request_limits, then)
        unix_path: str | None = None,
        splice: Splice | None = None,
    ) -> None:
        self.address = address
        self.unix_path = unix_path
        self.splice = splice
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.path = path
        self.store = store
        self.handler = handler or ExportHandler(store, max_body_bytes=max_body_bytes, bearer_token=bearer_token,
                                                request_limits=request_limits)
        self._server: HTTPServer | None = None
        self._started = False

    def handle_export(self, headers: Mapping[str, str], body: bytes) -> Response:
        return self.handler.handle_export(headers, body)

    def route(self, req: Request) -> WebResponse:
        """The ``http.server.HTTPServer`` route handler for ``POST /v1/metrics``."""
        headers = dict(req.headers.items())
        h = self.handler._lower(headers)
        declared = req.headers.get("Content-Length", "").strip()
        # The server refused a declared size over max_body_bytes before buffering anything, and holds a
        # bounded total of bodies per port; auth and type are checked here before the body is parsed.
        early = self.handler._preflight(h, headers, int(declared) if declared.isdigit() else 0)
        if not isinstance(early, str):
            return _web_response(early)
        try:
            # Undecoded: the handler inflates gzip and deflate itself, within the same limit.
            body = req.read_body(self.handler.max_body_bytes, decode=False)
        except HTTPError as exc:
            return _web_response(self.handler.fail(exc.status, exc.message, headers,
                                                   "body" if exc.status == 400 else None))
        # within max_body_bytes (read_body): what the preflight checked holds for it, not checked twice
        peer = self.handler.identify(self.handler.identities.connection_peer(req), h.get("authorization", ""))
        return _web_response(self.handler._export(h, body, early, peer))

    def unix_peer(self, info: Any) -> Peer:
        """The identity of a Unix-socket connection (its ``http.connection.ConnectionInfo``): ``SO_PEERCRED``."""
        return self.handler.identities.unix_peer(info)

    @property
    def http_server(self) -> HTTPServer | None:
        """The running ``http.server.HTTPServer`` (its self-metrics), or None when not started."""
        return self._server

    @property
    def server_address(self) -> tuple[str, int]:
        """The bound (host, port); the real port when started on port 0."""
        if self._server is None:
            raise RuntimeError("OTLPReceiver is not started")
        return self._server.server_address

    def bind(self) -> OTLPReceiver:
        """Bind the listening socket without serving yet (``ConfigError`` when the address cannot be
        used), so that a daemon can bind all its ports before it announces any."""
        if self._server is None:
            auth = "bearer token " + ("on" if self.handler.bearer_required else "off")
            # The server buffers a whole body before the route runs (so a slow client never holds a worker):
            # its limit is ours; gzip is inflated by the handler within the same limit.
            self._server = HTTPServer(self.address, {("POST", self.path): self.route},
                                      name="otlp-unix" if self.unix_path else "otlp", auth=auth,
                                      max_body_bytes=self.handler.max_body_bytes,
                                      max_connections=self.max_connections, request_timeout=self.request_timeout,
                                      inline=_inline, unix_path=self.unix_path, splice=self.splice)
        return self

    def start(self) -> OTLPReceiver:
        if self._started:
            raise RuntimeError("OTLPReceiver already started")
        self.bind()
        assert self._server is not None
        self._server.start()
        self._started = True
        return self

    def shutdown(self) -> None:
        server, self._server = self._server, None
        self._started = False
        if server is not None:
            server.shutdown()

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


#: Uncompressed pushes up to this size are handled on the server's selector thread (``HTTPServer``'s
#: ``inline``): one rank's export is a few KiB and costs a fraction of a millisecond to store, less than the
#: hand-off to a worker thread and back. Larger or compressed bodies (which may inflate to
#: --otlp.max-body-bytes) go to the worker pool, so the selector never runs a long request.
INLINE_MAX_BODY = 64 * 1024


def _inline(req: Request) -> bool:
    if req.body_length > INLINE_MAX_BODY:
        return False
    if req.connection is not None and req.connection.identity is None:
        return False  # a connection's first request: finding its peer reads /proc, off the selector thread
    encoding = req.headers.get("Content-Encoding")
    return encoding is None or encoding.strip().lower() in ("", "identity")


def _web_response(response: Response) -> WebResponse:
    status, content_type, body = response
    if status == 200 and not body:
        return _EMPTY_OK[content_type]  # a full success in protobuf: one object, so the server reuses its bytes
    headers = {"Content-Type": content_type}
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="otlp"'
    return WebResponse(status, body, headers)


#: The web response to a full success in protobuf (read-only headers: ``http.messages.serialise`` reuses its bytes).
_EMPTY_OK = {ct: WebResponse(200, b"", MappingProxyType({"Content-Type": ct})) for ct in (PROTOBUF, JSON)}

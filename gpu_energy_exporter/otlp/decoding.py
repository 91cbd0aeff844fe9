"""OTLP request bodies to messages: undoing ``Content-Encoding`` within the size limit, counting what the body
would make (``otlp.census``), and parsing protobuf into ``wire.WireRequest`` or OTLP/JSON through
``otlp.jsonwire`` (else protobuf's generic JSON parser). Every failure is a ``DecodeFailure`` with the HTTP
status and one message saying what is wrong; the receivers (``otlp.receiver`` for HTTP, ``otlp.grpcreceiver``
through it) turn it into their answer.

Pure: bytes in, a message or ``DecodeFailure`` out; never touches the store, never performs I/O.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from gpu_energy_exporter.http.codec import GZIP, RAW_DEFLATE, ZLIB, BodyTooLarge, MalformedBody, TruncatedBody, inflate
from gpu_energy_exporter.otlp import census, jsonwire
from gpu_energy_exporter.otlp.census import DEFAULT_REQUEST_LIMITS, RequestLimits
from gpu_energy_exporter.otlp.status import JSON
from gpu_energy_exporter.otlp.wire import WireRequest


class DecodeFailure(Exception):
    """A request refused with an HTTP status and one message (``field``: what a 400 names)."""

    def __init__(self, status: int, message: str, field: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field



def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo ``Content-Encoding`` with the size limit applied to the output (``http.codec.inflate``)."""
    try:
        if encoding in ("gzip", "x-gzip"):
            return inflate(body, limit, GZIP)
        if encoding == "deflate":
            # HTTP "deflate" means zlib-wrapped, but some clients send raw deflate: accept both.
            try:
                return inflate(body, limit, ZLIB)
            except MalformedBody:
                return inflate(body, limit, RAW_DEFLATE)
    except MalformedBody as exc:
        raise DecodeFailure(400, f"body is not valid {encoding} data: {exc}", "body") from None
    except TruncatedBody:
        raise DecodeFailure(400, "compressed body is truncated", "body") from None
    except BodyTooLarge:
        raise DecodeFailure(413, f"request body exceeds {limit} bytes after decompression "
                            "(--otlp.max-body-bytes)") from None
    return body


def _load_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise DecodeFailure(400, f"body is not valid JSON: {exc}", "body") from None


def _parse_json(doc: Any) -> ExportMetricsServiceRequest:
    """The generic OTLP/JSON parse of a loaded document (``ParseDict``); ``DecodeFailure(400)`` saying what is wrong."""
    request = ExportMetricsServiceRequest()
    if not isinstance(doc, dict):
        raise DecodeFailure(400, "JSON body must be an ExportMetricsServiceRequest object", "body")
    try:
        jsonwire.strip_exemplars(doc)
        json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise DecodeFailure(400, f"JSON body is not an OTLP ExportMetricsServiceRequest: {exc}",
                       "resourceMetrics") from None
    return request


def decode(body: bytes, content_type: str) -> ExportMetricsServiceRequest:
    """Parse an export request body; raises ``DecodeFailure(400)`` with a message saying what is wrong."""
    if content_type == JSON:
        return _parse_json(_load_json(body))
    request = ExportMetricsServiceRequest()
    try:
        request.ParseFromString(body)
    except Exception as exc:  # DecodeError, or whatever the C parser raises on garbage
        raise DecodeFailure(400, f"body is not a protobuf ExportMetricsServiceRequest: {exc}",
                       "resource_metrics") from None
    return request


def _count(body: bytes, limits: RequestLimits, as_json: bool = False) -> None:
    """``census`` (``json_census``) of a body about to be parsed: ``DecodeFailure(413)`` naming the limit and its
    flag when it would make more than ``limits`` allow, before anything is built for it."""
    if len(body) <= census.SMALL_BODY:
        return  # a rank's export: it cannot make much (census), and pays nothing
    try:
        if as_json:
            census.json_census(body, limits)
        else:
            census.census(body, limits)
    except census.TooMuch as exc:
        raise DecodeFailure(413, str(exc)) from None


def decode_wire(body: bytes, content_type: str, limits: RequestLimits = DEFAULT_REQUEST_LIMITS) -> Message:
    """``decode``, into a ``wire.WireRequest`` (data-point attributes left as bytes: see ``otlp.wire``); JSON
    bodies through ``otlp.jsonwire`` when it handles them, else the generic parser. A protobuf body that parses
    so and not as OTLP's type fails in ``translate_request`` (``wire.Undecodable``); ``_handle`` then answers
    what ``decode`` says. Every body is counted first (``otlp.census``): one that would make more than
    ``limits`` allow is refused (413) before it is parsed."""
    if content_type == JSON:
        _count(body, limits, as_json=True)
        doc = _load_json(body)
        try:
            # the fast path (``otlp.jsonwire``): the same message as ParseDict gives, or Unsupported
            encoded = jsonwire.encode(doc)
        except jsonwire.Unsupported:
            return _parse_json(doc)
        del doc  # the document is the larger: gone before the parse
        _count(encoded, limits)
        return WireRequest.FromString(encoded)
    _count(body, limits)
    request = WireRequest()
    try:
        request.ParseFromString(body)
    except Exception:  # what OTLP's own type says about it
        decode(body, content_type)
        raise
    return request



"""``google.rpc.Status`` error bodies of the OTLP receivers, encoded by hand: the exporter depends on
protobuf and opentelemetry-proto only, and googleapis-common-protos (which defines Status) is not among
them. Pure functions; the content types are the two OTLP/HTTP encodings.
"""

from __future__ import annotations

import json
from typing import Any

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

# google.rpc.Code for each HTTP status we answer with (the OTLP spec lets servers omit it; it helps
# whoever reads a captured response).
_RPC_CODES = {400: 3, 401: 16, 413: 8, 415: 3, 500: 13}
_BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def status_body(status: int, message: str, content_type: str, field: str | None = None) -> bytes:
    """A ``google.rpc.Status`` for an error response, in protobuf or OTLP JSON. With ``field`` set
    (400 responses) it carries a ``google.rpc.BadRequest`` detail naming it."""
    code = _RPC_CODES.get(status, 2)
    if content_type == JSON:
        doc: dict[str, Any] = {"code": code, "message": message}
        if field is not None:
            doc["details"] = [{"@type": _BAD_REQUEST_TYPE,
                               "fieldViolations": [{"field": field, "description": message}]}]
        return json.dumps(doc, allow_nan=False).encode()
    out = _varint(1 << 3) + _varint(code) + _len_field(2, message.encode())
    if field is not None:
        violation = _len_field(1, field.encode()) + _len_field(2, message.encode())
        bad_request = _len_field(1, violation)
        out += _len_field(3, _len_field(1, _BAD_REQUEST_TYPE.encode()) + _len_field(2, bad_request))
    return out

"""OTLP JSON bodies straight to protobuf bytes: the fast path of the receiver's JSON decoding.

The generic protobuf JSON parser (``json_format.ParseDict``) costs about 85 µs per data point, most of the
receiver's time on a JSON push. ``encode(doc)`` walks the ``json.loads`` document of an
``ExportMetricsServiceRequest`` with tables built from OTLP's own descriptors and writes the protobuf bytes
the parsed message would serialise to; the receiver then parses them as it parses a protobuf body
(``wire.WireRequest``), so everything after decoding is the protobuf path.

It accepts only a strict subset of what the OTLP/JSON mapping allows, and raises ``Unsupported`` for
anything else, the receiver then falling back to ``ParseDict`` (which accepts it or gives today's error
message). Accepted: field names in lowerCamelCase or as in the proto (never both for one field, never two
members of a oneof); strings; booleans; integers as JSON numbers or decimal strings, in the field's range;
doubles as JSON numbers or the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``; enums by number or name;
nested messages and lists. ``exemplars`` of data points are skipped (as the slow path strips them). Falls
back on: unknown keys, ``null``, bytes and any other type or range, and ``exponentialHistogram`` (which the
translation rejects anyway).

``strip_exemplars`` prepares a document for that generic parser (in place).

Pure: tables are built at import; never performs I/O and never holds state.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from gpu_energy_exporter.core.bounded_memo import remember


class Unsupported(Exception):
    """The document is outside what ``encode`` handles: decode it with the generic parser."""


_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64 = (0, (1 << 64) - 1)
_UINT32 = (0, (1 << 32) - 1)
_INT32 = (-(1 << 31), (1 << 31) - 1)
_RANGES = {
    FieldDescriptor.TYPE_INT64: _INT64, FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_UINT64: _UINT64, FieldDescriptor.TYPE_FIXED64: _UINT64,
    FieldDescriptor.TYPE_UINT32: _UINT32, FieldDescriptor.TYPE_FIXED32: _UINT32,
    FieldDescriptor.TYPE_INT32: _INT32, FieldDescriptor.TYPE_SFIXED32: _INT32,
}
_FIXED64 = (FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64)
_FIXED32 = (FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32)
_DOUBLE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_pack_double = struct.Struct("<d").pack

# field kinds
_MESSAGE, _STRING, _BOOL, _INT, _DOUBLE, _ENUM = range(6)


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # negative int32/int64: ten bytes, two's complement
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


#: ``_varint(n)`` for the lengths of most strings and small messages.
_SMALL = [_varint(n) for n in range(128)]


class _Field:
    __slots__ = ("bit", "tag", "kind", "repeated", "table", "oneof", "wire", "range", "enum")

    def __init__(self, fd: FieldDescriptor, tables: dict[str, dict[str, _Field]]) -> None:
        if fd.number >= 30:
            raise KeyError  # the masks below stay small integers (OTLP's metrics messages number fields < 30)
        self.bit = 1 << fd.number  # in the mask of the fields a message already set (both spellings: one field)
        self.repeated = bool(fd.is_repeated) if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        oneof = fd.containing_oneof
        # the oneof's members share one bit of their own, above every field number
        self.oneof = 1 << (30 + oneof.index) if oneof is not None else 0
        self.table: dict[str, _Field] | None = None
        self.range = _RANGES.get(fd.type)
        self.enum: dict[object, int] | None = None
        t = fd.type
        if t == FieldDescriptor.TYPE_MESSAGE:
            self.kind, self.wire = _MESSAGE, 2
            self.table = _table(fd.message_type, tables)
        elif t == FieldDescriptor.TYPE_STRING:
            self.kind, self.wire = _STRING, 2
        elif t == FieldDescriptor.TYPE_BOOL:
            self.kind, self.wire = _BOOL, 0
        elif t == FieldDescriptor.TYPE_DOUBLE:
            self.kind, self.wire = _DOUBLE, 1
        elif t == FieldDescriptor.TYPE_ENUM:
            self.kind, self.wire = _ENUM, 0
            self.enum = {v.number: v.number for v in fd.enum_type.values}
            self.enum.update({v.name: v.number for v in fd.enum_type.values})
        elif self.range is not None:
            self.kind = _INT
            self.wire = 1 if t in _FIXED64 else 5 if t in _FIXED32 else 0
        else:
            raise KeyError  # bytes, float, sint: not supported (the field falls back)
        # a repeated scalar is written packed (proto3's default); the tag is the one for its form
        self.tag = _varint(fd.number << 3 | (2 if self.repeated and self.kind != _MESSAGE and
                                             self.kind != _STRING else self.wire))


def _table(desc: Descriptor, tables: dict[str, dict[str, _Field]]) -> dict[str, _Field]:
    """Both spellings of each supported field of ``desc`` (fields of unsupported types are left out: a
    document using one falls back)."""
    table = tables.get(desc.full_name)
    if table is not None:
        return table
    table = tables[desc.full_name] = {}
    for fd in desc.fields:
        if fd.name == "exponential_histogram" or fd.name == "exemplars":
            continue
        try:
            field = _Field(fd, tables)
        except KeyError:
            continue
        table[fd.name] = field
        table[fd.json_name] = field
    return table


_TABLES: dict[str, dict[str, _Field]] = {}
_ROOT = _table(ExportMetricsServiceRequest.DESCRIPTOR, _TABLES)
_KEY_VALUE = _TABLES["opentelemetry.proto.common.v1.KeyValue"]
#: Messages whose ``exemplars`` are skipped (the slow path strips them before parsing).
_WITH_EXEMPLARS = frozenset(id(_TABLES[name]) for name in (
    "opentelemetry.proto.metrics.v1.NumberDataPoint", "opentelemetry.proto.metrics.v1.HistogramDataPoint"))


def encode(doc: Any) -> bytes:
    """The protobuf bytes of the ``ExportMetricsServiceRequest`` that OTLP/JSON document ``doc`` (from
    ``json.loads``) describes; ``Unsupported`` when it is outside the subset handled here."""
    try:
        return _message(doc, _ROOT)
    except (RecursionError, UnicodeEncodeError, OverflowError, ValueError):
        raise Unsupported from None


def _message(doc: Any, table: dict[str, _Field]) -> bytes:
    if type(doc) is not dict:
        raise Unsupported
    out: list[bytes | bytearray] = []
    append = out.append
    seen = 0  # field bits, and one bit per oneof with a member set
    for key, value in doc.items():
        field = table.get(key)
        if field is None:
            if key == "exemplars" and id(table) in _WITH_EXEMPLARS:
                continue
            raise Unsupported
        bits = field.bit | field.oneof
        if seen & bits or value is None:
            raise Unsupported
        seen |= bits
        kind = field.kind
        if not field.repeated:
            append(field.tag)
            if kind == _MESSAGE:
                data = _message(value, field.table)  # type: ignore[arg-type]
            elif kind == _STRING:
                if type(value) is not str:
                    raise Unsupported
                data = value.encode("utf-8")
            else:
                append(_raw(value, field))
                continue
            n = len(data)
            append(_SMALL[n] if n < 128 else _varint(n))
            append(data)
            continue
        if type(value) is not list:
            raise Unsupported
        if field.table is _KEY_VALUE:
            for item in value:
                append(field.tag)
                append(_key_value(item, field))
        elif kind == _MESSAGE or kind == _STRING:
            for item in value:
                if item is None:
                    raise Unsupported
                append(field.tag)
                append(_scalar(item, field))
        elif value:
            # one growing buffer: a list of per-element bytes costs about 50 bytes an element, so a gzip body
            # of a few KiB holding millions of zeros would take gigabytes before any limit is checked
            packed = bytearray()
            for item in value:
                packed += _raw(item, field)
            append(field.tag)
            append(_varint(len(packed)))
            append(packed)
    return b"".join(out)


#: Encoded attributes (``_scalar`` of a ``KeyValue``) by (key, value field, value, its type): a sender repeats
#: the same few on every data point. Only what encoded without error is kept; bounded like translate's caches.
_KV_MEMO: dict[tuple[str, str, object, type], bytes] = {}
_KV_MEMO_MAX = 4096
_KV_MEMO_KEY_MAX = 256


def _key_value(item: Any, field: _Field) -> bytes:
    """``_scalar(item, field)`` for one attribute, memoised when it has the usual shape (a key and a value of
    one string, integer or boolean)."""
    if type(item) is dict and len(item) == 2:
        key, value = item.get("key"), item.get("value")
        if type(key) is str and type(value) is dict and len(value) == 1:
            ((which, v),) = value.items()
            t = type(v)
            if t is str or t is int or t is bool:
                memo_key = (key, which, v, t)
                out = _KV_MEMO.get(memo_key)
                if out is None:
                    out = _scalar(item, field)
                    if len(key) + len(which) + (len(v) if t is str else 20) <= _KV_MEMO_KEY_MAX:
                        remember(_KV_MEMO, memo_key, out, _KV_MEMO_MAX)
                return out
    if item is None:
        raise Unsupported
    return _scalar(item, field)


def _scalar(value: Any, field: _Field) -> bytes:
    """One field's value as it follows its tag (length-prefixed for messages and strings)."""
    kind = field.kind
    if kind == _MESSAGE:
        assert field.table is not None
        data = _message(value, field.table)
    elif kind == _STRING:
        if type(value) is not str:
            raise Unsupported
        data = value.encode("utf-8")
    else:
        return _raw(value, field)
    n = len(data)
    return (_SMALL[n] if n < 128 else _varint(n)) + data


def _raw(value: Any, field: _Field) -> bytes:
    """A number or boolean's encoding without tag (also each element of a packed list)."""
    kind = field.kind
    if kind == _DOUBLE:
        t = type(value)
        if t is float:
            if not math.isfinite(value):
                raise Unsupported
        elif t is int:
            value = float(value)
        elif t is str and value in _DOUBLE_STRINGS:
            value = _DOUBLE_STRINGS[value]
        else:
            raise Unsupported
        return _pack_double(value)
    if kind == _INT:
        t = type(value)
        if t is str:
            digits = value[1:] if value[:1] == "-" else value
            if not (digits.isascii() and digits.isdigit()):
                raise Unsupported
            value = int(value)
        elif t is not int:
            raise Unsupported
        lo, hi = field.range  # type: ignore[misc]
        if not lo <= value <= hi:
            raise Unsupported
        if field.wire == 1:
            return value.to_bytes(8, "little", signed=value < 0)
        if field.wire == 5:
            return value.to_bytes(4, "little", signed=value < 0)
        return _varint(value)
    if kind == _BOOL:
        if type(value) is not bool:
            raise Unsupported
        return b"\x01" if value else b"\x00"
    if kind == _ENUM:
        assert field.enum is not None
        if type(value) is bool:
            raise Unsupported
        number = field.enum.get(value) if type(value) in (int, str) else None
        if number is None:
            raise Unsupported
        return _varint(number)
    raise Unsupported


# ----------------------------------------------------------------------------------------------------
# the generic parser's preparation (``otlp.receiver``)


def strip_exemplars(doc: Any) -> None:
    """Drop exemplars before JSON parsing: they are not exposed, and OTLP JSON encodes their trace and
    span ids as hex where the generic protobuf JSON parser expects base64."""
    for rm in _items(doc, "resourceMetrics", "resource_metrics"):
        for sm in _items(rm, "scopeMetrics", "scope_metrics"):
            for metric in _items(sm, "metrics"):
                if not isinstance(metric, dict):
                    continue
                for key in ("gauge", "sum", "histogram", "exponentialHistogram", "exponential_histogram"):
                    for dp in _items(metric.get(key), "dataPoints", "data_points"):
                        if isinstance(dp, dict):
                            dp.pop("exemplars", None)


def _items(doc: Any, *keys: str) -> list[Any]:
    if not isinstance(doc, dict):
        return []
    for key in keys:
        value = doc.get(key)
        if isinstance(value, list):
            return value
    return []

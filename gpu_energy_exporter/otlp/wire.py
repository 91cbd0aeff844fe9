"""The message type the receiver parses protobuf bodies into: OTLP's ``ExportMetricsServiceRequest`` with
every data point's ``attributes`` left as the bytes of its ``KeyValue`` messages.

Why: a trainer sends the same few attribute lists (run id, rank, GPU) on every data point of every export.
Their translation is cached by their bytes (``translate``), and with OTLP's own types those bytes had to be
rebuilt with ``SerializeToString`` per attribute and point, the largest single cost of a push. Declared as
``bytes`` (a length-delimited field either way: the wire format is the same), the parser hands them over as
sent. A ``KeyValue`` is parsed (``key_value``) only the first time its bytes are seen, with OTLP's type, so
a malformed or non-UTF-8 one is refused as the full parse would refuse it (``Undecodable``: the receiver
then answers what the full parse says).

Everything else (resources, scopes, metrics, values, exemplars) is OTLP's definition unchanged, in a
descriptor pool of its own (the default pool keeps OTLP's types untouched). ``as_wire`` converts an OTLP
``ExportMetricsServiceRequest`` (from the JSON mapping, or a test) by serialising it once.

Pure: builds message classes at import; never performs I/O and never holds state.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2

#: The data-point messages whose ``attributes`` (``repeated KeyValue``) arrive as ``repeated bytes``.
DATA_POINTS = ("NumberDataPoint", "HistogramDataPoint", "ExponentialHistogramDataPoint", "SummaryDataPoint")


class Undecodable(Exception):
    """A data point's attribute is not a valid ``KeyValue`` (the full parse of the body would fail)."""


def _build() -> Any:
    pool = descriptor_pool.DescriptorPool()
    for module in (common_pb2, resource_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    metrics = descriptor_pb2.FileDescriptorProto.FromString(metrics_pb2.DESCRIPTOR.serialized_pb)
    for msg in metrics.message_type:
        if msg.name in DATA_POINTS:
            for fld in msg.field:
                if fld.name == "attributes":
                    fld.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                    fld.ClearField("type_name")
    pool.Add(metrics)
    pool.AddSerializedFile(metrics_service_pb2.DESCRIPTOR.serialized_pb)
    name = metrics_service_pb2.ExportMetricsServiceRequest.DESCRIPTOR.full_name
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


#: ``ExportMetricsServiceRequest`` with data-point attributes as bytes (``ParseFromString`` as usual).
WireRequest = _build()


def as_wire(request: Message) -> Message:
    """``request`` as a ``WireRequest`` (itself when it already is one)."""
    if isinstance(request, WireRequest):
        return request
    return WireRequest.FromString(request.SerializeToString())


def key_value(raw: bytes) -> common_pb2.KeyValue:
    """One attribute's bytes as OTLP's ``KeyValue``; ``Undecodable`` when they are not one."""
    try:
        return common_pb2.KeyValue.FromString(raw)
    except Exception as exc:  # DecodeError, or whatever the C parser raises on garbage
        raise Undecodable(str(exc)) from None

"""OTLP request bodies that cost the receiver as much as a body of their size can (issue 29): each is a
function of a size or count, built with protobuf's wire format by hand (so it can say what OTLP's own
types would refuse to build), shared by ``bench.otlp_bounds`` and the tests.

Pure: builds bytes; never opens a socket.
"""

from __future__ import annotations

import time


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def fixed64(number: int, value: int) -> bytes:
    return varint(number << 3 | 1) + value.to_bytes(8, "little")


def double(number: int, value: float) -> bytes:
    import struct

    return varint(number << 3 | 1) + struct.pack("<d", value)


def string_kv(key: str, value: str) -> bytes:
    """A ``KeyValue`` with a string value."""
    return field(1, key.encode()) + field(2, field(1, value.encode()))


def request(metrics: bytes, resource: bytes = b"") -> bytes:
    """``metrics`` (encoded ``Metric`` fields, each ``field(2, metric)``) in one resource and one scope."""
    rm = (field(1, resource) if resource else b"") + field(2, metrics)
    return field(1, rm)


def empty_resources(size: int) -> bytes:
    """``size`` bytes of empty ``ResourceMetrics`` (``0a 00`` repeated): the issue's 8 KB gzip'd body."""
    return b"\x0a\x00" * (size // 2)


def gauge_points(n: int, attributes: int = 3, distinct: bool = True, per_metric: int = 0) -> bytes:
    """``n`` gauge points with ``attributes`` string attributes each (a run id, and ``k<i>``), all in one metric
    (``per_metric`` 0) or ``per_metric`` to a metric; ``distinct``: every point its own series."""
    now = time.time_ns()
    points = []
    for i in range(n):
        attrs = b"".join(field(7, string_kv(f"k{a}", f"v{i if distinct else 0}-{a}")) for a in range(attributes - 1))
        points.append(field(1, field(7, string_kv("run_id", "hostile")) + attrs + fixed64(3, now) + double(4, 1.0)))
    if not per_metric:
        return request(field(2, field(1, b"hostile_gauge") + field(5, b"".join(points))))
    metrics = [field(2, field(1, f"hostile_{j}".encode()) + field(5, b"".join(points[j:j + per_metric])))
               for j in range(0, n, per_metric)]
    return request(b"".join(metrics))


def histogram_points(n: int, buckets: int) -> bytes:
    """``n`` cumulative histogram points (distinct series) of ``buckets`` buckets each."""
    import struct

    now = time.time_ns()
    bounds = struct.pack(f"<{buckets - 1}d", *(float(b) for b in range(buckets - 1)))
    counts = struct.pack(f"<{buckets}Q", *([1000] * buckets))
    points = [field(1, field(9, string_kv("run_id", "hostile")) + field(9, string_kv("i", str(i))) + fixed64(3, now)
                    + fixed64(4, 1000 * buckets) + double(5, 1.0) + field(6, counts) + field(7, bounds))
              for i in range(n)]
    hist = b"".join(points) + varint(2 << 3) + varint(2)  # aggregation_temporality = CUMULATIVE
    return request(field(2, field(1, b"hostile_hist") + field(9, hist)))


def attribute_flood(size: int) -> bytes:
    """One gauge point carrying ``size`` bytes of empty attributes."""
    point = field(1, b"\x3a\x00" * (size // 2) + double(4, 1.0))
    return request(field(2, field(1, b"hostile_gauge") + field(5, point)))


def nested_values(depth: int) -> bytes:
    """A resource attribute whose value nests arrays ``depth`` deep."""
    value = b""
    for _ in range(depth):
        value = field(5, field(1, value))  # AnyValue.array_value -> ArrayValue.values
    resource = field(1, field(1, b"deep") + field(2, value))
    return request(field(2, field(1, b"g") + field(5, field(1, double(4, 1.0)))), resource)


def empty_scopes(n: int) -> bytes:
    return field(1, b"\x12\x00" * n)


def empty_metrics(n: int) -> bytes:
    return field(1, field(2, b"\x12\x00" * n))


def empty_points(n: int) -> bytes:
    return request(field(2, field(1, b"g") + field(5, b"\x0a\x00" * n)))


def empty_quantiles(n: int) -> bytes:
    """One summary point of ``n`` empty quantile values."""
    return request(field(2, field(1, b"s") + field(11, field(1, b"\x32\x00" * n))))


def empty_exemplars(n: int) -> bytes:
    """One gauge point of ``n`` empty exemplars."""
    return request(field(2, field(1, b"g") + field(5, field(1, b"\x2a\x00" * n + double(4, 1.0)))))


def resources_with_attributes(n: int, attributes: int) -> bytes:
    """``n`` resources of ``attributes`` string attributes each (distinct), each with one gauge point."""
    metric = field(2, field(1, b"g") + field(5, field(1, field(7, string_kv("run_id", "hostile")) + double(4, 1.0))))
    out = []
    for i in range(n):
        resource = b"".join(field(1, string_kv(f"attr{a}", f"value-{i}-{a}")) for a in range(attributes))
        out.append(field(1, field(1, resource) + field(2, metric)))
    return b"".join(out)


def as_json(body: bytes) -> bytes:
    """A protobuf request body as OTLP/JSON."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    return json_format.MessageToJson(ExportMetricsServiceRequest.FromString(body), indent=None).encode()

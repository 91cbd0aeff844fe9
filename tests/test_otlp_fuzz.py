"""Property-based tests of the OTLP receiver (Hypothesis): whatever a client sends, the receiver answers
without a 5xx, the store stays within its bounds, a run pushed before is served unchanged and ``/metrics``
still parses.

Three kinds of input: OTLP protobuf structures built field by field (any kind, temporality, value,
timestamp, bucket layout, attribute type), OTLP-JSON-shaped documents with leaves of any JSON type, and a
real body produced by the OpenTelemetry SDK with bits flipped, bytes cut off or spliced in. Each example
gets a fresh store (small limits, so that they are reached) with a sentinel run pushed first. Example
counts are bounded so that the file runs in well under a minute.
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
import subprocess
from typing import Any

import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from gpu_energy_exporter.otlp.receiver import ExportHandler
from gpu_energy_exporter.otlp.store import TrainingStore

PB = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}
LIMITS: dict[str, Any] = dict(max_series=60, max_series_per_run=40, max_bytes=120_000, max_series_bytes=20_000,
                              max_label_length=64, max_labels_per_point=6, max_buckets_per_point=12,
                              max_quantiles_per_point=6, max_new_series_per_request=30,
                              max_new_runs_per_request=4)
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
NOW_NS = 1_700_000_000 * 10**9
SENTINEL = b'sentinel_tokens_total{rank="0",run_id="sentinel"} 42.0\n'


def _sentinel() -> bytes:
    dp = pb.NumberDataPoint(attributes=[KeyValue(key="run_id", value=AnyValue(string_value="sentinel")),
                                        KeyValue(key="rank", value=AnyValue(int_value=0))],
                            as_int=42, start_time_unix_nano=1, time_unix_nano=NOW_NS - 10**9)
    metric = pb.Metric(name="sentinel.tokens", sum=pb.Sum(
        aggregation_temporality=pb.AGGREGATION_TEMPORALITY_CUMULATIVE, is_monotonic=True, data_points=[dp]))
    return ExportMetricsServiceRequest(resource_metrics=[pb.ResourceMetrics(
        scope_metrics=[pb.ScopeMetrics(metrics=[metric])])]).SerializeToString()


class Receiver:
    """A fresh store and handler with the sentinel run stored; ``check()`` asserts the invariants."""

    def __init__(self) -> None:
        self.store = TrainingStore(clock=lambda: 1000.0, **LIMITS)
        self.handler = ExportHandler(self.store, max_body_bytes=1 << 20)
        status, _, _ = self.handler.handle_export(PB, _sentinel())
        assert status == 200 and SENTINEL in self.store.render(False)

    def post(self, body: bytes, headers: dict[str, str]) -> int:
        status, _, _ = self.handler.handle_export(headers, body)
        assert status < 500, status
        return status

    def check(self) -> bytes:
        store = self.store
        assert store.bytes_used() <= LIMITS["max_bytes"]
        assert store.series_count() <= LIMITS["max_series"]
        text = store.render(False)
        assert SENTINEL in text
        store.render(True)
        assert store.collect()
        assert b"gpuenergy_otlp_requests_total{status=\"500\"} 0.0" in text
        _check_totals_finite(text)
        return text


def _check_totals_finite(text: bytes) -> None:
    """Counters, histogram buckets, counts and sums, summary counts and sums: finite (never +Inf/NaN)."""
    kinds: dict[str, str] = {}
    for line in text.decode().split("\n"):
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            kinds[name] = kind
        elif line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            value = float(line.rsplit(" ", 1)[1])
            family = next((name.removesuffix(sfx) for sfx in ("_bucket", "_count", "_sum", "")
                           if name.removesuffix(sfx) in kinds and name.endswith(sfx)), name)
            kind = kinds.get(family, "")
            if kind == "counter" or (kind in ("histogram", "summary") and family != name):
                assert math.isfinite(value), line


# ----------------------------------------------------------------------------------------------------
# OTLP protobuf structures

# a few names and run ids come back often, so that later requests update what earlier ones stored
_names = st.one_of(st.sampled_from(["h", "g", "c", "s", "h_bucket", "c_total", "g_count"]),
                   st.text(alphabet="ab_.:/1 X", min_size=0, max_size=6))
_key = st.one_of(st.sampled_from(["run_id", "rank", "le", "quantile", "__name__", "gpu_uuid", "a.b", "a_b", ""]),
                 st.text(alphabet="ab._-1", max_size=5), st.text(min_size=60, max_size=80))
_doubles = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e308, 5e-324]))
_time = st.one_of(st.just(0), st.integers(0, 2**64 - 1), st.integers(NOW_NS - 10**12, NOW_NS + 10**12),
                  st.just(2**64 - 1))


def _any_value(depth: int = 0) -> st.SearchStrategy[AnyValue]:
    leaves = st.one_of(
        st.builds(lambda s: AnyValue(string_value=s), st.one_of(st.text(max_size=8), st.text(min_size=60, max_size=90),
                                                                st.sampled_from(["run-1", "run-2", "r" * 5]))),
        st.builds(lambda i: AnyValue(int_value=i), st.integers(-(2**63), 2**63 - 1)),
        st.builds(lambda b: AnyValue(bool_value=b), st.booleans()),
        st.builds(lambda d: AnyValue(double_value=d), _doubles),
        st.builds(lambda b: AnyValue(bytes_value=b), st.binary(max_size=8)),
        st.just(AnyValue()),
    )
    if depth >= 2:
        return leaves
    inner = _any_value(depth + 1)
    return st.one_of(
        leaves,
        st.builds(lambda vs: AnyValue(array_value=ArrayValue(values=vs)), st.lists(inner, max_size=3)),
        st.builds(lambda kvs: AnyValue(kvlist_value=KeyValueList(values=kvs)),
                  st.lists(st.builds(KeyValue, key=_key, value=inner), max_size=3)),
    )


_attrs = st.lists(st.builds(KeyValue, key=_key, value=_any_value()), max_size=8)
_run_attrs = st.builds(lambda run, rank, extra: [KeyValue(key="run_id", value=AnyValue(string_value=run)),
                                                 KeyValue(key="rank", value=AnyValue(int_value=rank)), *extra],
                       st.sampled_from(["r1", "r2", "r3", "r4", "r5", "r6", "sentinel"]),
                       st.one_of(st.integers(0, 2), st.integers(0, 40)),
                       st.lists(st.builds(KeyValue, key=_key, value=_any_value()), max_size=2))
_point_attrs = st.one_of(_run_attrs, _attrs)


@st.composite
def _number_point(draw: st.DrawFn) -> pb.NumberDataPoint:
    dp = pb.NumberDataPoint(attributes=draw(_point_attrs), start_time_unix_nano=draw(_time),
                            time_unix_nano=draw(_time), flags=draw(st.sampled_from([0, 0, 0, 1, 2])))
    which = draw(st.sampled_from(["double", "int", "none"]))
    if which == "double":
        dp.as_double = draw(_doubles)
    elif which == "int":
        dp.as_int = draw(st.integers(-(2**63), 2**63 - 1))
    return dp


@st.composite
def _histogram_point(draw: st.DrawFn) -> pb.HistogramDataPoint:
    bounds = draw(st.one_of(
        st.lists(st.floats(-1e3, 1e3), max_size=16, unique=True).map(sorted),
        st.lists(st.floats(allow_nan=True), max_size=5)))
    counts = draw(st.one_of(st.just([]), st.lists(st.integers(0, 2**64 - 1), min_size=len(bounds) + 1,
                                                  max_size=len(bounds) + 1),
                            st.lists(st.integers(0, 10), max_size=18)))
    total = sum(counts) if counts and draw(st.booleans()) else draw(st.integers(0, 2**64 - 1))
    dp = pb.HistogramDataPoint(attributes=draw(_point_attrs), explicit_bounds=bounds, bucket_counts=counts,
                               count=min(total, 2**64 - 1), start_time_unix_nano=draw(_time),
                               time_unix_nano=draw(_time), flags=draw(st.sampled_from([0, 0, 1])))
    if draw(st.booleans()):
        dp.sum = draw(_doubles)
    return dp


@st.composite
def _summary_point(draw: st.DrawFn) -> pb.SummaryDataPoint:
    quantiles = draw(st.lists(st.builds(pb.SummaryDataPoint.ValueAtQuantile, quantile=_doubles, value=_doubles),
                              max_size=8))
    return pb.SummaryDataPoint(attributes=draw(_point_attrs), quantile_values=quantiles,
                               count=draw(st.integers(0, 2**64 - 1)), sum=draw(_doubles),
                               time_unix_nano=draw(_time), start_time_unix_nano=draw(_time))


@st.composite
def _metric(draw: st.DrawFn) -> pb.Metric:
    metric = pb.Metric(name=draw(_names), unit=draw(st.sampled_from(["", "s", "1", "By", "{token}", "ms/s", "%"])),
                       description=draw(st.text(max_size=10)))
    kind = draw(st.sampled_from(["gauge", "sum", "histogram", "summary", "exp", "none"]))
    temporality = draw(st.sampled_from([0, 1, 2, 2]))
    if kind == "gauge":
        metric.gauge.data_points.extend(draw(st.lists(_number_point(), max_size=6)))
    elif kind == "sum":
        metric.sum.aggregation_temporality = temporality
        metric.sum.is_monotonic = draw(st.booleans())
        metric.sum.data_points.extend(draw(st.lists(_number_point(), max_size=6)))
    elif kind == "histogram":
        metric.histogram.aggregation_temporality = temporality
        metric.histogram.data_points.extend(draw(st.lists(_histogram_point(), max_size=4)))
    elif kind == "summary":
        metric.summary.data_points.extend(draw(st.lists(_summary_point(), max_size=4)))
    elif kind == "exp":
        metric.exponential_histogram.aggregation_temporality = temporality
        metric.exponential_histogram.data_points.add(count=1, scale=draw(st.integers(-10, 20)))
    return metric


@st.composite
def _request(draw: st.DrawFn) -> ExportMetricsServiceRequest:
    rms = []
    for _ in range(draw(st.integers(1, 2))):
        rm = pb.ResourceMetrics(scope_metrics=[pb.ScopeMetrics(metrics=draw(st.lists(_metric(), max_size=5)))])
        rm.resource.attributes.extend(draw(_attrs))
        rms.append(rm)
    return ExportMetricsServiceRequest(resource_metrics=rms)


def _encode(request: ExportMetricsServiceRequest, how: str) -> tuple[bytes, dict[str, str]]:
    if how == "json":
        return json_format.MessageToJson(request).encode(), JSON
    body = request.SerializeToString()
    if how == "gzip":
        return gzip.compress(body), {**PB, "Content-Encoding": "gzip"}
    return body, PB


@SETTINGS
@given(st.lists(st.tuples(_request(), st.sampled_from(["pb", "pb", "json", "gzip"])), min_size=1, max_size=4))
def test_protobuf_structures(requests: list[tuple[ExportMetricsServiceRequest, str]]) -> None:
    receiver = Receiver()
    for request, how in requests:
        body, headers = _encode(request, how)
        if len(body) <= 1 << 20:
            receiver.post(body, headers)
        receiver.check()


# ----------------------------------------------------------------------------------------------------
# OTLP-JSON-shaped documents with leaves of any JSON type

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                       st.text(max_size=6), st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "12", "0x1"]))
_json_any = st.recursive(_json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                         max_leaves=8)


def _maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(value, _json_any)


_json_attr = st.fixed_dictionaries({"key": _maybe(st.sampled_from(["run_id", "rank", "x.y"])),
                                    "value": _maybe(st.fixed_dictionaries({
                                        "stringValue": _maybe(st.sampled_from(["r1", "r2", "sentinel"]))}))})
_json_point = st.fixed_dictionaries({
    "attributes": _maybe(st.lists(_json_attr, max_size=3)),
    "timeUnixNano": _maybe(st.sampled_from([str(NOW_NS), "0", "18446744073709551615", str(NOW_NS * 2)])),
}, optional={"asDouble": _maybe(st.sampled_from([1.0, "NaN", "Infinity", -1])), "asInt": _maybe(st.just("7")),
             "bucketCounts": _maybe(st.lists(st.sampled_from(["1", "2", 3]), max_size=4)),
             "explicitBounds": _maybe(st.lists(st.floats(allow_nan=False), max_size=3)),
             "count": _maybe(st.just("3")), "sum": _maybe(st.just(1.5)),
             "quantileValues": _maybe(st.lists(st.fixed_dictionaries({"quantile": _json_any, "value": _json_any}),
                                               max_size=3))})
_json_name = _maybe(st.sampled_from(["a", "b.c", "a_count", "target_info"]))
_json_metric = st.fixed_dictionaries({"name": _json_name}, optional={
    kind: _maybe(st.fixed_dictionaries({"dataPoints": _maybe(st.lists(_json_point, max_size=3))},
                                       optional={"aggregationTemporality": _maybe(st.sampled_from([1, 2, 3, "X"])),
                                                 "isMonotonic": _maybe(st.booleans())}))
    for kind in ("gauge", "sum", "histogram", "summary", "exponentialHistogram")})
_json_doc = st.fixed_dictionaries({"resourceMetrics": _maybe(st.lists(st.fixed_dictionaries({
    "resource": _maybe(st.fixed_dictionaries({"attributes": _maybe(st.lists(_json_attr, max_size=2))})),
    "scopeMetrics": _maybe(st.lists(st.fixed_dictionaries({"metrics": _maybe(st.lists(_json_metric, max_size=3))}),
                                    max_size=2))}), max_size=2))})


@SETTINGS
@given(st.one_of(_json_doc, _json_any))
def test_json_documents(doc: Any) -> None:
    receiver = Receiver()
    receiver.post(json.dumps(doc).encode(), JSON)
    receiver.check()


# ----------------------------------------------------------------------------------------------------
# a real SDK body, mutated


def _sdk_body() -> bytes:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "trainer"}))
    meter = provider.get_meter("gpu_energy_exporter.training")
    attrs = {"run_id": "sdk", "rank": 0, "gpu_uuid": "GPU-aaaa"}
    meter.create_counter("training.tokens", unit="{token}").add(1000, attrs)
    meter.create_counter("training.steps", unit="{step}").add(10, attrs)
    meter.create_histogram("training.step.duration", unit="s").record(0.25, attrs)
    meter.create_gauge("training.loss").set(2.5, attrs)
    meter.create_up_down_counter("training.queue").add(3, attrs)
    data = reader.get_metrics_data()
    provider.shutdown()
    assert data is not None
    return encode_metrics(data).SerializeToString()


SDK_BODY = _sdk_body()
SDK_JSON = json_format.MessageToJson(ExportMetricsServiceRequest.FromString(SDK_BODY)).encode()


@st.composite
def _mutated(draw: st.DrawFn, base: bytes) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "flip", "truncate", "insert", "delete", "dup"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i:i + draw(st.integers(1, 8))]
        else:
            j = draw(st.integers(i, min(len(data), i + 64)))
            data[j:j] = data[i:j] * draw(st.integers(1, 50))
    return bytes(data)


@SETTINGS
@given(st.one_of(_mutated(SDK_BODY).map(lambda b: (b, "pb")),
                 _mutated(SDK_BODY).map(lambda b: (b, "gzip")),
                 _mutated(gzip.compress(SDK_BODY)).map(lambda b: (b, "gz-mutated")),
                 _mutated(SDK_JSON).map(lambda b: (b, "json"))))
def test_mutated_sdk_bodies(case: tuple[bytes, str]) -> None:
    body, how = case
    receiver = Receiver()
    assert receiver.post(SDK_BODY, PB) == 200
    before = receiver.check()
    if how == "json":
        status = receiver.post(body, JSON)
    elif how == "gzip":
        status = receiver.post(gzip.compress(body), {**PB, "Content-Encoding": "gzip"})
    elif how == "gz-mutated":
        status = receiver.post(body, {**PB, "Content-Encoding": "gzip"})
    else:
        status = receiver.post(body, PB)
    assert status in (200, 400, 413)
    after = receiver.check()
    if status != 200:  # a refused request stores nothing
        strip = [line for line in after.splitlines() if not line.startswith(b"gpuenergy_otlp_")]
        assert strip == [line for line in before.splitlines() if not line.startswith(b"gpuenergy_otlp_")]


# ----------------------------------------------------------------------------------------------------
# the exposition of whatever was stored parses (promtool: exit 1 is a parse error, 3 only style lint)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(_request(), min_size=1, max_size=3))
def test_exposition_always_parses(requests: list[ExportMetricsServiceRequest]) -> None:
    receiver = Receiver()
    for request in requests:
        receiver.post(request.SerializeToString(), PB)
    text = receiver.check()
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert out.returncode in (0, 3), (out.stdout + out.stderr).decode()
    assert b"error while linting" not in out.stdout + out.stderr
    assert out.returncode == 0 or all(" " in line for line in out.stderr.decode().splitlines())

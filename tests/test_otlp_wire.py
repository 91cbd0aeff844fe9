"""The receiver parses protobuf bodies into ``otlp.wire.WireRequest`` (data-point attributes kept as bytes):
it must translate exactly as OTLP's own type does and refuse exactly the bodies OTLP's parser refuses, with
the same response bytes."""

from __future__ import annotations

import time

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb

from bench import trainers as bench_trainers
from gpu_energy_exporter.otlp import wire
from gpu_energy_exporter.otlp.receiver import PROTOBUF, ExportHandler, status_body
from gpu_energy_exporter.otlp.store import TrainingStore
from gpu_energy_exporter.otlp.translate import translate_request

PB = {"Content-Type": PROTOBUF}


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def _request(kind: str, key: str = "zzkey") -> ExportMetricsServiceRequest:
    """One data point of ``kind`` carrying the attribute ``key`` (and a run id)."""
    req = ExportMetricsServiceRequest()
    m = req.resource_metrics.add().scope_metrics.add().metrics.add(name="training.thing")
    attrs = [_kv("run_id", "r1"), _kv(key, "v")]
    if kind == "gauge":
        m.gauge.data_points.add(time_unix_nano=5, as_double=1.0).attributes.extend(attrs)
    elif kind == "no_value":
        m.gauge.data_points.add(time_unix_nano=5, flags=1).attributes.extend(attrs)
    elif kind == "exponential_histogram":  # rejected as a whole (unsupported_type)
        m.exponential_histogram.data_points.add(time_unix_nano=5, count=1).attributes.extend(attrs)
    elif kind == "delta_updown":  # rejected as a whole (unsupported_temporality)
        m.sum.aggregation_temporality = pb.AGGREGATION_TEMPORALITY_DELTA
        m.sum.data_points.add(time_unix_nano=5, as_double=1.0).attributes.extend(attrs)
    elif kind == "too_many_labels":
        m.gauge.data_points.add(time_unix_nano=5, as_double=1.0).attributes.extend(
            attrs + [_kv(f"k{i}", "v") for i in range(40)])
    return req


@pytest.mark.parametrize("kind", ["gauge", "no_value", "exponential_histogram", "delta_updown", "too_many_labels"])
@pytest.mark.parametrize("damage", ["bad_utf8", "truncated"])
def test_a_body_otlp_refuses_is_refused_with_the_same_bytes(kind: str, damage: str) -> None:
    body = _request(kind).SerializeToString()
    if damage == "bad_utf8":
        body = body.replace(b"zzkey", b"zz\xffey")
    else:  # the attribute's KeyValue claims 40 bytes for its key; its own length stays as it was
        body = body.replace(b"\n\x05zzkey", b"\n\x28zzkey")
    with pytest.raises(Exception) as exc:
        ExportMetricsServiceRequest().ParseFromString(body)
    store = TrainingStore()
    for _ in range(2):  # the second time, after the valid attributes were cached
        answer = ExportHandler(store).handle_export(PB, body)
        expected = status_body(400, f"body is not a protobuf ExportMetricsServiceRequest: {exc.value}", PROTOBUF,
                               "resource_metrics")
        assert answer == (400, PROTOBUF, expected)
    assert store.series_count() == 0


@pytest.mark.parametrize("kind", ["gauge", "no_value", "exponential_histogram", "delta_updown", "too_many_labels"])
def test_translation_is_the_same_from_otlp_and_wire_messages(kind: str) -> None:
    req = _request(kind)
    for _ in range(2):  # uncached, then cached
        a = translate_request(req, 99)
        b = translate_request(wire.WireRequest.FromString(req.SerializeToString()), 99)
        assert (a.points, a.rejected, a.messages, a.resources, a.received) == \
            (b.points, b.rejected, b.messages, b.resources, b.received)


def test_helper_exports_translate_the_same_from_otlp_and_wire_messages() -> None:
    trainers = [bench_trainers.Trainer("run-a", rank) for rank in range(3)]
    for _ in range(3):
        for t in trainers:
            body, n = t.request()
            now = time.time_ns()
            a = translate_request(ExportMetricsServiceRequest.FromString(body), now)
            b = translate_request(wire.WireRequest.FromString(body), now)
            assert len(b.points) == n
            assert (a.points, a.rejected, a.resources) == (b.points, b.rejected, b.resources)

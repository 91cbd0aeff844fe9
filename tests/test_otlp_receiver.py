"""The OTLP/HTTP receiver and the training store, driven by the real OpenTelemetry SDK.

The SDK's ``OTLPMetricExporter`` (http/protobuf) pushes to a receiver on 127.0.0.1:0; what the store
exposes is read back through a ``prometheus_client`` registry, as a scrape would see it. Hand-built
requests cover what the SDK never sends (JSON, broken bodies, restarts, retries, limits).
"""

from __future__ import annotations

import gzip
import http.client
import json
import shutil
import subprocess
import threading
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry, generate_latest

from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.otlp.receiver import OTLPReceiver, load_bearer_token
from gpu_energy_exporter.otlp.store import AcceptedPoint, TrainingStore

DELTA = pb.AGGREGATION_TEMPORALITY_DELTA
CUMULATIVE = pb.AGGREGATION_TEMPORALITY_CUMULATIVE

ATTRS: dict[str, AttributeValue] = {"run_id": "run-1", "rank": 0, "gpu_uuid": "GPU-aaaa,GPU-bbbb"}
LABELS = {"run_id": "run-1", "rank": "0", "gpu_uuid": "GPU-aaaa,GPU-bbbb"}
PB = {"Content-Type": "application/x-protobuf"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Env:
    """A store, its registry and a started receiver."""

    def __init__(self, clock: FakeClock, **kw: Any) -> None:
        store_kw = {k: kw.pop(k) for k in ("series_ttl", "max_series", "max_series_per_run") if k in kw}
        self.clock = clock
        self.store = TrainingStore(clock=clock, **store_kw)
        self.registry = CollectorRegistry()
        self.registry.register(self.store)
        self.receiver = OTLPReceiver(("127.0.0.1", 0), self.store, **kw).start()
        host, port = self.receiver.server_address
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}/v1/metrics"
        self.providers: list[MeterProvider] = []

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.registry.get_sample_value(name, labels or {})

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def provider(
        self, *, delta: bool = False, compression: Compression | None = None,
        headers: dict[str, str] | None = None, resource: dict[str, str] | None = None,
    ) -> tuple[MeterProvider, PeriodicExportingMetricReader]:
        temporality: dict[type, AggregationTemporality] | None = (
            {Counter: AggregationTemporality.DELTA, Histogram: AggregationTemporality.DELTA}
            if delta else None)
        exporter = OTLPMetricExporter(endpoint=self.url, compression=compression, headers=headers,
                                      preferred_temporality=temporality, timeout=5)
        # A long interval: tests export with force_flush, deterministically.
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
        mp = MeterProvider(metric_readers=[reader],
                           resource=Resource.create(resource or {"service.name": "trainer"}))
        self.providers.append(mp)
        return mp, reader

    def post(self, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request("POST", "/v1/metrics", body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def close(self) -> None:
        for mp in self.providers:
            mp.shutdown()  # before the receiver goes: shutdown exports once more
        self.receiver.shutdown()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_env(clock: FakeClock) -> Iterator[Callable[..., Env]]:
    envs: list[Env] = []

    def make(**kw: Any) -> Env:
        env = Env(clock, **kw)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()


# ----------------------------------------------------------------------------------------------------
# hand-built requests


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def _attrs(labels: dict[str, str]) -> list[KeyValue]:
    return [_kv(k, v) for k, v in labels.items()]


def counter_request(value: float, *, start: int = 1, time: int = 2, delta: bool = False,
                    labels: dict[str, str] | None = None, name: str = "training.tokens",
                    unit: str = "{token}") -> bytes:
    dp = pb.NumberDataPoint(attributes=_attrs(labels if labels is not None else LABELS), as_double=value,
                            start_time_unix_nano=start, time_unix_nano=time)
    metric = pb.Metric(name=name, unit=unit, sum=pb.Sum(
        aggregation_temporality=DELTA if delta else CUMULATIVE, is_monotonic=True, data_points=[dp]))
    return _wrap(metric)


def gauge_request(name: str, points: list[tuple[dict[str, str], float]], time: int = 2) -> bytes:
    dps = [pb.NumberDataPoint(attributes=_attrs(lab), as_double=v, time_unix_nano=time) for lab, v in points]
    return _wrap(pb.Metric(name=name, gauge=pb.Gauge(data_points=dps)))


def _wrap(*metrics: pb.Metric) -> bytes:
    return ExportMetricsServiceRequest(resource_metrics=[pb.ResourceMetrics(
        scope_metrics=[pb.ScopeMetrics(metrics=list(metrics))])]).SerializeToString()


def _gzip_zeros(size: int) -> bytes:
    """A gzip stream of ``size`` zero bytes, built without holding them in memory."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    parts = [z.compress(chunk) for _ in range(size // len(chunk))]
    parts.append(z.flush())
    return b"".join(parts)


def _status(body: bytes) -> status_pb2.Status:
    status = status_pb2.Status()
    status.ParseFromString(body)
    return status


def _response(body: bytes) -> ExportMetricsServiceResponse:
    response = ExportMetricsServiceResponse()
    response.ParseFromString(body)
    return response


# ----------------------------------------------------------------------------------------------------
# the real SDK


def test_sdk_cumulative_push_exposes_helper_instruments(env: Env) -> None:
    mp, reader = env.provider()
    meter = mp.get_meter("gpu_energy_exporter.training")
    tokens = meter.create_counter("training.tokens", unit="{token}")
    samples = meter.create_counter("training.samples", unit="{sample}")
    steps = meter.create_counter("training.steps", unit="{step}")
    flops = meter.create_counter("training.flops", unit="{flop}")
    loss = meter.create_gauge("training.loss")
    val_loss = meter.create_gauge("training.validation.loss")
    lr = meter.create_gauge("training.learning_rate")
    epoch = meter.create_gauge("training.epoch")
    duration = meter.create_histogram("training.step.duration", unit="s",
                                      explicit_bucket_boundaries_advisory=[0.1, 0.5, 1.0, 2.0])
    run_info = meter.create_gauge("training.run.info")
    gpu_info = meter.create_gauge("training.run.gpu.info")
    total_steps = meter.create_gauge("training.run.total_steps")
    finished = meter.create_gauge("training.run.finished")

    run_info.set(1, {**ATTRS, "model": "tiny-llama", "backend": "unsloth"})
    gpu_info.set(1, {**ATTRS, "gpu_uuid": "GPU-aaaa"})
    total_steps.set(100, ATTRS)
    finished.set(0, ATTRS)
    for step in range(3):
        tokens.add(512, ATTRS)
        samples.add(4, ATTRS)
        steps.add(1, ATTRS)
        flops.add(1e12, ATTRS)
        loss.set(3.0 - step, ATTRS)
        lr.set(1e-4, ATTRS)
        duration.record(0.3 + step * 0.5, ATTRS)
    epoch.set(1, ATTRS)
    val_loss.set(1.25, ATTRS)
    assert reader.force_flush()
    tokens.add(512, ATTRS)
    finished.set(1, ATTRS)
    assert reader.force_flush()

    assert env.value("training_tokens_total", LABELS) == 2048
    assert env.value("training_samples_total", LABELS) == 12
    assert env.value("training_steps_total", LABELS) == 3
    assert env.value("training_flops_total", LABELS) == 3e12
    assert env.value("training_loss", LABELS) == 1.0
    assert env.value("training_validation_loss", LABELS) == 1.25
    assert env.value("training_learning_rate", LABELS) == 1e-4
    assert env.value("training_epoch", LABELS) == 1
    assert env.value("training_run_info", {**LABELS, "model": "tiny-llama", "backend": "unsloth"}) == 1
    assert env.value("training_run_gpu_info", {**LABELS, "gpu_uuid": "GPU-aaaa"}) == 1
    assert env.value("training_run_total_steps", LABELS) == 100
    assert env.value("training_run_finished", LABELS) == 1
    # durations 0.3, 0.8, 1.3
    assert env.value("training_step_duration_seconds_bucket", {**LABELS, "le": "0.1"}) == 0
    assert env.value("training_step_duration_seconds_bucket", {**LABELS, "le": "0.5"}) == 1
    assert env.value("training_step_duration_seconds_bucket", {**LABELS, "le": "1.0"}) == 2
    assert env.value("training_step_duration_seconds_bucket", {**LABELS, "le": "2.0"}) == 3
    assert env.value("training_step_duration_seconds_bucket", {**LABELS, "le": "+Inf"}) == 3
    assert env.value("training_step_duration_seconds_count", LABELS) == 3
    assert env.value("training_step_duration_seconds_sum", LABELS) == pytest.approx(2.4)

    text = env.text()
    assert "# TYPE training_tokens_total counter" in text
    assert "# TYPE training_step_duration_seconds histogram" in text
    # Resource identity: one target_info per process, never job/instance on any series.
    assert 'target_info{' in text and 'service_name="trainer"' in text
    for line in text.splitlines():
        assert 'job="' not in line and 'instance="' not in line, line
        if line.startswith("training_"):
            assert 'run_id="run-1"' in line and 'rank="0"' in line and "gpu_uuid=" in line, line
    assert env.value("gpuenergy_otlp_requests_total", {"status": "200"}) == 2
    assert env.value("gpuenergy_otlp_series") == 13
    assert env.value("gpuenergy_otlp_points_rejected_total", {"reason": "invalid_point"}) == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_exposition_passes_promtool_lint(env: Env) -> None:
    mp, reader = env.provider()
    meter = mp.get_meter("t")
    meter.create_counter("training.tokens", unit="{token}").add(5, ATTRS)
    meter.create_histogram("training.step.duration", unit="s").record(0.5, ATTRS)
    meter.create_gauge("gpu.memory.utilization", unit="1").set(0.5, ATTRS)
    assert reader.force_flush()
    result = subprocess.run(["promtool", "check", "metrics"], input=env.text(), capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpu_memory_utilization_ratio" in env.text()


@pytest.mark.parametrize("compression", [None, Compression.Gzip, Compression.Deflate])
def test_sdk_delta_temporality_is_accumulated(make_env: Callable[..., Env],
                                              compression: Compression | None) -> None:
    env = make_env()
    mp, reader = env.provider(delta=True, compression=compression)
    meter = mp.get_meter("t")
    tokens = meter.create_counter("training.tokens", unit="{token}")
    duration = meter.create_histogram("training.step.duration", unit="s",
                                      explicit_bucket_boundaries_advisory=[1.0])
    tokens.add(100, ATTRS)
    duration.record(0.5, ATTRS)
    assert reader.force_flush()
    assert env.value("training_tokens_total", LABELS) == 100
    tokens.add(50, ATTRS)
    duration.record(3.0, ATTRS)
    duration.record(0.25, ATTRS)
    assert reader.force_flush()
    assert reader.force_flush()  # an export with nothing new changes nothing
    assert env.value("training_tokens_total", LABELS) == 150
    assert env.value("training_step_duration_seconds_bucket", {**LABELS, "le": "1.0"}) == 2
    assert env.value("training_step_duration_seconds_bucket", {**LABELS, "le": "+Inf"}) == 3
    assert env.value("training_step_duration_seconds_count", LABELS) == 3
    assert env.value("training_step_duration_seconds_sum", LABELS) == 3.75
    assert env.value("gpuenergy_otlp_points_rejected_total", {"reason": "out_of_order"}) == 0


def test_sdk_observable_gauge_and_updown_counter(env: Env) -> None:
    mp, reader = env.provider()
    meter = mp.get_meter("t")

    def observe(options: CallbackOptions) -> list[Observation]:
        return [Observation(0.75, ATTRS)]

    meter.create_observable_gauge("training.gpu.busy", [observe], unit="1")
    queue = meter.create_up_down_counter("training.queue.depth", unit="{batch}")
    queue.add(5, ATTRS)
    queue.add(-2, ATTRS)
    assert reader.force_flush()
    assert env.value("training_gpu_busy_ratio", LABELS) == 0.75
    assert env.value("training_queue_depth", LABELS) == 3
    assert "# TYPE training_queue_depth gauge" in env.text()


def test_restarted_trainer_is_folded_into_a_monotonic_counter(env: Env) -> None:
    seen: list[AcceptedPoint] = []
    env.store.add_listener(seen.append)
    for added in (100, 30):  # two processes, one after the other: the second has a new start time
        mp, reader = env.provider()
        mp.get_meter("t").create_counter("training.tokens", unit="{token}").add(added, ATTRS)
        assert reader.force_flush()
        mp.shutdown()
        env.providers.remove(mp)
    assert env.value("training_tokens_total", LABELS) == 130
    assert env.value("gpuenergy_otlp_stream_restarts_total") == 1
    totals = [p.value for p in seen if p.name == "training_tokens_total"]
    assert totals == sorted(totals) and totals[-1] == 130  # never a negative jump


def test_cumulative_edge_cases_by_hand(env: Env) -> None:
    def push(value: float, start: int, time: int) -> None:
        status, _, _ = env.post(counter_request(value, start=start, time=time), PB)
        assert status == 200

    push(10, start=1, time=2)
    push(15, start=1, time=3)
    push(12, start=1, time=1)  # older than the last point: ignored
    assert env.value("training_tokens_total", LABELS) == 15
    push(4, start=1, time=4)  # went down with the same start time: still a restart
    assert env.value("training_tokens_total", LABELS) == 19
    push(3, start=0, time=5)  # a late point from before the restart
    assert env.value("training_tokens_total", LABELS) == 19
    assert env.value("gpuenergy_otlp_points_rejected_total", {"reason": "out_of_order"}) == 2
    assert env.value("gpuenergy_otlp_stream_restarts_total") == 1


def test_retried_delta_export_is_not_counted_twice(env: Env) -> None:
    body = counter_request(7, start=10, time=20, delta=True)
    status, _, out = env.post(body, PB)
    assert status == 200 and _response(out).partial_success.rejected_data_points == 0
    status, _, out = env.post(body, PB)  # the client did not see the first answer and retried
    assert status == 200
    assert _response(out).partial_success.rejected_data_points == 1
    assert "out_of_order" in _response(out).partial_success.error_message
    status, _, _ = env.post(counter_request(5, start=20, time=30, delta=True), PB)
    assert env.value("training_tokens_total", LABELS) == 12


def test_json_body_and_json_response(env: Env) -> None:
    doc: dict[str, Any] = {"resourceMetrics": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "curl"}}]},
        "scopeMetrics": [{"scope": {"name": "manual"}, "metrics": [
            {"name": "training.tokens", "unit": "{token}", "sum": {
                "aggregationTemporality": 2, "isMonotonic": True, "dataPoints": [{
                    "attributes": [{"key": "run_id", "value": {"stringValue": "run-j"}},
                                   {"key": "rank", "value": {"intValue": "3"}}],
                    "startTimeUnixNano": "1700000000000000000", "timeUnixNano": "1700000001000000000",
                    "asInt": "4096",
                    "exemplars": [{"timeUnixNano": "1700000000500000000", "asInt": "1",
                                   "traceId": "5B8EFFF798038103D269B633813FC60C",
                                   "spanId": "EEE19B7EC3C1B174"}]}]}},
            {"name": "training.loss", "gauge": {"dataPoints": [{
                "attributes": [{"key": "run_id", "value": {"stringValue": "run-j"}}],
                "timeUnixNano": "1700000001000000000", "asDouble": 2.5}]}},
            {"name": "futureField", "somethingNew": {"x": 1}},
        ]}]}]}
    status, headers, body = env.post(json.dumps(doc).encode(), {"Content-Type": "application/json"})
    assert status == 200, body
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {}
    assert env.value("training_tokens_total", {"run_id": "run-j", "rank": "3"}) == 4096
    assert env.value("training_loss", {"run_id": "run-j"}) == 2.5

    doc["resourceMetrics"][0]["scopeMetrics"][0]["metrics"].append(
        {"name": "x", "exponentialHistogram": {"aggregationTemporality": 2,
                                               "dataPoints": [{"count": "1"}]}})
    status, _, body = env.post(json.dumps(doc).encode(), {"Content-Type": "application/json; charset=utf-8"})
    partial = json.loads(body)["partialSuccess"]
    assert partial["rejectedDataPoints"] == "1"
    assert "unsupported_type" in partial["errorMessage"]


def test_partial_success_stores_the_valid_points(env: Env) -> None:
    good = pb.Metric(name="training.loss", gauge=pb.Gauge(data_points=[
        pb.NumberDataPoint(attributes=_attrs(LABELS), as_double=1.0, time_unix_nano=2)]))
    bad = pb.Metric(name="training.step.duration", unit="s", histogram=pb.Histogram(
        aggregation_temporality=CUMULATIVE, data_points=[pb.HistogramDataPoint(
            attributes=_attrs(LABELS), count=5, bucket_counts=[1, 1], explicit_bounds=[1.0])]))
    status, headers, body = env.post(_wrap(good, bad), PB)
    assert status == 200 and headers["content-type"] == "application/x-protobuf"
    partial = _response(body).partial_success
    assert partial.rejected_data_points == 1
    assert "invalid_point" in partial.error_message and "add up to 2, count is 5" in partial.error_message
    assert env.value("training_loss", LABELS) == 1.0
    assert env.value("training_step_duration_seconds_count", LABELS) is None
    assert env.value("gpuenergy_otlp_points_received_total") == 2
    assert env.value("gpuenergy_otlp_points_rejected_total", {"reason": "invalid_point"}) == 1


# ----------------------------------------------------------------------------------------------------
# bad input: right status, OTLP Status body, nothing stored, the server keeps serving


def test_self_metrics_exist_at_zero_before_any_request(env: Env) -> None:
    for status in ("200", "400", "401", "413", "415", "500"):
        assert env.value("gpuenergy_otlp_requests_total", {"status": status}) == 0
    for reason in ("series_limit", "run_series_limit", "out_of_order", "invalid_point"):
        assert env.value("gpuenergy_otlp_points_rejected_total", {"reason": reason}) == 0
    assert env.value("gpuenergy_otlp_series") == 0
    assert env.value("gpuenergy_otlp_series_expired_total") == 0
    assert env.value("gpuenergy_otlp_points_received_total") == 0


def test_malformed_protobuf_is_400_with_a_status(env: Env) -> None:
    status, headers, body = env.post(b"\x0a\xff\xff\xff\xff\x0fgarbage", PB)
    assert status == 400
    assert headers["content-type"] == "application/x-protobuf"
    st = _status(body)
    assert "not a protobuf ExportMetricsServiceRequest" in st.message
    bad_request = error_details_pb2.BadRequest()
    assert st.details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].description == st.message
    assert env.value("gpuenergy_otlp_requests_total", {"status": "400"}) == 1
    assert env.value("gpuenergy_otlp_series") == 0


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"resourceMetrics": "x"}',
                                  b'{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"sum": '
                                  b'{"dataPoints": [{"asInt": "many"}]}}]}]}]}',
                                  b"[" * 100_000])
def test_malformed_json_is_400_with_a_json_status(env: Env, body: bytes) -> None:
    status, headers, out = env.post(body, {"Content-Type": "application/json"})
    assert status == 400
    assert headers["content-type"] == "application/json"
    doc = json.loads(out)
    assert doc["code"] == 3 and doc["message"]
    assert doc["details"][0]["@type"] == "type.googleapis.com/google.rpc.BadRequest"


def test_wrong_content_type_and_encoding_are_415(env: Env) -> None:
    status, _, body = env.post(counter_request(1), {"Content-Type": "text/plain"})
    assert status == 415 and "unsupported Content-Type 'text/plain'" in _status(body).message
    status, _, body = env.post(counter_request(1), {**PB, "Content-Encoding": "br"})
    assert status == 415 and "Content-Encoding" in _status(body).message
    assert env.value("gpuenergy_otlp_requests_total", {"status": "415"}) == 2
    assert env.value("gpuenergy_otlp_series") == 0


def test_oversized_bodies_are_413_before_and_after_decompression(make_env: Callable[..., Env]) -> None:
    env = make_env(max_body_bytes=4096)
    status, _, body = env.post(b"\x00" * 5000, PB)
    assert status == 413 and "--otlp.max-body-bytes" in _status(body).message
    # Valid protobuf that compresses well: small on the wire, over the limit once inflated.
    big = counter_request(1, labels={**LABELS, "notes": "x" * 10_000})
    squeezed = gzip.compress(big)
    assert len(squeezed) < 4096 < len(big)
    status, _, body = env.post(squeezed, {**PB, "Content-Encoding": "gzip"})
    assert status == 413 and "after decompression" in _status(body).message
    assert env.value("gpuenergy_otlp_series") == 0


def test_chunked_bodies_are_read_within_the_limit(make_env: Callable[..., Env]) -> None:
    env = make_env(max_body_bytes=4096)
    body = counter_request(11)
    conn = http.client.HTTPConnection(env.host, env.port, timeout=10)
    conn.request("POST", "/v1/metrics", body=iter([body[:10], body[10:]]), headers=PB, encode_chunked=True)
    assert conn.getresponse().status == 200
    conn.close()
    assert env.value("training_tokens_total", LABELS) == 11
    conn = http.client.HTTPConnection(env.host, env.port, timeout=10)
    conn.request("POST", "/v1/metrics", body=iter([b"\x00" * 3000] * 2), headers=PB, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and resp.getheader("Content-Type") == "application/x-protobuf"
    assert "4096" in _status(resp.read()).message
    conn.close()


def test_gzip_bomb_is_refused_without_inflating_it(make_env: Callable[..., Env]) -> None:
    env = make_env(max_body_bytes=1 << 20)
    bomb = _gzip_zeros(128 << 20)  # 128 MiB of zeros in ~128 KiB
    assert len(bomb) < 1 << 20
    headers = {**PB, "Content-Encoding": "gzip"}
    tracemalloc.start()
    try:
        status, _, body = env.receiver.handle_export(headers, bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 413
    assert peak < 8 << 20, f"peak {peak} bytes while refusing a gzip bomb"
    status, _, _ = env.post(bomb, headers)  # and over the wire
    assert status == 413


def test_truncated_or_corrupt_gzip_is_400_and_stores_nothing(env: Env) -> None:
    body = gzip.compress(counter_request(5))
    status, _, out = env.post(body[:-12], {**PB, "Content-Encoding": "gzip"})
    assert status == 400 and "truncated" in _status(out).message
    status, _, out = env.post(b"\x1f\x8b\x08\x00garbage-not-deflate", {**PB, "Content-Encoding": "gzip"})
    assert status == 400
    assert env.value("gpuenergy_otlp_series") == 0
    assert env.value("training_tokens_total", LABELS) is None


def test_garbage_never_takes_the_server_down(env: Env) -> None:
    bodies = [b"", b"\x00", b"\xff" * 64, bytes(range(256)) * 8, b"\x0a\x02\x0a\x00" * 1000,
              b"\x1a" * 5000, b"\x08\x96\x01", gzip.compress(b"\xff" * 100)]
    for body in bodies:
        for headers in (PB, {"Content-Type": "application/json"}, {**PB, "Content-Encoding": "gzip"}):
            status, _, _ = env.post(body, headers)
            assert status in (200, 400), (body[:16], headers, status)
    conn = http.client.HTTPConnection(env.host, env.port, timeout=10)
    conn.request("GET", "/v1/metrics")
    assert conn.getresponse().status == 405
    conn.close()
    conn = http.client.HTTPConnection(env.host, env.port, timeout=10)
    conn.request("POST", "/v1/traces", body=b"", headers=PB)
    assert conn.getresponse().status == 404
    conn.close()
    status, _, _ = env.post(counter_request(9), PB)
    assert status == 200 and env.value("training_tokens_total", LABELS) == 9


def test_bearer_token(make_env: Callable[..., Env], tmp_path: Any) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    env = make_env(bearer_token=load_bearer_token(str(token_file)))
    status, headers, body = env.post(counter_request(1), PB)
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    assert "bearer token" in _status(body).message
    status, _, _ = env.post(counter_request(1), {**PB, "Authorization": "Bearer wrong"})
    assert status == 401
    assert env.value("training_tokens_total", LABELS) is None
    mp, reader = env.provider(headers={"Authorization": "Bearer s3cret"})
    mp.get_meter("t").create_counter("training.tokens", unit="{token}").add(3, ATTRS)
    assert reader.force_flush()
    assert env.value("training_tokens_total", LABELS) == 3
    assert env.value("gpuenergy_otlp_requests_total", {"status": "401"}) == 2

    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(ConfigError, match="empty"):
        load_bearer_token(str(empty))


def test_listen_address_in_use_is_a_config_error(env: Env) -> None:
    with pytest.raises(ConfigError, match="cannot listen"):
        OTLPReceiver((env.host, env.port), env.store).start()


# ----------------------------------------------------------------------------------------------------
# bounds: TTL and series limits


def test_series_expire_after_the_ttl(make_env: Callable[..., Env], clock: FakeClock) -> None:
    env = make_env(series_ttl=600.0)
    mp, reader = env.provider()
    mp.get_meter("t").create_gauge("training.loss").set(2.0, ATTRS)
    assert reader.force_flush()
    assert env.value("training_loss", LABELS) == 2.0
    clock.now += 599
    assert env.value("training_loss", LABELS) == 2.0
    assert "target_info{" in env.text()
    clock.now += 2
    assert env.value("training_loss", LABELS) is None
    assert "target_info{" not in env.text()
    assert env.value("gpuenergy_otlp_series") == 0
    assert env.value("gpuenergy_otlp_series_expired_total") == 1


def test_series_limits_total_and_per_run(make_env: Callable[..., Env], clock: FakeClock) -> None:
    env = make_env(max_series=4, max_series_per_run=2, series_ttl=60.0)
    run_a = [({"run_id": "a", "rank": str(r)}, 1.0) for r in range(3)]
    status, _, body = env.post(gauge_request("training.loss", run_a), PB)
    partial = _response(body).partial_success
    assert status == 200 and partial.rejected_data_points == 1
    assert "run_id 'a' has 2 series (--otlp.max-series-per-run)" in partial.error_message
    run_b = [({"run_id": "b", "rank": str(r)}, 1.0) for r in range(2)]
    run_c = [({"run_id": "c", "rank": "0"}, 1.0)]
    status, _, body = env.post(gauge_request("training.loss", run_b + run_c), PB)
    assert _response(body).partial_success.rejected_data_points == 1
    assert "(--otlp.max-series)" in _response(body).partial_success.error_message
    assert env.value("gpuenergy_otlp_series") == 4
    assert env.value("gpuenergy_otlp_points_rejected_total", {"reason": "run_series_limit"}) == 1
    assert env.value("gpuenergy_otlp_points_rejected_total", {"reason": "series_limit"}) == 1
    # existing series keep updating at the limit
    status, _, body = env.post(gauge_request("training.loss", [({"run_id": "a", "rank": "0"}, 5.0)],
                                             time=3), PB)
    assert _response(body).partial_success.rejected_data_points == 0
    assert env.value("training_loss", {"run_id": "a", "rank": "0"}) == 5.0
    # stale series make room again
    clock.now += 61
    status, _, body = env.post(gauge_request("training.loss", run_c), PB)
    assert _response(body).partial_success.rejected_data_points == 0
    assert env.value("training_loss", {"run_id": "c", "rank": "0"}) == 1.0
    assert env.value("gpuenergy_otlp_series") == 1


def test_type_conflict_and_reserved_names_are_rejected(env: Env) -> None:
    env.post(counter_request(1, name="jobs", unit=""), PB)  # -> jobs_total, a counter
    status, _, body = env.post(gauge_request("jobs.total", [(LABELS, 3.0)]), PB)  # -> jobs_total gauge
    assert "type_conflict" in _response(body).partial_success.error_message
    status, _, body = env.post(gauge_request("gpuenergy.gpu.power", [(LABELS, 300.0)]), PB)
    assert "reserved for the exporter" in _response(body).partial_success.error_message
    assert env.value("jobs_total", LABELS) == 1
    assert env.value("gpuenergy_gpu_power", LABELS) is None


def test_no_recorded_value_flag_ends_a_series(env: Env) -> None:
    env.post(gauge_request("training.loss", [(LABELS, 1.0)]), PB)
    assert env.value("training_loss", LABELS) == 1.0
    dp = pb.NumberDataPoint(attributes=_attrs(LABELS), time_unix_nano=3, flags=1)
    env.post(_wrap(pb.Metric(name="training.loss", gauge=pb.Gauge(data_points=[dp]))), PB)
    assert env.value("training_loss", LABELS) is None
    assert env.value("gpuenergy_otlp_series") == 0


def test_summary_is_exposed_as_sent(env: Env) -> None:
    dp = pb.SummaryDataPoint(attributes=_attrs(LABELS), count=10, sum=5.0, time_unix_nano=2,
                             quantile_values=[pb.SummaryDataPoint.ValueAtQuantile(quantile=0.5, value=0.4),
                                              pb.SummaryDataPoint.ValueAtQuantile(quantile=0.99, value=0.9)])
    env.post(_wrap(pb.Metric(name="rpc.latency", unit="s", summary=pb.Summary(data_points=[dp]))), PB)
    assert env.value("rpc_latency_seconds", {**LABELS, "quantile": "0.99"}) == 0.9
    assert env.value("rpc_latency_seconds_count", LABELS) == 10
    assert env.value("rpc_latency_seconds_sum", LABELS) == 5.0


def test_listener_sees_every_point_and_cannot_break_ingest(env: Env) -> None:
    seen: list[AcceptedPoint] = []

    def broken(_: AcceptedPoint) -> None:
        raise RuntimeError("ledger bug")

    env.store.add_listener(broken)
    env.store.add_listener(seen.append)
    status, _, _ = env.post(counter_request(42, time=1_700_000_000_000_000_000), PB)
    assert status == 200
    assert len(seen) == 1
    point = seen[0]
    assert (point.run_id, point.name, dict(point.labels), point.value, point.kind) == (
        "run-1", "training_tokens_total", LABELS, 42.0, "counter")
    assert point.time == 1_700_000_000.0
    with pytest.raises(TypeError):
        point.labels["x"] = "y"  # type: ignore[index]
    env.store.remove_listener(broken)
    env.store.remove_listener(seen.append)
    env.post(counter_request(43, time=1_700_000_001_000_000_000), PB)
    assert len(seen) == 1


def test_concurrent_pushes_and_scrapes(env: Env) -> None:
    errors: list[BaseException] = []

    def pusher(rank: int) -> None:
        try:
            labels = {"run_id": "conc", "rank": str(rank)}
            for i in range(1, 21):
                status, _, _ = env.post(counter_request(i, time=i + 1, labels=labels), PB)
                assert status == 200
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=pusher, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        env.text()
    for t in threads:
        t.join()
    assert not errors
    for rank in range(4):
        assert env.value("training_tokens_total", {"run_id": "conc", "rank": str(rank)}) == 20


def test_incremental_render_equals_full_encoding_after_changes(env: Env) -> None:
    """``TrainingStore.render`` (the scrape fast path: only changed series are encoded again) must give
    exactly what prometheus_client's encoders give for ``collect()``, in both formats, before and after
    a change, a new series, a histogram and an expiry."""
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest

    def full(openmetrics: bool) -> bytes:
        reg = CollectorRegistry()
        reg.register(env.store)
        if openmetrics:
            body = om_latest(reg)
            return body[: -len(b"# EOF\n")]
        return generate_latest(reg)

    def check() -> None:
        for om in (False, True):
            assert env.store.render(om) == full(om)

    mp, reader = env.provider()
    meter = mp.get_meter("t")
    tokens = meter.create_counter("training.tokens", unit="{token}")
    loss = meter.create_gauge("training.loss")
    duration = meter.create_histogram("training.step.duration", unit="s",
                                      explicit_bucket_boundaries_advisory=[0.1, 1.0])
    tokens.add(5, ATTRS)
    loss.set(2.5, ATTRS)
    assert reader.force_flush()
    check()
    tokens.add(7, ATTRS)  # a changed series must be re-encoded, not served stale
    tokens.add(3, {**ATTRS, "rank": "1"})  # a new series
    duration.record(0.5, ATTRS)
    assert reader.force_flush()
    check()
    line = b'training_tokens_total{gpu_uuid="GPU-aaaa,GPU-bbbb",rank="0",run_id="run-1"} 12.0'
    assert line in env.store.render(False)
    env.clock.now += 10_000  # every series expires
    check()
    assert b"training_tokens_total{" not in env.store.render(False)

"""OpenTelemetry -> Prometheus name, unit, label and value translation.

The worked examples come from the OpenTelemetry "Prometheus and OpenMetrics Compatibility" spec, the
Collector's ``pkg/translator/prometheus`` README and Prometheus's ``otlptranslator`` test tables
(``UnderscoreEscapingWithSuffixes``), so a dashboard written against either works here.
"""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb

from gpu_energy_exporter.core import contract as instruments
from gpu_energy_exporter.otlp.naming import attribute_value, format_double, label_name, metric_name, unit_name
from gpu_energy_exporter.otlp.translate import translate_labels, translate_request

DELTA = pb.AGGREGATION_TEMPORALITY_DELTA
CUMULATIVE = pb.AGGREGATION_TEMPORALITY_CUMULATIVE

# (OTel name, unit, kind) -> Prometheus name
WORKED_EXAMPLES = [
    # Collector README, "Full normalization"
    ("(lambda).function.executions(#)", "", "gauge", "lambda_function_executions"),
    ("system.filesystem.usage", "By", "gauge", "system_filesystem_usage_bytes"),
    ("system.network.dropped", "{packets}", "gauge", "system_network_dropped"),
    ("system.network.dropped", "packets", "gauge", "system_network_dropped_packets"),
    ("system.memory.utilization", "1", "gauge", "system_memory_utilization_ratio"),
    # spec: abbreviations to words, {annotations} dropped, "1" -> ratio (gauges), "foo/bar" -> foo_per_bar
    ("http.request.duration", "ms", "histogram", "http_request_duration_milliseconds"),
    ("requests", "1/s", "gauge", "requests_per_second"),
    ("throughput", "By/s", "gauge", "throughput_bytes_per_second"),
    ("requests", "", "counter", "requests_total"),
    ("http.requests", "1", "counter", "http_requests_total"),
    ("items", "1", "counter", "items_total"),  # _ratio is for gauges only
    ("active", "1", "updown", "active"),  # ... and not for non-monotonic sums
    ("cpu_usage", "1", "gauge", "cpu_usage_ratio"),
    # the unit and type suffixes are not repeated
    ("cpu_usage_ratio", "1", "gauge", "cpu_usage_ratio"),
    ("response_time_seconds", "s", "gauge", "response_time_seconds"),
    ("requests_total", "", "counter", "requests_total"),
    ("process.cpu.time", "s", "counter", "process_cpu_time_seconds_total"),
    # unit words
    ("uptime", "d", "gauge", "uptime_days"),
    ("timeout", "min", "gauge", "timeout_minutes"),
    ("latency", "us", "gauge", "latency_microseconds"),
    ("memory", "MiBy", "gauge", "memory_mebibytes"),
    ("temperature", "Cel", "gauge", "temperature_celsius"),
    ("frequency", "Hz", "gauge", "frequency_hertz"),
    ("power", "W", "gauge", "power_watts"),
    ("energy", "J", "counter", "energy_joules_total"),
    ("cpu_usage", "%", "gauge", "cpu_usage_percent"),
    ("events", "1/h", "gauge", "events_per_hour"),
    ("custom", "1/custom_unit", "gauge", "custom_per_custom_unit"),
    ("custom_metric", "custom_unit", "gauge", "custom_metric_custom_unit"),
    # odd units and names
    ("custom_metric", "{custom}", "gauge", "custom_metric"),
    ("custom_metric", "By/{custom}", "gauge", "custom_metric_bytes"),
    ("custom_metric", "unit@with#special/chars", "gauge", "custom_metric_unit_with_special_per_chars"),
    ("metric__with__multiple__underscores", "unit__multiple__underscores", "gauge",
     "metric_with_multiple_underscores_unit_multiple_underscores"),
    ("metric", "By/", "gauge", "metric_bytes"),
    ("metric", " By / s ", "gauge", "metric_bytes_per_second"),
    ("metric", "/", "gauge", "metric"),
    ("metric@with#special$chars", "", "gauge", "metric_with_special_chars"),
    ("123_requests", "", "counter", "_123_requests_total"),
    ("request.size", "By", "histogram", "request_size_bytes"),
    ("response.time", "ms", "summary", "response_time_milliseconds"),
]


@pytest.mark.parametrize(("name", "unit", "kind", "want"), WORKED_EXAMPLES)
def test_metric_name_worked_examples(name: str, unit: str, kind: str, want: str) -> None:
    assert metric_name(name, unit, kind) == want  # type: ignore[arg-type]


# The instruments the training helper sends (agreed names) and what dashboards query.
HELPER_INSTRUMENTS = [
    ("training.tokens", "{token}", "counter", "training_tokens_total"),
    ("training.samples", "{sample}", "counter", "training_samples_total"),
    ("training.steps", "{step}", "counter", "training_steps_total"),
    ("training.flops", "{flop}", "counter", "training_flops_total"),
    ("training.loss", "", "gauge", "training_loss"),
    ("training.validation.loss", "", "gauge", "training_validation_loss"),
    ("training.learning_rate", "", "gauge", "training_learning_rate"),
    ("training.epoch", "", "gauge", "training_epoch"),
    ("training.step.duration", "s", "histogram", "training_step_duration_seconds"),
    ("training.run.info", "", "gauge", "training_run_info"),
    ("training.run.gpu.info", "", "gauge", "training_run_gpu_info"),
    ("training.global_step", "{step}", "gauge", "training_global_step"),
    ("training.run.total_steps", "", "gauge", "training_run_total_steps"),
    ("training.run.finished", "", "gauge", "training_run_finished"),
    ("training.model.parameters", "{parameter}", "gauge", "training_model_parameters"),
]


@pytest.mark.parametrize(("name", "unit", "kind", "want"), HELPER_INSTRUMENTS)
def test_training_helper_instrument_names(name: str, unit: str, kind: str, want: str) -> None:
    assert metric_name(name, unit, kind) == want  # type: ignore[arg-type]


def test_training_helper_table_translates_to_the_agreed_names() -> None:
    agreed = {name: (unit, kind, want) for name, unit, kind, want in HELPER_INSTRUMENTS}
    assert {inst.name for inst in instruments.ALL} == set(agreed)
    for inst in instruments.ALL:
        unit, kind, want = agreed[inst.name]
        assert (inst.unit, inst.kind) == (unit, kind), inst
        assert metric_name(inst.name, inst.unit, inst.kind) == want
        assert inst.prometheus == want, inst  # the name the ledger, rules and docs take from the contract


@pytest.mark.parametrize("name", ["", "@#$%", "...", "字符"])
def test_names_with_nothing_valid_are_refused(name: str) -> None:
    assert metric_name(name, "", "gauge") == ""
    assert metric_name(name, "s", "counter") == ""


@pytest.mark.parametrize(("unit", "want"), [
    ("s", "seconds"), ("By/s", "bytes_per_second"), ("1", ""), ("{token}", ""), ("1/s", "per_second"),
    ("ms", "milliseconds"), ("custom_unit", "custom_unit"), ("By/{custom}", "bytes"), ("", ""),
])
def test_unit_name(unit: str, want: str) -> None:
    assert unit_name(unit) == want


@pytest.mark.parametrize(("key", "want"), [
    # otlptranslator label tests (Prometheus's defaults: underscore sanitisation on, multiple
    # underscores preserved - the Collector behaves the same)
    ("label:with:colons", "label_with_colons"),
    ("LabelWithCapitalLetters", "LabelWithCapitalLetters"),
    ("label!with&special$chars)", "label_with_special_chars_"),
    ("label_with_foreign_characters_字符", "label_with_foreign_characters___"),
    ("label.with.dots", "label_with_dots"),
    ("123label", "key_123label"),
    ("_label_starting_with_underscore", "key_label_starting_with_underscore"),
    ("__label_starting_with_2underscores", "__label_starting_with_2underscores"),
    ("regular label", "regular_label"),
    ("ようこそ", ""),
    ("", ""),
    ("service.name", "service_name"),
    ("run_id", "run_id"),
])
def test_label_name(key: str, want: str) -> None:
    assert label_name(key) == want


def _kv(key: str, value: AnyValue) -> KeyValue:
    return KeyValue(key=key, value=value)


def _s(text: str) -> AnyValue:
    return AnyValue(string_value=text)


@pytest.mark.parametrize(("value", "want"), [
    (AnyValue(string_value="GPU-1,GPU-2"), "GPU-1,GPU-2"),
    (AnyValue(int_value=3), "3"),
    (AnyValue(int_value=-9007199254740993), "-9007199254740993"),
    (AnyValue(bool_value=True), "true"),
    (AnyValue(bool_value=False), "false"),
    (AnyValue(double_value=1.0), "1"),
    (AnyValue(double_value=0.1), "0.1"),
    (AnyValue(double_value=3e-4), "0.0003"),
    (AnyValue(double_value=1e-7), "1e-7"),
    (AnyValue(double_value=1.5e-7), "1.5e-7"),
    (AnyValue(double_value=1e21), "1e+21"),
    (AnyValue(double_value=1e20), "100000000000000000000"),
    (AnyValue(double_value=123456789012.5), "123456789012.5"),
    (AnyValue(bytes_value=b"\x00\xff"), "AP8="),
    (AnyValue(array_value=ArrayValue(values=[_s("a"), AnyValue(int_value=1), AnyValue(bool_value=True),
                                             AnyValue(double_value=2.0)])), '["a",1,true,2]'),
    (AnyValue(kvlist_value=KeyValueList(values=[_kv("b", _s("<x>")), _kv("a", AnyValue(int_value=1))])),
     '{"a":1,"b":"\\u003cx\\u003e"}'),
    (AnyValue(), ""),
])
def test_attribute_values(value: AnyValue, want: str) -> None:
    assert attribute_value(value) == want


def test_format_double_special_values() -> None:
    assert format_double(float("nan")) == "json: unsupported value: NaN"
    assert format_double(0.0) == "0"
    assert format_double(-2.5) == "-2.5"


def test_labels_collide_by_joining_values_in_key_order() -> None:
    # spec, "Metric Attributes": same sanitised key -> values joined with ";" by original key order
    labels = translate_labels([_kv("a_b", _s("2")), _kv("a.b", _s("1")), _kv("z", _s("x"))])
    assert labels == (("a_b", "1;2"), ("z", "x"))


def test_empty_label_values_are_dropped() -> None:
    assert translate_labels([_kv("empty", _s("")), _kv("rank", AnyValue(int_value=0))]) == (("rank", "0"),)


# ----------------------------------------------------------------------------------------------------
# request translation: what gets rejected, with which reason


def _dp(value: float, attrs: dict[str, str] | None = None, **kw: int) -> pb.NumberDataPoint:
    return pb.NumberDataPoint(attributes=[_kv(k, _s(v)) for k, v in (attrs or {}).items()],
                              as_double=value, start_time_unix_nano=kw.get("start", 1),
                              time_unix_nano=kw.get("time", 2), flags=kw.get("flags", 0))


def _request(*metrics: pb.Metric, resource: dict[str, str] | None = None) -> ExportMetricsServiceRequest:
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource

    res = Resource(attributes=[_kv(k, _s(v)) for k, v in (resource or {}).items()])
    return ExportMetricsServiceRequest(resource_metrics=[pb.ResourceMetrics(
        resource=res, scope_metrics=[pb.ScopeMetrics(metrics=list(metrics))])])


def test_translate_request_classifies_every_point() -> None:
    req = _request(
        pb.Metric(name="training.tokens", unit="{token}", sum=pb.Sum(
            aggregation_temporality=CUMULATIVE, is_monotonic=True, data_points=[_dp(5, {"run_id": "r1"})])),
        pb.Metric(name="queue.depth", sum=pb.Sum(
            aggregation_temporality=DELTA, is_monotonic=False, data_points=[_dp(1)])),
        pb.Metric(name="no.temporality", sum=pb.Sum(is_monotonic=True, data_points=[_dp(1)])),
        pb.Metric(name="latency", exponential_histogram=pb.ExponentialHistogram(
            aggregation_temporality=CUMULATIVE, data_points=[pb.ExponentialHistogramDataPoint(count=1)])),
        pb.Metric(name="@#$", gauge=pb.Gauge(data_points=[_dp(1)])),
        pb.Metric(name="gpuenergy.gpu.power", unit="W", gauge=pb.Gauge(data_points=[_dp(1)])),
        pb.Metric(name="bad.hist", histogram=pb.Histogram(aggregation_temporality=CUMULATIVE, data_points=[
            pb.HistogramDataPoint(count=1, bucket_counts=[1], explicit_bounds=[1.0, 2.0])])),
        pb.Metric(name="neg", sum=pb.Sum(aggregation_temporality=DELTA, is_monotonic=True,
                                         data_points=[_dp(-1)])),
        pb.Metric(name="novalue", gauge=pb.Gauge(data_points=[pb.NumberDataPoint(time_unix_nano=5)])),
        pb.Metric(name="reserved.label", gauge=pb.Gauge(data_points=[_dp(1, {"__x": "y"})])),
        pb.Metric(name="le.label", histogram=pb.Histogram(aggregation_temporality=CUMULATIVE, data_points=[
            pb.HistogramDataPoint(count=0, attributes=[_kv("le", _s("1"))])])),
        resource={"service.name": "trainer", "service.instance.id": "abc"},
    )
    batch = translate_request(req, received_ns=99)
    assert batch.received == 11
    assert [p.name for p in batch.points] == ["training_tokens_total"]
    assert batch.points[0].run_id == "r1" and batch.points[0].labels == (("run_id", "r1"),)
    assert batch.rejected == {
        "unsupported_temporality": 2, "unsupported_type": 1, "invalid_name": 2, "invalid_point": 3,
        "invalid_label": 2,
    }
    assert "'@#$'" in batch.messages["invalid_name"]  # the first message per reason is kept
    assert "reserved label name '__x'" in batch.messages["invalid_label"]
    assert batch.resources == [(("service_instance_id", "abc"), ("service_name", "trainer"))]


def test_translate_request_details() -> None:
    req = _request(
        pb.Metric(name="loss", gauge=pb.Gauge(data_points=[_dp(1.5, time=0)])),
        pb.Metric(name="legacy", gauge=pb.Gauge(data_points=[_dp(1)]),
                  metadata=[_kv("prometheus.type", _s("unknown"))]),
        pb.Metric(name="ended", gauge=pb.Gauge(data_points=[_dp(0, flags=1)])),
        pb.Metric(name="step.duration", unit="s", histogram=pb.Histogram(
            aggregation_temporality=DELTA, data_points=[pb.HistogramDataPoint(
                count=3, sum=1.5, bucket_counts=[1, 2, 0], explicit_bounds=[0.5, 1.0],
                start_time_unix_nano=1, time_unix_nano=2)])),
    )
    points = {p.name: p for p in translate_request(req, received_ns=99).points}
    assert points["loss"].time_ns == 99  # missing time: the receive time stands in
    assert points["loss"].value == 1.5
    assert points["legacy"].kind == "unknown"
    assert points["ended"].no_value
    hist = points["step_duration_seconds"]
    assert (hist.kind, hist.delta, hist.bounds, hist.counts, hist.count, hist.sum, hist.unit) == (
        "histogram", True, (0.5, 1.0), (1, 2, 0), 3, 1.5, "seconds")


# ----------------------------------------------------------------------------------------------------
# the training contract's labels, checked once per label set (otlp.reserved.labels_fit in the attribute cache)


def test_contract_label_check_is_cached_per_label_set_not_per_family() -> None:
    attrs = {"run_id": "c1", "rank": "0", "gpu_uuid": "GPU-1", "model": "tiny"}
    tokens = pb.Metric(name="training.tokens", unit="{token}", sum=pb.Sum(
        aggregation_temporality=CUMULATIVE, is_monotonic=True, data_points=[_dp(5, attrs)]))
    info = pb.Metric(name="training.run.info", gauge=pb.Gauge(data_points=[_dp(1, attrs)]))
    mine = pb.Metric(name="my.gauge", gauge=pb.Gauge(data_points=[_dp(1, attrs)]))
    # The same attribute bytes under three families, in both orders: the first translation fills the
    # attribute cache, the others hit it; each family still gets its own answer.
    for order in ((mine, info, tokens), (tokens, info, mine)):
        batch = translate_request(_request(*order), received_ns=99)
        assert sorted(p.name for p in batch.points) == ["my_gauge", "training_run_info"]
        assert batch.rejected == {"contract_violation": 1}
        assert "training_tokens_total: label 'model' is not an attribute" in batch.messages["contract_violation"]
    # A label set the contract accepts for tokens, then one without run_id (a new label set: refused).
    ok = translate_request(_request(pb.Metric(name="training.tokens", unit="{token}", sum=pb.Sum(
        aggregation_temporality=CUMULATIVE, is_monotonic=True, data_points=[
            _dp(5, {"run_id": "c1", "rank": "0"}), _dp(5, {"rank": "1"})]))), received_ns=99)
    assert [p.labels for p in ok.points] == [(("rank", "0"), ("run_id", "c1"))]
    assert ok.rejected == {"contract_violation": 1} and "needs a run_id" in ok.messages["contract_violation"]


@pytest.mark.parametrize("keys", [(), ("run_id",), ("rank",), ("run_id", "rank", "gpu_uuid"),
                                  ("run_id", "model"), ("run_id", "padding", "flops"), ("run_id", "step"),
                                  ("model", "rank"), ("run_id", "rank", "model", "step")])
def test_labels_fit_agrees_with_label_refusal(keys: tuple[str, ...]) -> None:
    from gpu_energy_exporter.otlp import reserved

    labels = tuple(sorted((k, "v") for k in keys))
    fits = reserved.labels_fit(labels)
    for name in reserved.ALLOWED_LABELS:
        assert bool(fits & reserved.family_bit(name)) == (reserved.label_refusal(name, labels) is None), name
    assert reserved.family_bit("my_gauge") == 0

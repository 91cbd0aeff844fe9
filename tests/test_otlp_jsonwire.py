"""The receiver's JSON fast path (``otlp.jsonwire``): what it accepts decodes to exactly the message the generic
OTLP/JSON parser gives, and everything else falls back to that parser, so answers and errors are unchanged."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from gpu_energy_exporter.otlp import jsonwire, receiver
from gpu_energy_exporter.otlp.receiver import ExportHandler
from gpu_energy_exporter.otlp.store import TrainingStore
from gpu_energy_exporter.otlp.wire import WireRequest, as_wire

JSON = {"Content-Type": "application/json"}
T = 1_700_000_000_000_000_000


def attrs(**kv: Any) -> list[dict[str, Any]]:
    out = []
    for k, v in kv.items():
        key = "intValue" if isinstance(v, int) and not isinstance(v, bool) else \
            "boolValue" if isinstance(v, bool) else "doubleValue" if isinstance(v, float) else "stringValue"
        out.append({"key": k, "value": {key: v}})
    return out


def request(*metrics: dict[str, Any], resource: dict[str, Any] | None = None) -> dict[str, Any]:
    rm: dict[str, Any] = {"scopeMetrics": [{"scope": {"name": "s", "version": "1"}, "metrics": list(metrics)}]}
    if resource is not None:
        rm["resource"] = resource
    return {"resourceMetrics": [rm]}


GOOD: list[dict[str, Any]] = [
    request({"name": "training.tokens", "unit": "{token}", "sum": {
        "aggregationTemporality": 2, "isMonotonic": True,
        "dataPoints": [{"attributes": attrs(run_id="r", rank=3, gpu_uuid="GPU-1"), "startTimeUnixNano": str(T),
                        "timeUnixNano": str(T + 10), "asDouble": 1.5,
                        "exemplars": [{"traceId": "5b8efff798038103d269b633813fc60c", "asDouble": 1}]}]}},
        resource={"attributes": attrs(**{"service.name": "svc"})}),
    # the proto field names, int64 as JSON numbers, enums by name, zero values set explicitly
    {"resource_metrics": [{"resource": {}, "scope_metrics": [{"metrics": [
        {"name": "g", "description": "d", "gauge": {"data_points": [
            {"attributes": attrs(run_id="r", flag=True, ratio=0.25), "time_unix_nano": T, "as_int": "-7"},
            {"time_unix_nano": T, "as_int": 0, "flags": 0},
            {"time_unix_nano": 0, "as_double": 0.0}]}},
        {"name": "c", "sum": {"aggregation_temporality": "AGGREGATION_TEMPORALITY_DELTA", "is_monotonic": False,
                              "data_points": [{"as_double": "NaN", "time_unix_nano": T}]}}]}]}]},
    # histogram with an explicit zero sum (proto3 optional), min/max, infinities as strings
    request({"name": "h", "histogram": {"aggregationTemporality": "AGGREGATION_TEMPORALITY_CUMULATIVE",
             "dataPoints": [{"count": "3", "sum": 0, "min": "-Infinity", "max": "Infinity",
                             "bucketCounts": ["1", 2, "0"], "explicitBounds": [0.5, 1],
                             "attributes": attrs(run_id="r"), "timeUnixNano": str(T), "exemplars": []}]}}),
    request({"name": "s", "summary": {"dataPoints": [{"count": 2, "sum": 3.0, "timeUnixNano": str(T),
             "quantileValues": [{"quantile": 0.5, "value": 1}, {"quantile": 1.0, "value": 2.0}]}]}}),
    # metadata, an array attribute value, an empty envelope, a metric with no points
    request({"name": "u", "metadata": attrs(**{"prometheus.type": "unknown"}), "gauge": {"dataPoints": [
        {"attributes": [{"key": "l", "value": {"arrayValue": {"values": [{"stringValue": "a"}, {"intValue": "2"}]}}}],
         "asDouble": 1, "timeUnixNano": str(T)}]}}, {"name": "empty"}, {"name": "none", "gauge": {"dataPoints": []}}),
    {},
    {"resourceMetrics": []},
]


@pytest.mark.parametrize("doc", GOOD)
def test_what_the_fast_path_accepts_is_the_message_the_generic_parser_gives(doc: dict[str, Any]) -> None:
    fast = WireRequest.FromString(jsonwire.encode(doc))
    slow = as_wire(receiver._parse_json(copy.deepcopy(doc)))
    assert fast == slow
    assert fast.SerializeToString(deterministic=True) == slow.SerializeToString(deterministic=True)


def _dp(**fields: Any) -> dict[str, Any]:
    return request({"name": "g", "gauge": {"dataPoints": [{"timeUnixNano": str(T), "asDouble": 1.0, **fields}]}})


UNSUPPORTED: list[Any] = [
    [1, 2],
    {"resourceMetrics": "x"},
    {"resourceMetrics": [None]},
    {"resourceMetrics": [], "somethingNew": 1},
    {"resourceMetrics": [], "resource_metrics": []},
    _dp(asInt="1"),  # two members of the value oneof
    _dp(flags=1.0),
    _dp(flags=True),
    _dp(flags=-1),
    _dp(flags=1 << 32),
    _dp(startTimeUnixNano="1e3"),
    _dp(startTimeUnixNano=" 1"),
    _dp(startTimeUnixNano=str(1 << 64)),
    _dp(attributes=[{"key": "k", "value": {"bytesValue": "AAEC"}}]),
    _dp(attributes=[{"key": "k\ud800", "value": {"stringValue": "v"}}]),
    _dp(attributes=[{"key": 1, "value": {"stringValue": "v"}}]),
    _dp(attributes=None),
    request({"name": "g", "gauge": {"dataPoints": [{"asDouble": "1.5"}]}}),
    request({"name": "g", "gauge": {"dataPoints": [{"asDouble": float("inf")}]}}),
    request({"name": "g", "gauge": {"dataPoints": [{"asDouble": True}]}}),
    request({"name": "c", "sum": {"aggregationTemporality": "CUMULATIVE", "dataPoints": []}}),
    request({"name": "c", "sum": {"aggregationTemporality": 7, "dataPoints": []}}),
    request({"name": "c", "sum": {"isMonotonic": 1, "dataPoints": []}}),
    request({"name": "e", "exponentialHistogram": {"dataPoints": []}}),
    request({"name": "s", "summary": {"dataPoints": [{"exemplars": []}]}}),
]


@pytest.mark.parametrize("doc", UNSUPPORTED)
def test_anything_else_falls_back_to_the_generic_parser_and_its_answer(doc: Any) -> None:
    with pytest.raises(jsonwire.Unsupported):
        jsonwire.encode(doc)
    body = json.dumps(doc).encode()
    try:
        expected: Any = as_wire(receiver._parse_json(json.loads(body))).SerializeToString(deterministic=True)
    except receiver._Failure as exc:
        expected = (exc.status, exc.message, exc.field)
    try:
        got: Any = as_wire(receiver.decode_wire(body, receiver.JSON)).SerializeToString(deterministic=True)
    except receiver._Failure as exc:
        got = (exc.status, exc.message, exc.field)
    assert got == expected


def test_a_json_push_through_the_fast_path_stores_what_the_protobuf_push_stores() -> None:
    doc = GOOD[0]
    pb = receiver._parse_json(copy.deepcopy(doc)).SerializeToString()
    renders = []
    for headers, body in ((JSON, json.dumps(doc).encode()), ({"Content-Type": "application/x-protobuf"}, pb)):
        store = TrainingStore()
        status, _, out = ExportHandler(store).handle_export(headers, body)
        assert status == 200 and out in (b"{}", b"")
        # the training series and target_info (the self-metrics differ: request durations)
        renders.append([line for line in store.render(False).splitlines() if b"gpuenergy_" not in line])
    assert renders[0] == renders[1]
    assert any(line.startswith(b"training_tokens_total{") for line in renders[0])


def test_a_remembered_attribute_never_stands_in_for_one_the_fast_path_refuses() -> None:
    # attributes are memoised by key, value field, value and type: True == 1, but a boolean intValue falls back
    good = _dp(attributes=[{"key": "rank", "value": {"intValue": 1}}])
    fast = WireRequest.FromString(jsonwire.encode(good))
    assert fast == as_wire(receiver._parse_json(copy.deepcopy(good)))
    for value in (True, 1.0, "1.0"):
        with pytest.raises(jsonwire.Unsupported):
            jsonwire.encode(_dp(attributes=[{"key": "rank", "value": {"intValue": value}}]))
    again = jsonwire.encode(_dp(attributes=[{"key": "rank", "value": {"intValue": "1"}}]))
    assert WireRequest.FromString(again) == fast


@pytest.mark.parametrize("field, item", [("explicitBounds", 0), ("bucketCounts", "0")])
def test_a_long_packed_list_costs_about_its_encoded_size(field: str, item: object) -> None:
    # A JSON list of a million zeros is a few KiB gzipped. Encoding each element to its own bytes object first
    # cost about 50 bytes an element (0.6 GiB for an 8 MiB body), where the encoded list is 8 bytes an element.
    import tracemalloc

    n = 1_000_000
    doc = {"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": "h", "histogram": {
        "aggregationTemporality": 2, "dataPoints": [{"timeUnixNano": "1", "count": "0", field: [item] * n}]}}]}]}]}
    tracemalloc.start()
    try:
        out = jsonwire.encode(doc)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(out) > 8 * n
    assert peak < 4 * 8 * n, f"{peak / 2**20:.0f} MiB to encode {n:,} elements"

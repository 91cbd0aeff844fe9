"""Decoding bounded by what it makes, not by bytes (issue 29, item 4): ``otlp.census`` counts what a body would
make before it is parsed, the translation counts what it makes as it goes, and a request over either bound is
refused whole, with a message naming --otlp.max-points-per-request. In the real exporter, the issue's request
(8 MiB of empty ResourceMetrics, 8 KB gzip'd: 29 MB -> 2.5 GB of RSS before) and the worst requests the
limits allow raise its peak RSS by at most 64 MB, over HTTP and gRPC, and all of its slots at once by at most
256 MB. (Figures for every shape: ``python -m bench.otlp_decoding``.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers import ExporterProcess, sample_value
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from bench import hostile
from bench.otlp_decoding import post_grpc, post_http
from bench.trainers import Trainer
from gpu_energy_exporter.otlp import census
from gpu_energy_exporter.otlp.census import RequestLimits, TooMuch
from gpu_energy_exporter.otlp.receiver import ExportHandler
from gpu_energy_exporter.otlp.status import PROTOBUF
from gpu_energy_exporter.otlp.store import TrainingStore

MiB = 1 << 20
PB = {"Content-Type": PROTOBUF}
FLAG = "--otlp.max-points-per-request"


def _helper_batch(ranks: int) -> bytes:
    """A Collector's batch of ``ranks`` helper-like exports (concatenated requests parse as one)."""
    return b"".join(Trainer(f"run-{i // 8}", i % 8).request()[0] for i in range(ranks))


# ----------------------------------------------------------------------------------------------------
# the census, pure


def test_the_walk_counts_what_the_parse_makes_and_the_bound_agrees() -> None:
    body = _helper_batch(80) * 2  # 2,080 points in 160 resources, 300 KB
    parsed = ExportMetricsServiceRequest.FromString(body)
    exact = census._walk(body, census.DEFAULT_REQUEST_LIMITS, bound=census.EXACT).counts
    assert exact[1:5] == [len(parsed.resource_metrics), sum(len(rm.scope_metrics) for rm in parsed.resource_metrics),
                          sum(len(sm.metrics) for rm in parsed.resource_metrics for sm in rm.scope_metrics), 2080]
    for bound in (census.COARSE, census.METRICS):  # resources (and scopes) exact, the rest bounded
        counts = census._walk(body, census.DEFAULT_REQUEST_LIMITS, bound=bound).counts
        assert counts[1:3] == exact[1:3]
        assert exact[0] <= counts[0] <= 16 * exact[0]
    assert census.census(body).walked
    small, _ = Trainer("x", 0).request()  # one rank's export: never walked
    assert len(small) <= census.SMALL_BODY and not census.census(small).walked


@pytest.mark.parametrize(("body", "refusal"), [
    (hostile.empty_resources(8 * MiB - 16), "more than 4096 resources (derived from --otlp.max-points-per-request)"),
    (hostile.empty_scopes(300_000), "more than 4096 scopes"),
    (hostile.empty_metrics(300_000), "more than 16384 metrics"),
    (hostile.attribute_flood(8 * MiB - 64), "would take more than 24 MiB to decode"),
    (hostile.empty_exemplars(400_000), "would take more than 24 MiB to decode"),
    (hostile.nested_values(40), "nests messages more than 32 deep"),
])
def test_bodies_that_would_make_too_much_are_refused_before_they_are_parsed(body: bytes, refusal: str) -> None:
    if len(body) <= census.SMALL_BODY:
        body += b"\x0a\x00" * census.SMALL_BODY  # past the size that is never walked
    started = time.perf_counter()
    with pytest.raises(TooMuch) as exc:
        census.census(body)
    assert refusal in str(exc.value)
    assert "send smaller batches" in str(exc.value) or "deep" in str(exc.value)
    assert time.perf_counter() - started < 5  # the walk stops at the bound, it does not count everything


def test_a_body_that_is_not_protobuf_keeps_the_parsers_own_answer() -> None:
    body = _helper_batch(80)
    broken = body[:-7]  # cut inside the last point: the parse's 400, as before
    assert census.census(broken).walked  # counted up to the cut, no error of its own
    with pytest.raises(Exception) as parse_error:
        ExportMetricsServiceRequest().ParseFromString(broken)
    status, _, out = ExportHandler(TrainingStore()).handle_export(PB, broken)
    assert status == 400 and str(parse_error.value).encode() in out


def test_packed_varints_are_counted_at_the_width_the_parse_gives_them() -> None:
    # an exponential histogram's buckets: a byte each on the wire, 8 in memory
    buckets = hostile.field(8, hostile.field(2, b"\x01" * (4 * MiB)))
    body = hostile.request(hostile.field(2, hostile.field(1, b"e") + hostile.field(10, hostile.field(1, buckets))))
    with pytest.raises(TooMuch, match="to decode"):
        census.census(body)


def test_json_bodies_are_counted_before_they_are_loaded() -> None:
    limits = RequestLimits()
    items = b'{"resourceMetrics": [' + b"{}," * (limits.max_json_items // 2) + b"{}]}"
    with pytest.raises(TooMuch, match="objects, arrays and values"):
        census.json_census(items, limits)
    wide = b'{"resourceMetrics": [], "x": "' + b"a" * (7 * MiB) + "\U0001f600".encode() + b'"}'
    with pytest.raises(TooMuch, match="4 bytes a character"):
        census.json_census(wide, limits)
    assert census.json_census(wide.replace("\U0001f600".encode(), b"a"), limits) > 0  # the same length in ASCII


# ----------------------------------------------------------------------------------------------------
# the receiver, in process


def test_a_request_over_the_points_limit_is_refused_whole_with_the_flag() -> None:
    store = TrainingStore()
    handler = ExportHandler(store, request_limits=RequestLimits(max_points=1000))
    status, _, out = handler.handle_export(PB, hostile.gauge_points(1001, 3))
    assert status == 413 and f"more than 1000 data points ({FLAG})".encode() in out
    assert store.series_count() == 0  # nothing stored
    status, _, _ = handler.handle_export(PB, hostile.gauge_points(1000, 3, distinct=False))
    assert status == 200 and store.series_count() == 1


def test_what_the_translation_would_make_is_bounded_too() -> None:
    store = TrainingStore()
    handler = ExportHandler(store)
    # 2,000 histograms of 256 buckets: 8 MiB on the wire, 40 MB of Python tuples once translated
    status, _, out = handler.handle_export(PB, hostile.histogram_points(2000, 256))
    assert status == 413 and b"once translated" in out and FLAG.encode() in out
    assert store.series_count() == 0
    status, _, out = handler.handle_export(PB, hostile.histogram_points(100, 256))  # 400 KB
    assert status == 200, out
    response = ExportMetricsServiceResponse.FromString(out)
    assert response.partial_success.rejected_data_points == 0
    assert store.series_count() == 100


def test_a_collectors_batch_passes_and_is_stored_exactly() -> None:
    store = TrainingStore()
    body = _helper_batch(80) * 4  # 4,160 points: walked, bounded, translated
    status, _, out = ExportHandler(store).handle_export(PB, body)
    assert status == 200 and ExportMetricsServiceResponse.FromString(out).partial_success.rejected_data_points == 0
    assert store.series_count() == 80 * 13


# ----------------------------------------------------------------------------------------------------
# the exporter's memory, over HTTP and gRPC


def _kb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(field)


def _peak(exp: ExporterProcess, send: list) -> tuple[float, list[str]]:  # type: ignore[type-arg]
    """Peak RSS growth (MB) of ``exp`` while the ``send`` callables run at once; their answers."""
    Path(f"/proc/{exp.pid}/clear_refs").write_text("5")
    before = _kb(exp.pid, "VmRSS")
    answers: list[str] = []
    threads = [threading.Thread(target=lambda s=s: answers.append(s())) for s in send]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return _kb(exp.pid, "VmHWM") - before, answers


@pytest.fixture
def exporter(start_exporter: type[ExporterProcess]) -> ExporterProcess:
    exp = start_exporter(["--no-collector.gpu", "--otlp.grpc.listen-address=127.0.0.1:0"]).wait_ready()
    warm, _ = Trainer("warm", 0).request()
    assert post_http(exp.push_url, warm) == "200"
    assert post_grpc(exp.grpc_endpoint.split("//", 1)[1], warm) == "OK"
    time.sleep(0.3)
    return exp


def test_the_issues_request_costs_little_over_http_and_grpc(exporter: ExporterProcess) -> None:
    """8 MiB of empty ResourceMetrics, 8 KB gzip'd: RSS 29 MB -> 2,502 MB peak before (same over gRPC)."""
    body = hostile.empty_resources(8 * MiB - 16)
    target = exporter.grpc_endpoint.split("//", 1)[1]
    grew, answers = _peak(exporter, [lambda: post_http(exporter.push_url, body)])
    assert answers == ["413"] and grew < 64, grew
    grew, answers = _peak(exporter, [lambda: post_grpc(target, body)])
    assert answers == ["INVALID_ARGUMENT"] and grew < 64, grew
    text = exporter.metrics()
    assert sample_value(text, "gpuenergy_otlp_requests_total", status="413") == 1
    assert sample_value(text, "gpuenergy_otlp_grpc_requests_total", code="INVALID_ARGUMENT") == 1
    body, _ = Trainer("after", 0).request()  # and the receiver goes on
    assert post_http(exporter.push_url, body) == "200"


def test_the_worst_requests_the_limits_allow_stay_within_64_mb(exporter: ExporterProcess) -> None:
    target = exporter.grpc_endpoint.split("//", 1)[1]
    for body in (hostile.gauge_points(16_000, 3, per_metric=1), hostile.histogram_points(1_000, 256)):
        for send in (lambda b=body: post_http(exporter.push_url, b), lambda b=body: post_grpc(target, b)):
            grew, answers = _peak(exporter, [send])
            assert answers in (["200"], ["OK"]) and grew < 64, (answers, grew)


def test_every_slot_at_once_stays_within_256_mb(exporter: ExporterProcess) -> None:
    """4 HTTP bodies in flight and 4 gRPC calls (what the default slots admit), each the worst of its kind."""
    target = exporter.grpc_endpoint.split("//", 1)[1]
    allowed, refused = hostile.histogram_points(1_000, 256), hostile.empty_resources(8 * MiB - 16)
    senders = [lambda b=b: post_http(exporter.push_url, b) for b in (allowed, refused) * 2]
    senders += [lambda b=b: post_grpc(target, b) for b in (allowed, refused) * 2]
    grew, answers = _peak(exporter, senders)
    assert sorted(answers) == sorted(["200", "413"] * 2 + ["OK", "INVALID_ARGUMENT"] * 2), answers
    assert grew < 256, grew

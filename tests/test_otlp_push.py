"""Pushing the node's readings over OTLP (``--otlp.push-endpoint``): the mapping onto the OpenTelemetry
hardware conventions on plain values, and the whole exporter (fake NVML) pushing through the SDK's OTLP
exporter to an endpoint that decodes with the OpenTelemetry protos, and to the project's own receiver."""

from __future__ import annotations

import gzip
import logging
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fakenvml import Constant, Scenario, a100, h100
from helpers import ExporterProcess, sample_value, wait_until
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from tlsutil import self_signed

import gpu_energy_exporter.daemon.exporter  # noqa: F401 - registers every collector's specs in the catalogue
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.core.metrics import CATALOGUE
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.otlp.conventions import CONVENTIONS, own_name, pushed, snapshot_points
from gpu_energy_exporter.otlp.naming import metric_name
from gpu_energy_exporter.otlp.push import OTLPPusher, PushSettings, load_headers_file

CUMULATIVE = 2

# ---- the mapping, on plain values -----------------------------------------------------------------------


def test_every_series_without_a_convention_translates_back_to_its_prometheus_name() -> None:
    """Prometheus' OTLP translation of ``own_name`` must give back exactly the /metrics name, so a
    dashboard works on pushed data with the same queries."""
    checked = 0
    for spec in CATALOGUE.values():
        if not pushed(spec) or spec.name in CONVENTIONS:
            continue
        name, unit = own_name(spec)
        kind = "counter" if spec.kind == "counter" else "gauge"
        assert metric_name(name, unit, kind) == spec.name, (spec.name, name, unit)
        assert name.startswith("gpuenergy.")
        checked += 1
    assert checked > 30


def _families() -> list[Any]:
    info = InfoMetricFamily("gpuenergy_gpu", "", labels=["gpu", "gpu_uuid", "model", "driver_version"])
    info.add_metric(["0", "GPU-a", "NVIDIA H100 80GB HBM3", "550.54"], {})
    energy = CounterMetricFamily("gpuenergy_gpu_energy_joules", "", labels=["gpu", "gpu_uuid"])
    energy.add_metric(["0", "GPU-a"], 1234.5)
    used = GaugeMetricFamily("gpuenergy_gpu_memory_used_bytes", "", labels=["gpu", "gpu_uuid"])
    used.add_metric(["0", "GPU-a"], 20.0)
    total = GaugeMetricFamily("gpuenergy_gpu_memory_total_bytes", "", labels=["gpu", "gpu_uuid"])
    total.add_metric(["0", "GPU-a"], 80.0)
    up = GaugeMetricFamily("gpuenergy_gpu_up", "", labels=["gpu", "gpu_uuid"])
    up.add_metric(["0", "GPU-a"], 0.0)
    temp = GaugeMetricFamily("gpuenergy_gpu_temperature_celsius", "", labels=["gpu", "gpu_uuid"])
    temp.add_metric(["0", "GPU-a"], 61.0)
    avg = GaugeMetricFamily("gpuenergy_gpu_power_average_watts", "", labels=["gpu", "gpu_uuid"])
    avg.add_metric(["0", "GPU-a"], 400.0)
    rapl = CounterMetricFamily("gpuenergy_rapl_energy_joules", "", labels=["zone", "domain", "package", "scope"])
    rapl.add_metric(["intel-rapl:0", "package-0", "0", "package"], 10.0)
    rapl.add_metric(["intel-rapl:0:0", "core", "0", "package_part"], 4.0)
    return [info, energy, used, total, up, temp, avg, rapl]


def test_snapshot_points_follow_the_hardware_conventions() -> None:
    points = snapshot_points(_families(), taken_at=100.0, gpu_times={"GPU-a": 99.5})
    by_name: dict[str, list[Any]] = {}
    for p in points:
        by_name.setdefault(p.name, []).append(p)
    (energy,) = by_name["hw.energy"][:1]
    attrs = dict(energy.attributes)
    assert (energy.unit, energy.kind, energy.value, energy.time_s) == ("J", "counter", 1234.5, 99.5)
    assert attrs == {"hw.type": "gpu", "hw.id": "GPU-a", "hw.name": "gpu0", "hw.vendor": "NVIDIA",
                     "hw.model": "NVIDIA H100 80GB HBM3", "hw.driver_version": "550.54"}
    (frac,) = by_name["hw.gpu.memory.utilization"]
    assert frac.value == pytest.approx(0.25) and frac.unit == "1"
    assert {p.kind for p in by_name["hw.gpu.memory.usage"]} == {"updown"}
    status = {dict(p.attributes)["hw.state"]: p.value for p in by_name["hw.status"]}
    assert status == {"ok": 0.0, "failed": 1.0}
    (temp,) = by_name["hw.temperature"]
    assert dict(temp.attributes) == {"hw.type": "temperature", "hw.id": "GPU-a:gpu", "hw.name": "gpu0 gpu",
                                     "hw.parent": "GPU-a"}
    # RAPL: only the non-overlapping package zone becomes hw.energy; core keeps the project's name
    rapl_hw = [p for p in by_name["hw.energy"] if dict(p.attributes)["hw.type"] == "cpu"]
    assert [(p.value, dict(p.attributes)["hw.id"]) for p in rapl_hw] == [(10.0, "rapl:intel-rapl:0")]
    assert [p.value for p in by_name["gpuenergy.rapl.energy"]] == [4.0]
    (avg,) = by_name["gpuenergy.gpu.power_average"]
    assert (avg.unit, avg.kind, dict(avg.attributes)) == ("W", "gauge", {"gpu": "0", "gpu_uuid": "GPU-a"})
    assert "gpuenergy.gpu" not in by_name  # the info family is attributes, not a metric


def test_headers_file_and_flags_are_validated(tmp_path: Path) -> None:
    f = tmp_path / "headers"
    f.write_text("# the collector's key\nAuthorization: Bearer s3cret\n\nX-Scope-OrgID: team-a\n")
    assert load_headers_file(str(f)) == {"Authorization": "Bearer s3cret", "X-Scope-OrgID": "team-a"}
    f.write_text("no colon here\n")
    with pytest.raises(ConfigError, match="line 1: expected 'Name: value'"):
        load_headers_file(str(f))
    with pytest.raises(ConfigError, match="--otlp.push-endpoint.*http:// or https://"):
        load_config(["--otlp.push-endpoint=collector:4318"], {})
    with pytest.raises(ConfigError, match="--otlp.push-interval must be at least 1s"):
        load_config(["--otlp.push-endpoint=http://c:4318/v1/metrics", "--otlp.push-interval=100ms"], {})
    cfg = load_config([], {"GPU_ENERGY_EXPORTER_OTLP_PUSH_ENDPOINT": "https://c:4318/v1/metrics"})
    assert cfg.otlp_push_endpoint == "https://c:4318/v1/metrics" and cfg.otlp_push_interval == 10.0


# ---- a real OTLP/HTTP endpoint decoding with the OpenTelemetry protos ----------------------------------


@dataclass
class Endpoint:
    url: str
    requests: list[ExportMetricsServiceRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    fail_first: int = 0
    hang: threading.Event | None = None
    status: int = 200
    location: str = ""
    response_body: bytes = b""
    lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: int = 0


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    yield from _endpoint(None)


@pytest.fixture
def tls_endpoint(tmp_path: Path) -> Iterator[tuple[Endpoint, Path]]:
    cert = self_signed(tmp_path)
    for ep in _endpoint(cert):
        yield ep, cert


def _endpoint(cert: Path | None) -> Iterator[Endpoint]:
    ep = Endpoint("")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server API
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with ep.lock:
                ep.attempts += 1
                failing = ep.attempts <= ep.fail_first
            if ep.hang is not None:
                ep.hang.wait(30)
            if failing:
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            req = ExportMetricsServiceRequest()
            req.ParseFromString(body)
            with ep.lock:
                ep.requests.append(req)
                ep.headers.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(ep.status)
            if ep.location:
                self.send_header("Location", ep.location)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(ep.response_body)))
            self.end_headers()
            self.wfile.write(ep.response_body)

        def log_message(self, *args: Any) -> None:
            pass

    server = _QuietServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    scheme = "http"
    if cert is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, cert.with_suffix(".key"))
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    ep.url = f"{scheme}://127.0.0.1:{server.server_address[1]}/v1/metrics"
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield ep
    finally:
        if ep.hang is not None:
            ep.hang.set()
        server.shutdown()
        server.server_close()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # refused handshakes are the point of the TLS tests


def _attrs(kvs: Any) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in kvs}


def _metrics(req: ExportMetricsServiceRequest) -> dict[str, Any]:
    out = {}
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = m
    return out


def _gpu_points(metric: Any, uuid: str) -> list[Any]:
    data = metric.sum if metric.HasField("sum") else metric.gauge
    return [dp for dp in data.data_points if _attrs(dp.attributes).get("hw.id") == uuid]


def _scenario(tmp_path: Path, sc: Scenario) -> dict[str, str]:
    path = tmp_path / "scenario.ini"
    sc.write(path)
    return {"FAKE_NVML_SCENARIO": str(path), "NODE_NAME": "gpu-node-7"}


def test_exporter_pushes_hardware_conventions_with_reading_times_and_the_scripted_energy_rate(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path, endpoint: Endpoint
) -> None:
    gpus = [h100(0, power=Constant(300.0)), a100(1, power=Constant(200.0))]
    env = _scenario(tmp_path, Scenario(epoch=time.time() - 30, gpus=gpus))
    headers = tmp_path / "headers"
    headers.write_text("X-Scope-OrgID: team-a\n")
    exp = start_exporter([
        f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", f"--otlp.push-endpoint={endpoint.url}",
        "--otlp.push-interval=1s", f"--otlp.push-headers-file={headers}",
    ], env).wait_ready()
    wait_until(lambda: len(endpoint.requests) >= 4, timeout=30, what="four pushes")
    first, last = endpoint.requests[1], endpoint.requests[-1]
    assert endpoint.headers[-1]["x-scope-orgid"] == "team-a"
    assert endpoint.headers[-1]["content-encoding"] == "gzip"
    assert endpoint.headers[-1]["content-type"] == "application/x-protobuf"

    res = _attrs(last.resource_metrics[0].resource.attributes)
    assert res["service.name"] == "gpu-energy-exporter" and res["host.name"] and res["service.version"]
    assert res["k8s.node.name"] == "gpu-node-7"

    m = _metrics(last)
    energy = m["hw.energy"]
    assert energy.unit == "J" and energy.sum.is_monotonic
    assert energy.sum.aggregation_temporality == CUMULATIVE
    (dp,) = _gpu_points(energy, gpus[0].uuid)
    a = _attrs(dp.attributes)
    assert a["hw.type"] == "gpu" and a["hw.vendor"] == "NVIDIA" and a["hw.model"] == "NVIDIA H100 80GB HBM3"
    assert a["hw.name"] == "gpu0" and a["hw.driver_version"]
    assert dp.start_time_unix_nano < dp.time_unix_nano
    # the energy rate between two pushes is the scripted power, timed by the readings' own timestamps
    for gpu, watts in ((gpus[0], 300.0), (gpus[1], 200.0)):
        (d0,) = _gpu_points(_metrics(first)["hw.energy"], gpu.uuid)
        (d1,) = _gpu_points(m["hw.energy"], gpu.uuid)
        assert d0.start_time_unix_nano == d1.start_time_unix_nano  # one cumulative series
        rate = (d1.as_double - d0.as_double) / ((d1.time_unix_nano - d0.time_unix_nano) / 1e9)
        assert rate == pytest.approx(watts, rel=0.01)

    (power,) = _gpu_points(m["hw.power"], gpus[0].uuid)
    assert m["hw.power"].unit == "W" and power.as_double == pytest.approx(300.0, rel=0.01)
    usage = m["hw.gpu.memory.usage"]
    assert usage.unit == "By" and not usage.sum.is_monotonic and usage.sum.aggregation_temporality == CUMULATIVE
    assert m["hw.gpu.memory.limit"].unit == "By"
    assert m["hw.gpu.utilization"].unit == "1"
    assert {_attrs(d.attributes)["hw.type"] for d in m["hw.temperature"].gauge.data_points} == {"temperature"}
    status = {_attrs(d.attributes)["hw.state"]: d.as_double for d in _gpu_points(m["hw.status"], gpus[0].uuid)}
    assert status == {"ok": 1.0, "failed": 0.0}
    # readings without a convention keep the project's names, unit in the unit field
    assert m["gpuenergy.gpu.power_average"].unit == "W"
    assert "gpuenergy.carbon.intensity_grams_per_kilowatt_hour" in m and "gpuenergy.datacenter.pue" in m

    text = exp.metrics()
    assert sample_value(text, "gpuenergy_otlp_push_points_total") > 0
    assert sample_value(text, "gpuenergy_otlp_push_failures_total") == 0


def test_failed_pushes_back_off_and_never_hold_up_sampling_or_scraping(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path, endpoint: Endpoint
) -> None:
    endpoint.fail_first = 2
    env = _scenario(tmp_path, Scenario(epoch=time.time() - 30, gpus=[h100(0, power=Constant(300.0))]))
    exp = start_exporter([
        f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", f"--otlp.push-endpoint={endpoint.url}",
        "--otlp.push-interval=1s",
    ], env).wait_ready()
    wait_until(lambda: len(endpoint.requests) >= 1, timeout=40, what="a push after two failures")
    text = exp.metrics()
    # the SDK's exporter retries a 503 itself within one push; a push that still fails counts once
    assert sample_value(text, "gpuenergy_otlp_push_failures_total") >= 1
    assert sample_value(text, "gpuenergy_otlp_push_points_total") > 0
    assert exp.log().count("failed:") == 1 and "retrying with back-off" in exp.log()
    assert "works again" in exp.log()
    assert endpoint.attempts <= 4  # no hammering: each failure doubles the wait


def test_a_hung_endpoint_does_not_slow_scrapes(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path, endpoint: Endpoint
) -> None:
    endpoint.hang = threading.Event()
    env = _scenario(tmp_path, Scenario(epoch=time.time() - 30, gpus=[h100(0, power=Constant(300.0))]))
    exp = start_exporter([
        f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", f"--otlp.push-endpoint={endpoint.url}",
        "--otlp.push-interval=1s",
    ], env).wait_ready()
    wait_until(lambda: endpoint.attempts >= 1, timeout=20, what="a push attempt")
    t0 = sample_value(exp.metrics(), "gpuenergy_snapshot_timestamp_seconds")
    slowest = 0.0
    for _ in range(10):
        start = time.monotonic()
        exp.metrics()
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.1)
    assert slowest < 1.0
    assert sample_value(exp.metrics(), "gpuenergy_snapshot_timestamp_seconds") > t0  # sampling goes on


def test_pushes_land_in_the_projects_own_receiver_under_prometheus_names(
    start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path
) -> None:
    receiver = start_exporter(["--no-collector.gpu", "--no-collector.rapl"], {}).wait_ready()
    gpus = [h100(0, power=Constant(300.0))]
    env = _scenario(tmp_path, Scenario(epoch=time.time() - 30, gpus=gpus))
    start_exporter([
        f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms",
        f"--otlp.push-endpoint={receiver.otlp_url}/v1/metrics", "--otlp.push-interval=1s",
    ], env).wait_ready()
    wait_until(lambda: sample_value(receiver.metrics(), "hw_energy_joules_total", hw_id=gpus[0].uuid) is not None,
               timeout=30, what="hw_energy_joules_total in the receiver")
    text = receiver.metrics()
    assert sample_value(text, "hw_power_watts", hw_id=gpus[0].uuid, hw_type="gpu") == pytest.approx(300.0, rel=0.01)
    assert sample_value(text, "hw_gpu_memory_usage_bytes", hw_id=gpus[0].uuid) is not None
    assert sample_value(text, "hw_gpu_utilization_ratio", hw_id=gpus[0].uuid) is not None


# ---- the pusher in-process, against real endpoints: TLS, redirects, partial success ----------------------


@dataclass
class _Snap:
    families: list[Any]
    timestamp: float
    gpus: tuple[Any, ...] = ()


def _pusher(url: str, **settings: Any) -> OTLPPusher:
    snap = _Snap(_families(), time.time())
    return OTLPPusher(PushSettings(url, interval_s=1.0, timeout_s=5.0, **settings), lambda: snap, environ={})


def test_a_redirect_is_a_failed_push_not_an_accepted_one(endpoint: Endpoint, caplog: pytest.LogCaptureFixture) -> None:
    """The SDK takes any status below 400 as success and never follows redirects: nothing was stored."""
    endpoint.status, endpoint.location = 307, "http://elsewhere:4318/v1/metrics"
    pusher = _pusher(endpoint.url)
    with caplog.at_level(logging.WARNING):
        assert pusher.push_once() is False
    assert pusher.points_pushed == 0 and pusher.failures == 1
    assert "307 (a redirect to http://elsewhere:4318/v1/metrics)" in caplog.text


def test_a_partial_success_counts_only_the_accepted_points(
    endpoint: Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    resp = ExportMetricsServiceResponse()
    resp.partial_success.rejected_data_points = 3
    resp.partial_success.error_message = "3 points over the series limit"
    endpoint.response_body = resp.SerializeToString()
    pusher = _pusher(endpoint.url)
    with caplog.at_level(logging.WARNING):
        assert pusher.push_once() and pusher.push_once()
    sent = len(snapshot_points(_families(), taken_at=0.0))
    assert pusher.points_rejected == 6 and pusher.points_pushed == 2 * (sent - 3)
    assert caplog.text.count("rejected 3 of") == 1 and "over the series limit" in caplog.text


def test_tls_endpoint_needs_its_ca_and_skip_verify_really_skips(
    tls_endpoint: tuple[Endpoint, Path], caplog: pytest.LogCaptureFixture
) -> None:
    ep, cert = tls_endpoint
    with caplog.at_level(logging.WARNING):
        assert _pusher(ep.url).push_once() is False  # self-signed: not trusted by default
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text or "certificate" in caplog.text.lower()
    # --otlp.push-ca-file wins even where REQUESTS_CA_BUNDLE points at another bundle (as on this machine)
    assert _pusher(ep.url, ca_file=str(cert)).push_once() is True
    assert _pusher(ep.url, insecure_skip_verify=True).push_once() is True
    assert len(ep.requests) == 2


def test_a_lost_gpus_status_is_stamped_now_not_with_its_last_reading() -> None:
    points = snapshot_points(_families(), taken_at=500.0, gpu_times={"GPU-a": 100.0})
    status = [p for p in points if p.name == "hw.status"]
    assert status and {p.time_s for p in status} == {500.0}
    assert {p.time_s for p in points if p.name == "hw.energy" and dict(p.attributes)["hw.type"] == "gpu"} == {100.0}


def test_headers_file_with_bom_non_utf8_and_bad_names(tmp_path: Path) -> None:
    f = tmp_path / "headers"
    f.write_bytes(b"\xef\xbb\xbfAuthorization: Bearer x\r\n")
    assert load_headers_file(str(f)) == {"Authorization": "Bearer x"}
    f.write_bytes(b"Authorization: \xff\xfe\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_headers_file(str(f))
    f.write_text("Bad Name: x\n")
    with pytest.raises(ConfigError, match="line 1"):
        load_headers_file(str(f))
    f.write_text("X-Key: caf\u00e9\u2603\n")
    with pytest.raises(ConfigError, match="non-Latin-1"):
        load_headers_file(str(f))

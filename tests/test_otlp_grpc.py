"""The OTLP/gRPC receiver (``--otlp.grpc.listen-address``) in the real exporter process: the OpenTelemetry
SDK's own gRPC exporter pushes (cumulative and delta) and the points show on /metrics and in the run ledger;
hostile input gets the codes the OTLP specification gives (oversized: RESOURCE_EXHAUSTED, before and after
gzip; malformed: INVALID_ARGUMENT with the HTTP receiver's message; no token: UNAUTHENTICATED); slow and idle
clients do not hold the port; TLS (and client certificates) from --web.config.file with a test CA.

Raw calls go through a real grpc channel with the method's path and bytes, so a test can send what no SDK
would (garbage, a bomb, a call that never sends its message)."""

from __future__ import annotations

import datetime
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fakenvml import Constant, Scenario, h100
from helpers import ExporterProcess, sample_value, wait_until
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb
from opentelemetry.sdk.metrics import Counter, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from tlsutil import self_signed

from gpu_energy_exporter.core import contract
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.daemon.config import DEFAULT_OTLP_GRPC_PORT, load_config

EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
GRPC_ON = "--otlp.grpc.listen-address=127.0.0.1:0"


def _target(exp: ExporterProcess) -> str:
    return exp.grpc_endpoint.split("//", 1)[1]


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def _counter_request(name: str, value: float, labels: dict[str, str]) -> bytes:
    point = pb.NumberDataPoint(as_double=value, start_time_unix_nano=1, time_unix_nano=time.time_ns(),
                               attributes=[_kv(k, v) for k, v in labels.items()])
    metric = pb.Metric(name=name, unit="1", sum=pb.Sum(
        data_points=[point], is_monotonic=True,
        aggregation_temporality=pb.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE))
    return ExportMetricsServiceRequest(resource_metrics=[pb.ResourceMetrics(
        scope_metrics=[pb.ScopeMetrics(metrics=[metric])])]).SerializeToString()


def _call(target: str, body: bytes, *, metadata: tuple[tuple[str, str], ...] = (),
          compression: grpc.Compression | None = None,
          credentials: grpc.ChannelCredentials | None = None) -> tuple[grpc.StatusCode, str, bytes]:
    """(code, details, response bytes) of one Export call with ``body`` as the message."""
    channel = (grpc.secure_channel(target, credentials) if credentials is not None
               else grpc.insecure_channel(target))
    with channel:
        try:
            out = channel.unary_unary(EXPORT)(body, timeout=20, metadata=metadata, compression=compression)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", b""
    return grpc.StatusCode.OK, "", out


def _provider(endpoint: str, temporality: AggregationTemporality = AggregationTemporality.CUMULATIVE,
              **kw: Any) -> tuple[MeterProvider, PeriodicExportingMetricReader]:
    exporter = OTLPMetricExporter(endpoint=endpoint, preferred_temporality={Counter: temporality},
                                  timeout=20, **kw)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader],
                             resource=Resource.create({"service.name": contract.SERVICE_NAME}))
    return provider, reader


def _grpc_count(exp: ExporterProcess, code: str) -> float | None:
    return sample_value(exp.metrics(), "gpuenergy_otlp_grpc_requests_total", code=code)


@pytest.fixture
def gpu_env(fake_nvml_lib: Path, tmp_path: Path) -> tuple[list[str], dict[str, str], str]:
    gpu = h100(0, power=Constant(300.0))
    Scenario(epoch=time.time() - 60, gpus=[gpu]).write(tmp_path / "scenario.ini")
    return ([f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms"],
            {"FAKE_NVML_SCENARIO": str(tmp_path / "scenario.ini")}, gpu.uuid)


# ----------------------------------------------------------------------------------------------------
# configuration


def test_flag_default_is_localhost_4317_and_empty_turns_it_off() -> None:
    assert load_config([], {}).otlp_grpc_listen_address == ("localhost", DEFAULT_OTLP_GRPC_PORT) == ("localhost", 4317)
    assert load_config(["--otlp.grpc.listen-address="], {}).otlp_grpc_listen_address is None
    env = {"GPU_ENERGY_EXPORTER_OTLP_GRPC_LISTEN_ADDRESS": ":14317"}
    assert load_config([], env).otlp_grpc_listen_address == ("", 14317)
    assert load_config([], {"GPU_ENERGY_EXPORTER_OTLP_GRPC_LISTEN_ADDRESS": ""}).otlp_grpc_listen_address is None
    with pytest.raises(ConfigError, match="--otlp.grpc.listen-address and --otlp.listen-address must differ"):
        load_config(["--otlp.listen-address=:4317", "--otlp.grpc.listen-address=:4317"], {})
    with pytest.raises(ConfigError, match="--otlp.grpc.listen-address"):
        load_config(["--otlp.grpc.listen-address=nope"], {})


def test_grpc_is_not_loaded_when_off() -> None:
    # The daemon with the receiver off never imports grpc (its memory stays out of the exporter's RSS).
    code = ("import sys\n"
            "from gpu_energy_exporter.daemon.config import load_config\n"
            "from gpu_energy_exporter.daemon.exporter import Exporter\n"
            "e = Exporter(load_config(['--no-collector.gpu', '--web.listen-address=127.0.0.1:0',"
            " '--otlp.listen-address=127.0.0.1:0', '--otlp.grpc.listen-address=']))\n"
            "e.start(); loaded = 'grpc' in sys.modules; e.stop(); print(loaded)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_port_in_use_is_a_config_error_naming_the_flag(start_exporter: type[ExporterProcess]) -> None:
    # grpc sets SO_REUSEPORT unless told not to: a second exporter would then share the port silently.
    first = start_exporter(["--no-collector.gpu", GRPC_ON]).wait_ready()
    taken = _target(first)
    second = subprocess.run([sys.executable, "-m", "gpu_energy_exporter", "--no-collector.gpu",
                             "--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                             f"--otlp.grpc.listen-address={taken}"], capture_output=True, text=True, timeout=60)
    assert second.returncode != 0
    assert f"--otlp.grpc.listen-address: cannot listen on {taken}" in second.stderr, second.stderr
    assert "Traceback" not in second.stderr


# ----------------------------------------------------------------------------------------------------
# the SDK's own gRPC exporter, into /metrics and the ledger


def test_sdk_grpc_exporter_cumulative_and_delta_reach_metrics_and_the_ledger(
    start_exporter: type[ExporterProcess], gpu_env: tuple[list[str], dict[str, str], str],
) -> None:
    args, env, uuid = gpu_env
    exp = start_exporter([*args, GRPC_ON, "--runs.stale-after=1m"], env).wait_ready()
    assert exp.grpc_endpoint.startswith("http://127.0.0.1:")
    text = exp.metrics()
    for code in ("OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED"):
        assert sample_value(text, "gpuenergy_otlp_grpc_requests_total", code=code) == 0  # present before use
    pushed = {}
    providers = []
    for run_id, temporality in (("grpc-cumulative", AggregationTemporality.CUMULATIVE),
                                ("grpc-delta", AggregationTemporality.DELTA)):
        provider, reader = _provider(exp.grpc_endpoint, temporality, insecure=True)
        tokens = provider.get_meter(contract.SCOPE_NAME).create_counter(
            contract.TOKENS.name, unit=contract.TOKENS.unit)
        attrs = {contract.ATTR_RUN_ID: run_id, contract.ATTR_RANK: "0", contract.ATTR_GPU_UUID: uuid}
        tokens.add(1000, attrs)
        assert reader.force_flush(20_000)
        tokens.add(500, attrs)  # the second export: the cumulative total, or the delta of 500
        assert reader.force_flush(20_000)
        providers.append(provider)  # shut down after the count below (a cumulative reader exports once more)
        pushed[run_id] = 1500

    text = exp.metrics()
    for run_id, total in pushed.items():
        assert sample_value(text, contract.TOKENS.prometheus, run_id=run_id, rank="0", gpu_uuid=uuid) == total
    assert sample_value(text, "gpuenergy_otlp_grpc_requests_total", code="OK") == 4
    assert sample_value(text, "gpuenergy_otlp_requests_total", status="200") == 0  # HTTP's count: untouched
    for provider in providers:
        provider.shutdown()

    def ledger_tokens() -> dict[str, float] | None:
        with urllib.request.urlopen(exp.metrics_url + "/api/v1/runs", timeout=10) as r:
            runs = {d["run_id"]: d["tokens"] for d in json.load(r)["runs"]}
        return runs if all(runs.get(k) == v for k, v in pushed.items()) else None

    # the ledger counts the pushed tokens at its next snapshot
    assert wait_until(ledger_tokens, timeout=30, what="both runs' tokens in the ledger") == pushed


def test_partial_success_is_answered_as_over_http(start_exporter: type[ExporterProcess]) -> None:
    exp = start_exporter(["--no-collector.gpu", GRPC_ON, "--otlp.max-labels-per-point=2"]).wait_ready()
    body = _counter_request("train_things", 5, {"a": "1", "b": "2", "c": "3"})  # one attribute too many
    code, _, out = _call(_target(exp), body)
    assert code == grpc.StatusCode.OK
    partial = ExportMetricsServiceResponse.FromString(out).partial_success
    assert partial.rejected_data_points == 1
    assert "too_many_labels" in partial.error_message and "--otlp.max-labels-per-point" in partial.error_message
    ok = _counter_request("train_things", 5, {"a": "1"})
    code, _, out = _call(_target(exp), ok)
    assert code == grpc.StatusCode.OK and out == b""  # a full success: the empty response
    text = exp.metrics()
    assert sample_value(text, "train_things_total", a="1") == 5
    assert sample_value(text, "gpuenergy_otlp_points_rejected_total", reason="too_many_labels") == 1


# ----------------------------------------------------------------------------------------------------
# hostile input


def test_oversized_messages_are_resource_exhausted_before_and_after_gzip(
    start_exporter: type[ExporterProcess],
) -> None:
    exp = start_exporter(["--no-collector.gpu", GRPC_ON, "--otlp.max-body-bytes=65536"]).wait_ready()
    target = _target(exp)
    code, details, _ = _call(target, b"\x00" * 70_000)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    # small on the wire (about 10 KiB), 10 MiB inflated: refused without inflating it all
    code, details, _ = _call(target, b"\x00" * (10 << 20), compression=grpc.Compression.Gzip)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    # a valid message just under the limit, gzip'd, is stored
    code, _, _ = _call(target, _counter_request("train_ok", 1, {"pad": "x" * 60_000}),
                       compression=grpc.Compression.Gzip)
    assert code == grpc.StatusCode.OK
    # gRPC answers these itself: the receiver counts calls cancelled before their message
    assert wait_until(lambda: _grpc_count(exp, "CANCELLED") == 2, timeout=10, what="both refusals counted")
    assert _grpc_count(exp, "OK") == 1


def test_malformed_message_is_invalid_argument_with_one_clear_message(
    start_exporter: type[ExporterProcess],
) -> None:
    exp = start_exporter(["--no-collector.gpu", GRPC_ON]).wait_ready()
    code, details, _ = _call(_target(exp), b"\x0a\xff\xff\xff\xff\x0fgarbage")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # the HTTP receiver's 400 message, word for word
    assert details.startswith("body is not a protobuf ExportMetricsServiceRequest: "), details
    assert "\n" not in details
    # a call with no message at all (client streaming, closed at once)
    with grpc.insecure_channel(_target(exp)) as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.stream_unary(EXPORT)(iter(()), timeout=20)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no ExportMetricsServiceRequest" in (err.value.details() or "")
    # not HTTP/2 at all: an OTLP/HTTP push sent to the gRPC port by mistake, and noise; the port stays up
    host, port = _target(exp).rsplit(":", 1)
    for junk in (b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", bytes(range(256)) * 64):
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(junk)
            while s.recv(4096):  # the server closes the connection (socket.timeout fails the test)
                pass
    text = exp.metrics()
    assert sample_value(text, "gpuenergy_otlp_grpc_requests_total", code="INVALID_ARGUMENT") == 2
    assert sample_value(text, "gpuenergy_otlp_series") == 0
    code, details, _ = _call(_target(exp), _counter_request("train_after_junk", 1, {}))
    assert code == grpc.StatusCode.OK, details


def _stalled_calls(target: str, n: int) -> tuple[threading.Event, list[grpc.StatusCode], list[threading.Thread]]:
    """``n`` calls that open and never send their message (until the event is set)."""
    release = threading.Event()
    codes: list[grpc.StatusCode] = []

    def never() -> Iterator[bytes]:
        release.wait(60)
        return
        yield b""  # a generator that yields nothing

    def one() -> None:
        with grpc.insecure_channel(target) as channel:
            try:
                channel.stream_unary(EXPORT)(never(), timeout=60)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return release, codes, threads


def test_slow_and_idle_clients_do_not_block_a_push(start_exporter: type[ExporterProcess]) -> None:
    from gpu_energy_exporter.otlp.grpcreceiver import SLOTS

    exp = start_exporter(["--no-collector.gpu", GRPC_ON, "--web.request-timeout=20s"]).wait_ready()
    target = _target(exp)
    host, port = target.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(20)]  # never say a word
    release, codes, threads = _stalled_calls(target, 2 * SLOTS)  # every slot, and as many waiting
    try:
        # every stalled call is open (holding a slot or waiting for one) before the push
        wait_until(lambda: sample_value(exp.metrics(), "gpuenergy_otlp_grpc_calls_in_flight") == 2 * SLOTS,
                   timeout=30, what="the stalled calls to be open")
        provider, reader = _provider(exp.grpc_endpoint, insecure=True)
        provider.get_meter("t").create_counter("train.pushed").add(7, {"run_id": "through"})
        started = time.monotonic()
        assert reader.force_flush(30_000)
        took = time.monotonic() - started
        provider.shutdown()
        assert sample_value(exp.metrics(), "train_pushed_total", run_id="through") == 7
        # well under the 20 s a stalled call may hold its slot: the slowest receivers were cut for it
        assert took < 15, took
    finally:
        release.set()
        for t in threads:
            t.join(30)
        for s in idle:
            s.close()
    # every stalled call ended with a code a client retries or gives up on, none with OK
    assert len(codes) == 2 * SLOTS and grpc.StatusCode.OK not in codes, codes
    assert set(codes) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT,
                          grpc.StatusCode.DEADLINE_EXCEEDED}, codes


def test_a_call_that_never_sends_its_message_ends_at_the_request_timeout(
    start_exporter: type[ExporterProcess],
) -> None:
    exp = start_exporter(["--no-collector.gpu", GRPC_ON, "--web.request-timeout=2s"]).wait_ready()
    release, codes, threads = _stalled_calls(_target(exp), 1)
    try:
        threads[0].join(30)
        assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED]
    finally:
        release.set()
    assert _grpc_count(exp, "DEADLINE_EXCEEDED") == 1


def test_idle_connections_are_closed_after_the_handshake_timeout(start_exporter: type[ExporterProcess]) -> None:
    exp = start_exporter(["--no-collector.gpu", GRPC_ON, "--web.request-timeout=1s",
                          "--web.max-connections=4"]).wait_ready()
    host, port = _target(exp).rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=30) for _ in range(4)]
    try:
        for s in idle:
            while s.recv(1024):  # the server closes it (socket.timeout after 30 s fails the test)
                pass
        # the port takes a new client once they are gone
        code, details, _ = _call(_target(exp), _counter_request("train_after_idle", 1, {}))
        assert code == grpc.StatusCode.OK, details
    finally:
        for s in idle:
            s.close()


# ----------------------------------------------------------------------------------------------------
# bearer token and TLS


def test_bearer_token_in_the_authorization_metadata(start_exporter: type[ExporterProcess], tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    exp = start_exporter(["--no-collector.gpu", GRPC_ON, f"--otlp.bearer-token-file={token}"]).wait_ready()
    body = _counter_request("train_auth", 1, {})
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
        code, details, _ = _call(_target(exp), body, metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "--otlp.bearer-token-file" in details
    assert sample_value(exp.metrics(), "train_auth_total") is None
    provider, reader = _provider(exp.grpc_endpoint, insecure=True, headers={"authorization": "Bearer s3cret"})
    provider.get_meter("t").create_counter("train.auth").add(2)
    assert reader.force_flush(20_000)
    provider.shutdown()
    text = exp.metrics()
    assert sample_value(text, "train_auth_total") == 2
    assert sample_value(text, "gpuenergy_otlp_grpc_requests_total", code="UNAUTHENTICATED") == 3


def _client_cert(directory: Path) -> tuple[bytes, bytes]:
    """A self-signed client certificate and key (PEM), which is its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainer")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (directory / "client-ca.crt").write_bytes(pem)
    return pem, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())


def test_tls_from_the_web_config_with_a_test_ca_and_client_certificates(
    start_exporter: type[ExporterProcess], tmp_path: Path,
) -> None:
    server_cert = self_signed(tmp_path)
    client_pem, client_key = _client_cert(tmp_path)
    web_config = tmp_path / "web.yml"
    web_config.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                          "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: client-ca.crt\n")
    exp = start_exporter(["--no-collector.gpu", GRPC_ON, f"--web.config.file={web_config}"]).wait_ready()
    assert exp.grpc_endpoint.startswith("https://127.0.0.1:")
    ca = server_cert.read_bytes()
    body = _counter_request("train_tls", 1, {})
    mutual = grpc.ssl_channel_credentials(root_certificates=ca, private_key=client_key, certificate_chain=client_pem)
    code, details, _ = _call(_target(exp), body, credentials=mutual)
    assert code == grpc.StatusCode.OK, details
    # without a client certificate, and in plain text: refused before any message
    code, _, _ = _call(_target(exp), body, credentials=grpc.ssl_channel_credentials(root_certificates=ca))
    assert code == grpc.StatusCode.UNAVAILABLE
    code, _, _ = _call(_target(exp), body)
    assert code == grpc.StatusCode.UNAVAILABLE
    # the SDK's exporter with the CA and the client certificate
    sdk_creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=client_key,
                                             certificate_chain=client_pem)
    provider, reader = _provider(exp.grpc_endpoint, credentials=sdk_creds)
    provider.get_meter("t").create_counter("train.tls").add(4)
    assert reader.force_flush(20_000)
    provider.shutdown()
    # /metrics serves the same web config (TLS with client certificates)
    (tmp_path / "client.key").write_bytes(client_key)
    context = ssl.create_default_context(cafile=str(server_cert))
    context.load_cert_chain(tmp_path / "client-ca.crt", tmp_path / "client.key")
    with urllib.request.urlopen(exp.metrics_url + "/metrics", timeout=10, context=context) as r:
        assert sample_value(r.read().decode(), "train_tls_total") == 5


def test_tls_certificate_files_are_reloaded_for_new_connections(
    start_exporter: type[ExporterProcess], tmp_path: Path,
) -> None:
    live, first_dir, second_dir = tmp_path / "live", tmp_path / "a", tmp_path / "b"
    for d in (live, first_dir, second_dir):
        d.mkdir()
    first, second = self_signed(first_dir), self_signed(second_dir)  # two CAs, two keys
    for name in ("server.crt", "server.key"):
        (live / name).write_bytes((first_dir / name).read_bytes())
    web_config = live / "web.yml"
    web_config.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    exp = start_exporter(["--no-collector.gpu", GRPC_ON, f"--web.config.file={web_config}"]).wait_ready()
    body = _counter_request("train_reload", 1, {})

    def code_with(ca: Path) -> grpc.StatusCode:
        return _call(_target(exp), body, credentials=grpc.ssl_channel_credentials(ca.read_bytes()))[0]

    assert code_with(first) == grpc.StatusCode.OK and code_with(second) == grpc.StatusCode.UNAVAILABLE
    for name in ("server.key", "server.crt"):  # as a certificate manager renews them
        (live / name).write_bytes((second_dir / name).read_bytes())
    assert wait_until(lambda: code_with(second) == grpc.StatusCode.OK, timeout=20, what="the new certificate")
    assert code_with(first) == grpc.StatusCode.UNAVAILABLE


def test_tls_settings_grpc_cannot_enforce_stop_the_exporter(tmp_path: Path) -> None:
    from gpu_energy_exporter.daemon.exporter import Exporter

    self_signed(tmp_path)
    web_config = tmp_path / "web.yml"
    base = "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
    for extra, needle in (("  min_version: TLS13\n", "min_version"),
                          ("  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: server.crt\n"
                           "  client_allowed_sans: [trainer]\n", "client_allowed_sans")):
        web_config.write_text(base + extra)
        args = ["--no-collector.gpu", f"--web.config.file={web_config}", GRPC_ON]
        with pytest.raises(ConfigError, match=needle) as err:
            Exporter(load_config(args, {}))
        assert "--otlp.grpc.listen-address=''" in str(err.value)
        # the same file is fine with the gRPC receiver off
        Exporter(load_config([*args, "--otlp.grpc.listen-address="], {})).ledger.close()


# ----------------------------------------------------------------------------------------------------
# the training helper with OTEL_EXPORTER_OTLP_PROTOCOL=grpc


def test_helper_protocol_and_endpoint_from_the_standard_variables(caplog: pytest.LogCaptureFixture) -> None:
    from gpu_energy_exporter.training.endpoint import GRPC, HTTP_PROTOBUF, resolve_endpoint, resolve_protocol

    assert resolve_protocol({}) == HTTP_PROTOBUF
    assert resolve_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == GRPC
    # the per-signal variable wins, as the specification says
    assert resolve_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                             "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf"}) == HTTP_PROTOBUF
    with caplog.at_level("WARNING", logger="gpu_energy_exporter.training"):
        assert resolve_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}) == HTTP_PROTOBUF
    assert "ignoring OTEL_EXPORTER_OTLP_PROTOCOL='http/json'" in caplog.text
    assert resolve_endpoint(None, {}, GRPC) == "http://localhost:4317"
    assert resolve_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://node:4317/"}, GRPC) == "http://node:4317"
    assert resolve_endpoint("node:4317", {}, GRPC) == "http://node:4317"
    assert resolve_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://node:4318"}) == "http://node:4318/v1/metrics"


def test_training_helper_pushes_over_grpc_into_the_ledger(
    start_exporter: type[ExporterProcess], gpu_env: tuple[list[str], dict[str, str], str],
) -> None:
    from gpu_energy_exporter.training import start_run

    args, env, uuid = gpu_env
    exp = start_exporter([*args, GRPC_ON]).wait_ready()
    run = start_run("helper-grpc", model="tiny", endpoint=exp.grpc_endpoint, export_interval=0.5,
                    gpu_uuids=[uuid], rank=0, world_size=1, environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    for _ in range(20):
        run.step(tokens=100, samples=2)
    assert run.flush()
    run.finish()
    assert run.dropped_exports == 0

    def tokens() -> float | None:
        with urllib.request.urlopen(exp.metrics_url + "/api/v1/runs", timeout=10) as r:
            runs = {d["run_id"]: d for d in json.load(r)["runs"]}
        doc = runs.get("helper-grpc")
        return doc["tokens"] if doc and doc["tokens"] == 2000 else None

    assert wait_until(tokens, timeout=30, what="the helper's tokens in the ledger") == 2000
    text = exp.metrics()
    assert sample_value(text, "training_tokens_total", run_id="helper-grpc", rank="0", gpu_uuid=uuid) == 2000
    assert (sample_value(text, "gpuenergy_otlp_grpc_requests_total", code="OK") or 0) >= 1
    assert sample_value(text, "gpuenergy_otlp_requests_total", status="200") == 0  # nothing came over HTTP


def test_helper_over_http_pointed_at_the_grpc_port_says_so(
    start_exporter: type[ExporterProcess], caplog: pytest.LogCaptureFixture,
) -> None:
    from gpu_energy_exporter.training import start_run

    exp = start_exporter(["--no-collector.gpu", GRPC_ON]).wait_ready()
    with caplog.at_level("WARNING", logger="gpu_energy_exporter.training"):
        run = start_run("wrong-port", endpoint=exp.grpc_endpoint, export_interval=60, gpu_uuids=["GPU-x"], rank=0,
                        world_size=1, environ={})
        run.step(tokens=1)
        assert not run.flush(10)
        run.finish(1)
    assert run.dropped_exports >= 1
    assert "speaks HTTP/2 (gRPC), not OTLP/HTTP" in caplog.text and "OTEL_EXPORTER_OTLP_PROTOCOL=grpc" in caplog.text
    assert "\x00" not in caplog.text  # no frame bytes quoted at the user

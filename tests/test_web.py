"""The HTTP layer against a real server on 127.0.0.1:0: negotiation, gzip, landing page, health and
readiness, routing errors, request bodies, shutdown, TLS (server and client certificates generated here
with ``cryptography``) and basic auth from a real web config file."""

from __future__ import annotations

import base64
import datetime
import gzip
import http.client
import ipaddress
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import bcrypt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client import CollectorRegistry, Counter, Gauge

from gpu_energy_exporter import __version__
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.daemon.endpoints import accepts_gzip, exporter_routes, new_exporter_server
from gpu_energy_exporter.http.messages import HTTPError, Request, Response, serialise
from gpu_energy_exporter.http.parsing import ClientFault, parse_head
from gpu_energy_exporter.http.server import HTTPServer
from gpu_energy_exporter.http.webconfig import WebConfig, load_web_config

PROM3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


# ----------------------------------------------------------------------------------------------------
# helpers


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


def fetch(
    server: HTTPServer, path: str, *, method: str = "GET", headers: dict[str, str] | None = None,
    body: bytes | None = None, context: ssl.SSLContext | None = None,
) -> Reply:
    host, port = server.server_address
    conn: http.client.HTTPConnection
    if context is not None:
        conn = http.client.HTTPSConnection(host, port, timeout=10, context=context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return Reply(r.status, r.headers, r.read())
    finally:
        conn.close()


@contextmanager
def serving(server: HTTPServer) -> Iterator[HTTPServer]:
    server.start()
    try:
        yield server
    finally:
        server.shutdown()


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("gpuenergy_test_energy_joules", "Energy.", ["gpu"], registry=reg).labels("0").inc(42)
    Gauge("gpuenergy_test_power_watts", "Power.", ["gpu"], registry=reg).labels("0").set(300)
    return reg


@pytest.fixture
def exporter(registry: CollectorRegistry) -> Iterator[HTTPServer]:
    with serving(new_exporter_server(("127.0.0.1", 0), registry)) as server:
        yield server


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


# --- certificates


@dataclass
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_path: Path
    key_path: Path


def issue(
    directory: Path, name: str, *, issuer: Issued | None = None, ca: bool = False,
    sans: tuple[x509.GeneralName, ...] = (), client: bool = False,
) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.cert.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()), critical=False)
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
        ), critical=True)
    else:
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    cert = builder.sign(issuer.key if issuer else key, hashes.SHA256())
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return Issued(cert, key, cert_path, key_path)


@dataclass
class PKI:
    dir: Path
    ca: Issued
    server: Issued
    client: Issued
    other_client: Issued  # signed by a CA the server does not trust


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca = issue(d, "ca", ca=True)
    other_ca = issue(d, "other-ca", ca=True)
    server = issue(d, "server", issuer=ca, sans=(
        x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1"))))
    client = issue(d, "client", issuer=ca, client=True, sans=(x509.DNSName("prometheus.example"),))
    other = issue(d, "intruder", issuer=other_ca, client=True, sans=(x509.DNSName("prometheus.example"),))
    return PKI(d, ca, server, client, other)


def client_context(pki: PKI, cert: Issued | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert_path))
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert_path), str(cert.key_path))
    return ctx


def write_config(tmp_path: Path, text: str) -> WebConfig:
    path = tmp_path / "web-config.yml"
    path.write_text(text)
    return load_web_config(path)


def tls_config(pki: PKI, tmp_path: Path, extra: str = "", top: str = "") -> WebConfig:
    return write_config(tmp_path, f"""
tls_server_config:
  cert_file: {pki.server.cert_path}
  key_file: {pki.server.key_path}
{extra}
{top}
""")


HANDSHAKE_REFUSED = (ssl.SSLError, ConnectionError)


# ----------------------------------------------------------------------------------------------------
# /metrics


def test_metrics_default_is_prometheus_text_0_0_4(exporter: HTTPServer) -> None:
    r = fetch(exporter, "/metrics")
    assert r.status == 200
    assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'gpuenergy_test_energy_joules_total{gpu="0"} 42.0' in r.body.decode()
    assert 'gpuenergy_test_power_watts{gpu="0"} 300.0' in r.body.decode()
    assert "# EOF" not in r.body.decode()


@pytest.mark.parametrize("accept", ["application/openmetrics-text; version=1.0.0", PROM3_ACCEPT])
def test_metrics_openmetrics_when_asked(exporter: HTTPServer, accept: str) -> None:
    r = fetch(exporter, "/metrics", headers={"Accept": accept})
    assert r.status == 200
    assert r.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    text = r.body.decode()
    assert text.endswith("# EOF\n")
    assert 'gpuenergy_test_energy_joules_total{gpu="0"} 42.0' in text


def test_metrics_gzip_when_accepted(exporter: HTTPServer) -> None:
    plain = fetch(exporter, "/metrics")
    r = fetch(exporter, "/metrics", headers={"Accept-Encoding": "deflate, gzip;q=0.8"})
    assert r.headers["Content-Encoding"] == "gzip"
    assert int(r.headers["Content-Length"]) == len(r.body)
    assert gzip.decompress(r.body) == plain.body
    assert plain.headers["Content-Encoding"] is None


def test_metrics_no_gzip_when_refused(exporter: HTTPServer) -> None:
    r = fetch(exporter, "/metrics", headers={"Accept-Encoding": "gzip;q=0, identity"})
    assert r.headers["Content-Encoding"] is None
    assert b"gpuenergy_test_power_watts" in r.body


@pytest.mark.parametrize("header,expected", [
    (None, False), ("", False), ("gzip", True), ("GZIP", True), ("br, gzip", True), ("gzip;q=0", False),
    ("gzip; q=0.5", True), ("gzip;q=zero", False), ("deflate", False), ("x-gzip", True),
])
def test_accepts_gzip(header: str | None, expected: bool) -> None:
    assert accepts_gzip(header) is expected


def test_metrics_head_has_headers_and_no_body(exporter: HTTPServer) -> None:
    get = fetch(exporter, "/metrics")
    head = fetch(exporter, "/metrics", method="HEAD")
    assert head.status == 200
    assert head.body == b""
    assert head.headers["Content-Length"] == str(len(get.body))
    assert head.headers["Content-Type"] == get.headers["Content-Type"]


def test_metrics_name_filter(exporter: HTTPServer) -> None:
    r = fetch(exporter, "/metrics?name[]=gpuenergy_test_power_watts")
    assert b"gpuenergy_test_power_watts" in r.body
    assert b"gpuenergy_test_energy_joules" not in r.body


def test_custom_telemetry_path(registry: CollectorRegistry) -> None:
    with serving(new_exporter_server(("127.0.0.1", 0), registry, telemetry_path="/gpu/metrics")) as s:
        assert fetch(s, "/gpu/metrics").status == 200
        assert fetch(s, "/metrics").status == 404
        assert b'href="./gpu/metrics"' in fetch(s, "/").body


def test_telemetry_path_must_not_hide_health(registry: CollectorRegistry) -> None:
    with pytest.raises(ConfigError, match="health"):
        exporter_routes(registry, telemetry_path="/-/ready")


# ----------------------------------------------------------------------------------------------------
# landing page, health, readiness, routing


def test_landing_page(registry: CollectorRegistry) -> None:
    links = [("OTLP receiver <:4318>", "http://node:4318/v1/metrics")]
    with serving(new_exporter_server(("127.0.0.1", 0), registry, links=links)) as s:
        r = fetch(s, "/")
    assert r.status == 200
    assert r.headers["Content-Type"] == "text/html; charset=utf-8"
    page = r.body.decode()
    assert "<title>gpu-energy-exporter</title>" in page
    assert __version__ in page
    for href in ("./metrics", "./-/healthy", "./-/ready", "http://node:4318/v1/metrics"):
        assert f'href="{href}"' in page
    assert "OTLP receiver &lt;:4318&gt;" in page  # escaped, not injected
    assert r.headers["Server"] == f"gpu-energy-exporter/{__version__}"


def test_healthy_and_ready_flip(registry: CollectorRegistry) -> None:
    published = threading.Event()

    def ready() -> tuple[bool, str]:
        return published.is_set(), "no snapshot published yet"

    with serving(new_exporter_server(("127.0.0.1", 0), registry, ready=ready)) as s:
        assert fetch(s, "/-/healthy").status == 200
        r = fetch(s, "/-/ready")
        assert r.status == 503
        assert b"no snapshot published yet" in r.body
        published.set()
        r = fetch(s, "/-/ready")
        assert r.status == 200
        assert r.body == b"gpu-energy-exporter is Ready.\n"
        assert fetch(s, "/-/ready", method="HEAD").status == 200


def test_ready_plain_bool_and_failing_check(registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    with serving(new_exporter_server(("127.0.0.1", 0), registry, ready=lambda: False)) as s:
        assert fetch(s, "/-/ready").status == 503

    def broken() -> bool:
        raise RuntimeError("sampler thread died")

    with serving(new_exporter_server(("127.0.0.1", 0), registry, ready=broken)) as s:
        r = fetch(s, "/-/ready")
    assert r.status == 503
    assert b"sampler thread died" in r.body


def test_not_found_and_method_not_allowed(exporter: HTTPServer) -> None:
    assert fetch(exporter, "/nope").status == 404
    assert fetch(exporter, "/metrics/").status == 404
    r = fetch(exporter, "/metrics", method="POST", body=b"x")
    assert r.status == 405
    assert r.headers["Allow"] == "GET, HEAD"
    assert fetch(exporter, "/-/healthy", method="DELETE").status == 405
    assert fetch(exporter, "/", method="OPTIONS").status == 405


def test_handler_exception_is_a_bare_500(caplog: pytest.LogCaptureFixture) -> None:
    def boom(req: Request) -> Response:
        raise RuntimeError("secret internal detail")

    with serving(HTTPServer(("127.0.0.1", 0), {("GET", "/boom"): boom})) as s, \
            caplog.at_level(logging.ERROR, logger="gpu_energy_exporter.daemon.endpoints"):
        r = fetch(s, "/boom")
        assert fetch(s, "/boom").status == 500  # the server keeps serving
    assert r.status == 500
    assert r.body == b"Internal Server Error\n"
    assert any(rec.exc_info and "secret internal detail" in str(rec.exc_info[1]) for rec in caplog.records)


def test_keep_alive_reuses_the_connection(exporter: HTTPServer) -> None:
    conn = http.client.HTTPConnection(*exporter.server_address, timeout=10)
    try:
        conn.request("GET", "/metrics")
        conn.getresponse().read()
        first = conn.sock
        conn.request("GET", "/-/healthy")
        r = conn.getresponse()
        assert r.status == 200 and r.read().endswith(b"Healthy.\n")
        assert conn.sock is first
    finally:
        conn.close()


# ----------------------------------------------------------------------------------------------------
# extra routes with bodies (the OTLP receiver's use)


def echo(req: Request) -> Response:
    if req.headers.get("X-Reject"):
        raise HTTPError(422, "point rejected")
    return Response(200, req.read_body(max_bytes=64), {"Content-Type": "application/octet-stream"})


@pytest.fixture
def echo_server() -> Iterator[HTTPServer]:
    with serving(HTTPServer(("127.0.0.1", 0), {("POST", "/echo"): echo}, name="otlp-test")) as s:
        yield s


def test_post_body(echo_server: HTTPServer) -> None:
    r = fetch(echo_server, "/echo", method="POST", body=b"hello")
    assert (r.status, r.body) == (200, b"hello")
    assert fetch(echo_server, "/echo").status == 405


def test_post_gzip_body_is_decoded(echo_server: HTTPServer) -> None:
    r = fetch(echo_server, "/echo", method="POST", body=gzip.compress(b"compressed"),
              headers={"Content-Encoding": "gzip"})
    assert (r.status, r.body) == (200, b"compressed")


def test_post_chunked_body(echo_server: HTTPServer) -> None:
    conn = http.client.HTTPConnection(*echo_server.server_address, timeout=10)
    try:
        conn.request("POST", "/echo", body=iter([b"hello ", b"chunks"]))
        r = conn.getresponse()
        assert (r.status, r.read()) == (200, b"hello chunks")
    finally:
        conn.close()


@pytest.mark.parametrize("body,headers,status,message", [
    (b"x" * 65, {}, 413, b"larger than 64 bytes"),
    (gzip.compress(b"x" * 1000, mtime=0), {"Content-Encoding": "gzip"}, 413, b"decompressed"),
    (b"not gzip at all", {"Content-Encoding": "gzip"}, 400, b"malformed gzip"),
    (gzip.compress(b"abc", mtime=0)[:-6], {"Content-Encoding": "gzip"}, 400, b"truncated gzip"),
    (b"abc", {"Content-Encoding": "br"}, 415, b"not supported"),
    (b"abc", {"X-Reject": "1"}, 422, b"point rejected"),
])
def test_post_body_errors(echo_server: HTTPServer, body: bytes, headers: dict[str, str], status: int,
                          message: bytes) -> None:
    r = fetch(echo_server, "/echo", method="POST", body=body, headers=headers)
    assert r.status == status
    assert message in r.body
    assert r.headers["Content-Type"] == "text/plain; charset=utf-8"


def test_body_the_handler_does_not_read_keeps_the_connection_usable(echo_server: HTTPServer) -> None:
    # The server receives every body in full before routing, so the next request starts where it should.
    conn = http.client.HTTPConnection(*echo_server.server_address, timeout=10)
    try:
        conn.request("POST", "/elsewhere", body=b"unread body")
        r = conn.getresponse()
        r.read()
        assert r.status == 404
        first = conn.sock
        conn.request("POST", "/echo", body=b"next")
        r = conn.getresponse()
        assert (r.status, r.read()) == (200, b"next")
        assert conn.sock is first
    finally:
        conn.close()


def test_bad_framing_is_400() -> None:
    with serving(HTTPServer(("127.0.0.1", 0), {("POST", "/echo"): echo})) as s:
        with socket.create_connection(s.server_address, timeout=10) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: many\r\n\r\n")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert b"invalid Content-Length" in reply


# ----------------------------------------------------------------------------------------------------
# binding and shutdown


def test_server_address_reports_the_ephemeral_port(exporter: HTTPServer) -> None:
    host, port = exporter.server_address
    assert host == "127.0.0.1" and port > 0
    assert exporter.url == f"http://127.0.0.1:{port}"


def test_port_in_use_is_a_config_error(exporter: HTTPServer) -> None:
    port = exporter.server_address[1]
    with pytest.raises(ConfigError, match=rf"cannot listen on 127\.0\.0\.1:{port}: .*in use"):
        HTTPServer(("127.0.0.1", port), {})


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_ipv6_listen_address(registry: CollectorRegistry, host: str) -> None:
    with serving(new_exporter_server((host, 0), registry)) as s:
        assert s.server_address[0] == "::1"
        assert s.url.startswith("http://[::1]:")
        assert fetch(s, "/-/healthy").status == 200


def test_host_name_listen_address(registry: CollectorRegistry) -> None:
    with serving(new_exporter_server(("localhost", 0), registry)) as s:
        assert ipaddress.ip_address(s.server_address[0]).is_loopback
        assert fetch(s, "/-/healthy").status == 200


def test_shutdown_finishes_in_flight_requests_and_closes_idle_ones() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(req: Request) -> Response:
        entered.set()
        release.wait(10)
        return Response.text(200, "done")

    def fast(req: Request) -> Response:
        return Response.text(200, "fast")

    server = HTTPServer(("127.0.0.1", 0), {("GET", "/slow"): slow, ("GET", "/fast"): fast},
                        name="shutdown-test").start()
    address = server.server_address
    idle = http.client.HTTPConnection(*address, timeout=10)
    busy = http.client.HTTPConnection(*address, timeout=10)
    try:
        idle.request("GET", "/fast")
        assert idle.getresponse().read() == b"fast"
        busy.request("GET", "/slow")
        assert entered.wait(10)
        stopper = threading.Thread(target=server.shutdown)
        stopper.start()
        assert idle.sock is not None
        idle.sock.settimeout(10)
        assert idle.sock.recv(1) == b""  # the idle keep-alive connection was closed
        deadline = time.monotonic() + 10
        while True:  # the listening socket goes away
            try:
                socket.create_connection(address, timeout=1).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert stopper.is_alive()  # still waiting for the in-flight request
        release.set()
        r = busy.getresponse()
        assert (r.status, r.read()) == (200, b"done")
        assert r.headers["Connection"] == "close"
        stopper.join(10)
        assert not stopper.is_alive()
    finally:
        release.set()
        idle.close()
        busy.close()
        server.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("shutdown-test-")]


def test_shutdown_without_start_and_twice(registry: CollectorRegistry) -> None:
    server = new_exporter_server(("127.0.0.1", 0), registry)
    server.shutdown()
    server.shutdown()
    with pytest.raises(RuntimeError):
        server.start()


# ----------------------------------------------------------------------------------------------------
# TLS


def test_tls_serves_https(registry: CollectorRegistry, pki: PKI, tmp_path: Path) -> None:
    cfg = tls_config(pki, tmp_path)
    with serving(new_exporter_server(("127.0.0.1", 0), registry, web_config=cfg)) as s:
        assert s.url.startswith("https://127.0.0.1:")
        r = fetch(s, "/metrics", context=client_context(pki))
        assert r.status == 200 and b"gpuenergy_test_power_watts" in r.body
        # A plain-HTTP client gets no answer from a TLS port.
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            fetch(s, "/metrics")


def test_tls_relative_paths_and_min_version(registry: CollectorRegistry, pki: PKI) -> None:
    cfg = write_config(pki.dir, """
tls_server_config:
  cert_file: server.crt
  key_file: server.key
  min_version: TLS13
""")
    with serving(new_exporter_server(("127.0.0.1", 0), registry, web_config=cfg)) as s:
        assert fetch(s, "/-/healthy", context=client_context(pki)).status == 200
        old = client_context(pki)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(HANDSHAKE_REFUSED):
            fetch(s, "/-/healthy", context=old)


def test_tls_require_and_verify_client_cert(registry: CollectorRegistry, pki: PKI, tmp_path: Path) -> None:
    cfg = tls_config(pki, tmp_path, f"""
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: {pki.ca.cert_path}
""")
    with serving(new_exporter_server(("127.0.0.1", 0), registry, web_config=cfg)) as s:
        assert fetch(s, "/metrics", context=client_context(pki, pki.client)).status == 200
        with pytest.raises(HANDSHAKE_REFUSED):
            fetch(s, "/metrics", context=client_context(pki))
        with pytest.raises(HANDSHAKE_REFUSED):
            fetch(s, "/metrics", context=client_context(pki, pki.other_client))
        # The server is still fine after refusing clients.
        assert fetch(s, "/-/healthy", context=client_context(pki, pki.client)).status == 200


def test_tls_verify_client_cert_if_given(registry: CollectorRegistry, pki: PKI, tmp_path: Path) -> None:
    cfg = tls_config(pki, tmp_path, f"""
  client_auth_type: VerifyClientCertIfGiven
  client_ca_file: {pki.ca.cert_path}
""")
    with serving(new_exporter_server(("127.0.0.1", 0), registry, web_config=cfg)) as s:
        assert fetch(s, "/metrics", context=client_context(pki)).status == 200
        assert fetch(s, "/metrics", context=client_context(pki, pki.client)).status == 200
        with pytest.raises(HANDSHAKE_REFUSED):
            fetch(s, "/metrics", context=client_context(pki, pki.other_client))


@pytest.mark.parametrize("allowed,served", [("prometheus.example", True), ("other.example", False)])
def test_tls_client_allowed_sans(registry: CollectorRegistry, pki: PKI, tmp_path: Path, allowed: str,
                                 served: bool) -> None:
    cfg = tls_config(pki, tmp_path, f"""
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: {pki.ca.cert_path}
  client_allowed_sans: [{allowed}]
""")
    with serving(new_exporter_server(("127.0.0.1", 0), registry, web_config=cfg)) as s:
        if served:
            assert fetch(s, "/metrics", context=client_context(pki, pki.client)).status == 200
        else:
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
                fetch(s, "/metrics", context=client_context(pki, pki.client))


def test_tls_certificate_rotation_is_picked_up(registry: CollectorRegistry, pki: PKI, tmp_path: Path) -> None:
    first = issue(tmp_path, "rotating", issuer=pki.ca, sans=(x509.IPAddress(ipaddress.ip_address("127.0.0.1")),))
    cfg = write_config(tmp_path, f"tls_server_config:\n  cert_file: {first.cert_path}\n  key_file: {first.key_path}\n")

    def served_serial(s: HTTPServer) -> int:
        with socket.create_connection(s.server_address, timeout=10) as raw, \
                client_context(pki).wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der).serial_number

    with serving(new_exporter_server(("127.0.0.1", 0), registry, web_config=cfg)) as s:
        assert served_serial(s) == first.cert.serial_number
        (tmp_path / "next").mkdir()
        second = issue(tmp_path / "next", "rotated", issuer=pki.ca,
                       sans=(x509.IPAddress(ipaddress.ip_address("127.0.0.1")),))
        os.replace(second.key_path, first.key_path)
        os.replace(second.cert_path, first.cert_path)
        assert served_serial(s) == second.cert.serial_number
        # A broken replacement keeps the last good certificate in service.
        first.cert_path.write_text("garbage")
        assert served_serial(s) == second.cert.serial_number


# ----------------------------------------------------------------------------------------------------
# basic auth, headers, rate limit


@pytest.fixture(scope="module")
def alice_hash() -> str:
    return bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode().replace("$2b$", "$2y$")


def test_basic_auth(registry: CollectorRegistry, tmp_path: Path, alice_hash: str) -> None:
    cfg = write_config(tmp_path, f"basic_auth_users:\n  alice: '{alice_hash}'\n")
    with serving(new_exporter_server(("127.0.0.1", 0), registry, web_config=cfg)) as s:
        for headers in ({}, basic("alice", "wrong"), basic("bob", "s3cret"),
                        {"Authorization": "Bearer s3cret"}, {"Authorization": "Basic !!!"}):
            r = fetch(s, "/metrics", headers=headers)
            assert r.status == 401, headers
            assert r.headers["WWW-Authenticate"].startswith("Basic realm=")
            assert b"gpuenergy" not in r.body
        # Health endpoints and unknown paths are behind auth too, as in exporter-toolkit.
        assert fetch(s, "/-/healthy").status == 401
        assert fetch(s, "/nope").status == 401
        ok = fetch(s, "/metrics", headers=basic("alice", "s3cret"))
        assert ok.status == 200 and b"gpuenergy_test_power_watts" in ok.body
        assert fetch(s, "/-/healthy", headers=basic("alice", "s3cret")).status == 200
        assert fetch(s, "/nope", headers=basic("alice", "s3cret")).status == 404


def test_basic_auth_success_is_cached(tmp_path: Path) -> None:
    # Cost 12 takes a few hundred ms per check; a cached check must not pay it again.
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=12)).decode()
    cfg = write_config(tmp_path, f"basic_auth_users:\n  alice: '{hashed}'\n")
    header = basic("alice", "pw")["Authorization"]
    t0 = time.perf_counter()
    assert cfg.check_basic_auth(header)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(10):
        assert cfg.check_basic_auth(header)
    cached = (time.perf_counter() - t0) / 10
    assert first > 0.05
    assert cached < 0.01
    assert not cfg.check_basic_auth(basic("alice", "PW")["Authorization"])
    assert not cfg.check_basic_auth(basic("alice", "x" * 100)["Authorization"])  # > 72 bytes: refused


def test_tls_and_basic_auth_together(registry: CollectorRegistry, pki: PKI, tmp_path: Path,
                                     alice_hash: str) -> None:
    cfg = tls_config(pki, tmp_path, top=f"basic_auth_users:\n  alice: '{alice_hash}'\n")
    with serving(new_exporter_server(("127.0.0.1", 0), registry, web_config=cfg)) as s:
        ctx = client_context(pki)
        assert fetch(s, "/metrics", context=ctx).status == 401
        assert fetch(s, "/metrics", context=ctx, headers=basic("alice", "s3cret")).status == 200


def test_configured_headers_on_every_response(registry: CollectorRegistry, tmp_path: Path,
                                              alice_hash: str) -> None:
    cfg = write_config(tmp_path, f"""
basic_auth_users:
  alice: '{alice_hash}'
http_server_config:
  headers:
    X-Frame-Options: deny
    X-Content-Type-Options: nosniff
    Content-Security-Policy: ""
""")
    with serving(new_exporter_server(("127.0.0.1", 0), registry, web_config=cfg)) as s:
        for r in (fetch(s, "/metrics"), fetch(s, "/", headers=basic("alice", "s3cret"))):
            assert r.headers["X-Frame-Options"] == "deny"
            assert r.headers["X-Content-Type-Options"] == "nosniff"
            assert r.headers["Content-Security-Policy"] is None  # blank means unset


def test_rate_limit(registry: CollectorRegistry, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "rate_limit:\n  interval: 1h\n  burst: 2\n")
    with serving(new_exporter_server(("127.0.0.1", 0), registry, web_config=cfg)) as s:
        assert [fetch(s, "/-/healthy").status for _ in range(3)] == [200, 200, 429]


def test_clients_not_reading_their_answers_do_not_lock_others_out() -> None:
    big = b"x" * (8 << 20)

    def large(req: Request) -> Response:
        return Response(200, big)

    def small(req: Request) -> Response:
        return Response.text(200, "small")

    server = HTTPServer(("127.0.0.1", 0), {("GET", "/large"): large, ("GET", "/small"): small},
                        max_connections=4, name="stall-test").start()
    stalled = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(server.server_address)
            s.sendall(b"GET /large HTTP/1.1\r\nHost: x\r\n\r\n")
            stalled.append(s)
        time.sleep(1.5)  # every slot now holds an answer its client does not read
        start = time.monotonic()
        r = fetch(server, "/small")
        assert (r.status, r.body) == (200, b"small")
        assert time.monotonic() - start < 2
        assert server.stats["evicted"] >= 1
    finally:
        for s in stalled:
            s.close()
        server.shutdown()


# ----------------------------------------------------------------------------------------------------
# bodies in parts (the telemetry path: each source's bytes written one after another, never joined)

PARTS = (b"# HELP a A.\n# TYPE a gauge\n", b"a 1.0\n" * 3000, b"", b"b 2.0\n")
BIG_PARTS = tuple(bytes([65 + i]) * (3 << 20) for i in range(3))  # more than a socket takes at once


def _parts_route(parts: tuple[bytes, ...]):  # type: ignore[no-untyped-def]
    headers = MappingProxyType({"Content-Type": "text/plain"})

    def handle(req: Request) -> Response:
        return Response(200, parts, headers)

    return handle


@pytest.fixture
def parts_server() -> Iterator[HTTPServer]:
    routes = {("GET", "/parts"): _parts_route(PARTS), ("GET", "/big"): _parts_route(BIG_PARTS),
              ("GET", "/dict"): lambda req: Response(200, PARTS, {"Content-Type": "text/plain"})}
    with serving(HTTPServer(("127.0.0.1", 0), routes, inline=lambda req: req.path == "/parts")) as s:
        yield s


def test_a_body_in_parts_is_served_whole_on_keep_alive_connections(parts_server: HTTPServer) -> None:
    host, port = parts_server.server_address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        for path, parts in (("/parts", PARTS), ("/big", BIG_PARTS), ("/parts", PARTS), ("/dict", PARTS)):
            conn.request("GET", path)
            r = conn.getresponse()
            body = r.read()
            assert r.status == 200 and body == b"".join(parts), path
            assert r.headers["Content-Length"] == str(len(body)) and r.headers["Content-Type"] == "text/plain"
        conn.request("HEAD", "/parts")
        r = conn.getresponse()
        assert r.read() == b"" and r.headers["Content-Length"] == str(len(b"".join(PARTS)))
    finally:
        conn.close()


def test_a_body_in_parts_over_tls(pki: PKI, tmp_path: Path) -> None:
    cfg = tls_config(pki, tmp_path)
    with serving(HTTPServer(("127.0.0.1", 0), {("GET", "/big"): _parts_route(BIG_PARTS)}, web_config=cfg)) as s:
        r = fetch(s, "/big", context=client_context(pki))
        assert r.status == 200 and r.body == b"".join(BIG_PARTS)


@pytest.mark.parametrize("close", [False, True])
@pytest.mark.parametrize("head", [False, True])
def test_serialise_of_parts_is_the_bytes_of_the_joined_body(close: bool, head: bool) -> None:
    extra = (("X-Extra", "1"), ("Content-Type", "ignored: the response sets it"))
    for headers in (MappingProxyType({"Content-Type": "text/plain", "Vary": "Accept"}), {"Content-Type": "x/y"}):
        parts = serialise(Response(200, PARTS, headers), extra, close=close, head=head)
        joined = serialise(Response(200, b"".join(PARTS), dict(headers)), extra, close=close, head=head)
        assert (b"".join(parts) if isinstance(parts, list) else parts) == joined


def test_request_heads_are_parsed_once_and_faults_every_time() -> None:
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain\r\nConnection: close"
    first = parse_head(head)
    assert parse_head(bytes(head)) is first
    assert first[:3] == ("GET", "/metrics", (1, 1)) and not first[3].keep_alive
    for _ in range(2):
        with pytest.raises(ClientFault):
            parse_head(b"GET /metrics HTTP/1.1\r\nbad header line")

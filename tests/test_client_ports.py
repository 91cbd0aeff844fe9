"""Issue 31, items 2 and 3: ``top``, ``runs`` and ``report`` pointed at the wrong port or the wrong scheme.

A real exporter (in-process, simulated GPUs) serves its three ports, plain and with TLS; each command is
given the OTLP/gRPC port, the OTLP/HTTP port, https against plain HTTP and http against TLS, and must
answer with one message naming the port or scheme to use, never a traceback (``runs --url`` at the gRPC
port ended in ``http.client.BadStatusLine``; https against plain HTTP waited and said "did not answer").
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from test_web import issue

from gpu_energy_exporter.client import probe
from gpu_energy_exporter.client.api import TLS, WRONG_PORT, ExporterClient, ExporterUnreachable
from gpu_energy_exporter.core.ports import is_http2_frame
from gpu_energy_exporter.daemon import cli
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.devices.simulated import SimulatedBackend


def _exporter(args: list[str]) -> Exporter:
    config = load_config(["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                          "--otlp.grpc.listen-address=127.0.0.1:0", "--no-collector.rapl", *args], {})
    exporter = Exporter(config, backend_factory=lambda: SimulatedBackend(1))
    exporter.start()
    return exporter


def _ports(exporter: Exporter) -> dict[str, str]:
    """host:port of the metrics, OTLP/HTTP and OTLP/gRPC servers."""
    assert exporter.web is not None and exporter.otlp.http_server is not None and exporter.otlp_grpc is not None
    urls = {"web": exporter.web.url, "otlp": exporter.otlp.http_server.url, "grpc": exporter.otlp_grpc.url}
    return {name: url.split("://", 1)[1].rstrip("/") for name, url in urls.items()}


@pytest.fixture(scope="module")
def plain() -> Iterator[dict[str, str]]:
    exporter = _exporter([])
    try:
        yield _ports(exporter)
    finally:
        exporter.stop()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp: Path = tmp_path_factory.mktemp("tls")
    ca = issue(tmp, "ca", ca=True)
    server = issue(tmp, "server", issuer=ca, sans=(x509.IPAddress(ipaddress.ip_address("127.0.0.1")),))
    web = tmp / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {server.cert_path}\n  key_file: {server.key_path}\n")
    exporter = _exporter([f"--web.config.file={web}"])  # TLS on the metrics and the gRPC port
    try:
        yield {**_ports(exporter), "ca": str(ca.cert_path)}
    finally:
        exporter.stop()


def _command(command: str, url: str, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    """The command through the real entry point; its one-line error (exit 2, or 1 for ``top --once``)."""
    args = {"runs": ["runs", "--url", url], "top": ["top", "--once", "--url", url],
            "report": ["report", "some-run", "--url", url]}[command]
    capsys.readouterr()
    rc = cli.main([*args, *extra])
    out, err = capsys.readouterr()
    text = (out + err).strip()
    assert rc in (1, 2), text
    assert "Traceback" not in text
    return text


@pytest.mark.parametrize("command", ["runs", "top", "report"])
def test_the_otlp_grpc_port_is_named_with_the_metrics_port_to_use(
        plain: dict[str, str], command: str, capsys: pytest.CaptureFixture[str]) -> None:
    host = plain["grpc"].rsplit(":", 1)[0]
    for scheme in ("http", "https"):
        text = _command(command, f"{scheme}://{plain['grpc']}", capsys)
        assert "answered in HTTP/2 (gRPC)" in text and "OTLP/gRPC port (--otlp.grpc.listen-address" in text, text
        assert f"--url http://{host}:9863" in text and "--web.listen-address" in text, text


def test_the_otlp_http_port_is_named_with_the_metrics_port_to_use(
        plain: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    host = plain["otlp"].rsplit(":", 1)[0]
    for command in ("runs", "top", "report"):
        text = _command(command, f"http://{plain['otlp']}", capsys)
        assert "OTLP/HTTP port (--otlp.listen-address" in text and f"--url http://{host}:9863" in text, text
    # https at it: plain HTTP, and the OTLP/HTTP port at that
    text = _command("runs", f"https://{plain['otlp']}", capsys)
    assert "OTLP/HTTP port" in text and f"--url http://{host}:9863" in text, text


def test_https_against_plain_http_says_to_use_http(plain: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    text = _command("runs", f"https://{plain['web']}", capsys)
    assert "speaks plain HTTP, not TLS" in text and f"use --url http://{plain['web']}" in text, text
    assert "did not answer" not in text and "check --url and the network" not in text


def test_http_against_tls_says_to_use_https(tls: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    text = _command("top", f"http://{tls['web']}", capsys)
    assert "expects TLS" in text and f"use --url https://{tls['web']}" in text, text
    host = tls["grpc"].rsplit(":", 1)[0]
    text = _command("runs", f"http://{tls['grpc']}", capsys)
    assert "answered in HTTP/2 over TLS (gRPC)" in text and f"--url https://{host}:9863" in text, text
    # https: its certificate is checked first (a real problem of its own), then the port is named
    text = _command("runs", f"https://{tls['grpc']}", capsys)
    assert "cannot verify the TLS certificate" in text and "--ca-file" in text, text
    for extra in (["--insecure"], ["--ca-file", tls["ca"]]):
        text = _command("report", f"https://{tls['grpc']}", capsys, *extra)
        assert "answered in HTTP/2 over TLS (gRPC)" in text and f"--url https://{host}:9863" in text, text


class _SilentToTLS:
    """A plain HTTP/1.1 server that, like a real one, waits for the end of a request head: a TLS
    ClientHello (which holds none) gets no answer at all, so the client's handshake times out."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_a_tls_handshake_that_times_out_on_plain_http_says_to_use_http() -> None:
    server = _SilentToTLS()
    try:
        with pytest.raises(ExporterUnreachable) as info:
            ExporterClient(f"https://127.0.0.1:{server.port}", timeout=0.5).get("/api/v1/status")
        assert info.value.cause == TLS
        assert "speaks plain HTTP, not TLS" in str(info.value)
        assert f"use --url http://127.0.0.1:{server.port}" in str(info.value)
        assert ExporterClient(f"http://127.0.0.1:{server.port}").get("/api/v1/status") == {}
    finally:
        server.close()


def test_probe_kinds_and_causes(plain: dict[str, str], tls: dict[str, str]) -> None:
    def kind(hostport: str) -> str:
        host, port = hostport.rsplit(":", 1)
        return probe.listener_kind(host, int(port), 2.0)

    assert kind(plain["web"]) == kind(plain["otlp"]) == kind(tls["otlp"]) == probe.PLAIN_HTTP
    assert kind(plain["grpc"]) == probe.PLAIN_H2
    assert kind(tls["web"]) == probe.TLS_HTTP
    assert kind(tls["grpc"]) == probe.TLS_H2
    with pytest.raises(ExporterUnreachable) as info:
        ExporterClient(f"http://{plain['grpc']}").get("/api/v1/status")
    assert info.value.cause == WRONG_PORT


def test_http2_frame_recognition() -> None:
    # what a gRPC server sent the HTTP/1.1 client first (SETTINGS), and what urllib made of it
    assert is_http2_frame(b"\x00\x00\x18\x04\x00\x00\x00\x00\x00")
    assert is_http2_frame("\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00\x08\x07")
    assert is_http2_frame("'\x00\x00\x08\x07\x00")  # GOAWAY, quoted as urllib3 quotes it
    assert not is_http2_frame(b"HTTP/1.1 200 OK")
    assert not is_http2_frame(b"\x15\x03\x03\x00\x02")  # a TLS alert
    assert not is_http2_frame(b"\x00\x00\x18\x01")  # HEADERS: never a server's first frame
    assert not is_http2_frame(b"")


def test_the_training_helper_and_the_clients_name_the_ports_alike() -> None:
    # the training helper's message for the reverse mistake uses the same names (core/ports.py)
    from http.client import BadStatusLine

    from gpu_energy_exporter.core.ports import OTLP_GRPC_PORT, OTLP_HTTP_PORT
    from gpu_energy_exporter.training.export import describe_failure

    text = describe_failure("http://localhost:4317/v1/metrics", None, BadStatusLine("\x00\x00\x00\x04\x00"))
    assert OTLP_GRPC_PORT in text and OTLP_HTTP_PORT in text

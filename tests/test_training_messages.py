"""What the training helper says when its pushes fail, against real servers: the exporter's receiver
requiring a bearer token (401), a port nothing listens on (connection refused), a TLS server whose
self-signed certificate the trainer does not trust, and a receiver that accepts an export only in part
(OTLP ``partial_success``). Each failure gets one warning naming its one cause, complete, once per run."""

from __future__ import annotations

import http.server
import logging
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tlsutil import self_signed
from training_models import closed_port, receiver, total

from gpu_energy_exporter.otlp.receiver import OTLPReceiver
from gpu_energy_exporter.otlp.store import TrainingStore
from gpu_energy_exporter.training import start_run
from gpu_energy_exporter.training.run import TrainingRun

LOGGER = "gpu_energy_exporter.training"
GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
ONCE = "This warning is shown once per run."


def wait_for(run: TrainingRun, *, dropped: int = 0, delivered: int = 0, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while (run.dropped_exports < dropped or run.delivered_exports < delivered) and time.monotonic() < deadline:
        time.sleep(0.02)


def our_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def failing_run(endpoint: str, caplog: pytest.LogCaptureFixture, **kwargs: object) -> str:
    """Push to ``endpoint`` until two exports failed; the one warning the run logged."""
    caplog.set_level(logging.INFO)
    run = start_run(endpoint=endpoint, export_interval=0.05, export_timeout=0.5, finish_timeout=0.5,
                    gpu_uuids=[GPU_A], **kwargs)  # type: ignore[arg-type]
    run.step(tokens=1)
    wait_for(run, dropped=2)
    run.finish()
    assert run.dropped_exports >= 2 and run.delivered_exports == 0
    warnings = our_warnings(caplog)
    assert len(warnings) == 1, warnings
    message = warnings[0]
    # Complete: nothing cut mid-word, the closing sentence there.
    assert message.endswith(ONCE), message
    assert "dropped_exports" in message
    return message


def test_401_names_the_bearer_token_not_an_unreachable_exporter(caplog: pytest.LogCaptureFixture) -> None:
    store = TrainingStore()
    server = OTLPReceiver(("127.0.0.1", 0), store, bearer_token="s3cret").start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        message = failing_run(endpoint, caplog)
        assert "HTTP 401" in message and "bearer token" in message, message
        assert "requires a bearer token and this process sent none" in message
        assert "OTEL_EXPORTER_OTLP_HEADERS" in message
        assert "--otlp.bearer-token-file" in message
        # The receiver's own explanation is quoted.
        assert "missing or wrong bearer token" in message
        assert "running" not in message and "refused at" not in message and "certificate" not in message
        caplog.clear()
        message = failing_run(endpoint, caplog, headers={"Authorization": "Bearer wrong"})
        assert "HTTP 401" in message and "the bearer token this process sent was refused" in message
        # And the advice works: the right token is accepted.
        run = start_run(endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A],
                        headers={"Authorization": "Bearer s3cret"})
        run.step(tokens=7)
        run.finish()
        assert run.dropped_exports == 0 and total(store, "training_tokens_total") == 7
    finally:
        server.shutdown()


def test_connection_refused_says_nothing_listens_there(caplog: pytest.LogCaptureFixture) -> None:
    port = closed_port()
    message = failing_run(f"http://127.0.0.1:{port}", caplog)
    assert f"connection refused at 127.0.0.1:{port}" in message, message
    assert "nothing is listening there" in message and "--otlp.listen-address" in message
    assert "401" not in message and "bearer" not in message and "certificate" not in message


class _Quiet(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # failed handshakes are the point of the test


def _tls_receiver(cert: Path, store: TrainingStore) -> Iterator[str]:
    """The exporter's OTLP export handler behind a TLS server with ``cert``; yields the base URL."""
    otlp = OTLPReceiver(("127.0.0.1", 0), store)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            status, content_type, payload = otlp.handle_export(dict(self.headers.items()), body)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the http.server API
            pass

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, cert.with_suffix(".key"))
    server = _Quiet(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_untrusted_certificate_names_tls_and_the_ca_to_trust(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", "REQUESTS_CA_BUNDLE",
                 "CURL_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    cert = self_signed(tmp_path)
    store = TrainingStore()
    tls = _tls_receiver(cert, store)
    endpoint = next(tls)
    try:
        message = failing_run(endpoint, caplog)
        assert "TLS certificate of 127.0.0.1" in message and "not trusted" in message, message
        assert "self-signed certificate" in message  # OpenSSL's own reason, quoted
        assert "OTEL_EXPORTER_OTLP_CERTIFICATE" in message
        assert "refused" not in message and "bearer" not in message and "running" not in message
        # The advice works: trusting the certificate gets the points through.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(cert))
        run = start_run(endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A])
        run.step(tokens=5)
        run.finish()
        assert run.dropped_exports == 0 and total(store, "training_tokens_total") == 5
    finally:
        tls.close()


def test_partial_success_is_logged_once_with_the_receivers_message(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    store = TrainingStore(max_series_per_run=3)  # fewer than the run's series: some are refused
    server = OTLPReceiver(("127.0.0.1", 0), store).start()
    try:
        run = start_run("partial", endpoint=f"http://127.0.0.1:{server.server_address[1]}",
                        export_interval=0.05, gpu_uuids=[GPU_A])
        for _ in range(5):
            run.step(tokens=2, samples=1, loss=1.0)
        wait_for(run, delivered=3)
        run.finish()
        assert run.dropped_exports == 0 and run.delivered_exports >= 3
        assert run.rejected_points > 0
        warnings = our_warnings(caplog)
        assert len(warnings) == 1, warnings
        # The receiver's message, quoted: which limit refused what.
        assert "rejected" in warnings[0] and "--otlp.max-series-per-run" in warnings[0], warnings[0]
        assert "run_series_limit" in warnings[0] and warnings[0].endswith(ONCE)
        # Only the first three series were stored.
        assert sum(1 for f in store.collect() for s in f.samples if s.labels.get("run_id") == "partial") <= 3
    finally:
        server.shutdown()


def test_a_healthy_push_logs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    # A healthy push logs no warning at all.
    caplog.set_level(logging.INFO)
    with receiver() as (endpoint, store):
        run = start_run(endpoint=endpoint, export_interval=0.05, gpu_uuids=[GPU_A])
        run.step(tokens=3)
        wait_for(run, delivered=2)
        run.finish()
        assert total(store, "training_tokens_total") == 3
    assert our_warnings(caplog) == []

"""The OTLP/gRPC port under silent sockets (issue 29, item 5): 300 sockets to the port that never send the
HTTP/2 preface, reopened as soon as they are closed, made 8 of 8 legitimate exports fail UNAVAILABLE (grpcio
counts a silent connection against its cap until its handshake timeout, and at the cap closes the newest).
The front (``otlp.grpcfront``) holds the port: a connection reaches grpcio only once it has said something,
and at the cap the one silent the longest makes room. In the real exporter, with default settings."""

from __future__ import annotations

import selectors
import socket
import threading
import time

import grpc
from helpers import ExporterProcess, sample_value

from bench.trainers import Trainer

EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


class SilentFlood:
    """``n`` sockets to ``(host, port)`` that never send a byte, each reopened as soon as it is closed."""

    def __init__(self, host: str, port: int, n: int) -> None:
        self.addr = (host, port)
        self.n = n
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SilentFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _open(self, sel: selectors.BaseSelector) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(self.addr)
        sel.register(s, selectors.EVENT_READ)

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            for _ in range(self.n):
                self._open(sel)
            while not self._stop.is_set():
                for key, _ in sel.select(0.05):
                    s = key.fileobj
                    assert isinstance(s, socket.socket)
                    try:
                        data = s.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:  # closed by the server (or a frame from it: it is kept, never answered)
                        sel.unregister(s)
                        s.close()
                        self.reopened += 1
                        self._open(sel)
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]


def _export(target: str, body: bytes) -> tuple[grpc.StatusCode, str, float]:
    started = time.monotonic()
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        try:
            ch.unary_unary(EXPORT)(body, timeout=20)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", time.monotonic() - started
    return grpc.StatusCode.OK, "", time.monotonic() - started


def test_a_legitimate_export_gets_through_300_silent_sockets_reopened_as_they_close(
    start_exporter: type[ExporterProcess],
) -> None:
    exp = start_exporter(["--no-collector.gpu", "--otlp.grpc.listen-address=127.0.0.1:0"]).wait_ready()
    target = exp.grpc_endpoint.split("//", 1)[1]
    host, port = target.rsplit(":", 1)
    assert _export(target, b"")[0] == grpc.StatusCode.OK  # gRPC loaded
    results = []
    with SilentFlood(host, int(port), 300) as flood:
        time.sleep(2.0)  # every connection slot held
        for rank in range(8):
            body, _ = Trainer("legit", rank).request()
            results.append(_export(target, body))
        time.sleep(4.0)  # past the first-bytes timeout: the flood keeps reopening
        body, _ = Trainer("legit", 8).request()
        results.append(_export(target, body))
        assert flood.reopened > 0  # the flood really was closed and reopened meanwhile
    codes = [code for code, _, _ in results]
    assert codes == [grpc.StatusCode.OK] * 9, results
    assert max(took for _, _, took in results) < 10, results
    text = exp.metrics()
    assert sample_value(text, "training_tokens_total", run_id="legit", rank="7") is not None

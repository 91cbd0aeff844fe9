"""Baseline (not a benchmark): Python's own ``http.server.ThreadingHTTPServer`` serving bytes from memory.

``python -m bench.static_server`` listens on 127.0.0.1 (a free port), prints ``static listening on URL``
and then answers every GET with the body last POSTed to ``/body`` (its ``Content-Type`` too), over
HTTP/1.1 keep-alive. The scrape benchmark posts the exporter's own /metrics body here once per round and
times GETs of both servers alternately: what serving those bytes costs with nothing computed per request,
the floor a scrape is compared with. Stops on SIGTERM; only ever binds 127.0.0.1.
"""

from __future__ import annotations

import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_body: list[tuple[bytes, str]] = [(b"", "text/plain; version=0.0.4; charset=utf-8")]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        body, ctype = _body[0]
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        data = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        _body[0] = (data, self.headers.get("Content-Type", _body[0][1]))
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


def main() -> int:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True

    def stop(*_: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"static listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Baseline (not a benchmark): the floor of an HTTP answer on this machine, a socket writing prepared bytes.

``python -m bench.raw_server FILE`` listens on 127.0.0.1 (a free port), prints ``raw listening on URL``, and
answers every request on a keep-alive connection (one thread per connection) with one ``sendall`` of a
response prepared at start: status line, ``Content-Type``, ``Content-Length`` and the bytes of FILE. It never
parses the request beyond reading it, so what a client measures against it is the loopback round trip, the
client's own work and one Python ``recv``/``sendall``: the least any Python server can take to answer with
those bytes. The peers benchmark serves our /metrics body from it beside the exporters. Stops on SIGTERM;
only ever binds 127.0.0.1.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from pathlib import Path


def _serve(conn: socket.socket, response: bytes) -> None:
    with conn:
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            conn.sendall(response)


def main() -> int:
    body = Path(sys.argv[1]).read_bytes()
    response = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"raw listening on http://127.0.0.1:{listener.getsockname()[1]}", flush=True)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve, args=(conn, response), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())

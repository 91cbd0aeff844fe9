"""What listens at a host and port where a request of the workstation commands failed in a way that points
at the wrong port or scheme: plain HTTP/1.1, plain HTTP/2 (a gRPC port), or TLS (https, or gRPC over TLS).

``client/api.py`` calls ``listener_kind`` only after such a failure, never on the way of a request that
works. A probe is at most two short connections to the URL's own host and port: a plain ``GET /`` whose
first bytes are read, then, if those were not HTTP, a TLS handshake offering HTTP/2 and HTTP/1.1 (ALPN).
It never sends credentials, never verifies or trusts a certificate (it only asks "is this TLS?") and
never contacts another address.
"""

from __future__ import annotations

import socket
import ssl
import time

from gpu_energy_exporter.core.ports import is_http2_frame

#: Answers HTTP/1.x in plain text: an http:// URL works there.
PLAIN_HTTP = "http"
#: Answers a plain request with an HTTP/2 frame: a gRPC port without TLS.
PLAIN_H2 = "h2c"
#: Completes a TLS handshake without choosing HTTP/2: an https:// URL works there.
TLS_HTTP = "https"
#: Completes a TLS handshake choosing HTTP/2: a gRPC port with TLS.
TLS_H2 = "h2"
#: None of the above (closed, reset, silent, or not there).
UNKNOWN = ""


def listener_kind(host: str, port: int, timeout: float = 2.0) -> str:
    """One of the module's kinds for ``host:port``; ``timeout`` bounds each of the two probes. A host that
    cannot be connected to (refused, unreachable, silent) is ``UNKNOWN`` after the first."""
    name = f"[{host}]" if ":" in host else host
    request = f"GET / HTTP/1.1\r\nHost: {name}:{port}\r\nConnection: close\r\n\r\n".encode("ascii", "replace")
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return UNKNOWN  # nothing to tell apart: the caller's own message stands
    with sock:
        try:
            sock.sendall(request)
            head = _read_head(sock, 9, timeout)
        except OSError:
            head = b""
    if head.startswith(b"HTTP/"):
        return PLAIN_HTTP
    if is_http2_frame(head):
        return PLAIN_H2
    # a TLS alert, a reset, silence: perhaps TLS, which the second probe asks
    return _tls(host, port, timeout)


def _read_head(sock: socket.socket, size: int, timeout: float) -> bytes:
    """Up to ``size`` bytes: what arrives before the peer closes or ``timeout`` passes."""
    head = b""
    deadline = time.monotonic() + timeout
    while len(head) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(size - len(head))
        except OSError:
            break
        if not chunk:
            break
        head += chunk
    return head


def _tls(host: str, port: int, timeout: float) -> str:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # Only "does it speak TLS, and HTTP/2 or not": no trust decision rests on this handshake, and nothing
    # is sent over it.
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as conn:
            return TLS_H2 if conn.selected_alpn_protocol() == "h2" else TLS_HTTP
    except (OSError, ssl.SSLError, ValueError):
        return UNKNOWN


__all__ = ["PLAIN_H2", "PLAIN_HTTP", "TLS_H2", "TLS_HTTP", "UNKNOWN", "listener_kind"]

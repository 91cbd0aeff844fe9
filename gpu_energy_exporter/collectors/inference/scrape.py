"""One bounded GET of a local server's /metrics: at most ``max_bytes`` read, within ``timeout_s`` in all (connect,
headers and body together), plain HTTP on this host only. A server that is slow, hangs, answers with an error
or sends more than the bound costs one scrape thread at most ``timeout_s`` and ``max_bytes`` of memory, and
raises ``Refused`` with the reason the collector counts. Never called on the sampler or the scrape path.
"""

from __future__ import annotations

import socket
import time
import zlib
from urllib.parse import urlsplit

from gpu_energy_exporter.collectors.inference.engines import Refused

_LOCAL = frozenset({"127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0"})


def check_url(raw: str) -> str:
    """A --collector.inference.url entry: an http:// URL of this host (the serving process is found from the
    port's listening socket, which only this host's /proc can tell)."""
    parts = urlsplit(raw.strip())
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{raw!r} must be an http:// URL of a server on this host, e.g. http://127.0.0.1:8000/metrics")
    if parts.hostname not in _LOCAL and parts.hostname != socket.gethostname():
        raise ValueError(f"{raw!r} is not on this host: the exporter charges a server's GPUs only to a local "
                         "process (use 127.0.0.1 or localhost)")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{raw!r} has an invalid port") from None
    if port is None:
        raise ValueError(f"{raw!r} names no port (the server's process is found from its listening port)")
    return raw.strip() if parts.path else raw.strip() + "/metrics"


def port_of(url: str) -> int:
    return urlsplit(url).port or 80


def fetch(url: str, *, timeout_s: float, max_bytes: int) -> str:
    """The body of ``url``, decoded as UTF-8 (invalid bytes replaced). Raises ``Refused``."""
    # Imported here: the registry imports every collector's module, and http.client brings ssl and email
    # (several MB) that a daemon without --collector.inference never needs (tests/test_daemon_imports.py).
    import http.client

    parts = urlsplit(url)
    deadline = time.monotonic() + timeout_s
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)
    try:
        try:
            conn.request("GET", (parts.path or "/metrics") + (f"?{parts.query}" if parts.query else ""),
                         headers={"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "gzip"})
            resp = conn.getresponse()
        except TimeoutError:
            raise Refused("timeout", f"no answer within {timeout_s:g}s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise Refused("unreachable", f"{type(exc).__name__}: {exc}") from None
        if resp.status != 200:
            raise Refused("http_error", f"HTTP {resp.status} {resp.reason}")
        gzipped = (resp.getheader("Content-Encoding") or "").lower() == "gzip"
        chunks: list[bytes] = []
        size = 0
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzipped else None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Refused("timeout", f"the answer took longer than {timeout_s:g}s")
            if conn.sock is not None:
                conn.sock.settimeout(left)
            try:
                chunk = resp.read1(65536)
            except TimeoutError:
                raise Refused("timeout", f"the answer took longer than {timeout_s:g}s") from None
            except (OSError, http.client.HTTPException) as exc:
                raise Refused("unreachable", f"{type(exc).__name__}: {exc}") from None
            if not chunk:
                break
            if inflate is not None:
                # bounded inflation: never more than what is still allowed (a gzip bomb stops at the bound)
                chunk = inflate.decompress(chunk, max_bytes - size + 1)
            size += len(chunk)
            if size > max_bytes:
                raise Refused("too_large", f"more than {max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")
    finally:
        conn.close()

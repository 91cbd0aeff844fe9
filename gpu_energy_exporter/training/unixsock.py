"""OTLP/HTTP over the exporter's Unix-domain socket: a ``requests`` transport adapter for the SDK's exporter.

The exporter listens on ``/run/gpu-energy-exporter/otlp.sock`` (``--otlp.unix-socket``) and identifies each
connection by the kernel's ``SO_PEERCRED`` (docs/security.md): no neighbour on the node can push as this
process, whatever it writes in its resource. The SDK's OTLP/HTTP exporter speaks ``requests``, which has no
Unix-socket transport of its own: ``UnixAdapter`` is one, mounted on the exporter's session for
``UNIX_URL`` (the host name is a placeholder: the socket is the destination). gRPC needs none of this:
grpcio takes ``unix:`` targets as they are.

Never imports the SDK; never opens a connection before the SDK sends a request.
"""

from __future__ import annotations

import socket
from typing import Any

from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection
from urllib3.connectionpool import HTTPConnectionPool
from urllib3.exceptions import NewConnectionError

#: The base URL the session sends to; ``UnixAdapter`` carries it to the socket.
UNIX_URL = "http://otlp.sock"


class _UnixConnection(HTTPConnection):
    def __init__(self, *args: Any, socket_path: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._socket_path = socket_path

    def _new_conn(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        timeout = self.timeout
        sock.settimeout(float(timeout) if isinstance(timeout, (int, float)) else None)
        try:
            sock.connect(self._socket_path)
        except OSError as exc:
            sock.close()
            raise NewConnectionError(self, f"cannot connect to the Unix socket {self._socket_path}: {exc}") from exc
        return sock


class _UnixPool(HTTPConnectionPool):
    ConnectionCls = _UnixConnection


class UnixAdapter(HTTPAdapter):
    """Sends every request of the session's ``UNIX_URL`` over the Unix socket at ``path``."""

    def __init__(self, path: str, *, maxsize: int = 2) -> None:
        super().__init__()
        self.path = path
        self._pool = _UnixPool("otlp.sock", maxsize=maxsize, socket_path=path)

    def get_connection_with_tls_context(self, request: Any, verify: Any, proxies: Any = None,
                                        cert: Any = None) -> HTTPConnectionPool:
        return self._pool

    def get_connection(self, url: Any, proxies: Any = None) -> HTTPConnectionPool:  # requests < 2.32
        return self._pool

    def close(self) -> None:
        self._pool.close()
        super().close()

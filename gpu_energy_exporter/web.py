"""The HTTP layer: one small threaded server class, used for ``/metrics`` and reused by the OTLP receiver.

Interface for other modules (the OTLP receiver runs its own instance on its own port)::

    from gpu_energy_exporter.web import HTTPError, HTTPServer, Request, Response

    def receive(req: Request) -> Response:
        body = req.read_body(max_bytes=8 << 20)   # Content-Length or chunked, gzip decoded; limits
        ...                                        # raise HTTPError(413/400/415) by themselves
        return Response(200, payload, {"Content-Type": "application/x-protobuf"})

    server = HTTPServer(("localhost", 4318), {("POST", "/v1/metrics"): receive}, name="otlp")
    server.start()              # accepts on a daemon thread; returns self
    server.server_address       # (host, port) actually bound; port 0 gives an ephemeral port
    server.url                  # "http://127.0.0.1:4318", for logs and tests
    server.shutdown()           # stop accepting, let in-flight requests finish, close idle keep-alive
                                # connections, join every thread (idempotent)

- Routes are exact ``(method, path)`` pairs (no query string in the path). ``HEAD`` is answered from the
  ``GET`` route with the body left out; a known path with another method gets 405 with ``Allow``; any
  other path 404.
- A handler takes a ``Request`` and returns a ``Response`` (status, body bytes, headers; the server adds
  ``Content-Length``). It may raise ``HTTPError(status, message)`` for a plain-text error; any other
  exception becomes a bare 500 and is logged here with its traceback: a client never sees a traceback.
- ``web_config`` (``webconfig.WebConfig``) adds TLS (handshake on the connection's own thread, so a slow
  client cannot stall accepting), the ``rate_limit`` token bucket (429), basic auth (401 with
  ``WWW-Authenticate``) and the configured extra headers, on every path, health endpoints included, as
  exporter-toolkit does. Order: rate limit, then auth, then routing (no path discovery without auth).
- Listen addresses: ``("", port)`` is every interface (IPv6 dual-stack where the host has IPv6, else
  IPv4); ``"0.0.0.0"``, ``"::"``, ``"[::1]"``, ``"127.0.0.1"`` and host names work as expected. A bind
  failure raises ``ConfigError`` naming the address.
- Access logs go to this module's logger at debug level.

``exporter_routes`` / ``new_exporter_server`` build the exporter's own endpoints: the telemetry path
(Prometheus text 0.0.4 or OpenMetrics by ``Accept``, gzip by ``Accept-Encoding``, ``name[]`` filtering),
``/`` (landing page), ``/-/healthy`` and ``/-/ready``.

This module never samples anything: the metrics handler only serialises a registry whose collectors
read an in-memory snapshot, so a slow or hung GPU driver cannot make a scrape slow.
"""

from __future__ import annotations

import errno
import gzip
import html
import io
import ipaddress
import logging
import socket
import socketserver
import ssl
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpu_energy_exporter import __version__
from gpu_energy_exporter.errors import ConfigError
from gpu_energy_exporter.webconfig import WebConfig

log = logging.getLogger(__name__)

Handler = Callable[["Request"], "Response"]
Routes = Mapping[tuple[str, str], Handler]
#: A readiness check: True/False, or (ready, reason shown in the 503 body).
ReadyCheck = Callable[[], "bool | tuple[bool, str]"]
#: Renders the whole exposition for an ``Accept`` header: (body, content type).
Render = Callable[[str], tuple[bytes, str]]

PROJECT_NAME = "gpu-energy-exporter"
_TEXT = "text/plain; charset=utf-8"
# Level 1: scrape latency matters more than the last few percent of size; text metrics compress well.
_GZIP_LEVEL = 1
_MAX_CHUNK_LINE = 1024


class HTTPError(Exception):
    """Raised by handlers (and ``Request.read_body``) to answer with a plain-text error."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers: dict[str, str] = dict(headers or {})


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def text(cls, status: int, text: str, headers: Mapping[str, str] | None = None) -> Response:
        return cls(status, text.encode("utf-8"), {"Content-Type": _TEXT, **(headers or {})})


class Request:
    """One request as a handler sees it.

    ``method`` and ``path`` (without the query string), ``query`` (raw, without ``?``), ``headers``
    (case-insensitive ``.get``), ``client_address``; the body is read on demand with ``read_body``.
    """

    def __init__(
        self, method: str, path: str, query: str, headers: Message, client_address: tuple[Any, ...],
        body: _Body,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.client_address = client_address
        self._body = body

    def read_body(self, max_bytes: int, *, decode: bool = True) -> bytes:
        """The request body, at most ``max_bytes`` both as sent and after decoding.

        Raises ``HTTPError`` 413 when larger (checked against ``Content-Length`` before reading), 400 on
        bad framing or a damaged gzip stream, 415 on a ``Content-Encoding`` other than gzip/identity
        (with ``decode=True``). A second call returns the same bytes.
        """
        raw = self._body.read(max_bytes)
        if not decode:
            return raw
        return _decode(raw, self.headers.get("Content-Encoding"), max_bytes)


# ----------------------------------------------------------------------------------------------------
# the server


class HTTPServer:
    """A threaded HTTP/1.1 server for a fixed route table. See the module docstring."""

    def __init__(
        self,
        address: tuple[str, int],
        routes: Routes,
        *,
        web_config: WebConfig | None = None,
        name: str = PROJECT_NAME,
        auth: str | None = None,
        request_timeout: float = 60.0,
        handshake_timeout: float = 10.0,
        max_connections: int = 512,
    ) -> None:
        self.name = name
        # What the start-up line says about authentication when not the web config's basic auth (e.g. the
        # OTLP receiver's bearer token).
        self._auth_text = auth
        self._routes: dict[tuple[str, str], Handler] = {(m.upper(), p): h for (m, p), h in routes.items()}
        methods: dict[str, set[str]] = {}
        for m, p in self._routes:
            methods.setdefault(p, set()).add(m)
            if m == "GET":
                methods[p].add("HEAD")
        self._allow = {p: ", ".join(sorted(ms)) for p, ms in methods.items()}
        self._web_config = web_config or WebConfig()
        self._limiter = (
            _TokenBucket(self._web_config.rate_limit.interval_s, self._web_config.rate_limit.burst)
            if self._web_config.rate_limit else None
        )
        self._extra_headers = self._web_config.headers
        self._request_timeout = request_timeout
        self._handshake_timeout = handshake_timeout
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._conns: set[_Connection] = set()
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._refused_logged = False
        self._server = _bind(address, self)

    # -- public

    @property
    def server_address(self) -> tuple[str, int]:
        host, port = self._server.socket.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.server_address
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        scheme = "https" if self._web_config.tls_enabled else "http"
        return f"{scheme}://{host}:{port}"

    @property
    def listen_text(self) -> str:
        """Where the socket listens, as a person reads it (see ``listen_text``)."""
        host, port = self.server_address
        return listen_text(host, port, self.url, _dual_stack(self._server))

    def start(self) -> HTTPServer:
        """Serve on a daemon thread. Returns self."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} server was shut down")
            if self._thread is not None:
                return self
            self._thread = threading.Thread(
                target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                name=f"{self.name}-http", daemon=True,
            )
            self._thread.start()
        wc = self._web_config
        auth = self._auth_text or ("basic auth " + ("on" if wc.auth_enabled else "off"))
        log.info("%s listening on %s (TLS %s, %s)", self.name, self.listen_text,
                 "on" if wc.tls_enabled else "off", auth)
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, close the socket, close idle connections, give in-flight requests up to
        ``timeout`` seconds to finish (then cut them), and join every thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            thread = self._thread
        if thread is not None:
            self._server.shutdown()  # returns once serve_forever has left its loop
            thread.join()
        self._server.server_close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            if not c.busy:
                c.abort()
        deadline = time.monotonic() + timeout
        for c in conns:
            c.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [c for c in conns if c.thread.is_alive()]
        if stuck:
            log.warning("%s: cutting %d connection(s) still busy after %.1fs", self.name, len(stuck), timeout)
            for c in stuck:
                c.abort()
            for c in stuck:
                c.thread.join(1.0)

    def __enter__(self) -> HTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- connection handling (called by _ThreadingServer and _RequestHandler)

    def _spawn(self, sock: socket.socket, client_address: tuple[Any, ...]) -> None:
        with self._lock:
            refuse = self._stopping or len(self._conns) >= self._max_connections
            if not refuse:
                conn = _Connection(sock)
                conn.thread = threading.Thread(
                    target=self._serve_connection, args=(conn, client_address),
                    name=f"{self.name}-conn", daemon=True,
                )
                self._conns.add(conn)
        if refuse:
            if not self._stopping and not self._refused_logged:
                log.warning("%s: %d connections open, refusing new ones until some close",
                            self.name, self._max_connections)
                self._refused_logged = True
            self._server.shutdown_request(sock)
            return
        conn.thread.start()

    def _serve_connection(self, conn: _Connection, client_address: tuple[Any, ...]) -> None:
        try:
            ctx = self._web_config.ssl_context()
            if ctx is not None:
                conn.sock.settimeout(self._handshake_timeout)
                with conn.lock:
                    tls_sock = ctx.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
                    conn.sock = tls_sock
                tls_sock.do_handshake()
                tls = self._web_config.tls
                if tls is not None and not tls.client_san_allowed(tls_sock.getpeercert()):
                    log.debug("%s: %s: client certificate has none of client_allowed_sans", self.name,
                              client_address[0])
                    return
            if self._stopping:
                return
            _RequestHandler(conn.sock, client_address, self._server, conn)
        except (OSError, ssl.SSLError, EOFError) as exc:
            # Resets, timeouts and failed handshakes are the client's business: keep them out of the log.
            log.debug("%s: connection from %s ended: %s", self.name, client_address[0], exc)
        except Exception:
            log.exception("%s: unexpected error on connection from %s", self.name, client_address[0])
        finally:
            self._server.shutdown_request(conn.sock)
            with self._lock:
                self._conns.discard(conn)

    def _handle(self, req: Request) -> Response:
        try:
            if self._limiter is not None and not self._limiter.allow():
                return Response.text(429, "Too Many Requests\n")
            wc = self._web_config
            if wc.auth_enabled and not wc.check_basic_auth(req.headers.get("Authorization")):
                return Response.text(401, "Unauthorized\n",
                                     {"WWW-Authenticate": f'Basic realm="{self.name}", charset="UTF-8"'})
            handler = self._routes.get((req.method, req.path))
            if handler is None and req.method == "HEAD":
                handler = self._routes.get(("GET", req.path))
            if handler is None:
                allow = self._allow.get(req.path)
                if allow is not None:
                    return Response.text(405, "Method Not Allowed\n", {"Allow": allow})
                return Response.text(404, "Not Found\n")
            return handler(req)
        except HTTPError as exc:
            return Response.text(exc.status, exc.message.rstrip("\n") + "\n", exc.headers)
        except Exception:
            log.exception("%s: %s %s failed", self.name, req.method, req.path)
            return Response.text(500, "Internal Server Error\n")


class _Connection:
    """One accepted connection and the thread serving it. ``busy`` is True between reading a request
    line and finishing its response; shutdown closes only connections that are not busy."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.busy = False
        self.lock = threading.Lock()
        self.thread: threading.Thread = threading.Thread()

    def abort(self) -> None:
        with self.lock:
            sock = self.sock
        try:
            # The plain-socket shutdown, not SSLSocket.shutdown, which is not safe from another thread;
            # it wakes a reader blocked in recv on the connection's thread.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass


class _ThreadingServer(ThreadingHTTPServer):
    request_queue_size = 128

    def __init__(self, address: tuple[Any, ...], family: socket.AddressFamily, dualstack: bool,
                 owner: HTTPServer) -> None:
        self.address_family = family
        self.dualstack = dualstack
        self.owner = owner
        # RequestHandlerClass is never used: HTTPServer._spawn hands each connection to _RequestHandler.
        super().__init__(address, BaseHTTPRequestHandler)

    def server_bind(self) -> None:
        if self.dualstack:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # Not HTTPServer.server_bind: it calls socket.getfqdn, a DNS lookup that can hang start-up.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.owner._spawn(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("%s: error on connection from %s", self.owner.name, client_address, exc_info=True)


def listen_text(host: str, port: int, url: str, dual_stack: bool) -> str:
    """``:9863 on all interfaces (IPv4 and IPv6; http://[::1]:9863 from this host)`` for a wildcard address,
    else the URL: a server bound to ``::`` does not listen on ``[::1]`` only, as its client URL would say."""
    if host in ("0.0.0.0", "::", ""):
        family = "IPv4 only" if host == "0.0.0.0" else "IPv4 and IPv6" if dual_stack else "IPv6 only"
        return f":{port} on all interfaces ({family}; {url} from this host)"
    return url


def _dual_stack(server: socketserver.BaseServer) -> bool:
    sock = getattr(server, "socket", None)
    if sock is None or sock.family != socket.AF_INET6:
        return False
    try:
        return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    except OSError:
        return False


def _bind(address: tuple[str, int], owner: HTTPServer) -> _ThreadingServer:
    host, port = address
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    candidates: list[tuple[socket.AddressFamily, tuple[Any, ...], bool]]
    if host == "":
        # Every interface: one dual-stack IPv6 socket, or IPv4 where the host has no IPv6.
        candidates = [(socket.AF_INET6, ("::", port), True), (socket.AF_INET, ("0.0.0.0", port), False)]
    else:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
            except socket.gaierror as exc:
                raise ConfigError(f"cannot listen on {shown}: host name does not resolve ({exc.strerror})") from None
            # Like Go's net.Listen: one socket, IPv4 first when the name has both (localhost).
            infos.sort(key=lambda i: i[0] != socket.AF_INET)
            candidates = [(i[0], i[4], False) for i in infos[:1]]
        else:
            if ip.version == 6:
                candidates = [(socket.AF_INET6, (host, port), str(ip) == "::")]
            else:
                candidates = [(socket.AF_INET, (host, port), False)]
    last: OSError | None = None
    for family, sockaddr, dualstack in candidates:
        try:
            return _ThreadingServer(sockaddr, family, dualstack, owner)
        except OSError as exc:
            last = exc
            if host == "" and exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                continue  # no IPv6 here: fall back to IPv4
            break
    assert last is not None
    hint = " (another process is using this port; choose another listen address)" \
        if last.errno == errno.EADDRINUSE else ""
    raise ConfigError(f"cannot listen on {shown}: {last.strerror or last}{hint}") from None


class _RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"{PROJECT_NAME}/{__version__}"
    error_content_type = _TEXT
    error_message_format = "%(code)d %(message)s\n"
    # Headers and body are separate writes: with Nagle on, the body waits for the client's delayed ACK
    # of the headers (~40 ms per scrape).
    disable_nagle_algorithm = True
    server: _ThreadingServer

    def __init__(self, request: Any, client_address: Any, server: _ThreadingServer, conn: _Connection) -> None:
        self._conn = conn
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        # One socket timeout bounds an idle keep-alive connection and a slow request alike.
        self.request.settimeout(self.server.owner._request_timeout)
        super().setup()

    def handle_one_request(self) -> None:
        # BaseHTTPRequestHandler.handle_one_request, plus the busy flag and our own dispatch (any
        # method reaches the route table, so unknown methods get 405/404 rather than 501).
        self._conn.busy = False
        try:
            self.raw_requestline = self.rfile.readline(65537)
        except TimeoutError:
            self.close_connection = True
            return
        if not self.raw_requestline:
            self.close_connection = True
            return
        self._conn.busy = True
        try:
            if len(self.raw_requestline) > 65536:
                self.requestline = self.request_version = self.command = ""
                self.send_error(414)
                return
            if not self.parse_request():
                return
            self._dispatch()
            self.wfile.flush()
        finally:
            self._conn.busy = False
        if self.server.owner._stopping:
            self.close_connection = True

    def _dispatch(self) -> None:
        owner = self.server.owner
        target, _, query = self.path.partition("?")
        query = query.partition("#")[0]
        try:
            body = _Body(self.rfile, self.headers)
        except HTTPError as exc:
            # Unusable framing: answer and close, since the next request's start cannot be found.
            self.close_connection = True
            self._write(Response.text(exc.status, exc.message + "\n"), close=True)
            return
        req = Request(self.command, target, query, self.headers, self.client_address, body)
        response = owner._handle(req)
        # A body the handler did not read would be parsed as the next request: close instead.
        close = owner._stopping or not body.complete
        if close:
            self.close_connection = True
        self._write(response, close=close)

    def _write(self, response: Response, *, close: bool) -> None:
        self.send_response(response.status)
        sent = set()
        for k, v in response.headers.items():
            self.send_header(k, v)
            sent.add(k.lower())
        for k, v in self.server.owner._extra_headers:
            if k.lower() not in sent:
                self.send_header(k, v)
        body = response.body
        no_body = response.status in (204, 304) or response.status < 200
        if not no_body and "content-length" not in sent:
            self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD" and not no_body and body:
            self.wfile.write(body)

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s: %s %s", self.server.owner.name, self.address_string(), format % args)


# ----------------------------------------------------------------------------------------------------
# request bodies


class _Body:
    """Reads a request body framed by Content-Length or chunked transfer coding, within a limit."""

    def __init__(self, rfile: io.BufferedIOBase, headers: Message) -> None:
        self._rfile = rfile
        self._data: bytes | None = None
        te = headers.get("Transfer-Encoding")
        cl = headers.get("Content-Length")
        self._chunked = False
        self._length = 0
        if te is not None:
            if cl is not None:
                raise HTTPError(400, "both Transfer-Encoding and Content-Length are set")
            if te.strip().lower() != "chunked":
                raise HTTPError(501, f"Transfer-Encoding {te!r} is not supported (use chunked or Content-Length)")
            self._chunked = True
        elif cl is not None:
            if not cl.strip().isdigit():
                raise HTTPError(400, f"invalid Content-Length {cl!r}")
            self._length = int(cl)
        if not self._chunked and self._length == 0:
            self._data = b""

    @property
    def complete(self) -> bool:
        return self._data is not None

    def read(self, max_bytes: int) -> bytes:
        if self._data is not None:
            if len(self._data) > max_bytes:
                raise HTTPError(413, f"request body is larger than {max_bytes} bytes")
            return self._data
        if not self._chunked:
            if self._length > max_bytes:
                raise HTTPError(413, f"request body of {self._length} bytes is larger than {max_bytes} bytes")
            data = self._rfile.read(self._length)
            if len(data) != self._length:
                raise HTTPError(400, "request body is shorter than its Content-Length")
        else:
            data = self._read_chunked(max_bytes)
        self._data = data
        return data

    def _read_chunked(self, max_bytes: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            line = self._rfile.readline(_MAX_CHUNK_LINE + 1)
            if len(line) > _MAX_CHUNK_LINE or not line.endswith(b"\n"):
                raise HTTPError(400, "malformed chunked body")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HTTPError(400, "malformed chunk size in chunked body") from None
            if size == 0:
                break
            total += size
            if total > max_bytes:
                raise HTTPError(413, f"request body is larger than {max_bytes} bytes")
            chunk = self._rfile.read(size)
            if len(chunk) != size or self._rfile.read(2) != b"\r\n":
                raise HTTPError(400, "truncated chunked body")
            parts.append(chunk)
        while True:  # trailer section, ignored
            line = self._rfile.readline(_MAX_CHUNK_LINE + 1)
            if len(line) > _MAX_CHUNK_LINE or not line:
                raise HTTPError(400, "malformed chunked body trailer")
            if line in (b"\r\n", b"\n"):
                break
        return b"".join(parts)


def _decode(data: bytes, encoding: str | None, max_bytes: int) -> bytes:
    enc = (encoding or "identity").strip().lower()
    if enc in ("", "identity"):
        return data
    if enc not in ("gzip", "x-gzip"):
        raise HTTPError(415, f"Content-Encoding {encoding!r} is not supported (use gzip or none)")
    out = bytearray()
    rest = data
    while rest:  # a gzip stream may hold several members
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out += d.decompress(rest, max_bytes - len(out) + 1)
        except zlib.error as exc:
            raise HTTPError(400, f"malformed gzip body: {exc}") from None
        if len(out) > max_bytes:
            raise HTTPError(413, f"request body is larger than {max_bytes} bytes once decompressed")
        if not d.eof:
            raise HTTPError(400, "truncated gzip body")
        rest = d.unused_data
    return bytes(out)


class _TokenBucket:
    def __init__(self, interval_s: float, burst: int) -> None:
        self._rate = 1.0 / interval_s
        self._burst = float(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


# ----------------------------------------------------------------------------------------------------
# the exporter's endpoints


def accepts_gzip(accept_encoding: str | None) -> bool:
    """True when an ``Accept-Encoding`` header allows gzip (``gzip;q=0`` does not)."""
    for part in (accept_encoding or "").split(","):
        token, *params = part.split(";")
        if token.strip().lower() not in ("gzip", "x-gzip"):
            continue
        for p in params:
            name, _, value = p.partition("=")
            if name.strip().lower() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


def metrics_handler(registry: CollectorRegistry, render: Render | None = None) -> Handler:
    """Serialise ``registry``: format by ``Accept``, gzip by ``Accept-Encoding``, ``?name[]=`` filter.

    ``render(accept) -> (body, content_type)``, when given, serves unfiltered scrapes (the exporter passes
    its cached exposition); the registry serves filtered ones.
    """

    def handle(req: Request) -> Response:
        accept = req.headers.get("Accept", "")
        names = parse_qs(req.query).get("name[]")
        if render is not None and not names:
            body, content_type = render(accept)
        else:
            encoder, content_type = choose_encoder(accept)
            target = registry.restricted_registry(names) if names else registry
            body = encoder(target)
        headers = {"Content-Type": content_type, "Vary": "Accept, Accept-Encoding"}
        if accepts_gzip(req.headers.get("Accept-Encoding")):
            body = gzip.compress(body, compresslevel=_GZIP_LEVEL, mtime=0)
            headers["Content-Encoding"] = "gzip"
        return Response(200, body, headers)

    return handle


def landing_page_handler(
    *, name: str, version: str, description: str, telemetry_path: str, links: Sequence[tuple[str, str]] = (),
) -> Handler:
    """``/``: name, version and links. ``links`` are extra (label, href) pairs."""
    # Relative links keep working behind a reverse proxy that adds a path prefix.
    items = [("Metrics", "." + telemetry_path), ("Health", "./-/healthy"), ("Readiness", "./-/ready"), *links]
    li = "\n".join(f'      <li><a href="{html.escape(href)}">{html.escape(label)}</a></li>' for label, href in items)
    page = f"""<!DOCTYPE html>
<html lang="en">
  <head>
    <meta charset="utf-8">
    <title>{html.escape(name)}</title>
    <style>body {{ font-family: sans-serif; max-width: 50em; margin: 2em auto; padding: 0 1em; }}</style>
  </head>
  <body>
    <h1>{html.escape(name)}</h1>
    <p>{html.escape(description)}</p>
    <p>Version: {html.escape(version)}</p>
    <ul>
{li}
    </ul>
  </body>
</html>
""".encode()

    def handle(req: Request) -> Response:
        return Response(200, page, {"Content-Type": "text/html; charset=utf-8"})

    return handle


def health_handler(name: str) -> Handler:
    """``/-/healthy``: 200 whenever the process can answer."""

    def handle(req: Request) -> Response:
        return Response.text(200, f"{name} is Healthy.\n")

    return handle


def ready_handler(name: str, ready: ReadyCheck | None) -> Handler:
    """``/-/ready``: 200 when ``ready()`` says so, else 503 with the reason."""

    def handle(req: Request) -> Response:
        if ready is None:
            ok, reason = True, ""
        else:
            try:
                result = ready()
            except Exception as exc:
                log.warning("%s: readiness check failed: %s", name, exc)
                ok, reason = False, f"readiness check failed: {exc}"
            else:
                ok, reason = result if isinstance(result, tuple) else (bool(result), "not ready yet")
        if ok:
            return Response.text(200, f"{name} is Ready.\n")
        return Response.text(503, f"{name} is not ready: {reason}\n")

    return handle


def exporter_routes(
    registry: CollectorRegistry,
    *,
    telemetry_path: str = "/metrics",
    ready: ReadyCheck | None = None,
    name: str = PROJECT_NAME,
    version: str = __version__,
    description: str = "GPU energy, joules per token, compute utilisation and carbon for ML training.",
    links: Sequence[tuple[str, str]] = (),
    render: Render | None = None,
) -> dict[tuple[str, str], Handler]:
    """The exporter's routes: telemetry path, landing page, health and readiness."""
    if not telemetry_path.startswith("/"):
        raise ConfigError(f"telemetry path {telemetry_path!r} must start with '/'")
    if telemetry_path in ("/-/healthy", "/-/ready"):
        raise ConfigError(f"telemetry path {telemetry_path!r} collides with a health endpoint")
    routes: dict[tuple[str, str], Handler] = {
        ("GET", "/-/healthy"): health_handler(name),
        ("GET", "/-/ready"): ready_handler(name, ready),
    }
    if telemetry_path != "/":
        routes[("GET", "/")] = landing_page_handler(
            name=name, version=version, description=description, telemetry_path=telemetry_path, links=links,
        )
    routes[("GET", telemetry_path)] = metrics_handler(registry, render)
    return routes


def new_exporter_server(
    address: tuple[str, int],
    registry: CollectorRegistry,
    *,
    web_config: WebConfig | None = None,
    telemetry_path: str = "/metrics",
    ready: ReadyCheck | None = None,
    links: Sequence[tuple[str, str]] = (),
) -> HTTPServer:
    """The ``/metrics`` server, bound but not started (call ``start()``)."""
    routes = exporter_routes(registry, telemetry_path=telemetry_path, ready=ready, links=links)
    return HTTPServer(address, routes, web_config=web_config, name=PROJECT_NAME)

"""The HTTP engine behind ``web.HTTPServer``: one selector thread per port reads requests, a small
fixed pool of worker threads runs the handlers.

Why this shape (and not a thread per connection): a client that trickles its request one byte at a time,
or opens a connection and sends nothing, must cost a few hundred bytes and a file descriptor, never a
thread, and must never stop ``/metrics`` or the health endpoints from being answered. So:

- The selector thread accepts, performs TLS handshakes, reads request heads and bodies and writes
  responses, all non-blocking. Only a *complete* request (head and body, within limits) reaches a worker,
  so a slow client never holds a worker. Workers return the whole response as bytes; the selector thread
  writes it out, so a client that does not read its response never holds a worker either. A server may
  name requests to handle on the selector thread itself (``inline``: the OTLP receiver's small pushes,
  cheaper to store than to hand to a worker and back).
- Every request has a deadline for its head (``head_timeout``) and one for the whole request, body
  included (``request_timeout``), counted from its first byte, not per ``recv``. Past it the client gets
  408 and the connection is closed. A keep-alive connection may stay idle for ``idle_timeout``.
- At most ``max_connections`` connections are open per port. When a new one arrives at the cap, the
  connection that has been idle, or sending its request, the longest is closed to make room (oldest
  first, so the connection just accepted goes last); failing that, the one whose response has waited
  longest (over a second) for its client to read it. Requests being handled are never cut. So a flood of
  slow, idle or non-reading connections cannot lock a scraper out: its fresh connection evicts the oldest.
- Bodies are buffered up to ``max_body_bytes`` per request and ``max_buffered_bytes`` for the port as a
  whole (503 when that budget is spent), so memory stays bounded whatever clients send.
- Parsing is strict: ``HTTP/1.0`` and ``HTTP/1.1`` only (HTTP/0.9 gets 400), one ``Content-Length`` of
  ASCII digits, chunk sizes in hex with bounded extensions and trailers, bounded head size. Client faults
  get 400/408/413/414/431/501/505 and a debug log line, never a traceback.

Handlers, ``Request``, ``Response`` and ``HTTPError`` are described in ``web``'s module docstring. This
module never samples anything and never blocks its selector thread on a client.
"""

from __future__ import annotations

import collections
import email.utils
import errno
import ipaddress
import logging
import queue
import re
import resource
import selectors
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from gpu_energy_exporter import __version__
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.core.metrics import add, define
from gpu_energy_exporter.http.webconfig import AuthBusy, WebConfig

log = logging.getLogger(__name__)

Handler = Callable[["Request"], "Response"]
Routes = Mapping[tuple[str, str], Handler]

PROJECT_NAME = "gpu-energy-exporter"
_TEXT = "text/plain; charset=utf-8"

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_REQUEST_TIMEOUT = 30.0
DEFAULT_HEAD_TIMEOUT = 10.0
DEFAULT_IDLE_TIMEOUT = 60.0
DEFAULT_MAX_BODY_BYTES = 64 * 1024
DEFAULT_WORKERS = 4
_AUTH_WORKERS = 2
_AUTH_QUEUE = 8  # requests waiting for a bcrypt check; beyond it, 429 at once
#: Response bytes waiting for slow readers, per port; beyond it the writer stalled the longest is cut.
_MAX_PENDING_OUT = 64 << 20
#: At the connection cap with nothing idle or slow to close, a response still unwritten after this long
#: is cut to make room.
_STALLED_WRITE_S = 1.0

#: What ``HTTPServer.stats`` counts, all present from the start.
CONNECTION_EVENTS = ("evicted", "refused", "timeout", "write_timeout", "write_cut", "accept_failed")
REQUEST_REJECTIONS = ("bad_request", "too_large", "busy", "auth_busy")

HTTP_CONNECTIONS_CLOSED = define(
    "http", "connections_closed_total", "counter",
    "Connections the server closed to protect itself, by port (server) and reason: evicted (at "
    "--web.max-connections, the oldest idle or slow one), refused (cap reached with every connection "
    "busy), timeout (request not complete by its deadline, 408), write_timeout and write_cut (a client "
    "not reading its response), accept_failed (out of file descriptors).",
    ["server", "reason"], collector="exporter",
)
HTTP_REQUESTS_REJECTED = define(
    "http", "requests_rejected_total", "counter",
    "Requests refused before reaching a handler, by port (server) and reason: bad_request (400/501/505: "
    "malformed framing), too_large (413/414/431), busy (503: too many bodies in flight), auth_busy "
    "(429: too many password checks waiting).",
    ["server", "reason"], collector="exporter",
)
HTTP_OPEN_CONNECTIONS = define(
    "http", "open_connections", "gauge", "Connections open now, by port (server).", ["server"],
    collector="exporter",
)

_MAX_REQUEST_LINE = 8192
_MAX_HEAD = 32 * 1024
_MAX_CHUNK_LINE = 1024
_MAX_TRAILERS = 8192
_RECV = 65536
_TICK = 0.2

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_DIGITS = re.compile(rb"[0-9]{1,18}")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")
_HEAD_END = re.compile(rb"\r?\n\r?\n")


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


class Headers:
    """Request headers in arrival order; ``get`` and ``in`` ignore case."""

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self._items = items
        self._index: dict[str, list[str]] = {}
        for k, v in items:
            self._index.setdefault(k.lower(), []).append(v)

    def get(self, name: str, default: Any = None) -> Any:
        values = self._index.get(name.lower())
        return values[0] if values else default

    def get_all(self, name: str) -> list[str]:
        return list(self._index.get(name.lower(), []))

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._index

    def __getitem__(self, name: str) -> str | None:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)


class Request:
    """One request as a handler sees it.

    ``method`` and ``path`` (without the query string), ``query`` (raw, without ``?``), ``headers``
    (case-insensitive ``.get``), ``client_address``; the body, already received in full, through
    ``read_body``.
    """

    def __init__(
        self, method: str, path: str, query: str, headers: Headers, client_address: tuple[Any, ...],
        body: bytes = b"",
        *,
        refused_length: int = 0,
        limit: int = 0,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.client_address = client_address
        self._body = body
        self._refused_length = refused_length
        self._limit = limit

    @property
    def body_length(self) -> int:
        """Bytes of the body as received (before any decoding)."""
        return len(self._body)

    def read_body(self, max_bytes: int, *, decode: bool = True) -> bytes:
        """The request body, at most ``max_bytes`` both as sent and after decoding.

        Raises ``HTTPError`` 413 when larger, 400 on a damaged gzip stream, 415 on a ``Content-Encoding``
        other than gzip/identity (with ``decode=True``). Bodies over the server's ``max_body_bytes`` were
        already refused with 413 before the handler ran.
        """
        if self._refused_length:
            limit = min(max_bytes, self._limit) if self._limit else max_bytes
            raise HTTPError(413, f"request body of {self._refused_length} bytes is larger than {limit} bytes")
        if len(self._body) > max_bytes:
            raise HTTPError(413, f"request body of {len(self._body)} bytes is larger than {max_bytes} bytes")
        if not decode:
            return self._body
        return decode_body(self._body, self.headers.get("Content-Encoding"), max_bytes)


def decode_body(data: bytes, encoding: str | None, max_bytes: int) -> bytes:
    """Undo a gzip ``Content-Encoding`` within ``max_bytes`` (several members allowed)."""
    enc = (encoding or "identity").strip().lower()
    if enc in ("", "identity"):
        return data
    if enc not in ("gzip", "x-gzip"):
        raise HTTPError(415, f"Content-Encoding {encoding!r} is not supported (use gzip or none)")
    out = bytearray()
    rest = data
    while rest:
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


class _ClientFault(Exception):
    """A request the front refuses before any handler runs; answered with ``status`` and closed."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason  # the label counted in ``HTTPServer.stats``


# ----------------------------------------------------------------------------------------------------
# one connection's state


_HANDSHAKE, _IDLE, _HEAD, _BODY, _WORK, _WRITE, _DRAIN, _CLOSED = range(8)
_DRAIN_BYTES = 1 << 20
_DRAIN_S = 2.0


class _Conn:
    __slots__ = (
        "sock", "addr", "state", "buf", "since", "deadline", "request_deadline", "out", "close_after",
        "method", "target", "version", "headers", "keep_alive", "length", "chunked", "chunk_state",
        "chunk_left", "trailer_bytes", "body", "reserved", "events", "refused_length", "drained", "auth_job",
    )

    def __init__(self, sock: socket.socket, addr: tuple[Any, ...], now: float) -> None:
        self.sock = sock
        self.addr = addr
        self.state = _IDLE
        self.buf = bytearray()
        self.since = now  # when the current state (idle, or the request's first byte) began
        self.deadline = 0.0
        self.request_deadline = 0.0
        self.out = memoryview(b"")
        self.close_after = False
        self.events = 0
        self.reserved = 0
        self.drained = 0
        self.auth_job = False
        self._reset()

    def _reset(self) -> None:
        self.method = ""
        self.target = ""
        self.version = (1, 1)
        self.headers: Headers | None = None
        self.keep_alive = True
        self.length = 0
        self.chunked = False
        self.chunk_state = "size"
        self.chunk_left = 0
        self.trailer_bytes = 0
        self.body = bytearray()
        self.refused_length = 0  # a declared body over the limit: not read, the handler answers 413


# ----------------------------------------------------------------------------------------------------
# the server


class HTTPServer:
    """An HTTP/1.1 server for a fixed route table. See this module's and ``web``'s docstrings."""

    def __init__(
        self,
        address: tuple[str, int],
        routes: Routes,
        *,
        web_config: WebConfig | None = None,
        name: str = PROJECT_NAME,
        auth: str | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        head_timeout: float = DEFAULT_HEAD_TIMEOUT,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        handshake_timeout: float | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_buffered_bytes: int | None = None,
        workers: int = DEFAULT_WORKERS,
        inline: Callable[[Request], bool] | None = None,
    ) -> None:
        if max_connections < 1 or workers < 1:
            raise ConfigError(f"{name}: max connections and workers must be at least 1")
        # What the start-up line says about authentication when not the web config's basic auth (e.g. the
        # OTLP receiver's bearer token).
        self._auth_text = auth
        if request_timeout <= 0:
            raise ConfigError(f"{name}: the request timeout must be positive")
        self.name = name
        fd_cap = _connection_cap()
        if max_connections > fd_cap:
            log.warning("%s: the open-files limit allows about %d connections per port, not %d; using %d "
                        "(raise 'ulimit -n' to allow more)", name, fd_cap, max_connections, fd_cap)
            max_connections = fd_cap
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
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.head_timeout = min(head_timeout, request_timeout)
        self.idle_timeout = idle_timeout
        self.handshake_timeout = min(handshake_timeout or self.head_timeout, request_timeout)
        self.max_body_bytes = max_body_bytes
        self.max_buffered_bytes = max(max_buffered_bytes or 4 * max_body_bytes, max_body_bytes)
        self._buffered = 0
        self._n_workers = workers
        # Requests for which ``inline(req)`` is true are handled on the selector thread, without the hand-off
        # to a worker and back (a queue, a wake-up, two thread switches: more CPU than a small OTLP push
        # itself). Only for cheap, CPU-bound handlers on small bodies (the OTLP receiver's small pushes):
        # a request handled inline holds up the port's other connections while it runs.
        self._inline = inline
        #: counters since start, by event: "evicted", "refused", "timeout", "bad_request", ...
        self.stats: collections.Counter[str] = collections.Counter(
            {k: 0 for k in (*CONNECTION_EVENTS, *REQUEST_REJECTIONS)})
        self._out_pending = 0
        self._accept_paused_until = 0.0
        self._accept_failed_logged = -1e9
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._stopping = False
        self._closed = False
        self._stop_deadline = 0.0
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue[tuple[_Conn, Request] | None] = queue.SimpleQueue()
        # Requests whose credentials need a bcrypt check wait here, for their own two workers, so that a
        # flood of password guesses never delays a request that needs none (cached or no credentials).
        self._auth_jobs: queue.SimpleQueue[tuple[_Conn, Request] | None] = queue.SimpleQueue()
        self._auth_pending = 0
        self._done: collections.deque[tuple[_Conn, bytes, bool]] = collections.deque()
        self._refused_logged = False
        self._listener = _bind(address)  # first: a bind error leaves nothing open behind
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    # -- public

    @property
    def server_address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        return client_url(self.server_address, "https" if self._web_config.tls_enabled else "http")

    @property
    def listen_text(self) -> str:
        """Where the socket listens, as a person reads it (see ``listen_text``)."""
        host, port = self.server_address
        return listen_text(host, port, self.url, _dual_stack(self._listener))

    def open_connections(self) -> int:
        return len(self._conns)

    def collect(self) -> list[Any]:
        """This server's self-metrics (``HTTP_*`` families), for the exporter's /metrics."""
        closed, rejected, open_ = (HTTP_CONNECTIONS_CLOSED.family(), HTTP_REQUESTS_REJECTED.family(),
                                   HTTP_OPEN_CONNECTIONS.family())
        stats = dict(self.stats)
        for reason in CONNECTION_EVENTS:
            add(closed, [self.name, reason], float(stats.get(reason, 0)))
        for reason in REQUEST_REJECTIONS:
            add(rejected, [self.name, reason], float(stats.get(reason, 0)))
        add(open_, [self.name], float(len(self._conns)))
        return [closed, rejected, open_]

    def start(self) -> HTTPServer:
        """Serve on daemon threads (one selector thread, ``workers`` handler threads). Returns self."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} server was shut down")
            if self._thread is not None:
                return self
            self._sel.register(self._listener, selectors.EVENT_READ, None)
            self._sel.register(self._wake_r, selectors.EVENT_READ, None)
            for i in range(self._n_workers):
                t = threading.Thread(target=self._work, args=(self._jobs,), name=f"{self.name}-worker-{i}",
                                     daemon=True)
                t.start()
                self._workers.append(t)
            if self._web_config.auth_enabled:
                for i in range(_AUTH_WORKERS):
                    t = threading.Thread(target=self._work, args=(self._auth_jobs,),
                                         name=f"{self.name}-auth-{i}", daemon=True)
                    t.start()
                    self._workers.append(t)
            self._thread = threading.Thread(target=self._loop, name=f"{self.name}-http", daemon=True)
            self._thread.start()
        wc = self._web_config
        auth = self._auth_text or ("basic auth " + ("on" if wc.auth_enabled else "off"))
        log.info("%s listening on %s (TLS %s, %s, at most %d connections)", self.name, self.listen_text,
                 "on" if wc.tls_enabled else "off", auth, self.max_connections)
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, close the socket, close idle connections, give requests being handled up to
        ``timeout`` seconds to finish and be written (then cut them), and join every thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._stop_deadline = time.monotonic() + timeout
            self._stopping = True
        if thread is None:
            self._listener.close()
            self._close_wakeup()
            return
        self._wake()
        thread.join(timeout + 2.0)
        for _ in self._workers:
            self._jobs.put(None)
            self._auth_jobs.put(None)
        stuck = time.monotonic() + 1.0
        for t in self._workers:
            t.join(max(0.0, stuck - time.monotonic()))
        if thread.is_alive() or any(t.is_alive() for t in self._workers):
            log.warning("%s: a handler was still running %.1fs after shutdown", self.name, timeout)
        else:
            self._close_wakeup()

    def __enter__(self) -> HTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the selector thread

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the pipe is full: a wake-up is already pending

    def _close_wakeup(self) -> None:
        self._wake_r.close()
        self._wake_w.close()
        self._sel.close()

    def _loop(self) -> None:
        try:
            while True:
                if self._stopping and not self._stop_step():
                    return
                for key, events in self._sel.select(_TICK):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    else:
                        self._on_event(key.data, events)
                self._drain_done()
                self._expire()
        except Exception:
            log.exception("%s: the HTTP front failed; closing every connection", self.name)
        finally:
            for c in list(self._conns.values()):
                self._close(c)
            try:
                self._sel.unregister(self._listener)
            except (KeyError, ValueError):
                pass
            self._listener.close()

    def _stop_step(self) -> bool:
        """One step of shutting down; False once every connection is gone (or time is up)."""
        if self._listener.fileno() >= 0:
            try:
                self._sel.unregister(self._listener)
            except (KeyError, ValueError):
                pass
            self._listener.close()
        for c in list(self._conns.values()):
            if c.state not in (_WORK, _WRITE):
                self._close(c)
        return bool(self._conns) and time.monotonic() < self._stop_deadline

    def _accept(self) -> None:
        for _ in range(64):  # bounded per tick, so reads and writes keep their turn under a connect flood
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: free one (oldest idle or slow connection) for the next try, and
                    # stop watching the listener for a moment rather than spin on it.
                    self.stats["accept_failed"] += 1
                    if time.monotonic() - self._accept_failed_logged > 60:
                        log.warning("%s: cannot accept connections: %s (raise the open-files limit or lower "
                                    "--web.max-connections)", self.name, exc.strerror)
                        self._accept_failed_logged = time.monotonic()
                    self._evict()
                    self._sel.unregister(self._listener)
                    self._accept_paused_until = time.monotonic() + 0.1
                    return
                continue  # ECONNABORTED and the like: the client gave up
            if self._stopping:
                sock.close()
                continue
            if len(self._conns) >= self.max_connections and not self._evict():
                self.stats["refused"] += 1
                if not self._refused_logged:
                    log.warning("%s: %d connections busy with requests, refusing new ones until some finish",
                                self.name, self.max_connections)
                    self._refused_logged = True
                sock.close()
                continue
            self._open(sock, addr)

    def _evict(self) -> bool:
        """Close the connection that has been idle, or sending its request, the longest.

        Oldest first, whatever it is doing, so the connection just accepted (a scraper's, say) is the last
        to go. Failing that, the answer that has waited longest (over ``_STALLED_WRITE_S``) for its client
        to read it. Requests being handled are never cut."""
        victim: _Conn | None = None
        writer: _Conn | None = None
        for c in self._conns.values():
            if c.state in (_IDLE, _HEAD, _BODY, _HANDSHAKE, _DRAIN) and (victim is None or c.since < victim.since):
                victim = c
            elif c.state == _WRITE and (writer is None or c.since < writer.since):
                writer = c
        if victim is None and writer is not None and time.monotonic() - writer.since > _STALLED_WRITE_S:
            victim = writer  # every other slot is busy: a client not reading its answer goes first
        if victim is None:
            return False
        if not self.stats["evicted"]:
            log.warning("%s: %d connections open; closing the oldest idle or slow ones to take new ones "
                        "(see --web.max-connections)", self.name, self.max_connections)
        self.stats["evicted"] += 1
        self._close(victim)
        return True

    def _open(self, sock: socket.socket, addr: tuple[Any, ...]) -> None:
        now = time.monotonic()
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        conn = _Conn(sock, addr, now)
        ctx = None
        try:
            ctx = self._web_config.ssl_context()
        except Exception as exc:  # noqa: BLE001 - a TLS set-up error must not stop the front
            log.error("%s: no TLS context, closing connection: %s", self.name, exc)
            sock.close()
            return
        if ctx is not None:
            conn.sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn.state = _HANDSHAKE
            conn.deadline = now + self.handshake_timeout
        else:
            # A fresh connection must start its request within the head timeout.
            conn.deadline = now + self.head_timeout
        self._conns[conn.sock.fileno()] = conn
        self._want(conn, selectors.EVENT_READ)
        if ctx is not None:
            self._on_event(conn, 0)

    def _want(self, conn: _Conn, events: int) -> None:
        if events == conn.events:
            return
        if conn.events == 0:
            self._sel.register(conn.sock, events, conn)
        elif events == 0:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _close(self, conn: _Conn) -> None:
        if conn.state == _CLOSED:
            return
        if conn.events:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            conn.events = 0
        self._conns.pop(conn.sock.fileno(), None)
        self._release(conn)
        self._out_pending -= len(conn.out)
        conn.out = memoryview(b"")
        conn.state = _CLOSED
        try:
            conn.sock.close()
        except OSError:
            pass

    def _release(self, conn: _Conn) -> None:
        self._buffered -= conn.reserved
        conn.reserved = 0

    def _expire(self) -> None:
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until and not self._stopping:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        for c in list(self._conns.values()):
            if c.state in (_WORK, _CLOSED) or now < c.deadline:
                continue
            if c.state in (_HEAD, _BODY):
                self.stats["timeout"] += 1
                log.debug("%s: %s: request not complete within its deadline", self.name, c.addr[0])
                self._fault(c, _ClientFault(408, "request not received in time", "timeout"))
            else:
                if c.state == _WRITE:
                    self.stats["write_timeout"] += 1
                self._close(c)

    def _on_event(self, conn: _Conn, events: int) -> None:
        try:
            if conn.state == _HANDSHAKE:
                self._handshake(conn)
            elif conn.state == _WRITE:
                self._flush(conn)
            elif conn.state == _DRAIN:
                data = conn.sock.recv(_RECV)
                conn.drained += len(data)
                if not data or conn.drained > _DRAIN_BYTES:
                    self._close(conn)
            elif conn.state in (_IDLE, _HEAD, _BODY):
                if conn.buf and not events:
                    self._parse(conn)
                else:
                    self._read(conn)
        except _ClientFault as fault:
            self._fault(conn, fault)
        except (OSError, ssl.SSLError) as exc:
            log.debug("%s: connection from %s ended: %s", self.name, conn.addr[0], exc)
            self._close(conn)

    def _handshake(self, conn: _Conn) -> None:
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._want(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
            return
        except (OSError, ssl.SSLError) as exc:
            log.debug("%s: TLS handshake with %s failed: %s", self.name, conn.addr[0], exc)
            self._close(conn)
            return
        tls = self._web_config.tls
        if tls is not None and not tls.client_san_allowed(sock.getpeercert()):
            log.debug("%s: %s: client certificate has none of client_allowed_sans", self.name, conn.addr[0])
            self._close(conn)
            return
        conn.state = _IDLE
        conn.since = time.monotonic()
        conn.deadline = conn.since + self.head_timeout
        self._want(conn, selectors.EVENT_READ)
        if sock.pending():
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        sock = conn.sock
        eof = False
        while True:
            try:
                data = sock.recv(_RECV)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            if not data:
                eof = True
                break
            conn.buf += data
            if len(conn.buf) > _MAX_HEAD + _RECV or conn.state == _BODY or not isinstance(sock, ssl.SSLSocket):
                break  # parse what is there before reading more (keeps one connection's memory bounded)
            if not sock.pending():
                break
        self._parse(conn)
        if eof and conn.state != _CLOSED:
            if conn.state in (_HEAD, _BODY):
                if conn.state == _BODY:
                    raise _ClientFault(400, "request body is shorter than its Content-Length", "bad_request")
                raise _ClientFault(400, "connection closed in the middle of the request head", "bad_request")
            if conn.state == _IDLE:
                self._close(conn)

    def _parse(self, conn: _Conn) -> None:
        """Advance the request on ``conn`` with what its buffer holds; hand it on once complete."""
        now = time.monotonic()
        if conn.state == _IDLE:
            # RFC 9112 2.2: ignore empty lines before a request line.
            while conn.buf[:2] == b"\r\n" or conn.buf[:1] == b"\n":
                del conn.buf[: 2 if conn.buf[:1] == b"\r" else 1]
            if not conn.buf:
                return
            conn.state = _HEAD
            conn.since = now
            conn.request_deadline = now + self.request_timeout
            conn.deadline = now + self.head_timeout
        if conn.state == _HEAD:
            m = _HEAD_END.search(conn.buf, 0, _MAX_HEAD + 4)
            if m is None:
                first = conn.buf.find(b"\n", 0, _MAX_REQUEST_LINE + 2)
                if first < 0 and len(conn.buf) > _MAX_REQUEST_LINE:
                    raise _ClientFault(414, "request line too long", "too_large")
                if first >= 0 and conn.buf[:first].rstrip(b"\r").count(b" ") == 1:
                    # HTTP/0.9 has no headers to wait for: refuse now rather than at the deadline.
                    raise _ClientFault(400, "HTTP/0.9 requests are not supported (send HTTP/1.1)", "bad_request")
                if len(conn.buf) > _MAX_HEAD:
                    raise _ClientFault(431, "request header fields too large", "too_large")
                return
            head = bytes(conn.buf[: m.start()])
            del conn.buf[: m.end()]
            self._parse_head(conn, head)
            conn.state = _BODY
            conn.deadline = conn.request_deadline
        if conn.state == _BODY:
            if conn.chunked:
                if not self._read_chunked(conn):
                    return
            elif conn.length:
                need = conn.length - len(conn.body)
                take = conn.buf[:need]
                conn.body += take
                del conn.buf[: len(take)]
                if len(conn.body) < conn.length:
                    return
            self._dispatch(conn)

    def _parse_head(self, conn: _Conn, head: bytes) -> None:
        lines = head.split(b"\n")
        line = lines[0].removesuffix(b"\r")
        if len(line) > _MAX_REQUEST_LINE:
            raise _ClientFault(414, "request line too long", "too_large")
        parts = line.split(b" ")
        if len(parts) != 3:
            if len(parts) == 2:
                raise _ClientFault(400, "HTTP/0.9 requests are not supported (send HTTP/1.1)", "bad_request")
            raise _ClientFault(400, "malformed request line", "bad_request")
        method, target, version = parts
        vm = _VERSION.fullmatch(version)
        if vm is None:
            raise _ClientFault(400, "malformed HTTP version in the request line", "bad_request")
        if (vm.group(1), vm.group(2)) not in ((b"1", b"0"), (b"1", b"1")):
            raise _ClientFault(505, "only HTTP/1.0 and HTTP/1.1 are supported", "bad_request")
        if not _TOKEN.fullmatch(method):
            raise _ClientFault(400, "malformed method in the request line", "bad_request")
        if not target or any(b <= 0x20 or b == 0x7F for b in target):
            raise _ClientFault(400, "malformed request target", "bad_request")
        conn.method = method.decode("ascii")
        conn.target = target.decode("latin-1")
        conn.version = (1, int(vm.group(2)))
        items: list[tuple[str, str]] = []
        for raw in lines[1:]:
            raw = raw.removesuffix(b"\r")
            if raw[:1] in (b" ", b"\t"):
                raise _ClientFault(400, "obsolete header line folding is not supported", "bad_request")
            name, sep, value = raw.partition(b":")
            if not sep or not _TOKEN.fullmatch(name):
                raise _ClientFault(400, "malformed header line", "bad_request")
            items.append((name.decode("ascii"), value.strip(b" \t").decode("latin-1")))
        headers = Headers(items)
        conn.headers = headers
        connection = {t.strip().lower() for t in ",".join(headers.get_all("Connection")).split(",")}
        conn.keep_alive = "close" not in connection if conn.version == (1, 1) else "keep-alive" in connection
        te = headers.get_all("Transfer-Encoding")
        cl = headers.get_all("Content-Length")
        if te:
            if cl:
                raise _ClientFault(400, "both Transfer-Encoding and Content-Length are set", "bad_request")
            if len(te) > 1 or te[0].strip().lower() != "chunked":
                raise _ClientFault(501, f"Transfer-Encoding {', '.join(te)!r} is not supported "
                                        "(use chunked or Content-Length)", "bad_request")
            if conn.version == (1, 0):
                raise _ClientFault(400, "chunked Transfer-Encoding needs HTTP/1.1", "bad_request")
            conn.chunked = True
        elif cl:
            if len(cl) > 1:
                raise _ClientFault(400, "more than one Content-Length header", "bad_request")
            raw_cl = cl[0].encode("latin-1")
            if not _DIGITS.fullmatch(raw_cl):
                raise _ClientFault(400, f"invalid Content-Length {cl[0]!r} (ASCII digits only)", "bad_request")
            conn.length = int(raw_cl)
            if conn.length > self.max_body_bytes:
                # Not read: the route still runs (to answer 413 in its own format, after its own checks)
                # and the connection closes after the answer.
                self.stats["too_large"] += 1
                conn.refused_length, conn.length, conn.keep_alive = conn.length, 0, False
                return
            self._reserve(conn, conn.length)
        if (conn.length or conn.chunked) and conn.version == (1, 1) and \
                headers.get("Expect", "").strip().lower() == "100-continue":
            try:
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            except (OSError, ssl.SSLError):
                pass  # the client sends its body after a pause anyway

    def _reserve(self, conn: _Conn, n: int) -> None:
        if self._buffered + n > self.max_buffered_bytes:
            self.stats["busy"] += 1
            raise _ClientFault(503, "too many request bodies in flight, retry later", "busy")
        self._buffered += n
        conn.reserved += n

    def _read_chunked(self, conn: _Conn) -> bool:
        """Decode what the buffer holds of a chunked body; True once the body and trailers are in."""
        buf = conn.buf
        while True:
            if conn.chunk_state == "size":
                nl = buf.find(b"\n", 0, _MAX_CHUNK_LINE)
                if nl < 0:
                    if len(buf) >= _MAX_CHUNK_LINE:
                        raise _ClientFault(400, "chunk size line too long", "bad_request")
                    return False
                line = bytes(buf[:nl]).removesuffix(b"\r")
                del buf[: nl + 1]
                size_text = line.split(b";", 1)[0].strip(b" \t")
                if not _HEX.fullmatch(size_text):
                    raise _ClientFault(400, "malformed chunk size in chunked body (hex digits only)",
                                       "bad_request")
                size = int(size_text, 16)
                if size == 0:
                    conn.chunk_state = "trailer"
                    continue
                if len(conn.body) + size > self.max_body_bytes:
                    # As with a declared length over the limit: the route answers 413, then we close.
                    self.stats["too_large"] += 1
                    conn.refused_length = len(conn.body) + size
                    conn.body = bytearray()
                    conn.keep_alive = False
                    self._release(conn)
                    return True
                self._reserve(conn, size)
                conn.chunk_left = size
                conn.chunk_state = "data"
            elif conn.chunk_state == "data":
                take = buf[: conn.chunk_left]
                conn.body += take
                del buf[: len(take)]
                conn.chunk_left -= len(take)
                if conn.chunk_left:
                    return False
                conn.chunk_state = "crlf"
            elif conn.chunk_state == "crlf":
                if len(buf) < 2 and buf[:1] != b"\n":
                    return False
                if buf[:2] == b"\r\n":
                    del buf[:2]
                elif buf[:1] == b"\n":
                    del buf[:1]
                else:
                    raise _ClientFault(400, "chunk data not followed by CRLF", "bad_request")
                conn.chunk_state = "size"
            else:  # trailer section: bounded, ignored
                nl = buf.find(b"\n")
                if nl < 0:
                    if conn.trailer_bytes + len(buf) > _MAX_TRAILERS:
                        raise _ClientFault(431, "chunked trailer section too large", "too_large")
                    return False
                conn.trailer_bytes += nl + 1
                if conn.trailer_bytes > _MAX_TRAILERS:
                    raise _ClientFault(431, "chunked trailer section too large", "too_large")
                line = bytes(buf[:nl]).removesuffix(b"\r")
                del buf[: nl + 1]
                if not line:
                    return True

    def _dispatch(self, conn: _Conn) -> None:
        assert conn.headers is not None
        target, _, query = conn.target.partition("?")
        if target.startswith(("http://", "https://")):  # absolute form (RFC 9112 3.2.2)
            target = "/" + target.split("/", 3)[3] if target.count("/") >= 3 else "/"
        req = Request(conn.method.upper(), target, query.partition("#")[0], conn.headers, conn.addr,
                      bytes(conn.body), refused_length=conn.refused_length, limit=self.max_body_bytes)
        conn.body = bytearray()
        wc = self._web_config
        conn.auth_job = wc.auth_enabled and wc.cached_basic_auth(req.headers.get("Authorization")) is None
        if conn.auth_job:
            if self._auth_pending >= _AUTH_QUEUE:
                self.stats["auth_busy"] += 1
                conn.auth_job = False
                data = self._serialise(Response.text(429, "Too many password checks in progress, retry later\n",
                                                     {"Retry-After": "1"}), close=not conn.keep_alive,
                                       head=req.method == "HEAD")
                self._release(conn)
                conn.state = _WORK
                self._start_write(conn, data, not conn.keep_alive)
                return
            self._auth_pending += 1
        conn.state = _WORK
        if not conn.auth_job and self._inline is not None and self._inline(req):
            try:
                response = self._handle(req)
                close = not conn.keep_alive or self._stopping
                data = self._serialise(response, close=close, head=req.method == "HEAD")
            except Exception:  # noqa: BLE001 - as in a worker: the server survives anything
                log.exception("%s: %s %s failed", self.name, req.method, req.path)
                data = self._serialise(Response.text(500, "Internal Server Error\n"), close=True, head=False)
                close = True
            self._release(conn)
            self._start_write(conn, data, close)
            return
        self._want(conn, 0)
        (self._auth_jobs if conn.auth_job else self._jobs).put((conn, req))

    def _fault(self, conn: _Conn, fault: _ClientFault) -> None:
        if conn.state in (_CLOSED, _WORK):
            return
        if fault.reason != "timeout":
            self.stats[fault.reason] += 1
        log.debug("%s: %s: %d %s", self.name, conn.addr[0], fault.status, fault)
        head_only = conn.method == "HEAD"
        data = self._serialise(Response.text(fault.status, fault.message + "\n"), close=True, head=head_only)
        self._release(conn)
        self._start_write(conn, data, close=True)

    def _start_write(self, conn: _Conn, data: bytes, close: bool) -> None:
        self._out_pending += len(data)
        if self._out_pending > _MAX_PENDING_OUT:
            self._cut_stalled_writers(conn)
        conn.out = memoryview(data)
        conn.close_after = close
        conn.state = _WRITE
        conn.since = time.monotonic()
        conn.deadline = conn.since + self.request_timeout
        # Write at once; wait for the socket to be writable only for what it did not take (a response
        # usually fits the send buffer: no epoll change for it).
        self._flush(conn)
        if conn.state == _WRITE and conn.out:
            self._want(conn, selectors.EVENT_WRITE)

    def _flush(self, conn: _Conn) -> None:
        sock = conn.sock
        while conn.out:
            try:
                n = sock.send(conn.out)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return
            except (OSError, ssl.SSLError) as exc:
                log.debug("%s: writing to %s failed: %s", self.name, conn.addr[0], exc)
                self._close(conn)
                return
            conn.out = conn.out[n:]
            self._out_pending -= n
        if conn.close_after or self._stopping:
            if isinstance(sock, ssl.SSLSocket) or self._stopping:
                self._close(conn)
                return
            # Lingering close: read and drop what the client is still sending for a moment, so that a
            # close with unread data (a reset) does not destroy the answer before the client reads it.
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                self._close(conn)
                return
            conn.state = _DRAIN
            conn.deadline = time.monotonic() + _DRAIN_S
            self._want(conn, selectors.EVENT_READ)
            return
        # Keep-alive: the next request may already be in the buffer.
        conn._reset()
        conn.state = _IDLE
        conn.since = time.monotonic()
        conn.deadline = conn.since + self.idle_timeout
        self._want(conn, selectors.EVENT_READ)
        if conn.buf or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            self._on_event(conn, selectors.EVENT_READ)  # a pipelined request, already received

    def _cut_stalled_writers(self, keep: _Conn) -> None:
        """Too many response bytes wait for clients that do not read: close the writers that started
        the longest ago until under the cap (a scraper reading its answer finishes in milliseconds)."""
        writers = sorted((c for c in self._conns.values() if c.state == _WRITE and c is not keep),
                         key=lambda c: c.since)
        for c in writers:
            if self._out_pending <= _MAX_PENDING_OUT:
                break
            self.stats["write_cut"] += 1
            self._close(c)

    def _drain_done(self) -> None:
        while self._done:
            conn, data, close = self._done.popleft()
            if conn.auth_job:
                conn.auth_job = False
                self._auth_pending -= 1
            if conn.state == _CLOSED:
                continue
            self._release(conn)
            self._start_write(conn, data, close)

    # -- the workers

    def _work(self, jobs: queue.SimpleQueue[tuple[_Conn, Request] | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            conn, req = job
            try:
                response = self._handle(req)
                close = not conn.keep_alive or self._stopping  # a response finished during shutdown closes
                data = self._serialise(response, close=close, head=req.method == "HEAD")
            except Exception:  # noqa: BLE001 - the last guard: a worker must survive anything
                log.exception("%s: %s %s failed", self.name, req.method, req.path)
                data = self._serialise(Response.text(500, "Internal Server Error\n"), close=True, head=False)
                close = True
            self._done.append((conn, data, close))
            self._wake()

    def _handle(self, req: Request) -> Response:
        try:
            if self._limiter is not None and not self._limiter.allow():
                return Response.text(429, "Too Many Requests\n")
            wc = self._web_config
            if wc.auth_enabled:
                try:
                    ok = wc.check_basic_auth(req.headers.get("Authorization"))
                except AuthBusy:
                    self.stats["auth_busy"] += 1
                    return Response.text(429, "Too many password checks in progress, retry later\n",
                                         {"Retry-After": "1"})
                if not ok:
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

    def _serialise(self, response: Response, *, close: bool, head: bool) -> bytes:
        lines = [_status_line(response.status), _SERVER_LINE, _date_line()]
        sent = set()
        for k, v in response.headers.items():
            lines.append(f"{k}: {v}")
            sent.add(k.lower())
        for k, v in self._extra_headers:
            if k.lower() not in sent:
                lines.append(f"{k}: {v}")
        body = response.body
        no_body = response.status in (204, 304) or response.status < 200
        if not no_body and "content-length" not in sent:
            lines.append(f"Content-Length: {len(body)}")
        if close:
            lines.append("Connection: close")
        out = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if not head and not no_body:
            out += body
        return out


_SERVER_LINE = f"Server: {PROJECT_NAME}/{__version__}"
_STATUS_LINES: dict[int, str] = {}
_date_cache: tuple[int, str] = (-1, "")


def _status_line(status: int) -> str:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = ""
        line = f"HTTP/1.1 {status} {reason}"
        if len(_STATUS_LINES) < 1000:
            _STATUS_LINES[status] = line
    return line


def _date_line() -> str:
    """The Date header, formatted once a second."""
    global _date_cache
    now = int(time.time())
    cached = _date_cache
    if cached[0] != now:
        cached = _date_cache = (now, "Date: " + email.utils.formatdate(now, usegmt=True))
    return cached[1]


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
# binding


def _connection_cap() -> int:
    """Connections one port may hold within the open-files limit: the soft limit is raised to the hard one
    first (as Go's runtime does), then a third of it is left to each of the two ports, the rest to the
    process (NVML, files, the kubelet socket)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
    except (ValueError, OSError):
        return 1 << 20
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(8, (soft - 64) // 3)


def client_url(address: tuple[str, int], scheme: str = "http") -> str:
    """The URL a client on this host uses for a server bound to ``address`` (a wildcard address is
    reached through loopback)."""
    host, port = address[0], address[1]
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def listen_text(host: str, port: int, url: str, dual_stack: bool) -> str:
    """``:9863 on all interfaces (IPv4 and IPv6; http://[::1]:9863 from this host)`` for a wildcard address,
    else the URL: a server bound to ``::`` does not listen on ``[::1]`` only, as its client URL would say."""
    if host in ("0.0.0.0", "::", ""):
        family = "IPv4 only" if host == "0.0.0.0" else "IPv4 and IPv6" if dual_stack else "IPv6 only"
        return f":{port} on all interfaces ({family}; {url} from this host)"
    return url


def _dual_stack(sock: socket.socket) -> bool:
    if sock.family != socket.AF_INET6:
        return False
    try:
        return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    except OSError:
        return False


def _bind(address: tuple[str, int]) -> socket.socket:
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
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if dualstack:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(sockaddr)
            sock.listen(1024)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
            if host == "" and exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                continue  # no IPv6 here: fall back to IPv4
            break
    assert last is not None
    hint = " (another process is using this port; choose another listen address)" \
        if last.errno == errno.EADDRINUSE else ""
    raise ConfigError(f"cannot listen on {shown}: {last.strerror or last}{hint}") from None

"""The HTTP server: one selector thread per port reads requests, a small fixed pool of worker threads runs
the handlers. Its public use is described in the ``gpu_energy_exporter.http`` package docstring.

Why this shape (and not a thread per connection): a client that trickles its request one byte at a time,
or opens a connection and sends nothing, must cost a few hundred bytes and a file descriptor, never a
thread, and must never stop ``/metrics`` or the health endpoints from being answered. So:

- The selector thread accepts, performs TLS handshakes, reads request heads and bodies and writes
  responses, all non-blocking (``connection``: each connection's state machine, its deadlines, the
  port's bounds on connections and buffered bytes). Only a *complete* request (head and body, within
  limits) reaches a worker, so a slow client never holds a worker. Workers return the whole response as
  bytes; the selector thread writes it out, so a client that does not read its response never holds a
  worker either. A server may name requests to handle on the selector thread itself (``inline``: the OTLP
  receiver's small pushes, cheaper to store than to hand to a worker and back).
- At most ``max_connections`` connections are open per port; at the cap a new one evicts the oldest idle
  or slow one, so a flood of slow, idle or non-reading connections cannot lock a scraper out.
- Parsing is strict (``parsing``); client faults get 400/408/413/414/431/501/505 and a debug log line,
  never a traceback.
- Each request passes the rate limit, then basic auth (checks that need bcrypt on threads of their own,
  429 when too many wait), then the route table.

This module never samples anything and never blocks its selector thread on a client.
"""

from __future__ import annotations

import collections
import errno
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.core.metrics import add, define
from gpu_energy_exporter.http import listen
from gpu_energy_exporter.http.basicauth import AuthBusy
from gpu_energy_exporter.http.connection import CLOSED, WORK, Conn, Connections
from gpu_energy_exporter.http.listen import bind, client_url, connection_cap, dual_stack, listen_text
from gpu_energy_exporter.http.messages import PROJECT_NAME, Handler, HTTPError, Request, Response, Routes, serialise
from gpu_energy_exporter.http.parsing import split_target
from gpu_energy_exporter.http.ratelimit import TokenBucket
from gpu_energy_exporter.http.splice import Splice
from gpu_energy_exporter.http.webconfig import WebConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_REQUEST_TIMEOUT = 30.0
DEFAULT_HEAD_TIMEOUT = 10.0
DEFAULT_IDLE_TIMEOUT = 60.0
DEFAULT_MAX_BODY_BYTES = 64 * 1024
DEFAULT_WORKERS = 4
AUTH_WORKERS = 2
AUTH_QUEUE = 8  # requests waiting for a bcrypt check; beyond it, 429 at once
_TICK = 0.2  # while shutting down: how often the draining connections are checked
_IDLE_TICK = 30.0  # with no deadline: every event (a connection, a worker's answer, a shutdown) wakes it anyway
_MIN_TICK = 0.01  # a deadline already past is enforced at the next pass: never a busy loop

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


class HTTPServer:
    """An HTTP/1.1 server for a fixed route table. See this module's and the ``http`` package's docstrings."""

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
        unix_path: str | None = None,
        splice: Splice | None = None,
    ) -> None:
        if max_connections < 1 or workers < 1:
            raise ConfigError(f"{name}: max connections and workers must be at least 1")
        # What the start-up line says about authentication when not the web config's basic auth (e.g. the
        # OTLP receiver's bearer token).
        self._auth_text = auth
        if request_timeout <= 0:
            raise ConfigError(f"{name}: the request timeout must be positive")
        self.name = name
        fd_cap = connection_cap()
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
        self._limiter = TokenBucket(self._web_config.rate_limit) if self._web_config.rate_limit else None
        self._extra_headers = self._web_config.headers
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.head_timeout = min(head_timeout, request_timeout)
        self.idle_timeout = idle_timeout
        self.handshake_timeout = min(handshake_timeout or self.head_timeout, request_timeout)
        self.max_body_bytes = max_body_bytes
        self.max_buffered_bytes = max(max_buffered_bytes or 4 * max_body_bytes, max_body_bytes)
        self._n_workers = workers
        # Requests for which ``inline(req)`` is true are handled on the selector thread, without the hand-off
        # to a worker and back (a queue, a wake-up, two thread switches: more CPU than a small OTLP push
        # itself). Only for cheap, CPU-bound handlers on small bodies (the OTLP receiver's small pushes):
        # a request handled inline holds up the port's other connections while it runs.
        self._inline = inline
        #: counters since start, by event: "evicted", "refused", "timeout", "bad_request", ...
        self.stats: collections.Counter[str] = collections.Counter(
            {k: 0 for k in (*CONNECTION_EVENTS, *REQUEST_REJECTIONS)})
        self._accept_paused_until = 0.0
        self._accept_failed_logged = -1e9
        self._lock = threading.Lock()
        self._closed = False
        self._stop_deadline = 0.0
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue[tuple[Conn, Request] | None] = queue.SimpleQueue()
        # Requests whose credentials need a bcrypt check wait here, for their own two workers, so that a
        # flood of password guesses never delays a request that needs none (cached or no credentials).
        self._auth_jobs: queue.SimpleQueue[tuple[Conn, Request] | None] = queue.SimpleQueue()
        self._auth_pending = 0
        self._done: collections.deque[tuple[Conn, bytes | list[bytes], bool]] = collections.deque()
        self._refused_logged = False
        # first: a bind error leaves nothing open behind (``unix_path``: that Unix socket instead of ``address``)
        self.unix_path = unix_path
        self._listener = listen.bind_unix(unix_path) if unix_path else bind(address)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._front = Connections(
            name, self._sel, self._web_config, self.stats, self._dispatch,
            max_connections=max_connections, request_timeout=request_timeout, head_timeout=self.head_timeout,
            idle_timeout=idle_timeout, handshake_timeout=self.handshake_timeout, max_body_bytes=max_body_bytes,
            max_buffered_bytes=self.max_buffered_bytes,
        )
        self._front.splice = self._splice = splice  # HTTP/2 on the OTLP Unix socket: to gRPC (``http.splice``)

    # -- public

    @property
    def server_address(self) -> tuple[str, int]:
        if self.unix_path:  # (path, 0) for a Unix-domain socket
            return self.unix_path, 0
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        if self.unix_path:
            return "unix:" + self.unix_path
        return client_url(self.server_address, "https" if self._web_config.tls_enabled else "http")

    @property
    def listen_text(self) -> str:
        """Where the socket listens, as a person reads it (see ``listen_text``)."""
        if self.unix_path:
            return f"the Unix socket {self.unix_path}"
        host, port = self.server_address
        return listen_text(host, port, self.url, dual_stack(self._listener))

    def open_connections(self) -> int:
        return len(self._front.conns)

    def collect(self) -> list[Any]:
        """This server's self-metrics (``HTTP_*`` families), for the exporter's /metrics."""
        closed, rejected, open_ = (HTTP_CONNECTIONS_CLOSED.family(), HTTP_REQUESTS_REJECTED.family(),
                                   HTTP_OPEN_CONNECTIONS.family())
        stats = dict(self.stats)
        for reason in CONNECTION_EVENTS:
            add(closed, [self.name, reason], float(stats.get(reason, 0)))
        for reason in REQUEST_REJECTIONS:
            add(rejected, [self.name, reason], float(stats.get(reason, 0)))
        add(open_, [self.name], float(len(self._front.conns)))
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
                for i in range(AUTH_WORKERS):
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
            self._front.stopping = True
        if thread is None:
            listen.close_listener(self._listener, self.unix_path)
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
                if self._front.stopping and not self._stop_step():
                    return
                tick = self._tick()
                if self._front.ready:
                    tick = 0.0
                accept = False
                for key, events in self._sel.select(tick):
                    if key.fileobj is self._listener:
                        accept = True
                    elif key.fileobj is self._wake_r:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    elif self._splice is not None and self._splice.owns(key.data):
                        self._splice.on_event(key.data, events)
                    else:
                        self._front.on_event(key.data, events)
                # New connections last: what the open ones already sent is read first. Accepting first let
                # a connect flood at the cap evict a connection (a legitimate push, its request waiting
                # unread in the kernel) before its turn came, and closing it with unread data reset it.
                if accept:
                    self._accept()
                self._drain_done()
                self._front.serve_ready()
                self._resume_accept()
                self._front.expire(time.monotonic())
        except Exception:
            log.exception("%s: the HTTP front failed; closing every connection", self.name)
        finally:
            self._front.close_all()
            if self._splice is not None:
                self._splice.close_all()
            try:
                self._sel.unregister(self._listener)
            except (KeyError, ValueError):
                pass
            listen.close_listener(self._listener, self.unix_path)

    def _tick(self) -> float:
        """How long the selector may sleep: until the earliest connection deadline or the end of an accept
        pause, at most ``_IDLE_TICK`` and at least ``_MIN_TICK``; ``_TICK`` while shutting down. A request, a
        worker's answer (the wake socket), a new connection or a shutdown wake it at once, so only deadlines
        need a timer: an idle keep-alive connection (Prometheus between scrapes) no longer wakes it five times
        a second."""
        if self._front.stopping:
            return _TICK
        now = time.monotonic()
        until = now + _IDLE_TICK
        for c in self._front.conns.values():  # the deadlines Connections.expire enforces
            if c.state not in (WORK, CLOSED) and c.deadline < until:
                until = c.deadline
        if self._accept_paused_until:
            until = min(until, self._accept_paused_until)
        return max(_MIN_TICK, until - now)

    def _resume_accept(self) -> None:
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until and not self._front.stopping:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, None)

    def _stop_step(self) -> bool:
        """One step of shutting down; False once every connection is gone (or time is up)."""
        if self._listener.fileno() >= 0:
            try:
                self._sel.unregister(self._listener)
            except (KeyError, ValueError):
                pass
            listen.close_listener(self._listener, self.unix_path)
        self._front.close_all(keep_busy=True)
        return bool(self._front.conns) and time.monotonic() < self._stop_deadline

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
                    self._front.evict()
                    self._sel.unregister(self._listener)
                    self._accept_paused_until = time.monotonic() + 0.1
                    return
                continue  # ECONNABORTED and the like: the client gave up
            if self._front.stopping:
                sock.close()
                continue
            if len(self._front.conns) >= self.max_connections and not self._front.evict():
                self.stats["refused"] += 1
                if not self._refused_logged:
                    log.warning("%s: %d connections busy with requests, refusing new ones until some finish",
                                self.name, self.max_connections)
                    self._refused_logged = True
                sock.close()
                continue
            self._front.add(sock, addr)

    def _dispatch(self, conn: Conn) -> None:
        assert conn.headers is not None
        target, query = split_target(conn.target)
        req = Request(conn.method.upper(), target, query, conn.headers, conn.addr,
                      bytes(conn.body), refused_length=conn.refused_length, limit=self.max_body_bytes,
                      connection=conn.info)
        conn.body = bytearray()
        wc = self._web_config
        conn.auth_job = wc.auth_enabled and wc.cached_basic_auth(req.headers.get("Authorization")) is None
        if conn.auth_job:
            if self._auth_pending >= AUTH_QUEUE:
                self.stats["auth_busy"] += 1
                conn.auth_job = False
                data = self._serialise(Response.text(429, "Too many password checks in progress, retry later\n",
                                                     {"Retry-After": "1"}), close=not conn.keep_alive,
                                       head=req.method == "HEAD")
                self._front.release(conn)
                conn.state = WORK
                self._front.start_write(conn, data, not conn.keep_alive)
                return
            self._auth_pending += 1
        conn.state = WORK
        if not conn.auth_job and self._inline is not None and self._inline(req):
            try:
                response = self._handle(req)
                close = not conn.keep_alive or self._front.stopping
                data = self._serialise(response, close=close, head=req.method == "HEAD")
            except Exception:  # noqa: BLE001 - as in a worker: the server survives anything
                log.exception("%s: %s %s failed", self.name, req.method, req.path)
                data = self._serialise(Response.text(500, "Internal Server Error\n"), close=True, head=False)
                close = True
            self._front.release(conn)
            self._front.start_write(conn, data, close)
            return
        self._front.want(conn, 0)
        (self._auth_jobs if conn.auth_job else self._jobs).put((conn, req))

    def _drain_done(self) -> None:
        while self._done:
            conn, data, close = self._done.popleft()
            if conn.auth_job:
                conn.auth_job = False
                self._auth_pending -= 1
            if conn.state == CLOSED:
                continue
            self._front.release(conn)
            self._front.start_write(conn, data, close)

    # -- the workers

    def _work(self, jobs: queue.SimpleQueue[tuple[Conn, Request] | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            conn, req = job
            try:
                response = self._handle(req)
                close = not conn.keep_alive or self._front.stopping  # a response finished during shutdown closes
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

    def _serialise(self, response: Response, *, close: bool, head: bool) -> bytes | list[bytes]:
        return serialise(response, self._extra_headers, close=close, head=head)

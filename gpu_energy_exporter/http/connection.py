"""One port's open connections, driven by its selector thread: each connection's state machine (TLS
handshake, idle, request head, body, handed to a handler, writing, draining) with its deadlines, and the
port's bounds on connections and buffered bytes.

- Every request has a deadline for its head (``head_timeout``) and one for the whole request, body
  included (``request_timeout``), counted from its first byte, not per ``recv``. Past it the client gets
  408 and the connection is closed. A keep-alive connection may stay idle for ``idle_timeout``.
- At the connection cap, ``evict`` closes the connection that has been idle, or sending its request, the
  longest (oldest first, so the connection just accepted goes last; one connected or idle for under a
  second only when nothing else is idle or slow); failing that, the one whose response has waited longest
  (over a second) for its client to read it. Requests being handled are never cut.
- Bodies are buffered up to ``max_body_bytes`` per request and ``max_buffered_bytes`` for the port (503
  beyond); response bytes waiting for slow readers up to ``MAX_PENDING_OUT`` (the writer stalled the
  longest is cut beyond).

Everything here runs on the selector thread and never blocks: sockets are non-blocking, a complete
request is handed to ``dispatch`` (the server's), and a response arrives as bytes through
``start_write``. This module never runs a handler and never interprets request syntax itself
(``parsing`` does).
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

from gpu_energy_exporter.http.lazytls import TLS, handshake
from gpu_energy_exporter.http.messages import Headers, Response, serialise
from gpu_energy_exporter.http.parsing import (
    MAX_HEAD,
    ChunkedReader,
    ClientFault,
    parse_head,
    skip_blank_lines,
    take_head,
)
from gpu_energy_exporter.http.peers import ConnectionInfo
from gpu_energy_exporter.http.webconfig import WebConfig

log = logging.getLogger(__name__)


HANDSHAKE, IDLE, HEAD, BODY, WORK, WRITE, DRAIN, CLOSED = range(8)

#: Response bytes waiting for slow readers, per port; beyond it the writer stalled the longest is cut.
MAX_PENDING_OUT = 64 << 20
#: At the connection cap with nothing idle or slow to close, a response still unwritten after this long
#: is cut to make room.
_STALLED_WRITE_S = 1.0
#: A connection accepted (or back to idle) less than this ago that has not started a request is evicted only
#: when nothing else can be: a client between its connect and its request is not slow yet.
_FRESH_IDLE_S = 1.0
_DRAIN_BYTES = 1 << 20
_DRAIN_S = 2.0
_RECV = 65536


class Conn:
    """One connection's state: its socket, what it has received, where its request stands, what is left
    to write."""

    __slots__ = (
        "sock", "addr", "state", "buf", "since", "deadline", "request_deadline", "out", "close_after",
        "method", "target", "version", "headers", "keep_alive", "length", "chunks", "body", "reserved",
        "events", "refused_length", "drained", "auth_job", "info",
    )

    def __init__(self, sock: socket.socket, addr: tuple[Any, ...], now: float) -> None:
        self.sock = sock
        self.addr = addr if isinstance(addr, tuple) and addr else ("unix", 0)  # a Unix peer's address is ""
        self.info = ConnectionInfo.accepted(sock, addr)
        self.state = IDLE
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
        self.reset()

    def reset(self) -> None:
        self.method = ""
        self.target = ""
        self.version = (1, 1)
        self.headers: Headers | None = None
        self.keep_alive = True
        self.length = 0
        self.chunks: ChunkedReader | None = None  # set for a chunked body
        self.body = bytearray()
        self.refused_length = 0  # a declared body over the limit: not read, the handler answers 413


class Connections:
    """The connections of one port (``conns``, by file descriptor) and their state machines. Used by the
    selector thread only; ``stopping`` is set by the server when it shuts down."""

    def __init__(
        self,
        name: str,
        sel: selectors.BaseSelector,
        web_config: WebConfig,
        stats: collections.Counter[str],
        dispatch: Callable[[Conn], None],
        *,
        max_connections: int,
        request_timeout: float,
        head_timeout: float,
        idle_timeout: float,
        handshake_timeout: float,
        max_body_bytes: int,
        max_buffered_bytes: int,
    ) -> None:
        self.name = name
        self._sel = sel
        self._web_config = web_config
        self._extra_headers = web_config.headers
        self.stats = stats
        self._dispatch = dispatch
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.head_timeout = head_timeout
        self.idle_timeout = idle_timeout
        self.handshake_timeout = handshake_timeout
        self.max_body_bytes = max_body_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.conns: dict[int, Conn] = {}
        self.splice: Any = None  # ``http.splice.Splice``: HTTP/2 connections go there; set by the server
        # Keep-alive connections whose next request is already received: the selector loop serves them
        # (``serve_ready``), never ``_flush`` itself, which would recurse once per pipelined request.
        self.ready: list[Conn] = []
        self.stopping = False
        self._buffered = 0
        self._out_pending = 0

    def close_all(self, keep_busy: bool = False) -> None:
        """Close every connection (with ``keep_busy``, all but those handling or writing a request)."""
        for c in list(self.conns.values()):
            if not keep_busy or c.state not in (WORK, WRITE):
                self.close(c)

    def evict(self) -> bool:
        """Close the connection idle, or sending its request, the longest: the one just accepted goes last,
        one idle for under ``_FRESH_IDLE_S`` only when nothing else is idle or slow (a flood of half-sent
        requests never pushes out a client about to send); failing that, the answer that has waited longest
        (over ``_STALLED_WRITE_S``) for its client to read it. Requests being handled are never cut."""
        now = time.monotonic()
        victim, best = None, (3, 0.0)
        for c in self.conns.values():  # (rank, since): slow, then fresh idle, then stalled writers; oldest first
            if c.state == IDLE and now - c.since < _FRESH_IDLE_S:
                key = (1, c.since)
            elif c.state in (IDLE, HEAD, BODY, HANDSHAKE, DRAIN):
                key = (0, c.since)
            elif c.state == WRITE and now - c.since > _STALLED_WRITE_S:
                key = (2, c.since)  # every other slot is busy: a client not reading its answer
            else:
                continue
            if key < best:
                victim, best = c, key
        if victim is None:
            return False
        if not self.stats["evicted"]:
            log.warning("%s: %d connections open; closing the oldest idle or slow ones to take new ones "
                        "(see --web.max-connections)", self.name, self.max_connections)
        self.stats["evicted"] += 1
        self.close(victim)
        return True

    def add(self, sock: socket.socket, addr: tuple[Any, ...]) -> None:
        """Take an accepted connection (TLS handshake first when configured)."""
        now = time.monotonic()
        conn = Conn(sock, addr, now)  # the socket made non-blocking, TCP_NODELAY (``ConnectionInfo.accepted``)
        ctx = None
        try:
            ctx = self._web_config.ssl_context()
        except Exception as exc:  # noqa: BLE001 - a TLS set-up error must not stop the front
            log.error("%s: no TLS context, closing connection: %s", self.name, exc)
            sock.close()
            return
        if ctx is not None:
            TLS.load()
            conn.sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn.state = HANDSHAKE
            conn.deadline = now + self.handshake_timeout
        else:
            # A fresh connection must start its request within the head timeout.
            conn.deadline = now + self.head_timeout
        self.conns[conn.sock.fileno()] = conn
        self.want(conn, selectors.EVENT_READ)
        if ctx is not None:
            self.on_event(conn, 0)

    def want(self, conn: Conn, events: int) -> None:
        if events == conn.events:
            return
        if conn.events == 0:
            self._sel.register(conn.sock, events, conn)
        elif events == 0:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def close(self, conn: Conn) -> None:
        if conn.state == CLOSED:
            return
        if conn.events:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            conn.events = 0
        self.conns.pop(conn.sock.fileno(), None)
        self.release(conn)
        self._out_pending -= len(conn.out)
        conn.out = memoryview(b"")
        conn.state = CLOSED
        try:
            conn.sock.close()
        except OSError:
            pass

    def release(self, conn: Conn) -> None:
        self._buffered -= conn.reserved
        conn.reserved = 0

    def expire(self, now: float) -> None:
        """Answer 408 to requests past their deadline; close idle, draining and unread connections past theirs."""
        for c in list(self.conns.values()):
            if c.state in (WORK, CLOSED) or now < c.deadline:
                continue
            if c.state in (HEAD, BODY):
                self.stats["timeout"] += 1
                log.debug("%s: %s: request not complete within its deadline", self.name, c.addr[0])
                self._fault(c, ClientFault(408, "request not received in time", "timeout"))
            else:
                if c.state == WRITE:
                    self.stats["write_timeout"] += 1
                self.close(c)

    def on_event(self, conn: Conn, events: int) -> None:
        try:
            if conn.state == HANDSHAKE:
                self._handshake(conn)
            elif conn.state == WRITE:
                self._flush(conn)
            elif conn.state == DRAIN:
                data = conn.sock.recv(_RECV)
                conn.drained += len(data)
                if not data or conn.drained > _DRAIN_BYTES:
                    self.close(conn)
            elif conn.state in (IDLE, HEAD, BODY):
                if conn.buf and not events:
                    self._parse(conn)
                else:
                    self._read(conn)
        except ClientFault as fault:
            self._fault(conn, fault)
        except OSError as exc:
            log.debug("%s: connection from %s ended: %s", self.name, conn.addr[0], exc)
            self.close(conn)
        except Exception:  # noqa: BLE001 - a bug met by one connection closes that connection, not the port
            log.exception("%s: connection from %s failed; closing it", self.name, conn.addr[0])
            self.close(conn)

    def serve_ready(self) -> None:
        """Serve the pipelined requests found since the last call, one per connection (the next ones wait
        their turn behind the other connections' events)."""
        ready, self.ready = self.ready, []
        for conn in ready:
            if conn.state == IDLE and self.conns.get(conn.sock.fileno()) is conn:
                self.on_event(conn, selectors.EVENT_READ)

    def _handshake(self, conn: Conn) -> None:
        sock = conn.sock
        try:
            wait = handshake(sock)
        except OSError as exc:
            log.debug("%s: TLS handshake with %s failed: %s", self.name, conn.addr[0], exc)
            self.close(conn)
            return
        if wait:
            self.want(conn, wait)
            return
        assert isinstance(sock, TLS.socket)
        tls = self._web_config.tls
        if tls is not None and not tls.client_san_allowed(sock.getpeercert()):
            log.debug("%s: %s: client certificate has none of client_allowed_sans", self.name, conn.addr[0])
            self.close(conn)
            return
        conn.state = IDLE
        conn.since = time.monotonic()
        conn.deadline = conn.since + self.head_timeout
        self.want(conn, selectors.EVENT_READ)
        if sock.pending():
            self._read(conn)

    def _read(self, conn: Conn) -> None:
        sock = conn.sock
        eof = False
        while True:
            try:
                data = sock.recv(_RECV)
            except TLS.would_block:
                break
            if not data:
                eof = True
                break
            conn.buf += data
            if len(conn.buf) > MAX_HEAD + _RECV or conn.state == BODY or not isinstance(sock, TLS.socket):
                break  # parse what is there before reading more (keeps one connection's memory bounded)
            if not sock.pending():
                break
        self._parse(conn)
        if eof and conn.state != CLOSED:
            if conn.state in (HEAD, BODY):
                if conn.state == BODY:
                    raise ClientFault(400, "request body is shorter than its Content-Length", "bad_request")
                raise ClientFault(400, "connection closed in the middle of the request head", "bad_request")
            if conn.state == IDLE:
                self.close(conn)

    def _parse(self, conn: Conn) -> None:
        """Advance the request on ``conn`` with what its buffer holds; hand it on once complete."""
        now = time.monotonic()
        if conn.state == IDLE:
            skip_blank_lines(conn.buf)
            if not conn.buf:
                return
            if self.splice is not None and self.splice.hand_over(self, conn):
                return  # HTTP/2 (gRPC on the OTLP Unix socket): spliced to the gRPC port, or waiting to tell
            conn.state = HEAD
            conn.since = now
            conn.request_deadline = now + self.request_timeout
            conn.deadline = now + self.head_timeout
        if conn.state == HEAD:
            head = take_head(conn.buf)
            if head is None:
                return
            self._start_request(conn, head)
            conn.state = BODY
            conn.deadline = conn.request_deadline
        if conn.state == BODY:
            if conn.chunks is not None:
                if not conn.chunks.read(conn.buf, conn.body, lambda size: self._admit_chunk(conn, size)):
                    return
            elif conn.length:
                need = conn.length - len(conn.body)
                take = conn.buf[:need]
                conn.body += take
                del conn.buf[: len(take)]
                if len(conn.body) < conn.length:
                    return
            self._dispatch(conn)

    def _start_request(self, conn: Conn, head: bytes) -> None:
        conn.method, conn.target, conn.version, framing = parse_head(head)
        conn.headers = framing.headers
        conn.keep_alive = framing.keep_alive
        conn.length = framing.length
        if framing.chunked:
            conn.chunks = ChunkedReader()
        if conn.length > self.max_body_bytes:
            # Not read: the route still runs (to answer 413 in its own format, after its own checks)
            # and the connection closes after the answer.
            self.stats["too_large"] += 1
            conn.refused_length, conn.length, conn.keep_alive = conn.length, 0, False
            return
        self._reserve(conn, conn.length)
        if (conn.length or framing.chunked) and framing.expect_continue:
            try:
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                pass  # the client sends its body after a pause anyway

    def _reserve(self, conn: Conn, n: int) -> None:
        if self._buffered + n > self.max_buffered_bytes:
            self.stats["busy"] += 1
            raise ClientFault(503, "too many request bodies in flight, retry later", "busy")
        self._buffered += n
        conn.reserved += n

    def _admit_chunk(self, conn: Conn, size: int) -> bool:
        """Whether the next chunk of ``size`` bytes may be buffered (503 when the port's budget is spent)."""
        if len(conn.body) + size > self.max_body_bytes:
            # As with a declared length over the limit: the route answers 413, then we close.
            self.stats["too_large"] += 1
            conn.refused_length = len(conn.body) + size
            conn.body = bytearray()
            conn.keep_alive = False
            self.release(conn)
            return False
        self._reserve(conn, size)
        return True

    def _fault(self, conn: Conn, fault: ClientFault) -> None:
        if conn.state in (CLOSED, WORK):
            return
        if fault.reason != "timeout":
            self.stats[fault.reason] += 1
        log.debug("%s: %s: %d %s", self.name, conn.addr[0], fault.status, fault)
        head_only = conn.method == "HEAD"
        data = serialise(Response.text(fault.status, fault.message + "\n"), self._extra_headers, close=True,
                         head=head_only)
        self.release(conn)
        self.start_write(conn, data, close=True)

    def start_write(self, conn: Conn, data: bytes | list[bytes], close: bool) -> None:
        if isinstance(data, list):
            data = self._send_parts(conn, data)
        self._out_pending += len(data)
        if self._out_pending > MAX_PENDING_OUT:
            self._cut_stalled_writers(conn)
        conn.out = memoryview(data)
        conn.close_after = close
        conn.state = WRITE
        conn.since = time.monotonic()
        conn.deadline = conn.since + self.request_timeout
        # Write at once; wait for the socket to be writable only for what it did not take (a response
        # usually fits the send buffer: no epoll change for it).
        self._flush(conn)
        if conn.state == WRITE and conn.out:
            self.want(conn, selectors.EVENT_WRITE)

    def _send_parts(self, conn: Conn, parts: list[bytes]) -> bytes:
        """Write a response given in parts (head, then the body's parts) with one ``sendmsg``, without joining
        them; returns what the socket did not take, to write the usual way (joined only then). TLS sockets
        have no ``sendmsg``: joined."""
        sock = conn.sock
        if isinstance(sock, TLS.socket) or len(parts) > 512:
            return b"".join(parts)
        try:
            sent = sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return b"".join(parts)  # ``_flush`` meets the error again and closes the connection
        for i, part in enumerate(parts):
            if sent < len(part):
                return b"".join([part[sent:], *parts[i + 1:]])
            sent -= len(part)
        return b""

    def _flush(self, conn: Conn) -> None:
        sock = conn.sock
        while conn.out:
            try:
                n = sock.send(conn.out)
            except TLS.would_block:
                return
            except OSError as exc:
                log.debug("%s: writing to %s failed: %s", self.name, conn.addr[0], exc)
                self.close(conn)
                return
            conn.out = conn.out[n:]
            self._out_pending -= n
        if conn.close_after or self.stopping:
            if isinstance(sock, TLS.socket) or self.stopping:
                self.close(conn)
                return
            # Lingering close: read and drop what the client is still sending for a moment, so that a
            # close with unread data (a reset) does not destroy the answer before the client reads it.
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                self.close(conn)
                return
            conn.state = DRAIN
            conn.deadline = time.monotonic() + _DRAIN_S
            self.want(conn, selectors.EVENT_READ)
            return
        # Keep-alive: the next request may already be in the buffer.
        conn.reset()
        conn.state = IDLE
        conn.since = time.monotonic()
        conn.deadline = conn.since + self.idle_timeout
        self.want(conn, selectors.EVENT_READ)
        if conn.buf or (isinstance(sock, TLS.socket) and sock.pending()):
            self.ready.append(conn)  # a pipelined request, already received

    def _cut_stalled_writers(self, keep: Conn) -> None:
        """Too many response bytes wait for clients that do not read: close the writers that started
        the longest ago until under the cap (a scraper reading its answer finishes in milliseconds)."""
        writers = sorted((c for c in self.conns.values() if c.state == WRITE and c is not keep),
                         key=lambda c: c.since)
        for c in writers:
            if self._out_pending <= MAX_PENDING_OUT:
                break
            self.stats["write_cut"] += 1
            self.close(c)


"""The OTLP/gRPC port's front: it holds the TCP listening sockets and relays each connection to grpcio, which
listens on a private Unix socket, once the connection has said something.

Why: grpcio accepts every TCP connection itself and counts it against ``grpc.max_allowed_incoming_connections``
until it has sent its HTTP/2 preface (or the handshake timeout closes it); at the cap it closes the newest
connection, never the oldest silent one. 300 sockets that never said a word, reopened as they were closed,
made 8 of 8 legitimate exports fail ``UNAVAILABLE``. The front keeps what grpcio cannot:

- A connection costs grpcio nothing until its first bytes arrive (a gRPC client sends its preface with its
  first packet; a TLS client its ClientHello); one silent for ``first_bytes_timeout`` is closed.
- At most ``max_connections`` connections, silent or relayed; at the cap a new connection closes the one
  silent the longest, failing that the relayed one idle the longest (no byte either way for ``IDLE_EVICT_S``;
  a gRPC client opens a new connection for its next call), as the HTTP ports do; failing both the new one is
  closed. So a flood of silent or idle sockets, whatever its size, never keeps a client that talks out.
- What remains (docs/security.md): connections that keep sending bytes are relayed and held, up to the cap;
  grpcio's own limits then apply to them (calls at once, ``grpc_admission``).

Relaying: each connection is paired with a Unix connection to grpcio, bound to an abstract name the kernel
picks, so grpcio's ``context.peer()`` (``unix-abstract:<name>``) maps back to the TCP peer (``peer_of``).
Bytes are copied as they come, at most ``CHUNK`` each way in flight: a direction whose other side does not
take them stops being read (flow control passes through). One thread (``otlp-grpc-front``) with a selector.

Never parses what it relays (beyond waiting for a first byte), never imports grpc, and never blocks on a
client: every socket is non-blocking.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from gpu_energy_exporter.core.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

#: Bytes read at once from one side; one such chunk waits for the other side at most.
CHUNK = 64 * 1024
#: Connections accepted per pass of the loop: data already waiting is read before more are accepted (a flood
#: of connects cannot push a client's preface out before it is read).
ACCEPT_BATCH = 32
#: A relayed connection with no byte either way for this long may be closed to make room at the cap.
IDLE_EVICT_S = 5.0


class _Conn:
    __slots__ = ("client", "upstream", "peer", "name", "since", "active", "to_up", "to_client", "eof_client",
                 "eof_up")

    def __init__(self, client: socket.socket, peer: str, now: float) -> None:
        self.client = client
        self.upstream: socket.socket | None = None  # None: silent so far
        self.peer = peer
        self.name = ""  # the upstream socket's abstract name (the key of grpcio's peer)
        self.since = now  # accepted at
        self.active = now  # last byte either way
        self.to_up = b""  # read from the client, not yet written upstream
        self.to_client = b""
        self.eof_client = False
        self.eof_up = False


def _peer(addr: object) -> str:
    """A TCP peer in grpcio's own form (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``)."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
    return str(addr)


class Front:
    """The front for ``listeners`` (listening, non-blocking) relaying to the Unix socket ``upstream``."""

    def __init__(self, listeners: list[socket.socket], upstream: str, *, max_connections: int,
                 first_bytes_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._listeners = listeners
        self._upstream = upstream
        self.max_connections = max_connections
        self.first_bytes_timeout = first_bytes_timeout
        self._clock = clock
        self._conns: dict[socket.socket, _Conn] = {}  # by either of its sockets
        self._open: dict[int, _Conn] = {}  # by id: every connection once
        self._peers: dict[str, str] = {}  # grpcio's peer for an upstream socket -> the TCP peer
        self._peers_lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._stop_r, self._stop_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._log = RateLimitedLog(log, period_s=300.0)
        self.stats = {"accepted": 0, "relayed": 0, "silent_closed": 0, "evicted_silent": 0, "evicted_idle": 0,
                      "refused": 0, "upstream_failed": 0}

    # ------------------------------------------------------------------------------------------------

    def start(self) -> Front:
        for sock in self._listeners:
            self._sel.register(sock, selectors.EVENT_READ, "listen")
        self._sel.register(self._stop_r, selectors.EVENT_READ, "stop")
        self._thread = threading.Thread(target=self._run, name="otlp-grpc-front", daemon=True)
        self._thread.start()
        return self

    def peer_of(self, grpc_peer: str | None) -> str:
        """The TCP peer (grpcio's form) of the connection grpcio calls ``grpc_peer``; itself when it is not one
        of the front's (a client of another port)."""
        if not grpc_peer:
            return ""
        with self._peers_lock:
            return self._peers.get(grpc_peer, grpc_peer)

    def connections(self) -> int:
        return len(self._open)

    def close(self) -> None:
        try:
            self._stop_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(5.0)
        for conn in list(self._open.values()):
            self._drop(conn)
        for sock in self._listeners:
            sock.close()
        self._listeners = []
        self._sel.close()
        self._stop_r.close()
        self._stop_w.close()

    # ------------------------------------------------------------------------------------------------
    # the loop

    def _run(self) -> None:
        while True:
            timeout = self._next_deadline()
            for key, mask in self._sel.select(timeout):
                if key.data == "stop":
                    return
                if key.data == "listen":
                    self._accept(key.fileobj)  # type: ignore[arg-type]
                    continue
                sock = key.fileobj
                conn = self._conns.get(sock) if isinstance(sock, socket.socket) else None
                if conn is None:
                    continue
                try:
                    if sock is conn.client:
                        self._client_event(conn, mask)
                    else:
                        self._upstream_event(conn, mask)
                except OSError as exc:
                    log.debug("otlp-grpc front: %s: %s", conn.peer, exc)
                    self._drop(conn)
            self._expire()

    def _next_deadline(self) -> float:
        silent = [c.since for c in self._open.values() if c.upstream is None]
        if not silent:
            return 1.0
        return max(0.0, min(silent) + self.first_bytes_timeout - self._clock())

    def _expire(self) -> None:
        now = self._clock()
        for conn in [c for c in self._open.values() if c.upstream is None
                     and now - c.since >= self.first_bytes_timeout]:
            self.stats["silent_closed"] += 1
            self._drop(conn)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._log.warning("accept", "otlp-grpc: cannot accept connections: %s (raise the open-files "
                                      "limit or lower --web.max-connections)", exc.strerror)
                    self._evict()  # one less for the next try
                return
            self.stats["accepted"] += 1
            if len(self._open) >= self.max_connections and not self._evict():
                self.stats["refused"] += 1
                self._log.warning("full", "otlp-grpc: %d connections, all of them busy: refusing new ones until "
                                  "some end (--web.max-connections)", self.max_connections)
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, _peer(addr), self._clock())
            self._conns[sock] = conn
            self._open[id(conn)] = conn
            self._sel.register(sock, selectors.EVENT_READ)

    def _evict(self) -> bool:
        """Close the connection silent the longest, else the relayed one idle the longest (over
        ``IDLE_EVICT_S``); False when neither exists."""
        silent = [c for c in self._open.values() if c.upstream is None]
        if silent:
            self.stats["evicted_silent"] += 1
            victim = min(silent, key=lambda c: c.since)
        else:
            now = self._clock()
            idle = [c for c in self._open.values() if now - c.active >= IDLE_EVICT_S]
            if not idle:
                return False
            self.stats["evicted_idle"] += 1
            victim = min(idle, key=lambda c: c.active)
        self._log.warning("evict", "otlp-grpc: %d connections open; closing the oldest silent or idle ones to take "
                          "new ones (--web.max-connections)", self.max_connections)
        self._drop(victim)
        return True

    # ------------------------------------------------------------------------------------------------
    # relaying

    def _client_event(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn, to_client=True)
        if mask & selectors.EVENT_READ and not conn.to_up and not conn.eof_client:
            data = conn.client.recv(CHUNK)
            conn.active = self._clock()
            if not data:
                conn.eof_client = True
                if conn.upstream is None:
                    self._drop(conn)  # said nothing and left
                    return
                conn.upstream.shutdown(socket.SHUT_WR)
            else:
                if conn.upstream is None and not self._connect(conn):
                    return
                conn.to_up = data
                self._flush(conn, to_client=False)
        self._settle(conn)

    def _upstream_event(self, conn: _Conn, mask: int) -> None:
        assert conn.upstream is not None
        if mask & selectors.EVENT_WRITE:
            self._flush(conn, to_client=False)
        if mask & selectors.EVENT_READ and not conn.to_client and not conn.eof_up:
            data = conn.upstream.recv(CHUNK)
            conn.active = self._clock()
            if not data:
                conn.eof_up = True
                conn.client.shutdown(socket.SHUT_WR)
            else:
                conn.to_client = data
                self._flush(conn, to_client=True)
        self._settle(conn)

    def _connect(self, conn: _Conn) -> bool:
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.bind("")  # an abstract name the kernel picks: grpcio's peer for this connection
            up.setblocking(False)
            up.connect(self._upstream)
        except OSError as exc:  # grpcio not listening (stopping), or its backlog full
            up.close()
            self.stats["upstream_failed"] += 1
            self._log.warning("upstream", "otlp-grpc: cannot reach the gRPC server (%s); closing a client's connection",
                              exc.strerror or exc)
            self._drop(conn)
            return False
        name = up.getsockname()
        conn.name = "unix-abstract:" + (name[1:].decode() if isinstance(name, bytes) else name.lstrip("\0"))
        conn.upstream = up
        self._conns[up] = conn
        self._sel.register(up, selectors.EVENT_READ)
        with self._peers_lock:
            self._peers[conn.name] = conn.peer
        self.stats["relayed"] += 1
        return True

    def _flush(self, conn: _Conn, *, to_client: bool) -> None:
        if to_client:
            if conn.to_client:
                sent = conn.client.send(conn.to_client)
                conn.to_client = conn.to_client[sent:]
        elif conn.to_up and conn.upstream is not None:
            sent = conn.upstream.send(conn.to_up)
            conn.to_up = conn.to_up[sent:]

    def _settle(self, conn: _Conn) -> None:
        """Watch each socket for what it waits for (reading while its other side took everything, writing while
        bytes wait for it); close the pair once both directions ended and nothing waits."""
        if conn.upstream is None:
            return
        if conn.eof_client and conn.eof_up and not conn.to_up and not conn.to_client:
            self._drop(conn)
            return
        for sock, pending, other_pending, eof in ((conn.client, conn.to_client, conn.to_up, conn.eof_client),
                                                  (conn.upstream, conn.to_up, conn.to_client, conn.eof_up)):
            events = (0 if other_pending or eof else selectors.EVENT_READ) | (selectors.EVENT_WRITE if pending else 0)
            key = self._sel.get_map().get(sock)
            if events == 0:
                if key is not None:
                    self._sel.unregister(sock)
            elif key is None:
                self._sel.register(sock, events)
            elif key.events != events:
                self._sel.modify(sock, events)

    def _drop(self, conn: _Conn) -> None:
        if self._open.pop(id(conn), None) is None:
            return
        for sock in (conn.client, conn.upstream):
            if sock is None:
                continue
            self._conns.pop(sock, None)
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        if conn.name:
            with self._peers_lock:
                self._peers.pop(conn.name, None)

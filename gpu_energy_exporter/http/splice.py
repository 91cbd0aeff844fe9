"""OTLP/gRPC on the OTLP Unix socket: an HTTP/2 connection spliced to the gRPC receiver's own port.

grpcio can listen on a Unix socket, but it never tells a call's handler who is at the other end of it (no
``SO_PEERCRED``), and the identity of a Unix-socket push is exactly that. So the HTTP server of the Unix socket
takes every connection, and one that opens with the HTTP/2 client preface (``PRI * HTTP/2.0``: a gRPC client)
is handed to a ``Splice``: it connects to the gRPC receiver's TCP port over loopback, records that connection's
local address with the Unix peer's identity (``registry``: what the gRPC receiver looks a call's peer up in
first), and copies bytes both ways until either side closes. A TCP 4-tuple is unique while its socket lives,
so no other process can be seen under a recorded address; the entry goes when the pair closes.

Bounds: at most ``max_pairs`` spliced connections (a new one beyond is closed), at most ``MAX_BUFFERED`` bytes
waiting per direction (reading the other side pauses until it drains). Everything runs on the HTTP server's
selector thread and never blocks: sockets are non-blocking, the upstream connect completes on writability.
This module never parses HTTP/2 beyond the preface's first bytes and never decides an identity itself.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
from collections.abc import Callable, MutableMapping
from typing import Any

log = logging.getLogger(__name__)

#: The first bytes of the HTTP/2 client connection preface (RFC 9113, 3.4): enough to tell it from HTTP/1.1.
PREFACE_START = b"PRI * HTTP/2.0\r\n"
MAX_BUFFERED = 256 * 1024
_RECV = 65536


def is_http2(buf: bytes | bytearray) -> bool | None:
    """Whether a connection's first bytes are the HTTP/2 preface; None while too few have arrived to say."""
    n = min(len(buf), len(PREFACE_START))
    if bytes(buf[:n]) != PREFACE_START[:n]:
        return False
    return True if n == len(PREFACE_START) else None


class _End:
    """One side of a spliced pair: its socket and what waits to be written to it."""

    __slots__ = ("sock", "out", "events", "pair", "connecting")

    def __init__(self, sock: socket.socket, pair: _Pair) -> None:
        self.sock = sock
        self.out = bytearray()
        self.events = 0
        self.pair = pair
        self.connecting = False


class _Pair:
    __slots__ = ("down", "up", "key", "closed", "ending")

    def __init__(self) -> None:
        self.down: _End
        self.up: _End
        self.key: tuple[str, int] | None = None
        self.closed = False
        self.ending = False  # one side closed: what it sent last (a GOAWAY) is written, then both close


class Splice:
    """Spliced connections of one HTTP server (see the module docstring). ``target()``: the gRPC port's
    (host, port), None while there is none; ``identify(info)``: the identity of the Unix connection (its
    ``ConnectionInfo``), recorded in ``registry`` under the upstream connection's local (address, port)."""

    def __init__(self, target: Callable[[], tuple[str, int] | None], identify: Callable[[Any], object],
                 registry: MutableMapping[tuple[str, int], Any], *, max_pairs: int = 256) -> None:
        self.target = target
        self.identify = identify
        self.registry = registry
        self.max_pairs = max_pairs
        self.pairs: set[_Pair] = set()
        self._sel: selectors.BaseSelector | None = None

    def hand_over(self, conns: Any, conn: Any) -> bool:
        """Whether an idle HTTP connection (``http.connection.Conn`` of ``conns``, its first bytes read) is not
        the HTTP server's to parse: the start of the HTTP/2 preface (more is awaited), or all of its first line
        (the connection is taken from ``conns`` and spliced, or closed)."""
        http2 = is_http2(conn.buf)
        if http2 is False:
            return False
        if http2:
            from gpu_energy_exporter.http.connection import CLOSED  # noqa: PLC0415 - it imports this module

            conns.want(conn, 0)  # let go of it without closing its socket
            conns.conns.pop(conn.sock.fileno(), None)
            conns.release(conn)
            conn.state = CLOSED
            first, conn.buf = bytes(conn.buf), bytearray()
            self.take(conns._sel, conn.sock, conn.info, first)
        return True

    def take(self, sel: selectors.BaseSelector, sock: socket.socket, info: Any, first: bytes) -> bool:
        """Splice ``sock`` (whose ``first`` bytes were already read) to the gRPC port. False (and ``sock``
        closed) when there is no gRPC port or too many pairs are open."""
        self._sel = sel
        if not self._take(sock, info, first):
            log.debug("OTLP Unix socket: an HTTP/2 (gRPC) connection, and no gRPC port to splice it to")
            try:
                sock.close()
            except OSError:
                pass
            return False
        return True

    def _take(self, sock: socket.socket, info: Any, first: bytes) -> bool:
        where = self.target()
        if where is None or len(self.pairs) >= self.max_pairs:
            return False
        host, port = where
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        up = socket.socket(family, socket.SOCK_STREAM)
        up.setblocking(False)
        err = up.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            up.close()
            log.debug("OTLP Unix socket: cannot reach the gRPC port %s:%d: %s", host, port, errno.errorcode.get(err))
            return False
        pair = _Pair()
        pair.down, pair.up = _End(sock, pair), _End(up, pair)
        pair.up.connecting = err != 0
        local = up.getsockname()
        pair.key = (str(local[0]), int(local[1]))
        self.registry[pair.key] = self.identify(info)  # before the gRPC server can see a call on it
        pair.up.out += first
        self.pairs.add(pair)
        self._want(pair.down, selectors.EVENT_READ)
        self._want(pair.up, selectors.EVENT_WRITE)
        return True

    def owns(self, data: object) -> bool:
        return isinstance(data, _End)

    def on_event(self, end: _End, events: int) -> None:
        pair = end.pair
        if pair.closed:
            return
        try:
            if end.connecting and events & selectors.EVENT_WRITE:
                err = end.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, errno.errorcode.get(err, "connect failed"))
                end.connecting = False
            if events & selectors.EVENT_READ and not pair.ending:
                other = pair.up if end is pair.down else pair.down
                data = end.sock.recv(_RECV)
                if data:
                    other.out += data
                else:
                    pair.ending = True
            if events & selectors.EVENT_WRITE and end.out and not end.connecting:
                sent = end.sock.send(end.out)
                del end.out[:sent]
            if pair.ending and not pair.down.out and not pair.up.out:
                self._close(pair)
                return
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            log.debug("OTLP Unix socket: spliced gRPC connection ended: %s", exc)
            self._close(pair)
            return
        self._rearm(pair)

    def _rearm(self, pair: _Pair) -> None:
        for end, other in ((pair.down, pair.up), (pair.up, pair.down)):
            want = 0
            if not end.connecting and not pair.ending and len(other.out) < MAX_BUFFERED:
                want |= selectors.EVENT_READ  # read only while the other side keeps up
            if end.out or end.connecting:
                want |= selectors.EVENT_WRITE
            self._want(end, want)

    def _want(self, end: _End, events: int) -> None:
        sel = self._sel
        assert sel is not None
        if events == end.events:
            return
        if end.events == 0:
            sel.register(end.sock, events, end)
        elif events == 0:
            sel.unregister(end.sock)
        else:
            sel.modify(end.sock, events, end)
        end.events = events

    def _close(self, pair: _Pair) -> None:
        if pair.closed:
            return
        pair.closed = True
        self.pairs.discard(pair)
        if pair.key is not None:
            self.registry.pop(pair.key, None)
        for end in (pair.down, pair.up):
            if end.events and self._sel is not None:
                try:
                    self._sel.unregister(end.sock)
                except (KeyError, ValueError):
                    pass
                end.events = 0
            try:
                end.sock.close()
            except OSError:
                pass

    def close_all(self) -> None:
        for pair in list(self.pairs):
            self._close(pair)

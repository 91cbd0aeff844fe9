"""The OTLP/gRPC port before its first connection: held by plain sockets, so ``grpc`` (about 15 MB of RSS and
20 threads) is loaded only on a node that receives a gRPC push.

``Placeholder(address)`` binds and listens on the addresses grpcio would bind for it (a host name's every
address, one port; ``""`` dual-stack), so a taken port is a ``ConfigError`` at start, and no second exporter
can take the port meanwhile (no ``SO_REUSEPORT``). ``watch(wake)`` starts one thread that blocks until the
first connection arrives, accepts it and calls ``wake(handoff)`` with it held: ``wake`` loads grpc, starts its
server (on a private Unix socket: ``grpcfront``), calls ``handoff()``, which gives it the listening sockets as
they are (connections waiting in their backlog included: the front relays them), and returns whether grpcio
serves now. Then every connection held here is answered as an HTTP/2 server would (a SETTINGS frame, an ACK of
the client's SETTINGS) and, once the client has opened its call on it (its HEADERS frame; or after
``CALL_WAIT``), with ``GOAWAY(last-stream-id=0, NO_ERROR)``: to a gRPC client that call was never processed,
so it sends it again on a new connection, which the front relays to grpcio (a transparent retry: the caller
sees no error). The GOAWAY must wait for the call: sent right behind the SETTINGS it can reach grpcio's client
before its subchannel watches the connection, and the call is then retried on that dead connection until its
deadline (grpcio 1.85, 3 first calls in 8). The connection is half-closed, what the client sends is read until
it closes or ``DRAIN_TIMEOUT``, and closed: closing with unread bytes would send a reset the client could see
before the GOAWAY. The port is never closed on the way: no connection is refused between the two.

This module never imports grpc and reads no more of a call than its frame headers.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from gpu_energy_exporter.core.errors import ConfigError

log = logging.getLogger(__name__)

#: An empty SETTINGS frame (length 0, type 0x4, no flags, stream 0): the server's connection preface.
SETTINGS = bytes.fromhex("000000040000000000")
#: GOAWAY (length 8, type 0x7, stream 0): last-stream-id 0 (no stream was processed), NO_ERROR (0).
GOAWAY = bytes.fromhex("000008070000000000") + bytes(4) + bytes(4)
#: SETTINGS ACK (length 0, type 0x4, flag ACK): the answer to the client's SETTINGS.
SETTINGS_ACK = bytes.fromhex("000000040100000000")
#: How long a held connection is read after the GOAWAY before it is closed (clients close at once).
DRAIN_TIMEOUT = 2.0
#: How long a held connection may go without opening a call before it gets its GOAWAY anyway (a client
#: that connected ahead of its first call, a port scanner).
CALL_WAIT = 1.0
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, SETTINGS_TYPE, ACK = 0x1, 0x4, 0x1


class _Held:
    """What a held connection has sent so far: its frames are read only for a SETTINGS to acknowledge and
    the HEADERS that opens a call."""

    __slots__ = ("goaway_at", "call_seen", "gone", "_buf", "_preface")

    def __init__(self, goaway_at: float) -> None:
        self.goaway_at = goaway_at
        self.call_seen = False
        self.gone = False  # GOAWAY sent
        self._buf = b""
        self._preface = False

    def feed(self, data: bytes) -> bytes:
        """Take what the client sent; the bytes to answer (SETTINGS ACKs). Not HTTP/2: nothing, and the
        connection gets its GOAWAY at once, as a call would."""
        if self.gone:
            return b""
        self._buf += data
        if not self._preface:
            if len(self._buf) < len(PREFACE):
                if not PREFACE.startswith(self._buf):
                    self.call_seen = True  # noise: answer now
                return b""
            if not self._buf.startswith(PREFACE):
                self.call_seen = True
                return b""
            self._preface, self._buf = True, self._buf[len(PREFACE):]
        out = b""
        while len(self._buf) >= 9:
            length = int.from_bytes(self._buf[:3], "big")
            kind, flags = self._buf[3], self._buf[4]
            if len(self._buf) < 9 + length:
                break
            self._buf = self._buf[9 + length:]
            if kind == SETTINGS_TYPE and not flags & ACK:
                out += SETTINGS_ACK
            elif kind == HEADERS:
                self.call_seen = True
        return out


def _send(sock: socket.socket, data: bytes, *, shut: bool = False) -> bool:
    """Write ``data`` (a few bytes: the socket buffer takes them) and optionally half-close; False when the
    connection is gone."""
    try:
        if data:
            sock.setblocking(True)
            sock.settimeout(DRAIN_TIMEOUT)
            sock.sendall(data)
            sock.setblocking(False)
        if shut:
            sock.shutdown(socket.SHUT_WR)
    except OSError:
        return False
    return True

#: What ``wake`` is given: it returns the listening sockets, which are then no longer the placeholder's.
Handoff = Callable[[], list[socket.socket]]


def _candidates(host: str, port: int) -> list[tuple[socket.AddressFamily, tuple[Any, ...], bool]]:
    """(family, socket address, dual-stack) for each address grpcio binds for ``host``."""
    if host in ("", "::"):
        # one dual-stack socket; IPv4 only where the host has no IPv6
        return [(socket.AF_INET6, ("::", port), True), (socket.AF_INET, ("0.0.0.0", port), False)]
    if host.lower() == "localhost":
        # grpcio binds both loopbacks for "localhost", whatever /etc/hosts says (it may list 127.0.0.1 only)
        return [(socket.AF_INET6, ("::1", port), False), (socket.AF_INET, ("127.0.0.1", port), False)]
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {shown(host, port)}: host name does not resolve "
                          f"({exc.strerror})") from None
    out: list[tuple[socket.AddressFamily, tuple[Any, ...], bool]] = []
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6) and (family, sockaddr[:2], False) not in out:
            out.append((family, sockaddr[:2], False))
    return out


def shown(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(address: tuple[str, int], backlog: int = 1024) -> list[socket.socket]:
    """Listening sockets on every address grpcio would bind for ``address`` (one port for all: the first's,
    when the port is 0). ``ConfigError`` naming the address when a port is taken or nothing can be bound;
    an address family the host lacks (``::1`` without IPv6) is skipped, as grpcio skips it."""
    host, port = address[0].strip(), address[1]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    sockets: list[socket.socket] = []
    first: OSError | None = None
    for family, sockaddr, dualstack in _candidates(host, port):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpcio sets it
            if dualstack:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            if sockets:
                sockaddr = (sockaddr[0], sockets[0].getsockname()[1])
            sock.bind(sockaddr)
            sock.listen(backlog)
            sock.setblocking(False)
            sockets.append(sock)
            if dualstack:
                return sockets
        except OSError as exc:
            sock.close()
            first = first or exc
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                break  # a taken port, a forbidden one: refused, not narrowed
    else:
        if sockets:
            return sockets
    for sock in sockets:
        sock.close()
    assert first is not None or not sockets
    reason = (first.strerror or str(first)) if first else "no address to bind"
    hint = (" (another process is using this port; choose another listen address)"
            if first is not None and first.errno == errno.EADDRINUSE else "")
    raise ConfigError(f"cannot listen on {shown(host, port)}: {reason}{hint}")


class Placeholder:
    """The port held until the first connection; see the module docstring."""

    def __init__(self, address: tuple[str, int], *, max_held: int = 256) -> None:
        self._listeners = listen(address)
        self.port: int = self._listeners[0].getsockname()[1]
        self._max_held = max_held
        self._held: list[socket.socket] = []
        self._stop_r, self._stop_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self.woken = threading.Event()  # set once the first connection was answered (for tests and shutdown)

    def watch(self, wake: Callable[[Handoff], bool]) -> None:
        self._thread = threading.Thread(target=self._run, args=(wake,), name="otlp-grpc-wait", daemon=True)
        self._thread.start()

    def _run(self, wake: Callable[[Handoff], bool]) -> None:
        with selectors.DefaultSelector() as sel:
            for sock in self._listeners:
                sel.register(sock, selectors.EVENT_READ)
            sel.register(self._stop_r, selectors.EVENT_READ)
            while True:
                ready = [key.fileobj for key, _ in sel.select()]
                if self._stop_r in ready:
                    return
                self._accept_waiting()
                if self._held:
                    break
        serving = False
        try:
            serving = wake(self.handoff)
        except Exception:  # never leave the held clients hanging
            log.exception("OTLP/gRPC receiver failed to start on its first connection")
        finally:
            self.release()
            self._answer(goaway=serving)
            self.woken.set()

    def _accept_waiting(self) -> None:
        for sock in self._listeners:
            while len(self._held) < self._max_held:
                try:
                    conn, _ = sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:  # out of files, a reset before accept: the client retries
                    log.debug("OTLP/gRPC placeholder accept: %s", exc)
                    break
                self._held.append(conn)

    def handoff(self) -> list[socket.socket]:
        """The listening sockets, as they are: from now on they are the caller's (``wake``'s front)."""
        listeners, self._listeners = self._listeners, []
        return listeners

    def release(self) -> None:
        """Accept what waits in the backlog, then close the listening sockets (grpcio could not start, or the
        receiver stops before it did)."""
        if not self._listeners:
            return
        self._accept_waiting()
        for sock in self._listeners:
            sock.close()
        self._listeners = []

    def _answer(self, *, goaway: bool) -> None:
        """SETTINGS to each held connection, then GOAWAY once it carries a call (or after ``CALL_WAIT``), then
        read until it closes (``DRAIN_TIMEOUT``). Without ``goaway`` (grpcio is not serving) just close them."""
        held, self._held = self._held, []
        if not goaway:
            for conn in held:
                conn.close()
            return
        now = time.monotonic()
        states: dict[socket.socket, _Held] = {}
        with selectors.DefaultSelector() as sel:
            for conn in held:
                try:
                    conn.setblocking(True)
                    conn.settimeout(DRAIN_TIMEOUT)
                    conn.sendall(SETTINGS)
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ)
                    states[conn] = _Held(now + CALL_WAIT)
                except OSError:
                    conn.close()
            deadline = now + CALL_WAIT + DRAIN_TIMEOUT
            while states and (left := deadline - time.monotonic()) > 0:
                pending = [st.goaway_at for st in states.values() if not st.gone]
                wait = min([left, *(max(0.0, t - time.monotonic()) for t in pending)])
                for key, _ in sel.select(wait):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        more = sock.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        more = b""
                    st = states[sock]
                    reply = st.feed(more) if more else b""
                    if not more or not _send(sock, reply):
                        sel.unregister(sock)
                        sock.close()
                        del states[sock]
                for sock, st in list(states.items()):
                    if not st.gone and (st.call_seen or time.monotonic() >= st.goaway_at):
                        st.gone = True
                        if not _send(sock, GOAWAY, shut=True):
                            sel.unregister(sock)
                            sock.close()
                            del states[sock]
            for sock in states:
                sock.close()

    def close(self) -> None:
        """Stop waiting (joins the thread, which finishes a wake already under way) and free the port."""
        try:
            self._stop_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(30.0)
        self.release()
        for conn in self._held:
            conn.close()
        self._held = []
        self._stop_r.close()
        self._stop_w.close()

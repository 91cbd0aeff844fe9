"""The OTLP/gRPC metrics receiver: ``opentelemetry.proto.collector.metrics.v1.MetricsService/Export`` on
``--otlp.grpc.listen-address`` (port 4317, what the Collector's ``otlp`` exporter and SDKs configured with
``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` push to).

A call's message goes through the function an OTLP/HTTP body goes through (``ExportHandler.store_body``):
the same store, ledger, ``--otlp.*`` limits and ``partial_success`` answers. What gRPC changes is the
transport and the codes (OTLP specification, "OTLP/gRPC Response"):

- ``INVALID_ARGUMENT``: the message is not an ``ExportMetricsServiceRequest`` (the HTTP receiver's 400
  message), or the call carried no message. Not retryable, as the spec says.
- ``UNAUTHENTICATED``: ``--otlp.bearer-token-file`` is set and the ``authorization`` metadata does not carry
  ``Bearer <token>``.
- ``RESOURCE_EXHAUSTED``: the message is over ``--otlp.max-body-bytes``, as sent or after gzip; gRPC itself
  refuses it and stops inflating at the limit, so a gzip bomb costs at most that much. The receiver sees only
  a call cancelled before its message (counted ``CANCELLED``, as a client that gave up).
- ``DEADLINE_EXCEEDED``: the message did not arrive within ``--web.request-timeout`` of the call's start.
- ``UNAVAILABLE``: a call still receiving its message after ``EVICT_AFTER`` seconds was cut to let a waiting
  call in (retryable: a genuine client sends again).

Bounds (memory and connections): at most ``SLOTS`` calls receive or are handled at once, so at most that
many messages of ``--otlp.max-body-bytes`` are in memory (the HTTP port holds four bodies' worth too); other
calls wait, holding no message (gRPC grants a call without a pending read one flow-control window, 64 KiB,
with BDP probing off). A call waits and receives within ``--web.request-timeout``. When every slot is taken
and a call waits, the call that has been receiving longest, for over ``EVICT_AFTER``, is cut, so a flood of
slow senders cannot hold the port. At most ``--web.max-connections`` connections, ``STREAMS_PER_CONNECTION``
calls on each, ``--web.max-connections`` calls in all (``RESOURCE_EXHAUSTED`` beyond); a connection with
no call for ``IDLE_TIMEOUT`` seconds is closed (GOAWAY: a client reconnects on its next export), and one
must send its HTTP/2 preface within ``HANDSHAKE_TIMEOUT`` (``HANDSHAKE_TIMEOUT_TLS`` with TLS). A failed call's
message must not outlive it: grpcio keeps the traceback of a call that ended with an error.

TLS: ``--web.config.file``'s ``tls_server_config`` (certificate, key, client CA; reloaded when the files
change, on the next connection). Settings grpcio cannot enforce (``client_allowed_sans``, TLS versions other
than 1.2 to 1.3, ``cipher_suites``) stop the exporter at start-up with a message, rather than serve weaker
than the file says. Basic auth and ``rate_limit`` in that file are HTTP-only: the bearer token is OTLP's.

Identity (docs/security.md): a call's peer (``context.peer()``, an address and port) is looked up in the
socket table (``http.peers``; off the loop when not remembered), or in ``spliced`` when the connection came
through the OTLP Unix socket (``http.splice``: its Unix peer); the token's tenant and trusted forwarders as
over HTTP (``ExportHandler.identify``).

Threads: one ``otlp-grpc`` thread runs an asyncio loop with a ``grpc.aio`` server; messages up to
``receiver.INLINE_MAX_BODY`` are stored on it (a rank's export costs less than a hand-off), larger ones on a
small pool. In plain text ``bind`` holds the port with a ``grpc_port_holder.Placeholder`` and ``grpc`` is imported,
the thread started and the server bound where the placeholder was only when the first client connects
(``_wake``); with TLS all of that happens at ``bind``. With ``--otlp.grpc.listen-address=`` grpc never loads.
This module never decodes OTLP itself, never touches the store except through ``ExportHandler``, and never
lets a call crash the server.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from gpu_energy_exporter.core import metrics
from gpu_energy_exporter.core.clientid import UNRESOLVED_LOCAL, Peer, address_peer
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.core.lazymodule import lazy
from gpu_energy_exporter.otlp.grpc_admission import EVICT_AFTER as EVICT_AFTER
from gpu_energy_exporter.otlp.grpc_admission import SLOTS as SLOTS
from gpu_energy_exporter.otlp.grpc_admission import Call, Refused, Slots
from gpu_energy_exporter.otlp.grpc_port_holder import Handoff, Placeholder, listen
from gpu_energy_exporter.otlp.grpcfront import Front
from gpu_energy_exporter.otlp.grpctls import TLSCredentials, check_tls
from gpu_energy_exporter.otlp.receiver import INLINE_MAX_BODY, PROTOBUF, ExportFailure, ExportHandler
from gpu_energy_exporter.otlp.selfmetrics import COLLECTOR

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures

    from grpc import aio

    from gpu_energy_exporter.http.tls import TLSServerConfig
else:
    # loaded when a client first connects (the placeholder holds the port till then): asyncio brings ssl
    asyncio = lazy("asyncio")

log = logging.getLogger(__name__)

SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
METHOD = "Export"

STREAMS_PER_CONNECTION = 8
IDLE_TIMEOUT = 60.0
#: How long a new connection may take to send its HTTP/2 preface and SETTINGS (a client sends them with its
#: first packet; a socket that stays silent holds one of --web.max-connections until then, and grpcio cannot
#: close the oldest such socket to let a new client in), and, with TLS, to finish the TLS handshake first.
HANDSHAKE_TIMEOUT = 3.0
HANDSHAKE_TIMEOUT_TLS = 10.0
#: Threads that store messages larger than ``INLINE_MAX_BODY`` (off the loop, so small calls go on).
WORKERS = 2

#: Every outcome, initialised at zero (gRPC status code names).
#: (RESOURCE_EXHAUSTED is not among them: gRPC answers it itself, before the receiver sees the message.)
CODES: tuple[str, ...] = ("OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "DEADLINE_EXCEEDED", "UNAVAILABLE",
                          "CANCELLED", "INTERNAL")

GRPC_REQUESTS = metrics.define(
    "otlp", "grpc_requests_total", "counter",
    "OTLP/gRPC export calls handled by the receiver, by gRPC status code. CANCELLED: the call ended before its "
    "message was read (the client cancelled, or the message was over --otlp.max-body-bytes, which gRPC "
    "answers RESOURCE_EXHAUSTED itself).",
    ("code",), collector=COLLECTOR)
GRPC_REQUEST_DURATION = metrics.define(
    "otlp", "grpc_request_duration_seconds_total", "counter",
    "Time spent in OTLP/gRPC export calls, waiting for and receiving the message included.",
    collector=COLLECTOR, unit="seconds")
GRPC_CALLS = metrics.define(
    "otlp", "grpc_calls_in_flight", "gauge",
    f"OTLP/gRPC export calls open now: receiving or being handled (at most {SLOTS} at once) or waiting for that.",
    collector=COLLECTOR)


class GRPCReceiver:
    """``MetricsService/Export`` on its own port, storing through ``handler`` (the OTLP/HTTP receiver's).

    ``bind()`` imports grpc, binds the port (``ConfigError`` naming the address when it cannot) and starts the
    ``otlp-grpc`` thread; ``start()`` starts serving; ``shutdown()`` stops both. ``collect()`` and
    ``version()`` are the self-metrics for ``/metrics``.
    """

    def __init__(
        self,
        address: tuple[str, int],
        handler: ExportHandler,
        *,
        tls: TLSServerConfig | None = None,
        max_connections: int = 256,
        request_timeout: float = 30.0,
        slots: int = SLOTS,
        spliced: Mapping[tuple[str, int], Peer] | None = None,
    ) -> None:
        self.address = address
        #: connections spliced from the OTLP Unix socket (``http.splice``): their local address -> Unix peer
        self.spliced = spliced
        self.handler = handler
        self.tls = tls
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.slots = slots
        if tls is not None:
            check_tls(tls)  # at construction, as every other setting: nothing has started yet
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(CODES, 0.0)
        self._seconds = 0.0
        self._in_flight = 0
        self._version = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: aio.Server | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._slots: Slots | None = None
        self._placeholder: Placeholder | None = None
        self._front: Front | None = None
        self._sockdir: str | None = None
        self.port = 0

    # ------------------------------------------------------------------------------------------------
    # self-metrics

    def _opened(self) -> None:
        with self._lock:
            self._in_flight += 1
            self._version += 1

    def _record(self, code: str, seconds: float) -> None:
        with self._lock:
            self._counts[code] = self._counts.get(code, 0.0) + 1
            self._seconds += seconds
            self._in_flight -= 1
            self._version += 1

    def version(self) -> int:
        return self._version

    def collect(self) -> list[Metric]:
        with self._lock:
            counts, seconds, in_flight = dict(self._counts), self._seconds, self._in_flight
        requests = GRPC_REQUESTS.family()
        for code, n in sorted(counts.items()):
            metrics.add(requests, (code,), n)
        duration = GRPC_REQUEST_DURATION.family()
        metrics.add(duration, (), seconds)
        calls = GRPC_CALLS.family()
        metrics.add(calls, (), in_flight)
        return [requests, duration, calls]

    def counts(self) -> dict[str, float]:
        """Calls by gRPC code so far (a copy)."""
        with self._lock:
            return dict(self._counts)

    # ------------------------------------------------------------------------------------------------
    # the call

    async def _export(self, requests: Any, context: aio.ServicerContext) -> bytes:
        import grpc

        started = time.perf_counter()
        code, message = "OK", ""
        call = Call()
        self._opened()
        try:
            return await self._serve(context, call)
        except Refused as exc:
            code, message = exc.code, exc.message
        except asyncio.CancelledError:
            # the client went away, or gRPC failed the call itself (the message was over the limit: _receive)
            code = "CANCELLED"
            raise
        except Exception:
            log.exception("OTLP/gRPC call handling failed")
            code, message = "INTERNAL", "internal error while handling the request; see the exporter log"
        finally:
            self._record(code, time.perf_counter() - started)
        await context.abort(getattr(grpc.StatusCode, code), message)
        raise AssertionError("unreachable: abort raises")  # pragma: no cover

    async def _serve(self, context: aio.ServicerContext, call: Call) -> bytes:
        authorization = ""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else ""
                break
        if not self.handler.bearer_ok(authorization):
            raise Refused("UNAUTHENTICATED", "missing or wrong bearer token (metadata authorization: Bearer "
                                              "<token> from --otlp.bearer-token-file)")
        assert self._slots is not None
        deadline = time.monotonic() + self.request_timeout
        await self._slots.acquire(call, deadline)
        try:
            # grpcio serves the front's private socket (grpcfront): the client's own TCP connection is the front's
            seen = self._front.peer_of(context.peer()) if self._front is not None else context.peer()
            peer = await self._peer(seen)
            if self.handler.identities.needs_lookup(peer):  # a pod's address: the look-up may wait for the list
                loop = asyncio.get_running_loop()
                peer = await loop.run_in_executor(self._pool, self.handler.identify, peer, authorization)
            else:
                peer = self.handler.identify(peer, authorization)
            data = await self._receive(context, call, deadline)
            if len(data) <= INLINE_MAX_BODY:
                return self.handler.store_body(data, PROTOBUF, peer)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self.handler.store_body, data, PROTOBUF, peer)
        except ExportFailure as exc:
            raise Refused("INVALID_ARGUMENT", exc.message) from None
        finally:
            await self._slots.release(call)

    async def _peer(self, text: str | None) -> Peer:
        """What the kernel says of a call's connection (``http.peers``): a connection spliced from the OTLP
        Unix socket is its Unix peer (``spliced``); a TCP one is looked up in the socket table, on the worker
        pool when not remembered (a scan reads /proc)."""
        host, port = peer_address(text)
        if not port:
            return address_peer(host) if host and not host.startswith("/") else UNRESOLVED_LOCAL
        if self.spliced is not None:
            found = self.spliced.get((host, port))
            if found is not None:
                return found
        resolver = self.handler.resolver
        if resolver is None:
            return address_peer(host)
        known = resolver.known(host, port, self.port)
        if known is not None:
            return known
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, resolver.tcp, host, port, self.port)

    async def _receive(self, context: aio.ServicerContext, call: Call, deadline: float) -> bytes:
        from grpc import aio

        loop = asyncio.get_running_loop()
        call.receiving_since = time.monotonic()
        call.read = asyncio.ensure_future(context.read())
        timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), call.stop, "DEADLINE_EXCEEDED")
        try:
            data = await call.read
        except asyncio.CancelledError:
            if call.cut == "UNAVAILABLE":
                raise Refused("UNAVAILABLE", "the message was still arriving after "
                                              f"{EVICT_AFTER:g}s while other calls waited; send it again") from None
            if call.cut == "DEADLINE_EXCEEDED":
                raise Refused("DEADLINE_EXCEEDED", f"the message did not arrive within {self.request_timeout:g}s "
                                                    "(--web.request-timeout)") from None
            raise  # this call's own task: the client went away, or gRPC ended the call
        finally:
            timer.cancel()
            call.read.cancel()
            call.read = None  # it holds the message: a failed call's traceback (kept by grpc) would keep it alive
            call.receiving_since = None
        if data is aio.EOF:
            # gRPC ends the read so when it refused the message (over max_receive_message_length, before or
            # after inflating: RESOURCE_EXHAUSTED to the client) or the client cancelled, and then cancels this
            # task: given a moment, it is counted CANCELLED, not as a call with no message, which gets here too.
            await asyncio.sleep(0.05)
            raise Refused("INVALID_ARGUMENT", "the call carried no ExportMetricsServiceRequest message")
        return bytes(data)

    # ------------------------------------------------------------------------------------------------
    # the server

    def _options(self) -> list[tuple[str, Any]]:
        ms = 1000
        return [
            ("grpc.max_receive_message_length", self.handler.max_body_bytes),
            ("grpc.max_send_message_length", 1 << 20),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
            ("grpc.max_connection_idle_ms", int(IDLE_TIMEOUT * ms)),
            ("grpc.server_handshake_timeout_ms", int(min(self.handshake_timeout, self.request_timeout) * ms)),
            # a waiting call's stream gets one 64 KiB window, not one grown by bandwidth probing
            ("grpc.http2.bdp_probe", 0),
            # without it a second exporter binds the same port and the kernel splits the pushes between them
            ("grpc.so_reuseport", 0),
        ]

    @property
    def handshake_timeout(self) -> float:
        return HANDSHAKE_TIMEOUT_TLS if self.tls is not None else HANDSHAKE_TIMEOUT

    async def _build(self) -> None:
        """The server, bound on its private Unix socket (the front relays the port to it)."""
        import grpc
        from grpc import aio

        self._slots = Slots(self.slots, time.monotonic)
        server = aio.server(options=self._options(), maximum_concurrent_rpcs=self.max_connections)
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {METHOD: grpc.stream_unary_rpc_method_handler(self._export)})
        server.add_generic_rpc_handlers((handler,))
        self._sockdir = tempfile.mkdtemp(prefix="gpu-energy-exporter-grpc-")  # 0700: no one else connects
        target = "unix:" + os.path.join(self._sockdir, "grpc.sock")
        try:
            if self.tls is not None:
                bound = server.add_secure_port(target, TLSCredentials(self.tls).credentials())
            else:
                bound = server.add_insecure_port(target)
        except RuntimeError:
            bound = 0
        if not bound:
            raise ConfigError(f"cannot listen on {target} for OTLP/gRPC (the private socket the port is relayed to; "
                              "is TMPDIR writable?)")
        self._server = server

    def _start_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="otlp-grpc", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        import concurrent.futures

        self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="otlp-grpc-worker")
        return loop

    def _front_for(self, listeners: list[socket.socket]) -> Front:
        assert self._sockdir is not None
        return Front(listeners, os.path.join(self._sockdir, "grpc.sock"), max_connections=self.max_connections,
                     first_bytes_timeout=min(HANDSHAKE_TIMEOUT, self.request_timeout))

    def bind(self) -> GRPCReceiver:
        """Bind the port; ``ConfigError`` when it cannot be used. In plain text the port is held by a
        ``grpc_port_holder.Placeholder`` and grpc is loaded on the first connection (``_wake``); with TLS grpc is
        imported, its loop thread started and its server bound now. Either way the port is the front's
        (``grpcfront``), which relays it to the server's private Unix socket."""
        if self._loop is not None or self._placeholder is not None:
            return self
        if self.tls is None:
            self._placeholder = Placeholder(self.address, max_held=self.max_connections)
            self.port = self._placeholder.port
            return self
        listeners = listen(self.address)
        self.port = listeners[0].getsockname()[1]
        loop = self._start_loop()
        try:
            asyncio.run_coroutine_threadsafe(self._build(), loop).result()
            self._front = self._front_for(listeners)
        except BaseException:
            for sock in listeners:
                sock.close()
            self.shutdown()
            raise
        return self

    def _wake(self, handoff: Handoff) -> bool:
        """The first connection arrived (placeholder's thread): load grpc, serve on the private socket, and
        take the port's listening sockets into the front. False (logged) when grpc cannot serve."""
        started = time.perf_counter()
        loop = self._start_loop()

        async def build_and_serve() -> None:
            await self._build()
            assert self._server is not None
            await self._server.start()

        try:
            asyncio.run_coroutine_threadsafe(build_and_serve(), loop).result()
        except ConfigError as exc:
            log.error("OTLP/gRPC receiver stopped: %s (--otlp.grpc.listen-address)", exc)
            return False
        self._front = self._front_for(handoff()).start()
        log.info("otlp-grpc: first connection, gRPC loaded and serving in %.0f ms",
                 (time.perf_counter() - started) * 1000)
        return True

    def start(self) -> GRPCReceiver:
        self.bind()
        if self._placeholder is not None:
            self._placeholder.watch(self._wake)
        else:
            assert self._loop is not None and self._server is not None and self._front is not None
            asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result()
            self._front.start()
        log.info("otlp-grpc listening on %s (gRPC, TLS %s, bearer token %s, at most %d connections)",
                 self.url, "on" if self.tls else "off", "on" if self.handler.bearer_required else "off",
                 self.max_connections)
        return self

    @property
    def url(self) -> str:
        """The endpoint a client on this host gives an OTLP gRPC exporter."""
        host = self.address[0].strip().strip("[]")
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1" if host == "0.0.0.0" else "localhost"
        if ":" in host:
            host = f"[{host}]"
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def shutdown(self) -> None:
        if self._placeholder is not None:
            self._placeholder.close()  # waits for a wake under way: its loop and server are stopped below
            self._placeholder = None
        if self._front is not None:
            self._front.close()  # the port first: no new connection while the server stops
            self._front = None
        loop, server = self._loop, self._server
        self._server = None
        if loop is None:
            self._remove_sockdir()
            return
        if server is not None:
            try:
                asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(5.0)
            except Exception:  # already stopped, or the loop is gone: nothing left to serve
                log.debug("OTLP/gRPC server stop", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5.0)
        if not loop.is_running():
            loop.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._loop = self._thread = self._pool = None
        self._remove_sockdir()

    def _remove_sockdir(self) -> None:
        if self._sockdir is not None:
            shutil.rmtree(self._sockdir, ignore_errors=True)
            self._sockdir = None

    def __enter__(self) -> GRPCReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def peer_address(peer: str | None) -> tuple[str, int]:
    """(address, port) from gRPC's peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``); port 0 for
    another kind (``unix:...``)."""
    if not peer:
        return "", 0
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("[") and "]:" in rest:
        host, _, port = rest[1:].partition("]:")
    elif kind == "ipv4":
        host, _, port = rest.rpartition(":")
    else:
        return rest, 0
    return host, int(port) if port.isdigit() else 0

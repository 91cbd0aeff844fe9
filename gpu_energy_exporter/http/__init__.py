"""The HTTP layer: a bounded selector server and the exporter-toolkit style web configuration.

Both ports (the exporter's ``/metrics`` and the OTLP receiver) run this server; nothing here knows what
they serve. Interface for other modules, each name imported from the module that defines it::

    from gpu_energy_exporter.http.messages import HTTPError, Request, Response
    from gpu_energy_exporter.http.server import HTTPServer

    def receive(req: Request) -> Response:
        body = req.read_body(max_bytes=8 << 20)   # already received in full; gzip decoded; limits
        ...                                        # raise HTTPError(413/400/415) by themselves
        return Response(200, payload, {"Content-Type": "application/x-protobuf"})

    server = HTTPServer(("localhost", 4318), {("POST", "/v1/metrics"): receive}, name="otlp",
                        max_body_bytes=8 << 20)  # bodies larger than this never reach memory
    server.start()              # a selector thread and a small worker pool (daemon threads); returns self
    server.server_address       # (host, port) actually bound; port 0 gives an ephemeral port
    server.url                  # "http://127.0.0.1:4318", for logs and tests
    server.shutdown()           # stop accepting, let in-flight requests finish, close idle keep-alive
                                # connections, join every thread (idempotent)

- Routes are exact ``(method, path)`` pairs (no query string in the path). ``HEAD`` is answered from the
  ``GET`` route with the body left out; a known path with another method gets 405 with ``Allow``; any
  other path 404.
- A handler takes a ``Request`` and returns a ``Response`` (status, body bytes, headers; the server adds
  ``Content-Length``). It may raise ``HTTPError(status, message)`` for a plain-text error; any other
  exception becomes a bare 500 and is logged with its traceback: a client never sees a traceback.
- Limits (connections per port, deadlines per request, strict parsing, bounded memory) and why the server
  is a selector thread plus a worker pool: ``server``'s docstring and docs/configuration.md.
- ``web_config`` (``webconfig.WebConfig``, from ``webconfig.load_web_config(path)``) adds TLS
  (non-blocking handshake on the selector thread, under the head deadline), the ``rate_limit`` token
  bucket (429), basic auth (401 with ``WWW-Authenticate``; 429 when too many bcrypt checks wait) and the
  configured extra headers, on every path, health endpoints included, as exporter-toolkit does. Order:
  rate limit, then auth, then routing (no path discovery without auth).
- ``unix_path=`` listens on that Unix-domain socket (mode 0666) instead of ``address``; its file is removed at
  shutdown, a stale one replaced at start.
- Listen addresses (``listen``): ``("", port)`` is every interface (IPv6 dual-stack where the host has
  IPv6, else IPv4); ``"0.0.0.0"``, ``"::"``, ``"[::1]"``, ``"127.0.0.1"`` and host names work as expected.
  A bind failure raises ``ConfigError`` naming the address. ``listen.client_url`` and
  ``listen.listen_text`` say where a server is, for a client and for a person.
- ``codec.inflate`` is the one size-limited decompressor (gzip, zlib, raw deflate) for request bodies.

The modules, top to bottom: ``server`` (threads, routing, auth order, public API) over ``connection``
(each connection's state machine and deadlines) over ``parsing`` (request framing, pure) and ``messages``
(``Request``/``Response``, a response's bytes); ``webconfig`` (the file to a frozen ``WebConfig``) over
``tls``, ``basicauth`` and ``ratelimit``; ``listen`` and ``codec`` stand alone. ``peers`` is what the kernel
says of a connection's peer (the socket table, ``SO_PEERCRED``; ``Request.connection``), ``splice`` hands an
HTTP/2 connection on a Unix-socket server (gRPC) over to the gRPC port.
"""

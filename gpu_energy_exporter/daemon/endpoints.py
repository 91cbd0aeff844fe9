"""The exporter's own endpoints on its ``/metrics`` port, as routes for ``http.server.HTTPServer``.

``exporter_routes`` / ``new_exporter_server`` build them: the telemetry path (Prometheus text 0.0.4 or
OpenMetrics by ``Accept``, gzip by ``Accept-Encoding``, ``name[]`` filtering cut from the same bytes as the
unfiltered body), ``/`` (landing page), ``/-/healthy`` and ``/-/ready``. The server itself, its limits and
its interface for other modules are the ``gpu_energy_exporter.http`` package's.

This module never samples anything: the metrics handler only serves bytes rendered from an in-memory
snapshot, so a slow or hung GPU driver cannot make a scrape slow.
"""

from __future__ import annotations

import gzip
import html
import logging
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from urllib.parse import parse_qs

from prometheus_client.registry import CollectorRegistry

from gpu_energy_exporter import __version__
from gpu_energy_exporter.core.bounded_memo import remember
from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.engine.exposition import select_samples
from gpu_energy_exporter.http.messages import PROJECT_NAME, Handler, Request, Response
from gpu_energy_exporter.http.server import HTTPServer
from gpu_energy_exporter.http.webconfig import WebConfig

log = logging.getLogger(__name__)

#: A readiness check: True/False, or (ready, reason shown in the 503 body).
ReadyCheck = Callable[[], "bool | tuple[bool, str]"]
#: Renders the exposition for an ``Accept`` header and an optional set of ``name[]`` sample names:
#: (body, content type); the body may be parts to write one after another (a tuple of bytes).
Render = Callable[[str, "frozenset[str] | None"], "tuple[bytes | tuple[bytes, ...], str]"]

# Level 1: scrape latency matters more than the last few percent of size; text metrics compress well.
_GZIP_LEVEL = 1

__all__ = [
    "Render", "ReadyCheck", "accepts_gzip", "exporter_routes", "inline_scrape", "new_exporter_server",
    "registry_render",
]


_GZIP_OK: dict[str | None, bool] = {}


def accepts_gzip(accept_encoding: str | None) -> bool:
    """True when an ``Accept-Encoding`` header allows gzip (``gzip;q=0`` does not). Remembered by header value
    (a scraper sends the same one every time)."""
    ok = _GZIP_OK.get(accept_encoding)
    if ok is None:
        ok = remember(_GZIP_OK, accept_encoding, _accepts_gzip(accept_encoding), 64)
    return ok


def _accepts_gzip(accept_encoding: str | None) -> bool:
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


def inline_scrape(telemetry_path: str) -> Callable[[Request], bool]:
    """Which requests the /metrics server handles on its selector thread (``HTTPServer``'s ``inline``):
    plain scrapes of the telemetry path. Their body is ready bytes written as parts (a fraction of a
    millisecond, also after every training series changed), less than the hand-off to a worker and back
    (a queue, a wake-up, two thread switches). A scrape asking for gzip (compressing a few hundred KiB takes
    milliseconds) or filtering with ``name[]`` (a pass over every line) goes to the worker pool, like every
    other path, so the selector never runs a long request."""

    def inline(req: Request) -> bool:
        return (req.method in ("GET", "HEAD") and req.path == telemetry_path and not req.query
                and not accepts_gzip(req.headers.get("Accept-Encoding")))

    return inline


def registry_render(registry: CollectorRegistry) -> Render:
    """A ``Render`` for a prometheus_client registry (tools and tests without a cached exposition):
    encoded whole, then cut by ``select_samples`` like the exporter's cached bytes."""

    from prometheus_client.exposition import choose_encoder  # heavy (http.server, ssl): tools and tests only

    def render(accept: str, names: frozenset[str] | None = None) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        body = encoder(registry)
        return (select_samples(body, names) if names is not None else body), content_type

    return render


def metrics_handler(render: Render) -> Handler:
    """The telemetry path: ``render(accept, names)`` gives the body (format by ``Accept``, ``?name[]=``
    filter); gzip by ``Accept-Encoding``."""

    def handle(req: Request) -> Response:
        accept = req.headers.get("Accept", "")
        names = parse_qs(req.query).get("name[]") if req.query else None
        body, content_type = render(accept, frozenset(names) if names else None)
        if accepts_gzip(req.headers.get("Accept-Encoding")):
            data = body if isinstance(body, bytes) else b"".join(body)
            return Response(200, gzip.compress(data, compresslevel=_GZIP_LEVEL, mtime=0),
                            _metrics_headers(content_type, True))
        return Response(200, body, _metrics_headers(content_type, False))

    return handle


_HEADERS: dict[tuple[str, bool], Mapping[str, str]] = {}


def _metrics_headers(content_type: str, gzipped: bool) -> Mapping[str, str]:
    """The telemetry path's response headers, one read-only mapping per content type and encoding (the server
    then reuses their encoded lines)."""
    headers = _HEADERS.get((content_type, gzipped))
    if headers is None:
        fields = {"Content-Type": content_type, "Vary": "Accept, Accept-Encoding"}
        if gzipped:
            fields["Content-Encoding"] = "gzip"
        headers = remember(_HEADERS, (content_type, gzipped), MappingProxyType(fields), 64)
    return headers


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
    routes[("GET", telemetry_path)] = metrics_handler(render or registry_render(registry))
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

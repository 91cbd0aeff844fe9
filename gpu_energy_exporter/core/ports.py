"""How messages name the exporter's three ports, and how a client tells that it reached the wrong one.

The workstation commands (``client/``: ``top``, ``runs``, ``report``, which read the metrics port) and the
training helper (``training/``, which pushes to an OTLP port) both meet the same mistakes: the metrics URL
given the OTLP/gRPC port, a trainer pointed at the gRPC port. They import the names from here, so a user
reads one wording whichever side they got wrong.

Pure text and bytes: this module never opens a socket, and imports nothing (the training helper loads it).
The default ports are defined here; ``daemon/config.py`` uses them for its flags.
"""

from __future__ import annotations

#: Default /metrics port. 9100 (node_exporter), 9400 (DCGM exporter), 9835 (nvidia_gpu_exporter) and
#: 9445 (nvidia-gpu-exporter forks) are taken; 9863 is unused in the Prometheus default port allocations.
DEFAULT_METRICS_PORT = 9863
#: OTLP/HTTP's registered port (the OpenTelemetry specification's default for HTTP exporters).
DEFAULT_OTLP_PORT = 4318
#: OTLP/gRPC's registered port (the OpenTelemetry specification's default for gRPC exporters).
DEFAULT_OTLP_GRPC_PORT = 4317

#: The port the JSON API, ``/metrics`` and the landing page are on (what ``top``, ``runs``, ``report`` read).
METRICS_PORT = f"the exporter's metrics port (--web.listen-address, {DEFAULT_METRICS_PORT} by default)"
#: The port trainers push OTLP/HTTP to.
OTLP_HTTP_PORT = f"the exporter's OTLP/HTTP port (--otlp.listen-address, {DEFAULT_OTLP_PORT} by default)"
#: The port trainers and Collectors push OTLP/gRPC to.
OTLP_GRPC_PORT = f"the exporter's OTLP/gRPC port (--otlp.grpc.listen-address, {DEFAULT_OTLP_GRPC_PORT} by default)"

#: HTTP/2 frame types a server sends first: SETTINGS (its connection preface, RFC 9113 section 3.4) or
#: GOAWAY (what a gRPC server answers to bytes that are not an HTTP/2 preface).
_SETTINGS, _GOAWAY = 0x4, 0x7


def is_http2_frame(head: bytes | str) -> bool:
    """Whether the first bytes a server sent are an HTTP/2 frame header (9 bytes: a 24-bit length, the
    type, flags, a stream id) of the kind a server opens with: what an HTTP/1.1 client reads as a status
    line when it reached a gRPC port. ``head`` may be the text ``http.client.BadStatusLine`` carries (its
    bytes decoded as ISO-8859-1, sometimes quoted)."""
    if isinstance(head, str):
        head = head.lstrip("'\"").encode("latin-1", errors="replace")
    # A server's first frame is short (SETTINGS: six bytes per setting; GOAWAY: eight and its debug text),
    # so its length starts with two zero bytes. A length whose low byte is 10 ends the "line" there.
    return len(head) >= 3 and head[:2] == b"\x00\x00" and (len(head) == 3 or head[3] in (_SETTINGS, _GOAWAY))


__all__ = [
    "DEFAULT_METRICS_PORT", "DEFAULT_OTLP_GRPC_PORT", "DEFAULT_OTLP_PORT", "METRICS_PORT", "OTLP_GRPC_PORT",
    "OTLP_HTTP_PORT", "is_http2_frame",
]

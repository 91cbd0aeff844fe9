"""A neighbour on the node: another process (not the test's, not one of its trainers) that pushes raw OTLP to
the exporter, as a hostile tenant would (issue 29). The test process cannot be its own neighbour: the exporter
identifies a pusher by the process the kernel sees at the other end of the connection, not by its source
address (any local process may bind 127.x.y.z) or its resource attributes.

``push(url, requests)`` runs one short-lived process that sends each request in turn and returns, per
request, (HTTP status, rejected data points, partial-success message). A request is a dict: ``doc`` (an OTLP
JSON ``ExportMetricsServiceRequest``), ``proto`` (send it as protobuf), ``source`` (the local address to bind),
``unix`` (a Unix socket path to send it over instead of TCP), ``headers``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

_SCRIPT = r'''
import http.client, json, socket, sys
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest, ExportMetricsServiceResponse)

class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=60)
        self.path_ = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.path_)

job = json.load(sys.stdin)
host, port = job["host"], job["port"]
out = []
for r in job["requests"]:
    if r.get("proto"):
        body = json_format.ParseDict(r["doc"], ExportMetricsServiceRequest()).SerializeToString()
        ctype = "application/x-protobuf"
    else:
        body, ctype = json.dumps(r["doc"]).encode(), "application/json"
    if r.get("unix"):
        conn = UnixConnection(r["unix"])
    else:
        conn = http.client.HTTPConnection(host, port, timeout=60, source_address=(r.get("source") or "127.0.0.1", 0))
    try:
        conn.request("POST", "/v1/metrics", body, {"Content-Type": ctype, **r.get("headers", {})})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    rejected, message = 0, ""
    if resp.status == 200 and data:
        if r.get("proto"):
            answer = ExportMetricsServiceResponse.FromString(data)
            rejected, message = answer.partial_success.rejected_data_points, answer.partial_success.error_message
        else:
            part = json.loads(data).get("partialSuccess", {})
            rejected, message = int(part.get("rejectedDataPoints", 0)), part.get("errorMessage", "")
    out.append([resp.status, int(rejected), message])
print(json.dumps(out))
'''


def push(address: tuple[str, int], requests: list[dict[str, Any]],
         timeout: float = 120.0) -> list[tuple[int, int, str]]:
    """Send ``requests`` from another process to the OTLP receiver at ``address`` (see the module docstring)."""
    job = {"host": address[0], "port": address[1], "requests": requests}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], input=json.dumps(job), capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise AssertionError(f"the neighbour process failed: {done.stderr[-2000:]}")
    return [(int(s), int(n), str(m)) for s, n, m in json.loads(done.stdout)]

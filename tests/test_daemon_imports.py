"""The daemon loads only what it uses: resident memory is a target (<= 40 MB on the fake library).

A fresh interpreter runs the real CLI's ``main()`` on the fake library with the default collectors (the OTLP/gRPC
receiver on, no client connected yet), waits
until it has taken samples and answered a scrape, and reports ``sys.modules``: the workstation clients, the
training helper, the OpenTelemetry SDK (the receiver needs only the protos), matplotlib, torch, and what
only optional features use (requests and urllib3 for --otlp.push-endpoint, yaml for --web.config.file,
bcrypt for basic auth) must not be among them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from fakenvml import Scenario, h100
from helpers import free_port

REPO = Path(__file__).resolve().parents[1]

#: Module prefixes the running daemon must not have imported (with the default flags).
NOT_LOADED = ("requests", "urllib3", "yaml", "bcrypt", "opentelemetry.sdk", "opentelemetry.exporter", "matplotlib",
              "torch", "transformers", "gpu_energy_exporter.training", "gpu_energy_exporter.client",
              # what prometheus_client's package __init__ brings (daemon/lean_imports.py): its HTTP servers and
              # clients, and with them OpenSSL (ssl, hashlib) and the email package: ~10 MB
              "prometheus_client.exposition", "http.server", "http.client", "urllib.request", "wsgiref", "email",
              "ssl", "_ssl", "hashlib", "_hashlib",
              # the OTLP/gRPC receiver's (on, no client yet): grpc, and asyncio with its own ssl
              "grpc", "asyncio", "concurrent.futures")

_CHILD = """
import json, os, socket, sys, threading, time
sys.path.insert(0, {repo!r})
sys.argv = ["gpu-energy-exporter", "--web.listen-address=127.0.0.1:{web}", "--otlp.listen-address=127.0.0.1:{otlp}",
            "--otlp.grpc.listen-address=127.0.0.1:{grpc}", "--nvml.library={lib}"]
from gpu_energy_exporter.daemon import cli

def http(port, request):
    # a raw socket: urllib and http.client would import what the daemon must not (ssl, email)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:200]

def report():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if "gpu_energy_exporter.devices.nvml" in sys.modules and "pynvml" in sys.modules:
            break
    time.sleep(2.5)  # a few samples
    for accept in (b"text/plain", b"application/openmetrics-text;version=1.0.0"):
        http({web}, b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\nAccept: " + accept
             + b"\\r\\nAccept-Encoding: gzip\\r\\nConnection: close\\r\\n\\r\\n")
    # an empty ExportMetricsServiceRequest (a rank with nothing to say yet): the receive path
    http({otlp}, b"POST /v1/metrics HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/x-protobuf"
         b"\\r\\nContent-Length: 0\\r\\nConnection: close\\r\\n\\r\\n")
    rss = [l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]
    print("@@OUT@@" + json.dumps({{"modules": sorted(sys.modules), "rss_kb": int(rss)}}), flush=True)
    os._exit(0)

threading.Thread(target=report, daemon=True).start()
cli.main()
"""


def test_the_running_daemon_never_imports_what_only_other_commands_or_flags_use(
        fake_nvml_lib: Path, tmp_path: Path) -> None:
    path = tmp_path / "scenario.ini"
    Scenario(epoch=time.time(), gpus=[h100(i) for i in range(2)]).write(path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
    env.update(FAKE_NVML_SCENARIO=str(path))
    script = textwrap.dedent(_CHILD.format(repo=str(REPO), lib=str(fake_nvml_lib), web=free_port(),
                                           otlp=free_port(), grpc=free_port()))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                          check=False, cwd=tmp_path)
    assert "@@OUT@@" in proc.stdout, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.split("@@OUT@@", 1)[1].splitlines()[0])
    modules = out["modules"]
    assert "gpu_energy_exporter.devices.nvml" in modules and "gpu_energy_exporter.otlp.receiver" in modules
    assert "gpu_energy_exporter.otlp.grpc_port_holder" in modules, "the gRPC receiver (on by default) holds its port"
    loaded = sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in NOT_LOADED))
    assert not loaded, f"the daemon imported {loaded}"


_LEAN_CHILD = """
import sys
sys.path.insert(0, {repo!r})
import gpu_energy_exporter.daemon.exporter  # a library import changes nothing: the whole package
assert "prometheus_client.exposition" in sys.modules, "importing the daemon as a library replaced a dependency"
for name in [m for m in sys.modules if m.startswith(("prometheus_client", "gpu_energy_exporter"))]:
    del sys.modules[name]
from gpu_energy_exporter.daemon.lean_imports import lean_prometheus_client
lean_prometheus_client()  # what the process's entry point (daemon.cli.main) does first
from prometheus_client.core import Metric
assert "prometheus_client.exposition" not in sys.modules, "the submodule import ran the package __init__"
import prometheus_client
assert prometheus_client.Metric is Metric, "a name of the package loads the whole package, then resolves"
from prometheus_client import CollectorRegistry, exposition, start_http_server
assert "prometheus_client.exposition" in sys.modules and callable(start_http_server)
r = CollectorRegistry()
assert exposition.generate_latest(r) == b""
from gpu_energy_exporter.daemon.lean_imports import few_malloc_arenas
print("OK", few_malloc_arenas())
"""


def test_the_lean_prometheus_client_still_gives_every_name_the_package_exports() -> None:
    script = textwrap.dedent(_LEAN_CHILD.format(repo=str(REPO)))
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK True", "glibc's mallopt(M_ARENA_MAX, 2) was refused"  # Debian: glibc


def test_the_date_header_is_email_utils_formatdate_without_the_email_package() -> None:
    import email.utils

    from gpu_energy_exporter.http.messages import http_date

    for t in (0, 951782400, 1_700_000_000, 1_798_761_599, 4_102_444_800, time.time()):
        assert http_date(t) == email.utils.formatdate(int(t), usegmt=True), t


def test_a_lazy_module_is_not_in_sys_modules_until_used() -> None:
    # Python 3.12's logging asks sys.modules["asyncio"] for the current task on every record: a lazy module
    # registered there was loaded by the first log line (+7 MB on a real H100's exporter, the gRPC receiver
    # on and no client). The stand-in stays out of sys.modules, so nothing but its own use loads it.
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, {repo!r})
        from gpu_energy_exporter.core.lazymodule import lazy
        colorsys = lazy("colorsys")
        assert "colorsys" not in sys.modules
        assert colorsys.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
        assert "colorsys" in sys.modules and colorsys.rgb_to_hsv is sys.modules["colorsys"].rgb_to_hsv
        print("OK")
    """).format(repo=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert proc.stdout.strip() == "OK", proc.stderr

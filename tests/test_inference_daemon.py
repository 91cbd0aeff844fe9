"""``--collector.inference`` wired in the daemon, end to end: a real in-process ``Exporter`` on simulated GPUs that
list this test process's pid (the stand-in servers of tests/inference_servers.py are threads of it: it holds
their listening sockets), scraping a stand-in vLLM server over HTTP on its own cadence. The serving session is a
run of kind ``serving`` in ``/api/v1/runs`` with tokens and energy, ``/metrics`` has ``gpuenergy_inference_*``,
and ``stop`` leaves no thread of the collector behind. Then discovery (``--collector.inference.discover``):
the server's port found through a fake ``--path.procfs`` tree (net/tcp, fd symlinks, stat) that lists the
port's listening socket under a GPU process.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import settle_rig
from helpers import sample_value, wait_until
from inference_servers import StandInServer, Trace, VLLMServer

from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.devices.simulated import SimulatedBackend

PID = os.getpid()
OUTPUT_RATE = 500.0  # output tokens per second of the stand-in server (on the real clock)
BASE = ["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0", "--otlp.grpc.listen-address=",
        "--no-collector.rapl", "--no-collector.host", "--collector.interval=100ms", "--collector.inference",
        "--collector.inference.interval=200ms", "--collector.inference.timeout=2s"]


def _get(exp: Exporter, path: str) -> str:
    assert exp.web is not None
    with urllib.request.urlopen(exp.web.url + path, timeout=10) as resp:
        return str(resp.read().decode())


def _serving(exp: Exporter) -> list[dict[str, Any]]:
    return [r for r in json.loads(_get(exp, "/api/v1/runs"))["runs"] if r.get("kind") == "serving"]


def _collector_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "inference" or t.name.startswith("inference-scrape")]


@pytest.fixture
def server() -> Iterator[StandInServer]:
    with VLLMServer("llama-3-8b", Trace.constant(prompt=2000.0, output=OUTPUT_RATE, requests=4.0)) as s:
        yield s


def _exporter(flags: list[str], pid: int = PID) -> tuple[Exporter, SimulatedBackend]:
    backend = SimulatedBackend(2)
    backend.set_load(1, 0.5, pid)  # GPU 1 lists the serving process; GPU 0 idles
    exp = Exporter(load_config(BASE + flags, {}), backend_factory=lambda: backend)
    return exp, backend


def test_a_serving_session_is_a_run_in_the_api_and_its_series_on_metrics(server: StandInServer) -> None:
    assert not _collector_threads()
    exp, _ = _exporter([f"--collector.inference.url={server.metrics_url}"])
    exp.start()
    try:
        def grown() -> list[dict[str, Any]]:
            runs = _serving(exp)
            return runs if runs and (runs[0].get("tokens") or 0) > 0 and (runs[0].get("energy_j") or 0) > 0 else []

        [s] = wait_until(grown, timeout=30, what="a serving session with tokens and energy")
        port = server.metrics_url.split(":")[2].split("/")[0]
        assert s["run_id"] == f"serving-{port}-{PID}" and s["status"] == "running"
        assert s["backend"] == "vllm" and s["model"] == "llama-3-8b" and s["gpu_count"] == 1
        # the session holds GPU 1 whole: its energy is that GPU's, none of GPU 0's
        assert s["energy_j"] > 0 and s["tokens"] > 0 and s["prompt_tokens"] > s["tokens"]
        doc = json.loads(_get(exp, "/api/v1/run?id=" + s["run_id"]))
        assert doc["serving"]["engine"] == "vllm" and doc["serving"]["pid"] == PID
        [model] = doc["serving"]["models"]
        assert model["model"] == "llama-3-8b" and model["output_tokens"] > 0 and model["energy_j"] > 0
        text = _get(exp, "/metrics")
        assert sample_value(text, "gpuenergy_inference_servers", engine="vllm") == 1.0
        assert (sample_value(text, "gpuenergy_inference_scrapes_total", result="ok") or 0) >= 1
        assert sample_value(text, "gpuenergy_inference_counter_resets_total") == 0.0
        assert 'gpuenergy_collector_success{collector="inference"} 1.0' in text
        assert _collector_threads(), "the collector's thread runs while the exporter does"
    finally:
        exp.stop()
    assert not [t for t in _collector_threads() if t.is_alive()], _collector_threads()


def test_the_collector_needs_a_url_or_discovery() -> None:
    from gpu_energy_exporter.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--collector.inference.url or --collector.inference.discover"):
        _exporter([])
    assert not _collector_threads()


# -- discovery through a fake procfs ---------------------------------------------------------------------

GPU_PID, LISTENER_PID, INODE = 4_100_002, 4_100_001, 912_345  # no such pids on this host: procfs is the fake's


def _stat(pid: int, ppid: int, ticks: int) -> str:
    fields = ["S", str(ppid)] + ["0"] * 17 + [str(ticks)] + ["0"] * 10
    return f"{pid} (python3) " + " ".join(fields) + "\n"


def fake_procfs(root: Path, port: int) -> Path:
    """A /proc with what the collector reads: the vLLM API server (``LISTENER_PID``) listening on ``port`` and its
    engine core (``GPU_PID``), the process NVML lists on the GPU; both in the host's pid namespace (status and
    cgroup: settle_rig's tree), so the GPU collector knows who the GPU process is."""
    settle_rig.fake_procfs(root, (LISTENER_PID, GPU_PID))
    (root / "net").mkdir(parents=True)
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    listen = f"   0: 0100007F:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000 0 {INODE} 1\n"
    other = "   1: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000  1000 0 777 1\n"
    (root / "net" / "tcp").write_text(header + listen + other)
    (root / "net" / "tcp6").write_text(header)
    (root / "stat").write_text("cpu  1 2 3 4\nbtime 1700000000\n")
    for pid, ppid, inodes in ((LISTENER_PID, 1, (INODE, 777)), (GPU_PID, LISTENER_PID, ())):
        d = root / str(pid)
        (d / "fd").mkdir()
        (d / "stat").write_text(_stat(pid, ppid, 1000))
        (d / "fd" / "0").symlink_to("/dev/null")
        for i, inode in enumerate(inodes):
            (d / "fd" / str(3 + i)).symlink_to(f"socket:[{inode}]")
    return root


def test_discovery_finds_the_server_listening_under_a_gpu_process(server: StandInServer, tmp_path: Path) -> None:
    port = int(server.metrics_url.split(":")[2].split("/")[0])
    procfs = fake_procfs(tmp_path / "proc", port)
    exp, _ = _exporter(["--collector.inference.discover", f"--path.procfs={procfs}"], pid=GPU_PID)
    exp.start()
    try:
        [s] = wait_until(lambda: [r for r in _serving(exp) if (r.get("energy_j") or 0) > 0 and r.get("tokens")],
                         timeout=30, what="a discovered serving session with tokens and energy")
        # the listener is the API server; its GPU is the one NVML lists its child (the engine core) on
        assert s["run_id"] == f"serving-{port}-{LISTENER_PID}" and s["gpu_count"] == 1
        doc = json.loads(_get(exp, "/api/v1/run?id=" + s["run_id"]))
        assert doc["serving"]["url"] == f"http://127.0.0.1:{port}/metrics"
        assert doc["serving"]["pid"] == LISTENER_PID
    finally:
        exp.stop()
    assert not [t for t in _collector_threads() if t.is_alive()], _collector_threads()


# -- the workstation commands, real, against that exporter -------------------------------------------------


def test_top_and_report_mark_the_serving_session_beside_a_training_run(server: StandInServer, tmp_path: Path
                                                                       ) -> None:
    import io

    from gpu_energy_exporter.client import report, top

    exp, _ = _exporter([f"--collector.inference.url={server.metrics_url}"])
    exp.start()
    try:
        [s] = wait_until(lambda: [r for r in _serving(exp) if (r.get("energy_j") or 0) > 0 and r.get("tokens")],
                         timeout=30, what="a serving session with tokens and energy")
        assert exp.web is not None
        out = io.StringIO()
        assert top.main(["--once", f"--url={exp.web.url}", "--ascii"], stdout=out) == 0
        frame = out.getvalue()
        assert "RUNS AND SERVING SESSIONS (1 active" in frame, frame
        row = next(line for line in frame.splitlines() if line.startswith(s["run_id"][:12]))
        assert "serving" in row.split(), row
        about = frame.splitlines()[frame.splitlines().index(row) + 1]
        assert about.split()[0] == "serving" and "J/token is J per output token" in about, about
        code = report.main([s["run_id"], f"--url={exp.web.url}", f"--out={tmp_path}"], stdout=io.StringIO(),
                           stderr=io.StringIO())
        assert code == 0
    finally:
        exp.stop()
    md = next(tmp_path.rglob("report.md")).read_text()
    assert f"Serving session report: {s['run_id']}" in md, md[:400]
    assert "| J per output token" in md and "| prompt tokens |" in md and "| requests |" in md
    assert "### Per model" in md and "### Per hour (UTC)" in md
    model_row = next(line for line in md.splitlines() if line.startswith("| llama-3-8b |"))
    cells = [c.strip() for c in model_row.strip("|").split("|")]
    assert float(cells[2].replace(",", "")) > 0 and cells[4].endswith("kWh") and cells[5] != "-", model_row
    assert "| steps |" not in md and "| MFU" not in md  # no training figures for a server

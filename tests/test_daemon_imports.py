"""The daemon loads only what it uses: resident memory is a target (<= 40 MB on the fake library).

A fresh interpreter runs the real CLI's ``main()`` on the fake library with the default collectors, waits
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

REPO = Path(__file__).resolve().parents[1]

#: Module prefixes the running daemon must not have imported (with the default flags).
NOT_LOADED = ("requests", "urllib3", "yaml", "bcrypt", "opentelemetry.sdk", "opentelemetry.exporter", "matplotlib",
              "torch", "transformers", "gpu_energy_exporter.training", "gpu_energy_exporter.client")

_CHILD = """
import json, os, sys, threading, time, urllib.request
sys.path.insert(0, {repo!r})
sys.argv = ["gpu-energy-exporter", "--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
            "--nvml.library={lib}"]
from gpu_energy_exporter.daemon import cli

def report():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if "gpu_energy_exporter.devices.nvml" in sys.modules and "pynvml" in sys.modules:
            break
    time.sleep(2.5)  # a few samples
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
    script = textwrap.dedent(_CHILD.format(repo=str(REPO), lib=str(fake_nvml_lib)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                          check=False, cwd=tmp_path)
    assert "@@OUT@@" in proc.stdout, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.split("@@OUT@@", 1)[1].splitlines()[0])
    modules = out["modules"]
    assert "gpu_energy_exporter.devices.nvml" in modules and "gpu_energy_exporter.otlp.receiver" in modules
    loaded = sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in NOT_LOADED))
    assert not loaded, f"the daemon imported {loaded}"

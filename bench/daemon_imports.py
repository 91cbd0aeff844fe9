"""What the daemon's imports cost in resident memory: the real CLI's ``main()`` on 8 fake H100s at the defaults
(OTLP/gRPC receiver on, no client), after a few samples, a scrape in each format and an empty OTLP push,
three times each way: as it runs (``main`` loads prometheus_client's submodules without its package
``__init__``, ``daemon/lean_imports.py``) and with the whole package imported first.

``python -m bench.daemon_imports``. Memory is VmRSS from /proc/self/status inside the child (the child of
tests/test_daemon_imports.py, the same script). Never asserts a figure.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fakenvml import Scenario, h100  # noqa: E402
from fakenvml.build import build_library  # noqa: E402
from helpers import free_port  # noqa: E402
from test_daemon_imports import _CHILD  # noqa: E402


def measure(lib: Path, env: dict[str, str], whole_package: bool) -> float:
    script = textwrap.dedent(_CHILD.format(repo=str(ROOT), lib=str(lib), web=free_port(), otlp=free_port(),
                                           grpc=free_port()))
    if whole_package:
        script = script.replace("from gpu_energy_exporter.daemon import cli",
                                "import prometheus_client\nfrom gpu_energy_exporter.daemon import cli")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    if "@@OUT@@" not in proc.stdout:
        raise SystemExit(f"the daemon failed:\n{proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.split("@@OUT@@", 1)[1].splitlines()[0])["rss_kb"]) / 1024


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_library(Path(tmp))
        scenario = Path(tmp) / "scenario.ini"
        Scenario(epoch=time.time(), gpus=[h100(i) for i in range(8)]).write(scenario)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
        env.update(FAKE_NVML_SCENARIO=str(scenario))
        rows = {"as it runs (daemon/lean_imports.py)": [], "the whole prometheus_client package": []}
        for _ in range(3):
            for name, whole in zip(rows, (False, True), strict=True):
                rows[name].append(measure(lib, env, whole))
    print("`python -m bench.daemon_imports`: the daemon's VmRSS, 8 fake H100s, defaults, after a scrape\n")
    print("| imports | RSS MB, 3 runs | median |\n|---|---|---:|")
    for name, values in rows.items():
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the health collector adds per sample: NVML calls and CPU, on the fake library, with the real-driver
estimate from the per-call costs measured on an H100 (/work/shared/reference/real-gpu-h100.md, quoted in
docs/health.md).

``python -m bench.health_cost [--gpus 8] [--reads 20]`` runs the gpu and health collectors in a child process
on the fake library (8 H100s, each with 18 NVLink links: the most calls a health read makes), counts the NVML
calls of one health read from the library's call log, and times (``time.process_time``) the health
collector's updates: with a read, and between reads (served from the last read: no NVML call). It prints a
table; nothing is asserted (tests/test_health.py holds the call count).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: CPU per call on the real H100 driver (docs/health.md; reference/real-gpu-h100.md), (low, high) seconds.
#: NVLink state and error counters answered NOT_SUPPORTED on that H100 (a VM): taken as a cheap getter.
REAL_CPU_S: dict[str, tuple[float, float]] = {
    "nvmlDeviceGetTotalEccErrors": (4e-6, 100e-6),
    "nvmlDeviceGetRemappedRows": (3e-6, 3e-6),
    "nvmlDeviceGetPcieReplayCounter": (185e-6, 185e-6),
    "nvmlDeviceGetPcieThroughput": (870e-6, 870e-6),
    "nvmlDeviceGetCurrPcieLinkGeneration": (15e-6, 30e-6),
    "nvmlDeviceGetMaxPcieLinkGeneration": (15e-6, 30e-6),
    "nvmlDeviceGetCurrPcieLinkWidth": (15e-6, 30e-6),
    "nvmlDeviceGetMaxPcieLinkWidth": (15e-6, 30e-6),
    "nvmlDeviceGetNvLinkState": (1e-6, 50e-6),
    "nvmlDeviceGetNvLinkErrorCounter": (1e-6, 50e-6),
    "nvmlDeviceGetFieldValues": (5e-6, 60e-6),
}
#: A 200 ms event wait with nothing happening cost 0.11 ms of CPU on the H100; the watcher waits 500 ms.
EVENT_WAIT_CPU_S = 0.11e-3
EVENT_WAIT_S = 0.5

_CHILD = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
from gpu_energy_exporter.collectors.gpu import GPUCollector
from gpu_energy_exporter.collectors.health.collector import HealthCollector
from gpu_energy_exporter.devices import nvml
t = [0.0]
gpu = GPUCollector(lambda: nvml.NVMLBackend({lib!r}), retry_interval=0.0, power_interval=3600.0)
health = HealthCollector(gpu, interval=30.0, monotonic=lambda: t[0])
gpu.update()
health.update()
# the event thread's calls (registration, then waits) are not the health read's
EVENTS = ("nvmlEventSet", "nvmlDeviceRegisterEvents", "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceGetHandleByIndex")
def calls():
    with open({log!r}) as f:
        return [l.split()[2] for l in f if l.split()[1] == str(os.getpid()) and not l.split()[2].startswith(EVENTS)]
read_cpu, idle_cpu = [], []
for _ in range({reads}):
    t[0] += 30.0
    start = len(calls())
    c0 = time.process_time(); health.update(); read_cpu.append(time.process_time() - c0)
    read_calls = calls()[start:]
    t[0] += 1.0
    c0 = time.process_time(); health.update(); idle_cpu.append(time.process_time() - c0)
health.close(); gpu.close()
print("@@OUT@@" + json.dumps({{"read_calls": read_calls, "read_cpu": read_cpu, "idle_cpu": idle_cpu}}))
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.health_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--reads", type=int, default=20)
    parser.add_argument("--interval", type=float, default=30.0, help="--collector.health.interval, seconds")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from fakenvml import Driver, Scenario, build_library, h100
    from fakenvml.health import HEALTHY_H100

    with tempfile.TemporaryDirectory(prefix="gee-health-") as tmp:
        work = Path(tmp)
        lib = build_library(work / "lib")
        scenario, log = work / "scenario.ini", work / "calls.log"
        Scenario(epoch=1_750_000_000.0, driver=Driver(frozen_time=1_750_000_100.0),
                 gpus=[h100(i, health=HEALTHY_H100) for i in range(args.gpus)]).write(scenario)
        log.touch()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
        env.update(FAKE_NVML_SCENARIO=str(scenario), FAKE_NVML_CALL_LOG=str(log))
        script = textwrap.dedent(_CHILD.format(repo=str(REPO), lib=str(lib), log=str(log), reads=args.reads))
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                              check=False)
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr, file=sys.stderr)
        return 1
    out = json.loads(proc.stdout.split("@@OUT@@", 1)[1])
    calls = Counter(out["read_calls"])
    per_gpu = {fn: n / args.gpus for fn, n in sorted(calls.items())}
    read_cpu = sorted(out["read_cpu"])[len(out["read_cpu"]) // 2]
    idle_cpu = sorted(out["idle_cpu"])[len(out["idle_cpu"]) // 2]
    low = sum(n * REAL_CPU_S[fn][0] for fn, n in per_gpu.items()) * args.gpus
    high = sum(n * REAL_CPU_S[fn][1] for fn, n in per_gpu.items()) * args.gpus
    events = EVENT_WAIT_CPU_S / EVENT_WAIT_S
    print(f"# health collector cost: {args.gpus} H100 (18 NVLink links each), read every {args.interval:g}s\n")
    print("| NVML call | calls per GPU per health read | real-driver CPU per call |")
    print("|---|---|---|")
    for fn, n in per_gpu.items():
        lo, hi = REAL_CPU_S[fn]
        print(f"| `{fn}` | {n:g} | {lo * 1e6:g}-{hi * 1e6:g} µs |")
    print(f"| total | {sum(per_gpu.values()):g} | |\n")
    print("| figure | value |")
    print("|---|---|")
    print(f"| CPU of an update with a health read, fake library (median of {args.reads}) | {read_cpu * 1e3:.2f} ms |")
    print(f"| CPU of an update between reads (no NVML call) | {idle_cpu * 1e6:.0f} µs |")
    print(f"| real-driver CPU of one health read, estimated | {low * 1e3:.1f}-{high * 1e3:.1f} ms |")
    print(f"| share of one core, estimated: reads (every {args.interval:g}s) | "
          f"{low / args.interval * 100:.3f}-{high / args.interval * 100:.3f}% |")
    print(f"| share of one core, estimated: event thread (0.11 ms per {EVENT_WAIT_S:g}s wait) | {events * 100:.3f}% |")
    print(f"| share of one core, fake library: Python per second (1 read per {args.interval:g}s, updates every 1s) | "
          f"{(read_cpu + (args.interval - 1) * idle_cpu) / args.interval * 100:.3f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Micro-benchmark of what a request of new runs costs the run ledger, by how far back its points are dated
(issue 20, item 6: requests of 16 new runs dated 20 s back held the exporter at 101% of a core at 1.8
requests/s, undated ones 266 requests/s at 82%).

One GPU sampled every 100 ms (the default power interval), one victim run pushing every second, 300 s of
history; then requests of 16 new runs (a tokens point and a finish each, as the junk of item 9) dated 0, 20
and 200 s before they arrive, each followed by one snapshot (which settles the recounts the request caused
and closes the runs). Per request: wall time in the
ledger (``on_points`` and the snapshot), snapshot intervals counted for runs (each asks who held the GPU
then), and the requests per second one core could take. The per-client run bounds are lifted so every
request starts its 16 runs. Not part of ``python -m bench``: run ``python -m bench.ledger_backdated``.

``python -m bench.ledger_backdated --exporter`` measures the same attack on the exporter process (fake H100,
raw OTLP JSON over HTTP, 1.8 requests/s for 30 s after 25 s of history, beside a victim run pushing with
every request): its CPU and the slowest push, with the default per-client bounds and with them lifted.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from gpu_energy_exporter.core.state import ENERGY_METHOD_COUNTER, GPUIdentity, GPUReading, GPUState, Snapshot
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.snapshot_frames import Frame
from gpu_energy_exporter.otlp.store import AcceptedPoint

T0 = 1_700_000_000.0
UUID = "GPU-00000000-0000-4000-8000-000000000001"
LABELS = {"rank": "0", "gpu_uuid": UUID}
REQUESTS = 10


class Counting(RunLedger):
    visited = 0

    def _holders(self, frame: Frame) -> Any:
        Counting.visited += 1
        return super()._holders(frame)


def _ledger(clock: list[float]) -> RunLedger:
    unbounded = dict(new_runs_per_client_per_minute=1e9, finished_runs_per_client_per_minute=1e9,
                     max_active_per_client=1 << 30, max_active_runs=1 << 30)
    try:
        return Counting(None, warmup_s=0.0, stale_after_s=600.0, clock=lambda: clock[0], **unbounded)
    except TypeError:  # a ledger without per-client bounds (before issue 20)
        return Counting(None, warmup_s=0.0, stale_after_s=600.0, clock=lambda: clock[0], max_active_runs=1 << 30)


def _snap(ledger: RunLedger, t: float) -> None:
    identity = GPUIdentity(index=0, uuid=UUID, name="NVIDIA H100 80GB HBM3", pci_bus_id="0:0", architecture="hopper",
                           compute_capability="9.0", energy_method=ENERGY_METHOD_COUNTER, power_usage_is_average=True)
    reading = GPUReading(timestamp=t, power_instant_w=300.0, memory_used_bytes=10 << 30, memory_total_bytes=80 << 30)
    gpu = GPUState(identity=identity, up=True, reading=reading, energy_j=300.0 * (t - T0), energy_resets=0,
                   last_good=t, idle_power_w=100.0, idle_power_source="flag")
    ledger.on_snapshot(Snapshot(seq=round((t - T0) * 10), timestamp=t, families=(), results=(), gpus=(gpu,)))


def _point(run_id: str, value: float, t: float, name: str = "training_tokens_total") -> AcceptedPoint:
    kind = "counter" if name.endswith("_total") else "gauge"
    return AcceptedPoint(run_id, name, {"run_id": run_id, **LABELS}, value, t, kind)  # type: ignore[arg-type]


def measure(back_s: float) -> tuple[float, float]:
    """(ms per request, intervals counted per request) for requests dated ``back_s`` back."""
    clock = [T0]
    ledger = _ledger(clock)
    t = T0
    _snap(ledger, t)
    ledger.on_point(_point("victim", 0.0, t))
    for i in range(1, 3001):  # 300 s at 100 ms
        t = T0 + i / 10
        clock[0] = t
        if i % 10 == 0:
            ledger.on_point(_point("victim", 100.0 * (t - T0), t))
        _snap(ledger, t)
    elapsed, visited = 0.0, Counting.visited
    for r in range(REQUESTS):
        points = [p for k in range(16) for p in (_point(f"new-{r}-{k}", 1.0, t - back_s),
                                                 _point(f"new-{r}-{k}", 1.0, t - back_s, "training_run_finished"))]
        t += 0.1
        clock[0] = t
        start = time.perf_counter()
        ledger.on_points(points)
        _snap(ledger, t)
        elapsed += time.perf_counter() - start
    return elapsed / REQUESTS * 1e3, (Counting.visited - visited) / REQUESTS


def _attrs(labels: dict[str, str]) -> list[dict[str, Any]]:
    return [{"key": k, "value": {"stringValue": v}} for k, v in labels.items()]


def _tokens(run_id: str, uuid: str, value: float, t_ns: int) -> dict[str, Any]:
    return {"name": "training.tokens", "unit": "{token}", "sum": {"aggregationTemporality": 2, "isMonotonic": True,
            "dataPoints": [{"attributes": _attrs({"run_id": run_id, "rank": "0", "gpu_uuid": uuid}),
                            "startTimeUnixNano": str(t_ns), "timeUnixNano": str(t_ns), "asDouble": value}]}}


def exporter_attack(back_s: float, args: list[str], rate: float = 1.8, duration_s: float = 30.0) -> str:
    """One table row: the exporter's CPU and slowest push under the attack (see the module docstring)."""
    import fakenvml
    from helpers import ExporterProcess

    from bench.harness import cpu_seconds

    tmp = Path(tempfile.mkdtemp(prefix="ledger-backdated-"))
    gpus = [fakenvml.h100(0, power=fakenvml.Constant(300.0))]
    fakenvml.Scenario(epoch=time.time() - 60, gpus=gpus).write(tmp / "scenario.ini")
    exp = ExporterProcess([f"--nvml.library={fakenvml.build_library(tmp)}", f"--runs.csv={tmp}/runs.csv",
                           "--runs.warmup=0s", *args], {"FAKE_NVML_SCENARIO": str(tmp / "scenario.ini")}).wait_ready()

    def post(metrics: list[dict[str, Any]]) -> float:
        body = json.dumps({"resourceMetrics": [{"scopeMetrics": [{"metrics": metrics}]}]}).encode()
        req = urllib.request.Request(exp.push_url, data=body, headers={"Content-Type": "application/json"})
        start = time.monotonic()
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
        return time.monotonic() - start

    try:
        time.sleep(25.0)  # history to date the points into
        cpu0, t0, n, slowest = cpu_seconds(exp.pid), time.monotonic(), 0, 0.0
        while time.monotonic() - t0 < duration_s:
            dated = int((time.time() - back_s) * 1e9)
            slowest = max(slowest, post([_tokens("victim", gpus[0].uuid, float(n), time.time_ns())]))
            slowest = max(slowest, post([_tokens(f"new-{n}-{k}", gpus[0].uuid, 1.0, dated) for k in range(16)]))
            n += 1
            time.sleep(max(0.0, n / rate - (time.monotonic() - t0)))
        elapsed = time.monotonic() - t0
        cpu = (cpu_seconds(exp.pid) - cpu0) / elapsed
    finally:
        exp.stop()
    bounds = "lifted" if args else "default"
    return f"| {back_s:g} s back | {bounds} | {n / elapsed:.1f} | {cpu:.0%} | {slowest * 1e3:,.0f} |"


def main() -> None:
    if "--exporter" in sys.argv[1:]:
        print("| first points dated | per-client bounds | requests/s reached | exporter CPU (of one core) | "
              "slowest push (ms) |")
        print("|---|---|---|---|---|")
        lifted = ["--runs.max-new-per-client=1000000", "--runs.max-active-per-client=1000000"]
        for back, args in ((0.0, []), (20.0, []), (20.0, lifted)):
            try:
                print(exporter_attack(back, args), flush=True)
            except AssertionError:  # an exporter without these flags (before issue 20)
                print(exporter_attack(back, []), flush=True)
        return
    print("| first points dated | ms per request (16 new runs + 1 snapshot) | intervals counted per request | "
          "requests/s per core |")
    print("|---|---|---|---|")
    for back in (0.0, 20.0, 200.0):
        ms, visited = measure(back)
        print(f"| {back:g} s back | {ms:.1f} | {visited:,.0f} | {1e3 / ms:,.0f} |")


if __name__ == "__main__":
    main()

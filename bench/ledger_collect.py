"""Micro-benchmark of the run ledger's scrape-time cost: ``RunLedger.collect()`` (what /metrics calls when
the ledger's version changed) and ``on_snapshot`` (the sampler's call, holding the ledger's lock).

10 runs x 8 ranks sharing 8 GPUs (like scrape_latency's 1,000 series), one snapshot per second, every
rank exporting every 10 s, stamped 0.3 s before the snapshot that follows. Not part of ``python -m bench``:
run ``python -m bench.ledger_collect [SECONDS]`` (default 600 s of simulated run before measuring).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from gpu_energy_exporter.core.state import ENERGY_METHOD_COUNTER, GPUIdentity, GPUReading, GPUState, Snapshot
from gpu_energy_exporter.ledger import RunLedger

T0 = 1_700_000_000.0
UUIDS = [f"GPU-{i:08x}-0000-4000-8000-000000000001" for i in range(8)]
RUNS, RANKS = 10, 8
COUNTERS = ("training_tokens_total", "training_samples_total", "training_steps_total", "training_flops_total")


class Ledger:
    def __init__(self) -> None:
        self.t = T0
        self.ledger = RunLedger(None, warmup_s=30.0, stale_after_s=300.0, clock=lambda: self.t)

    def snap(self) -> None:
        gpus = []
        for i, uuid in enumerate(UUIDS):
            watts = 300.0 + 10 * i
            identity = GPUIdentity(index=i, uuid=uuid, name="NVIDIA H100 80GB HBM3", pci_bus_id=f"0:{i}",
                                   architecture="hopper", compute_capability="9.0",
                                   energy_method=ENERGY_METHOD_COUNTER, power_usage_is_average=True)
            reading = GPUReading(timestamp=self.t, power_instant_w=watts, memory_used_bytes=10 << 30,
                                 memory_total_bytes=80 << 30)
            gpus.append(GPUState(identity=identity, up=True, reading=reading, energy_j=watts * (self.t - T0),
                                 energy_resets=0, last_good=self.t, idle_power_w=100.0, idle_power_source="flag"))
        self.ledger.on_snapshot(Snapshot(seq=int(self.t - T0), timestamp=self.t, families=(), results=(),
                                         gpus=tuple(gpus)))

    def export(self, run: int, rank: int, t: float) -> None:
        labels = {"run_id": f"run-{run}", "rank": str(rank), "gpu_uuid": UUIDS[rank]}
        for name in COUNTERS:
            self.ledger.record(f"run-{run}", name, labels, 1000.0 * (t - T0), t)
        self.ledger.record(f"run-{run}", "training_loss", labels, 1.0 / (t - T0 + 1), t)


def timed(label: str, before: Callable[[], None], call: Callable[[], object], n: int = 50) -> None:
    times = []
    for _ in range(n):
        before()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"{label}: median {times[n // 2] * 1e3:.2f} ms, p90 {times[int(n * 0.9)] * 1e3:.2f} ms")


def main(argv: list[str]) -> None:
    seconds = int(argv[0]) if argv else 600
    b = Ledger()
    b.snap()
    for r in range(RUNS):
        for k in range(RANKS):
            b.export(r, k, T0 + 0.5)
    for sec in range(1, seconds + 1):
        b.t = T0 + sec
        for r in range(RUNS):
            for k in range(RANKS):
                if (sec + r + k) % 10 == 0:
                    b.export(r, k, b.t - 0.3)
        b.snap()

    def one_export() -> None:
        b.export(0, 0, b.t - 0.2)

    def next_snapshot() -> None:
        b.t += 1.0
        b.snap()

    print(f"{RUNS} runs x {RANKS} ranks on {len(UUIDS)} GPUs after {seconds} s:")
    timed("collect(), nothing changed", lambda: None, b.ledger.collect)
    timed("collect() after one rank's export", one_export, b.ledger.collect)
    timed("collect() after one snapshot", next_snapshot, b.ledger.collect)

    def advance() -> None:
        b.t += 1.0

    timed("on_snapshot() (ledger lock held)", advance, b.snap)


if __name__ == "__main__":
    main(sys.argv[1:])

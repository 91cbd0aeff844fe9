"""Simulated GPUs for ``gpu-energy-exporter demo`` (no driver needed).

Every series it produces is marked: the ``backend="simulated"`` label on ``gpuenergy_gpu_info`` and
``gpuenergy_nvml_info``, "(simulated)" in the model name and UUIDs starting with ``GPU-SIM``. Never use it
for measurements. Power follows a load level that the demo's simulated trainer sets: idle at ~18% of
the power limit, a slow swing with a small step ripple under load; the energy counter is the integral of
that power, so the instant power the exporter samples brackets the counter's average.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from gpu_energy_exporter.core.state import ENERGY_METHOD_COUNTER, GPUIdentity, GPUProcess, GPUReading
from gpu_energy_exporter.devices.base import GPUBackend, joules, ratio


class _SimGPU:
    def __init__(self, index: int, t0: float, limit_w: float, memory_total: int) -> None:
        self.index = index
        self.limit_w = limit_w
        self.idle_w = 0.18 * limit_w
        self.memory_total = memory_total
        self.load = 0.0  # 0..1, set by the simulated trainer
        self.pid: int | None = None
        self.energy_j = 0.0
        self.last_t = t0

    def power_at(self, t: float) -> float:
        if self.load <= 0:
            return self.idle_w
        # A slow swing (7 s period) and a small ripple at the ~80 ms step rate. Mostly slow on purpose: the
        # exporter samples instant power once a second, and a trace dominated by fast bursts aliases with that
        # rate, so the sampled peak could fall below the counter's average power (issue 12: a demo whose
        # "peak" was below its "average"). With this trace every 1 s sampling of a run of 7 s or more sees a
        # value above the average, as a real GPU's would.
        slow = 0.12 * math.sin(2 * math.pi * t / 7.0 + self.index)
        ripple = 0.03 * math.sin(2 * math.pi * 12.5 * t + 0.37 * self.index)
        return self.idle_w + (self.limit_w - self.idle_w) * self.load * (0.82 + slow + ripple)

    def advance(self, t: float) -> None:
        # Integrate with 10 ms steps (the trace changes at 80 ms granularity).
        step = 0.01
        while self.last_t + step <= t:
            self.energy_j += self.power_at(self.last_t + step / 2) * step
            self.last_t += step
        if t > self.last_t:
            self.energy_j += self.power_at((self.last_t + t) / 2) * (t - self.last_t)
            self.last_t = t


class SimulatedBackend(GPUBackend):
    kind = "simulated"

    def __init__(self, count: int = 2, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        t0 = clock()
        self._gpus = [_SimGPU(i, t0, 700.0, 80 * 1024**3) for i in range(count)]
        self._ids = [
            GPUIdentity(
                index=i, uuid=f"GPU-SIM{i:05d}-0000-4000-8000-00000000000{i}",
                name="NVIDIA H100 80GB HBM3 (simulated)", pci_bus_id=f"00000000:{0x17 + i:02X}:00.0",
                architecture="hopper", compute_capability="9.0", energy_method=ENERGY_METHOD_COUNTER,
                power_usage_is_average=True,
            )
            for i in range(count)
        ]

    def set_load(self, index: int, load: float, pid: int | None = None) -> None:
        """Drive GPU ``index`` at ``load`` (0..1) on behalf of process ``pid`` (None when idle)."""
        with self._lock:
            g = self._gpus[index]
            g.advance(self._clock())
            g.load = max(0.0, min(1.0, load))
            g.pid = pid if load > 0 else None

    def driver_version(self) -> str:
        return "simulated"

    def devices(self) -> list[GPUIdentity]:
        return list(self._ids)

    def read_power_w(self, gpu: GPUIdentity) -> float | None:
        return self._gpus[gpu.index].power_at(self._clock())

    def read(self, gpu: GPUIdentity, *, processes: bool = False, process_utilization: bool = False,
             gpm: bool = False, energy: bool = True, fresh_processes: bool = True) -> GPUReading:
        # a simulated list costs nothing: always fresh, whatever ``fresh_processes`` allows
        now = self._clock()
        with self._lock:
            g = self._gpus[gpu.index]
            g.advance(now)
            power = g.power_at(now)
            avg = sum(g.power_at(now - (k + 0.5) * 0.05) for k in range(20)) / 20  # NVML's 1 s average
            load = g.load
            energy_mj = int(g.energy_j * 1000)  # an integer millijoule counter, as NVML's
            pid = g.pid
        used = int(g.memory_total * (0.05 + 0.8 * load))
        sm = 95.0 * load if process_utilization else None
        procs: tuple[GPUProcess, ...] | None = (
            ((GPUProcess(pid=pid, used_memory_bytes=used, sm_util_pct=sm),) if pid else ())
            if processes or process_utilization else None
        )
        return GPUReading(
            timestamp=now, energy_j=joules(energy_mj) if energy else None, power_instant_w=power, power_average_w=avg,
            power_limit_w=g.limit_w, memory_used_bytes=used, memory_total_bytes=g.memory_total,
            memory_reserved_bytes=512 * 1024**2,
            util_gpu_ratio=ratio(98.0 * load), util_memory_ratio=ratio(55.0 * load),
            temperature_gpu_c=34 + 40 * load, temperature_memory_c=38 + 35 * load,
            clock_sm_hz=1980e6 if load else 345e6, clock_memory_hz=2619e6,
            clock_events=frozenset({"gpu_idle"}) if load == 0 else frozenset(),
            processes=procs,
            # The simulated driver speaks percent like NVML, so the ratios are the same floats as a real GPU's.
            gpm={"sm_active": ratio(80.0 * load), "sm_occupancy": ratio(45.0 * load),
                 "tensor_active": ratio(60.0 * load), "dram_bandwidth": ratio(40.0 * load),
                 "graphics_active": ratio(98.0 * load)} if gpm else {},
        )

"""A whole node in one process on a frozen clock, for settlement tests (issue 28): the fake NVML library with
scripted power and per-process SM traces, the real GPU collector and sampler reading it through pynvml at the
daemon's defaults (a sample a second, the energy counter every 30 s), the real run ledger fed by them, and
trainers pushing points as the training helper does. The clock only moves when the rig steps it, so every
figure is exact arithmetic on the scenario, whatever the machine's load.

Edges as the daemon makes them: a run's first point and its finish make the exporter read every energy
counter at once (``counter_reads_at_run_edges`` and the sampler's early sample), ``EDGE_LATENCY_S`` after
the point (the export's delay, the request and the wake-up).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fakenvml import Process, Scenario, h100
from fakenvml.scenario import Driver, PowerTrace

from gpu_energy_exporter.collectors.gpu import GPUCollector
from gpu_energy_exporter.core import contract
from gpu_energy_exporter.core.state import Snapshot
from gpu_energy_exporter.daemon.exporter import counter_reads_at_run_edges
from gpu_energy_exporter.devices.nvml import NVMLBackend
from gpu_energy_exporter.engine.sampler import Sampler
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.otlp.store import AcceptedPoint

EPOCH = 1_750_000_000.0
EDGE_LATENCY_S = 0.02
INTERVAL = 1.0
ENERGY_INTERVAL = 30.0  # the flag's default
PROCESS_INTERVAL = 10.0  # --collector.gpu.process-interval's default


@dataclass
class Pusher:
    """One trainer process: pushes cumulative tokens every ``every`` s from ``start`` to ``end`` under
    ``run_id``, as ``pid`` (in the rig's /proc), on ``gpu``."""

    run_id: str
    start: float
    end: float
    gpu: str
    pid: int | None = 4242
    rate: float = 1000.0
    every: float = 5.0
    rank: str = "0"
    client: str = "node-1"  # core.clientid's client string the receiver would give its points
    pushed: list[float] = field(default_factory=list)
    finished: bool = False

    def resource(self) -> tuple[tuple[str, str], ...]:
        if self.pid is None:
            return ()
        return ((contract.LABEL_HOST_NAME, "node-1"), (contract.LABEL_PROCESS_PID, str(self.pid)))

    def point(self, name: str, value: float, t: float) -> AcceptedPoint:
        labels = {"run_id": self.run_id, "rank": self.rank, "gpu_uuid": self.gpu}
        kind = "counter" if name.endswith("_total") else "gauge"
        return AcceptedPoint(self.run_id, name, labels, value, t, kind, resource=self.resource(),  # type: ignore[arg-type]
                             client=self.client)


class Node:
    """The fake GPUs, the GPU collector, the sampler and the ledger on one frozen clock."""

    def __init__(self, lib: Path, tmp: Path, gpus: Sequence[Any], *, warmup_s: float = 0.0,
                 claim_grace_s: float = 30.0, carbon: Callable[[], tuple[float, float]] | None = None,
                 settle: bool = True, early: bool = True, jitter: float = 0.0, seed: int = 1,
                 state_dir: str | None = None, read_lag: Callable[[int], float] | None = None) -> None:
        """``state_dir``: the ledger's database directory (``restart`` reopens it). ``settle`` False: the ledger
        gets the GPU states without their spans (charged from the apportioned
        energy at each sample, as before issue 28); ``early`` False: an edge reads the counters at the next
        tick instead of a sample taken at once (the benchmark's "before"). ``jitter``: each sample taken up to
        that many seconds late, as on a loaded machine (a deterministic sequence from ``seed``). ``read_lag``:
        seconds the clock moves on before each GPU's read (given its index), as a sample on a loaded machine
        reads its GPUs one after the other, each after a wait of its own."""
        self._jitter = jitter
        self._read_lag = read_lag
        self._rng = random.Random(seed)
        self.now = EPOCH + 5.0
        self.gpus = list(gpus)
        # the host's /proc as the exporter sees it with hostPID: every process the GPUs list
        procfs = fake_procfs(tmp / "proc", sorted({p.pid for g in self.gpus for p in g.processes}))
        self.path = tmp / "scenario.ini"
        self._old = os.environ.get("FAKE_NVML_SCENARIO")
        os.environ["FAKE_NVML_SCENARIO"] = str(self.path)
        self.write()
        self._lib, self._procfs, self._settle, self._early = lib, procfs, settle, early
        self._new_ledger = lambda: RunLedger(str(tmp / "runs.csv"), warmup_s=warmup_s, stale_after_s=300.0,
                                             clock=self.clock, claim_grace_s=claim_grace_s, carbon=carbon,
                                             state_dir=state_dir)
        self.ledger = self._new_ledger()
        self._start_sampler()
        self.next_tick = self.now
        self.pushers: list[Pusher] = []

    def _start_sampler(self) -> None:
        """The GPU collector and the sampler as the daemon starts them (a fresh process knows no counter)."""
        clock = self.clock
        lag = self._read_lag

        def backend() -> NVMLBackend:
            return NVMLBackend(str(self._lib), clock=clock) if lag is None else _Lagging(
                str(self._lib), clock, lambda index: self._step(lag(index)))

        self.gpu = GPUCollector(backend, retry_interval=0.0, gpm=False,
                                interval=INTERVAL, energy_interval=ENERGY_INTERVAL, clock=clock, monotonic=clock,
                                power_interval=3600.0, process_interval=PROCESS_INTERVAL,
                                procfs=str(self._procfs), idle_power_w=50.0)
        self.sampler = Sampler([self.gpu], INTERVAL, gpu_states=self.gpu.states, clock=clock, monotonic=clock,
                               wait_budget=30.0)
        self.sampler.add_listener((lambda s: self.ledger.on_snapshot(s)) if self._settle else self._unsettled)
        # the daemon's wiring (daemon/exporter.py): a run's edge reads every counter in a sample taken at once
        self.edges = counter_reads_at_run_edges(
            lambda: (self.gpu.request_counter_read(), self.sampler.sample_soon() if self._early else None))

    def clock(self) -> float:
        return self.now

    def _step(self, seconds: float) -> None:
        if seconds > 0:
            self.now += seconds
            self.write()

    def restart(self, down_s: float | None = None) -> None:
        """The exporter restarted at this instant: the ledger closed and a new one opened on its database.
        ``down_s``: the whole process restarted (a new GPU collector and sampler, which know no counter read),
        down for that long; the trainers' pushes meanwhile are lost (their cumulative counters carry on)."""
        self.ledger.close()
        if down_s is not None:
            self.sampler.stop()
            self.now += down_s
            for p in self.pushers:
                while p.pushed and not p.finished and p.pushed[-1] + p.every <= min(self.now, p.end) + 1e-9:
                    p.pushed.append(p.pushed[-1] + p.every)  # sent to nobody
                if p.pushed and self.now >= p.end:
                    p.finished = True  # its finish too
            self.next_tick = self.now
            self.write()
        self.ledger = self._new_ledger()
        if down_s is not None:
            self._start_sampler()

    def _unsettled(self, snapshot: Snapshot) -> None:
        self.ledger.on_snapshot(replace(snapshot, gpus=tuple(replace(g, span=None) for g in snapshot.gpus)))

    def write(self) -> None:
        Scenario(epoch=EPOCH, driver=Driver(frozen_time=self.now), gpus=self.gpus).write(self.path)

    def scenario(self) -> Scenario:
        return Scenario(epoch=EPOCH, driver=Driver(frozen_time=self.now), gpus=self.gpus)

    def true_energy_j(self, index: int, t0: float, t1: float) -> float:
        return self.scenario().true_energy_j(index, t0, t1)

    def sample_at(self, t: float) -> None:
        self.now = t
        self.write()
        self.sampler.sample_once()

    def deliver(self, points: list[AcceptedPoint]) -> None:
        """Points as the OTLP store hands them on: to the edge listener and the ledger."""
        self.edges(points)
        self.ledger.on_points(points)

    def early_sample(self) -> None:
        """The sample the sampler takes when asked for one early, ``EDGE_LATENCY_S`` after the request."""
        if self.sampler.soon_pending():
            self.sample_at(self.now + EDGE_LATENCY_S)

    def add(self, p: Pusher) -> None:
        self.pushers.append(p)

    def _push(self, p: Pusher, t: float) -> None:
        """Pushes of ``p`` due at ``t``."""
        if not p.pushed and t >= p.start:
            self.now = max(self.now, p.start)
            self.deliver([p.point("training_run_info", 1, p.start),
                                   p.point("training_run_finished", 0, p.start),
                                   p.point("training_tokens_total", 0, p.start)])
            p.pushed.append(p.start)
        while p.pushed and not p.finished and p.pushed[-1] + p.every <= min(t, p.end) + 1e-9:
            pt = p.pushed[-1] + p.every
            self.now = max(self.now, pt)
            self.deliver([p.point("training_tokens_total", p.rate * (pt - p.start), pt)])
            p.pushed.append(pt)
        if p.pushed and not p.finished and t >= p.end:
            self.now = max(self.now, p.end)
            self.deliver([p.point("training_tokens_total", p.rate * (p.end - p.start), p.end),
                                   p.point("training_run_finished", 1, p.end)])
            p.finished = True

    def run_until(self, until: float) -> None:
        """Samples every ``INTERVAL`` up to ``until``, the trainers pushing between them (an edge reads the
        counters at once)."""
        events = sorted({e for p in self.pushers for e in (p.start, p.end)})
        while self.next_tick <= until + 1e-9:
            tick = self.next_tick
            for e in [e for e in events if self.now < e <= tick]:
                for p in self.pushers:
                    self._push(p, e)
                self.early_sample()
            late = tick + self._rng.uniform(0.0, self._jitter) if self._jitter else tick
            for e in [e for e in events if tick < e <= late and self.now < e]:
                for p in self.pushers:
                    self._push(p, e)
                self.early_sample()
            for p in self.pushers:
                self._push(p, max(tick, self.now))
            self.sample_at(max(late, self.now + 0.001))
            self.next_tick = tick + INTERVAL

    def served(self, name: str, run_id: str) -> float | None:
        """The value the ledger serves on /metrics for ``name`` and ``run_id``."""
        for fam in self.ledger.collect():
            for sample in fam.samples:
                if sample.name == name and sample.labels.get("run_id") == run_id:
                    return float(sample.value)
        return None

    def close(self) -> None:
        self.ledger.close()
        self.sampler.stop()
        if self._old is None:
            os.environ.pop("FAKE_NVML_SCENARIO", None)
        else:
            os.environ["FAKE_NVML_SCENARIO"] = self._old


class _Lagging(NVMLBackend):
    """The NVML backend, the clock moved on by ``before(index)`` before each GPU's read."""

    def __init__(self, lib: str, clock: Callable[[], float], before: Callable[[int], None]) -> None:
        super().__init__(lib, clock=clock)
        self._before = before

    def read(self, gpu: Any, **kwargs: Any) -> Any:
        self._before(gpu.index)
        return super().read(gpu, **kwargs)


def fake_procfs(root: Path, pids: Sequence[int]) -> Path:
    """A /proc with the given pids, each in the host's pid namespace (what the exporter sees with hostPID)."""
    root.mkdir(parents=True, exist_ok=True)
    for pid in pids:
        d = root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "status").write_text(f"Name:\tpython\nPid:\t{pid}\nNSpid:\t{pid}\n")
        (d / "cgroup").write_text("0::/user.slice\n")
    return root


def h100_with(index: int, power: PowerTrace, processes: Sequence[Process] = (Process(4242, 1 << 30, 90),),
              **overrides: Any) -> Any:
    """An H100 with ``power``, listing ``processes`` (by default the trainer of pid 4242 that ``Pusher`` is);
    ``overrides``: other fields of the fake GPU (``energy_offset_mj``, ``energy_reset_at_s``...)."""
    return h100(index, power=power, processes=tuple(processes), **overrides)


def rel_error(value: float | None, truth: float) -> float:
    assert value is not None
    return value / truth - 1.0 if truth else math.inf

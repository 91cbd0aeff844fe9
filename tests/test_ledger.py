"""The run ledger: energy, J/token, warm-up, ranks, idle/dynamic energy, CO2, staleness, files, /metrics.

Snapshots are real ``sampler.Snapshot`` objects built from scripted power traces whose energy counter is
the exact integral of the power; points are the OTLP store's real ``AcceptedPoint`` (and, in one test,
come through a real ``TrainingStore``). Time is an injected clock.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from gpu_energy_exporter.core import runs_schema
from gpu_energy_exporter.core.metrics import CATALOGUE
from gpu_energy_exporter.core.runs_schema import COLUMN_NAMES, columns_markdown
from gpu_energy_exporter.core.state import ENERGY_METHOD_COUNTER, GPUIdentity, GPUReading, GPUState, MIGDevice, Snapshot
from gpu_energy_exporter.daemon.api import api_routes
from gpu_energy_exporter.engine.sampler import Sampler
from gpu_energy_exporter.http.server import HTTPServer
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.accounting import Timeline
from gpu_energy_exporter.ledger.files import HEADER_LINE, append_csv_row, atomic_write, summary_filename
from gpu_energy_exporter.otlp.points import Batch, Point
from gpu_energy_exporter.otlp.store import AcceptedPoint, TrainingStore

T0 = 1_700_000_000.0
UUID_A = "GPU-aaaaaaaa-0000-4000-8000-000000000001"
UUID_B = "GPU-bbbbbbbb-0000-4000-8000-000000000002"
GIB = 1 << 30


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Trace:
    """A GPU's power as a function of time and its exact energy integral (what NVML's counter holds)."""

    def __init__(self, power: Callable[[float], float], energy: Callable[[float], float]) -> None:
        self.power = power
        self.energy = energy


def constant(watts: float) -> Trace:
    return Trace(lambda t: watts, lambda t: watts * (t - T0))


def bursty(mean: float = 400.0, amplitude: float = 300.0, period: float = 1.0) -> Trace:
    """Mean ``mean`` W, oscillating with ``period``: sampled once per period it always reads mean+amplitude,
    so integrating sampled power would overstate energy by amplitude/mean; the counter does not."""
    w = 2 * math.pi / period

    def power(t: float) -> float:
        return mean + amplitude * math.cos(w * (t - T0))

    def energy(t: float) -> float:
        return mean * (t - T0) + amplitude / w * math.sin(w * (t - T0))

    return Trace(power, energy)


def identity(uuid: str, index: int = 0, mig: tuple[str, ...] = ()) -> GPUIdentity:
    return GPUIdentity(
        index=index, uuid=uuid, name="NVIDIA H100 80GB HBM3", pci_bus_id=f"00000000:{0x17 + index:02X}:00.0",
        architecture="hopper", compute_capability="9.0", energy_method=ENERGY_METHOD_COUNTER,
        power_usage_is_average=True, mig_enabled=bool(mig),
        mig_devices=tuple(MIGDevice(m, uuid, i) for i, m in enumerate(mig)),
    )


def gpu_state(uuid: str, t: float, trace: Trace, *, index: int = 0, mem: int = 10 * GIB,
              idle: float | None = 100.0, up: bool = True, mig: tuple[str, ...] = ()) -> GPUState:
    reading = GPUReading(timestamp=t, power_instant_w=trace.power(t), memory_used_bytes=mem,
                         memory_total_bytes=80 * GIB)
    return GPUState(identity=identity(uuid, index, mig), up=up, reading=reading, energy_j=trace.energy(t),
                    energy_resets=0, last_good=t, idle_power_w=idle, idle_power_source="flag" if idle else "")


def snapshot(t: float, gpus: tuple[GPUState, ...], families: tuple[Metric, ...] = ()) -> Snapshot:
    return Snapshot(seq=int(t - T0), timestamp=t, families=families, results=(), gpus=gpus)


def point(run_id: str, name: str, value: float, t: float, rank: str = "0", gpu: str = UUID_A,
          **extra: str) -> AcceptedPoint:
    labels = {"run_id": run_id, "rank": rank, "gpu_uuid": gpu, **extra}
    kind = "counter" if name.endswith("_total") else "gauge"
    return AcceptedPoint(run_id, name, labels, value, t, kind)  # type: ignore[arg-type]


class Harness:
    """Drives a ledger: snapshots every ``interval`` from GPU traces, the clock following along."""

    def __init__(self, ledger: RunLedger, clock: Clock, traces: dict[str, Trace], interval: float = 1.0,
                 idle: dict[str, float | None] | None = None, mem: Callable[[float], int] | None = None) -> None:
        self.ledger = ledger
        self.clock = clock
        self.traces = traces
        self.interval = interval
        self.idle = idle or {}
        self.mem = mem or (lambda t: 10 * GIB)
        self.t = clock.t
        self.snap_at(self.t)  # the sampler runs before any trainer starts

    def snap_at(self, t: float) -> None:
        self.clock.t = t
        gpus = tuple(gpu_state(u, t, tr, index=i, idle=self.idle.get(u, 100.0), mem=self.mem(t))
                     for i, (u, tr) in enumerate(self.traces.items()))
        self.ledger.on_snapshot(snapshot(t, gpus))

    def run_until(self, until: float, pushes: Callable[[float], None] | None = None) -> None:
        """Snapshots at every interval up to ``until``; ``pushes(t)`` called just before each."""
        while self.t + self.interval <= until + 1e-9:
            self.t += self.interval
            if pushes is not None:
                pushes(self.t)
            self.snap_at(self.t)

    def push(self, p: AcceptedPoint) -> None:
        self.clock.t = max(self.clock.t, p.time)
        self.ledger.on_point(p)


def trainer(h: Harness, run_id: str, start: float, end: float, rate: float, *, rank: str = "0",
            gpu: str = UUID_A, every: float = 2.0, metadata: dict[str, str] | None = None,
            rate_at: Callable[[float], float] | None = None) -> Callable[[float], None]:
    """A trainer pushing cumulative tokens (``rate`` tokens/s) every ``every`` s between start and end.

    Returns the push function for ``Harness.run_until``; the start point is pushed now.
    """
    tokens_at = rate_at or (lambda t: rate * (t - start))
    h.push(point(run_id, "training_run_info", 1, start, rank, gpu, **(metadata or {})))
    h.push(point(run_id, "training_run_finished", 0, start, rank, gpu))
    h.push(point(run_id, "training_tokens_total", 0, start, rank, gpu))
    state = {"next": start + every}

    def pushes(t: float) -> None:
        while state["next"] <= min(t, end) + 1e-9:
            pt = state["next"]
            h.push(point(run_id, "training_tokens_total", tokens_at(pt), pt, rank, gpu))
            h.push(point(run_id, "training_steps_total", math.floor((pt - start) / 0.5), pt, rank, gpu))
            state["next"] += every
        if state["next"] > end and "done" not in state and t >= end:
            h.push(point(run_id, "training_tokens_total", tokens_at(end), end, rank, gpu))
            h.push(point(run_id, "training_steps_total", math.floor((end - start) / 0.5), end, rank, gpu))
            h.push(point(run_id, "training_run_finished", 1, end, rank, gpu))
            state["done"] = 1

    return pushes


def summary_of(ledger: RunLedger, run_id: str) -> dict:  # type: ignore[type-arg]
    found = ledger.run(run_id)
    assert found is not None, f"run {run_id} unknown"
    return found


# ----------------------------------------------------------------------------------------------------
# energy and efficiency


def test_j_per_token_on_bursty_trace_matches_hand_computed_value(tmp_path: Path) -> None:
    clock = Clock()
    trace = bursty(mean=400.0, amplitude=300.0, period=1.0)
    ledger = RunLedger(str(tmp_path / "runs.csv"), warmup_s=30.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: trace})
    h.run_until(T0 + 5)
    start, end = T0 + 5.5, T0 + 100.3
    pushes = trainer(h, "r1", start, end, rate=1000.0)
    h.run_until(T0 + 102, pushes)
    s = summary_of(ledger, "r1")
    assert s["status"] == "finished"
    w = start + 30.0
    # Hand-computed from the exact integral of the power trace.
    expected_j = (trace.energy(end) - trace.energy(w)) / (1000.0 * (end - w))
    assert s["j_per_token"] == pytest.approx(expected_j, rel=0.01)
    assert s["window_tokens"] == pytest.approx(1000.0 * (end - w))
    assert s["tokens"] == pytest.approx(1000.0 * (end - start))
    assert s["energy_j"] == pytest.approx(trace.energy(end) - trace.energy(start), rel=0.01)
    assert s["duration_s"] == pytest.approx(end - start)
    assert s["warmup_s"] == 30.0 and s["window_s"] == pytest.approx(end - w)
    assert s["tokens_per_s"] == pytest.approx(1000.0)
    assert s["energy_per_10k_tokens_j"] == pytest.approx(10_000 * s["j_per_token"])
    assert s["avg_power_w"] == pytest.approx(400.0, rel=0.01)
    # Every snapshot read the burst peak (700 W): integrating sampled power would have said 700 W.
    assert s["peak_power_w"] == pytest.approx(700.0)
    assert s["energy_coverage"] == pytest.approx(1.0)
    assert s["gpu_uuids"] == UUID_A and s["gpu_count"] == 1
    assert s["steps"] == math.floor((end - start) / 0.5)


def test_warmup_is_excluded_and_a_short_run_uses_the_whole_run(tmp_path: Path) -> None:
    clock = Clock()
    # 700 W and a slow token rate during the first 30 s (compilation, loading), 300 W and fast after.
    def power(t: float) -> float:
        return 700.0 if t < T0 + 30 else 300.0

    def energy(t: float) -> float:
        return 700.0 * min(t - T0, 30.0) + 300.0 * max(0.0, t - T0 - 30.0)

    def tokens(t: float) -> float:
        return 10.0 * min(t - T0, 30.0) + 1000.0 * max(0.0, t - T0 - 30.0)

    ledger = RunLedger(None, warmup_s=30.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: Trace(power, energy)})
    pushes = trainer(h, "warm", T0, T0 + 90, rate=0, rate_at=tokens, every=1.0)
    h.run_until(T0 + 91, pushes)
    s = summary_of(ledger, "warm")
    assert s["warmup_s"] == 30.0
    assert s["j_per_token"] == pytest.approx(300.0 / 1000.0, rel=0.01)
    assert s["tokens_per_s"] == pytest.approx(1000.0, rel=0.01)
    # The whole run would say (700*30 + 300*60) / (300 + 60000): not what the ledger reports.
    assert s["energy_j"] == pytest.approx(700 * 30 + 300 * 60, rel=0.01)
    assert "shorter than the warm-up" not in s["ledger_notes"]

    short = RunLedger(None, warmup_s=30.0, stale_after_s=300.0, clock=clock)
    clock.t = T0 + 200
    h2 = Harness(short, clock, {UUID_B: constant(250.0)})
    pushes = trainer(h2, "short", T0 + 200.0, T0 + 212.0, rate=500.0, gpu=UUID_B)
    h2.run_until(T0 + 214, pushes)
    s2 = summary_of(short, "short")
    assert s2["warmup_s"] == 0.0 and s2["window_s"] == pytest.approx(12.0)
    assert "shorter than the warm-up (30s)" in s2["ledger_notes"]
    assert s2["j_per_token"] == pytest.approx(250.0 / 500.0, rel=0.01)


def test_two_ranks_are_summed_and_the_run_ends_when_both_finished() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=10.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(300.0), UUID_B: constant(500.0)})
    h.run_until(T0 + 2)
    p0 = trainer(h, "ddp", T0 + 2, T0 + 60, rate=400.0, rank="0", gpu=UUID_A)
    p1 = trainer(h, "ddp", T0 + 2, T0 + 64, rate=600.0, rank="1", gpu=UUID_B)

    def both(t: float) -> None:
        p0(t)
        p1(t)

    h.run_until(T0 + 62, both)
    active = {r["run_id"]: r for r in ledger.runs()}
    assert active["ddp"]["status"] == "running", "rank 1 has not finished yet"
    h.run_until(T0 + 66, both)
    s = summary_of(ledger, "ddp")
    assert s["status"] == "finished"
    assert s["ranks"] == 2 and s["gpu_count"] == 2
    assert set(s["gpu_uuids"].split()) == {UUID_A, UUID_B}
    # Each rank counts its own tokens; steps are the same on both ranks, not added up.
    assert s["tokens"] == pytest.approx(400.0 * 58 + 600.0 * 62)
    assert s["steps"] == math.floor(62 / 0.5)
    assert s["duration_s"] == pytest.approx(62.0)
    assert s["energy_j"] == pytest.approx((300.0 + 500.0) * 62, rel=1e-6)
    per_gpu = {g["uuid"]: g["energy_j"] for g in s["gpus"]}
    assert per_gpu[UUID_A] == pytest.approx(300.0 * 62, rel=1e-6)
    assert s["peak_power_w"] == pytest.approx(800.0)


def test_idle_and_dynamic_energy_and_a_baseline_learned_late() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    idle: dict[str, float | None] = {UUID_A: None}
    h = Harness(ledger, clock, {UUID_A: constant(350.0)}, idle=idle)
    pushes = trainer(h, "idle", T0, T0 + 40, rate=100.0)
    h.run_until(T0 + 20, pushes)
    idle[UUID_A] = 80.0  # learned only now: it applies to the whole run
    h.run_until(T0 + 41, pushes)
    s = summary_of(ledger, "idle")
    assert s["energy_j"] == pytest.approx(350.0 * 40)
    assert s["idle_energy_j"] == pytest.approx(80.0 * 40)
    assert s["dynamic_energy_j"] == pytest.approx((350.0 - 80.0) * 40)
    assert s["dynamic_j_per_token"] == pytest.approx((350.0 - 80.0) / 100.0)
    assert s["gpus"][0]["idle_power_w"] == 80.0

    never = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h2 = Harness(never, clock, {UUID_A: constant(350.0)}, idle={UUID_A: None})
    start = clock.t
    pushes = trainer(h2, "noidle", start, start + 10, rate=100.0)
    h2.run_until(start + 11, pushes)
    s2 = summary_of(never, "noidle")
    assert s2["idle_energy_j"] is None and s2["dynamic_energy_j"] is None
    assert "idle power of the GPUs unknown" in s2["ledger_notes"]


def test_co2_follows_a_changing_grid_intensity() -> None:
    clock = Clock()
    grid = {"intensity": 100.0}
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock,
                       carbon=lambda: (grid["intensity"], 1.2))
    h = Harness(ledger, clock, {UUID_A: constant(720.0)})
    pushes = trainer(h, "co2", T0, T0 + 100, rate=10.0)
    h.run_until(T0 + 50, pushes)
    grid["intensity"] = 500.0
    h.run_until(T0 + 101, pushes)
    s = summary_of(ledger, "co2")
    kwh_half = 720.0 * 50 / 3.6e6
    assert s["co2_g"] == pytest.approx(kwh_half * 1.2 * 100.0 + kwh_half * 1.2 * 500.0)
    assert s["carbon_intensity_g_per_kwh"] == pytest.approx(300.0)
    assert s["pue"] == pytest.approx(1.2)
    assert s["energy_kwh"] == pytest.approx(720.0 * 100 / 3.6e6)


def test_stale_run_ends_at_its_last_point(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    trace = constant(500.0)
    ledger = RunLedger(None, warmup_s=10.0, stale_after_s=60.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: trace})
    pushes = trainer(h, "crash", T0 + 0.5, T0 + 1000, rate=200.0)

    def until_crash(t: float) -> None:
        if t <= T0 + 40:
            pushes(t)

    with caplog.at_level(logging.WARNING):
        h.run_until(T0 + 95, until_crash)
        assert any(r["run_id"] == "crash" and r["status"] == "running" for r in ledger.runs())
        h.run_until(T0 + 105, until_crash)
    s = summary_of(ledger, "crash")
    assert s["status"] == "stale"
    last = T0 + 38.5  # the last push (every 2 s from T0 + 0.5, none after T0 + 40)
    assert s["duration_s"] == pytest.approx(last - (T0 + 0.5))
    # Energy stops at the last point, not at the snapshot that noticed the silence.
    assert s["energy_j"] == pytest.approx(trace.energy(last) - trace.energy(T0 + 0.5), rel=1e-6)
    assert s["tokens"] == pytest.approx(200.0 * 38)
    assert len(s["timeline"]) > 0 and s["timeline"][-1]["t"] <= last + 1e-6
    assert "nothing pushed for 60s" in caplog.text


def test_a_finish_point_arriving_late_cuts_the_energy_at_the_finish() -> None:
    clock = Clock()
    trace = bursty(mean=300.0, amplitude=100.0, period=7.0)
    ledger = RunLedger(None, warmup_s=5.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: trace})
    pushes = trainer(h, "late", T0, T0 + 10_000, rate=50.0)
    h.run_until(T0 + 48, pushes)
    # The trainer finished at +45.25 but its last export reaches us only now.
    h.push(point("late", "training_tokens_total", 50.0 * 45.25, T0 + 45.25))
    h.push(point("late", "training_run_finished", 1, T0 + 45.25))
    h.run_until(T0 + 49)
    s = summary_of(ledger, "late")
    assert s["status"] == "finished"
    assert s["duration_s"] == pytest.approx(45.25)
    assert s["energy_j"] == pytest.approx(trace.energy(T0 + 45.25) - trace.energy(T0), rel=0.005)


def test_energy_comes_from_the_counter_and_missing_counters_are_reported() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    trace = constant(200.0)
    ledger.on_snapshot(snapshot(T0, (gpu_state(UUID_A, T0, trace),)))
    ledger.on_point(point("gap", "training_run_finished", 0, T0))
    for i in range(1, 21):
        t = T0 + i
        clock.t = t
        # The GPU is lost (up=False) from +8 to +12: no energy for that time, coverage says so.
        up = not (8 <= i <= 12)
        ledger.on_snapshot(snapshot(t, (gpu_state(UUID_A, t, trace, up=up),)))
        ledger.on_point(point("gap", "training_tokens_total", 10.0 * i, t))
    ledger.on_point(point("gap", "training_run_finished", 1, T0 + 20))
    clock.t = T0 + 21
    ledger.on_snapshot(snapshot(T0 + 21, (gpu_state(UUID_A, T0 + 21, trace),)))
    s = summary_of(ledger, "gap")
    # Segments (7,8]..(12,13] have a down end: 6 s without energy out of 20.
    assert s["energy_j"] == pytest.approx(200.0 * 14)
    assert s["energy_coverage"] == pytest.approx(14 / 20)
    assert "lower bound" in s["ledger_notes"]


def test_mig_instance_is_charged_its_parent_gpu_and_foreign_gpus_are_noted() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    mig = "MIG-11111111-2222-3333-4444-555555555555"
    other_node = "GPU-cccccccc-0000-4000-8000-000000000003"
    ledger.on_snapshot(snapshot(T0, (gpu_state(UUID_A, T0, constant(100.0), mig=(mig,)),)))
    ledger.on_point(point("mig", "training_run_finished", 0, T0, gpu=f"{mig},{other_node}"))
    ledger.on_point(point("mig", "training_tokens_total", 0, T0, gpu=mig))
    for i in range(1, 11):
        t = clock.t = T0 + i
        ledger.on_snapshot(snapshot(t, (gpu_state(UUID_A, t, constant(100.0), mig=(mig,)),)))
    ledger.on_point(point("mig", "training_run_finished", 1, T0 + 10, gpu=mig))
    clock.t = T0 + 11
    ledger.on_snapshot(snapshot(T0 + 11, (gpu_state(UUID_A, T0 + 11, constant(100.0), mig=(mig,)),)))
    s = summary_of(ledger, "mig")
    assert s["energy_j"] == pytest.approx(1000.0)
    assert s["gpu_uuids"].split() == [UUID_A, other_node]
    assert f"GPUs not seen by this exporter (another node?): {other_node}" in s["ledger_notes"]


def test_loss_metadata_and_step_time() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    meta = {"model": "tiny-llama", "backend": "unsloth", "optimizer": "adamw_torch", "batch_size": "8",
            "grad_accum": "4", "seq_len": "2048", "precision": "bf16", "seed": "42", "notes": "r=32",
            "world_size": "2"}
    ledger.on_point(point("meta", "training_run_info", 1, T0, rank="1", model="wrong-rank"))
    ledger.on_point(point("meta", "training_run_info", 1, T0, rank="0", **meta))
    losses = [(10, 2.5), (20, 1.9), (30, 2.1), (40, 1.7), (50, 1.8)]
    for step, loss in losses:
        t = T0 + step
        ledger.on_point(point("meta", "training_steps_total", step, t))
        ledger.on_point(point("meta", "training_steps_total", step, t, rank="1", gpu=UUID_B))
        ledger.on_point(point("meta", "training_loss", loss, t))
        ledger.on_point(point("meta", "training_loss", loss - 1.0, t, rank="1", gpu=UUID_B))  # ignored
    ledger.on_point(point("meta", "training_validation_loss", 1.95, T0 + 50))
    ledger.on_point(point("meta", "training_learning_rate", 2e-5, T0 + 50))
    ledger.on_point(point("meta", "training_epoch", 1.5, T0 + 50))
    ledger.on_point(point("meta", "training_run_total_steps", 100, T0))
    hist = AcceptedPoint("meta", "training_step_duration_seconds", {"run_id": "meta", "rank": "0"}, 12.5, T0 + 50,
                         "histogram", 50)
    ledger.on_point(hist)
    s = summary_of(ledger, "meta")
    assert {k: s[k] for k in meta} == meta
    assert s["metadata"]["model"] == "tiny-llama"
    assert s["best_loss"] == 1.7 and s["best_loss_step"] == 40
    assert s["last_loss"] == 1.8 and s["last_validation_loss"] == 1.95
    assert s["last_learning_rate"] == 2e-5 and s["epoch"] == 1.5
    assert s["total_steps"] == 100
    assert s["mean_step_s"] == pytest.approx(0.25)
    assert s["status"] == "running"


def test_progress_eta_and_energy_to_finish_count_from_the_global_step_after_a_resume() -> None:
    # "resumed" restarted from a checkpoint at step 490 of 1000: its process counts 0, 1, 2, ... steps
    # (training_steps_total) while the trainer's global step reads 490 + those. One step per 2 s on a
    # constant 400 W GPU: 800 J and 2 s per step. "old" is from a helper that pushes no global step.
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(400.0), UUID_B: constant(200.0)})
    for run_id, gpu, total in (("resumed", UUID_A, 1000), ("old", UUID_B, 100)):
        h.push(point(run_id, "training_run_total_steps", total, T0, gpu=gpu))
        h.push(point(run_id, "training_steps_total", 0, T0, gpu=gpu))

    def pushes(t: float) -> None:
        if (t - T0) % 2 == 0:
            steps = (t - T0) / 2
            for run_id, gpu in (("resumed", UUID_A), ("old", UUID_B)):
                h.push(point(run_id, "training_steps_total", steps, t, gpu=gpu))
            h.push(point("resumed", "training_global_step", 490 + steps, t, gpu=UUID_A))

    h.run_until(T0 + 20, pushes)
    s = summary_of(ledger, "resumed")
    assert s["steps"] == 10 and s["global_step"] == 500 and s["total_steps"] == 1000
    assert s["progress"] == 0.5  # from this process's steps: 10 / 1000
    assert s["steps_remaining"] == 500  # not 990
    assert s["eta_s"] == pytest.approx(500 * 2.0)
    assert s["energy_to_finish_j"] == pytest.approx(500 * 800.0, rel=0.01)
    old = summary_of(ledger, "old")
    assert old["global_step"] is None
    assert old["progress"] == 0.1 and old["steps_remaining"] == 90
    assert old["eta_s"] == pytest.approx(90 * 2.0)
    assert old["energy_to_finish_j"] == pytest.approx(90 * 400.0, rel=0.01)
    # A finished run has no time left to wait for.
    h.push(point("resumed", "training_run_finished", 1, T0 + 21, gpu=UUID_A))
    h.run_until(T0 + 22)
    assert summary_of(ledger, "resumed")["eta_s"] is None


def test_timeline_is_bounded_and_covers_the_whole_run() -> None:
    tl = Timeline(16)
    for i in range(1000):
        tl.add((float(i),))
    assert len(tl.points) < 16
    assert tl.points[0][0] == 0.0 and tl.points[-1][0] >= 1000 - 2 * tl.stride
    gaps = {b[0] - a[0] for a, b in zip(tl.points, tl.points[1:], strict=False)}
    assert len(gaps) == 1, "evenly spaced after decimation"

    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock, timeline_points=20)
    host = GaugeMetricFamily("gpuenergy_host_memory_available_bytes", "x", value=5 * GIB)
    ledger.on_snapshot(snapshot(T0, (gpu_state(UUID_A, T0, constant(123.0), mem=3 * GIB),)))
    ledger.on_point(point("tl", "training_run_finished", 0, T0))
    for i in range(1, 201):
        t = clock.t = T0 + i
        ledger.on_point(point("tl", "training_tokens_total", 10.0 * i, t - 0.5))
        ledger.on_snapshot(snapshot(t, (gpu_state(UUID_A, t, constant(123.0), mem=3 * GIB),), (host,)))
    detail = summary_of(ledger, "tl")
    tl_points = detail["timeline"]
    assert 2 <= len(tl_points) < 20
    assert tl_points[0]["t"] <= T0 + 16 and tl_points[-1]["t"] >= T0 + 180
    last = tl_points[-1]
    assert last["power_w"] == [123.0] and last["vram_used_bytes"] == 3 * GIB
    assert last["host_memory_available_bytes"] == 5 * GIB
    assert last["energy_j"] == pytest.approx(123.0 * (last["t"] - T0))
    assert last["tokens"] > 0
    assert detail["timeline_gpus"] == [UUID_A]
    assert detail["vram_peak_bytes"] == 3 * GIB and detail["vram_avg_bytes"] == pytest.approx(3 * GIB)


# ----------------------------------------------------------------------------------------------------
# wiring with the real store and sampler


def test_points_through_the_real_store_and_snapshots_from_the_real_sampler() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    store = TrainingStore(clock=clock)
    store.add_listener(ledger.on_point)
    trace = constant(250.0)
    states = {"t": T0}
    sampler = Sampler([], interval=1.0, gpu_states=lambda: (gpu_state(UUID_A, states["t"], trace),), clock=clock)
    sampler.add_listener(ledger.on_snapshot)

    def push(name: str, kind: str, value: float, t: float) -> None:
        labels = (("gpu_uuid", UUID_A), ("rank", "0"), ("run_id", "wired"))
        store.apply(Batch(points=[Point(kind, name, "", "", labels, "wired", int(T0 * 1e9), int(t * 1e9),  # type: ignore[arg-type]
                                        value=value)]))

    sampler.sample_once()
    push("training_run_finished", "gauge", 0, T0)
    push("training_tokens_total", "counter", 0, T0)
    for i in range(1, 21):
        clock.t = states["t"] = T0 + i
        push("training_tokens_total", "counter", 100.0 * i, T0 + i)
        sampler.sample_once()
    push("training_run_finished", "gauge", 1, T0 + 20)
    clock.t = states["t"] = T0 + 21
    sampler.sample_once()
    s = summary_of(ledger, "wired")
    assert s["status"] == "finished"
    assert s["tokens"] == 2000.0
    assert s["j_per_token"] == pytest.approx(250.0 * 20 / 2000.0)


def test_a_counter_pushed_with_its_attributes_in_any_order_is_one_series_of_the_run() -> None:
    # The store hands the ledger each point's labels already sorted (AcceptedPoint.key); the ledger must key
    # its series exactly as it does for points recorded directly (labels sorted by itself).
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    from gpu_energy_exporter.otlp.receiver import ExportHandler

    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    store = TrainingStore(clock=clock)
    store.add_batch_listener(ledger.on_points)
    handler = ExportHandler(store)
    attrs = {"run_id": "order", "rank": "0", "gpu_uuid": UUID_A}
    orders = (("run_id", "rank", "gpu_uuid"), ("gpu_uuid", "run_id", "rank"), ("rank", "gpu_uuid", "run_id"))
    for i, order in enumerate(orders):
        req = ExportMetricsServiceRequest()
        m = req.resource_metrics.add().scope_metrics.add().metrics.add(name="training.tokens")
        m.sum.is_monotonic = True
        m.sum.aggregation_temporality = 2
        dp = m.sum.data_points.add(start_time_unix_nano=int(T0 * 1e9), time_unix_nano=int((T0 + i) * 1e9),
                                   as_double=100.0 * i)
        dp.attributes.extend(KeyValue(key=k, value=AnyValue(string_value=attrs[k])) for k in order)
        status, _, _ = handler.handle_export({"Content-Type": "application/x-protobuf"}, req.SerializeToString())
        assert status == 200
    ledger.record("order", "training_tokens_total", dict(reversed(list(attrs.items()))), 300.0, T0 + 3)
    run = ledger._active["order"]
    assert [key for key in run.series] == [("training_tokens_total", tuple(sorted(attrs.items())))]
    assert run.counter("training_tokens_total") == 300.0


# ----------------------------------------------------------------------------------------------------
# files


def finished_run(tmp_path: Path, run_id: str = "r/1", csv_name: str = "runs.csv") -> tuple[RunLedger, Path]:
    clock = Clock()
    csv_path = tmp_path / csv_name
    ledger = RunLedger(str(csv_path), warmup_s=0.0, stale_after_s=300.0, clock=clock, carbon=lambda: (400.0, 1.0))
    h = Harness(ledger, clock, {UUID_A: constant(360.0)})
    pushes = trainer(h, run_id, T0, T0 + 10, rate=36.0, every=1.0, metadata={"backend": "bnb", "model": "m"})
    h.run_until(T0 + 11, pushes)
    return ledger, csv_path


def test_finished_run_writes_a_csv_row_and_a_json_summary(tmp_path: Path) -> None:
    ledger, csv_path = finished_run(tmp_path)
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == list(COLUMN_NAMES)
    row = rows[0]
    assert row["run_id"] == "r/1" and row["status"] == "finished" and row["backend"] == "bnb"
    assert float(row["energy_j"]) == pytest.approx(3600.0)
    assert float(row["energy_kwh"]) == pytest.approx(0.001)
    assert float(row["j_per_token"]) == pytest.approx(10.0)
    assert float(row["co2_g"]) == pytest.approx(0.4)
    assert row["summary_file"] == os.path.join("runs", "r_1.json")
    doc = json.loads((tmp_path / row["summary_file"]).read_text())
    assert doc["schema"] == runs_schema.SUMMARY_SCHEMA
    assert doc["run_id"] == "r/1" and doc["j_per_token"] == pytest.approx(10.0)
    assert doc["timeline"] and doc["gpus"][0]["uuid"] == UUID_A
    # A second run appends; the header is written once.
    ledger2, _ = finished_run(tmp_path, run_id="r2")
    lines = csv_path.read_text().splitlines()
    assert lines[0] == HEADER_LINE.decode().strip() and len(lines) == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_atomic_write_leaves_the_old_file_intact_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "runs.csv"
    target.write_bytes(b"old content\n")
    os.chmod(target, 0o640)

    def crash(f) -> None:  # type: ignore[no-untyped-def]
        f.write(b"half a new fi")
        raise RuntimeError("simulated crash in the middle of the write")

    with pytest.raises(RuntimeError):
        atomic_write(str(target), crash)
    assert target.read_bytes() == b"old content\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.csv"], "no temp file left behind"
    atomic_write(str(target), lambda f: f.write(b"new\n"))
    assert target.read_bytes() == b"new\n"
    assert os.stat(target).st_mode & 0o777 == 0o640, "the file's permissions are kept"


def test_csv_with_another_header_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "runs.csv"
    foreign = "run,model,energy_J,J_per_token\nold,llama,1,2\n"
    path.write_text(foreign)
    with caplog.at_level(logging.WARNING):
        append_csv_row(str(path), {"run_id": "new", "tokens": 5.0}, clock=lambda: T0)
    aside = [p for p in tmp_path.iterdir() if p.name.endswith(".old")]
    assert len(aside) == 1 and aside[0].read_text() == foreign
    rows = _rows(path)
    assert len(rows) == 1 and rows[0]["run_id"] == "new" and rows[0]["tokens"] == "5"
    assert "different header" in caplog.text and aside[0].name in caplog.text


def test_a_failing_write_is_counted_and_the_run_stays_in_memory(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "runs").write_text("a file where the summaries directory should be")
    (tmp_path / "runs.csv").write_bytes(HEADER_LINE)
    with caplog.at_level(logging.ERROR):
        ledger, csv_path = finished_run(tmp_path, run_id="kept")
    assert csv_path.read_bytes() == HEADER_LINE, "CSV untouched"
    assert "cannot write the run ledger" in caplog.text
    assert summary_of(ledger, "kept")["status"] == "finished"
    text = exposition(ledger)
    assert "gpuenergy_ledger_write_errors_total 1.0" in text


def test_summary_file_names_are_safe() -> None:
    assert summary_filename("../../etc/passwd") == "etc_passwd.json"
    assert summary_filename("run 1:β") == "run_1.json"
    assert summary_filename("") == "run.json"


def test_docs_list_the_columns_and_metrics_as_the_code_defines_them() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "ledger.md").read_text()
    assert columns_markdown() in doc, "regenerate the table in docs/ledger.md from runs_schema.columns_markdown()"
    ours = [name for name, spec in CATALOGUE.items() if spec.collector == runs_schema.COLLECTOR]
    assert len(ours) == 35
    assert [name for name in ours if f"`{name}`" not in doc] == []


# ----------------------------------------------------------------------------------------------------
# /metrics and the HTTP route


class _Source(PromCollector):
    def __init__(self, fn: Callable[[], list[Metric]]) -> None:
        self.fn = fn

    def collect(self):  # type: ignore[no-untyped-def]
        return self.fn()


def exposition(ledger: RunLedger) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Source(ledger.collect))
    return generate_latest(registry).decode()


def test_per_run_series_on_metrics_and_finished_runs_expire() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock, keep_finished_s=900.0)
    text = exposition(ledger)
    assert 'gpuenergy_ledger_runs_finished_total{status="finished"} 0.0' in text
    h = Harness(ledger, clock, {UUID_A: constant(200.0)})
    pushes = trainer(h, "live", T0, T0 + 20, rate=100.0, every=1.0, metadata={"backend": "bnb"})
    h.run_until(T0 + 10, pushes)
    text = exposition(ledger)
    assert 'gpuenergy_run_active{run_id="live"} 1.0' in text
    # Energy, tokens and steps are counters from zero at the run's start (the J/token rule takes their rates).
    assert "# TYPE gpuenergy_run_energy_joules_total counter" in text
    assert "# TYPE gpuenergy_run_tokens_total counter" in text
    assert 'gpuenergy_run_tokens_total{run_id="live"} 1000.0' in text
    assert 'gpuenergy_run_energy_joules_total{run_id="live"} 2000.0' in text
    assert 'gpuenergy_run_steps_total{run_id="live"} 20.0' in text
    assert 'gpuenergy_run_joules_per_token{run_id="live"} 2.0' in text
    assert 'backend="bnb"' in text and 'status="running"' in text
    h.run_until(T0 + 21, pushes)
    text = exposition(ledger)
    assert 'gpuenergy_run_active{run_id="live"} 0.0' in text
    version = ledger.version()
    assert ledger.version() == version, "nothing changed"
    assert 'gpuenergy_ledger_runs_finished_total{status="finished"} 1.0' in text
    clock.t += 901
    assert ledger.version() != version, "the finished run expired"
    assert 'run_id="live"' not in exposition(ledger)
    assert ledger.run("live") is None


def served(text: str, name: str, run_id: str) -> float:
    prefix = f'{name}{{run_id="{run_id}"}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"{prefix!r} not served exactly once"
    return float(lines[0][len(prefix):])


def test_run_counters_never_decrease_when_a_stale_run_is_cut_back_to_its_last_point() -> None:
    # Live figures are cut at the run's last point (counters are only known as of the last export), so a
    # run that died stops growing at once; closing it as stale then changes nothing. A counter that
    # dropped would be read by Prometheus as a reset, i.e. the whole run's energy again as one increase.
    clock = Clock()
    trace = constant(500.0)
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=60.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: trace})
    pushes = trainer(h, "crash", T0 + 0.5, T0 + 1000, rate=200.0)

    def until_crash(t: float) -> None:
        if t <= T0 + 40:
            pushes(t)

    h.run_until(T0 + 95, until_crash)
    text = exposition(ledger)
    live = served(text, "gpuenergy_run_energy_joules_total", "crash")
    assert live == pytest.approx(500.0 * 38, rel=1e-6)  # up to the last point, not the last snapshot
    assert served(text, "gpuenergy_run_active_seconds_total", "crash") == pytest.approx(38.0)
    assert summary_of(ledger, "crash")["status"] == "running"
    h.run_until(T0 + 105, until_crash)
    assert summary_of(ledger, "crash")["status"] == "stale"
    text = exposition(ledger)
    assert summary_of(ledger, "crash")["energy_j"] == pytest.approx(500.0 * 38, rel=1e-6)
    assert served(text, "gpuenergy_run_energy_joules_total", "crash") == pytest.approx(live)
    assert served(text, "gpuenergy_run_tokens_total", "crash") == pytest.approx(200.0 * 38)
    assert summary_of(ledger, "crash")["duration_s"] == pytest.approx(38.0)
    assert served(text, "gpuenergy_run_active_seconds_total", "crash") == pytest.approx(38.0)


def test_live_figures_are_cut_at_the_last_point() -> None:
    # Tokens are only known as of the last export: a live J/token counting energy up to the latest
    # snapshot would charge the last export interval's energy to tokens not reported yet.
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(400.0)})
    pushes = trainer(h, "live", T0 + 0.5, T0 + 1000, rate=100.0, every=10.0)
    h.run_until(T0 + 59, pushes)  # last export at T0 + 50.5, snapshots up to T0 + 59
    s = summary_of(ledger, "live")
    assert s["status"] == "running"
    assert s["duration_s"] == pytest.approx(50.0)
    assert s["j_per_token"] == pytest.approx(400.0 / 100.0, rel=1e-6)
    assert s["tokens_per_s"] == pytest.approx(100.0, rel=1e-6)


def test_throughput_counters_start_with_the_run_and_active_seconds_stop_at_its_end() -> None:
    # The throughput rules divide the rates of gpuenergy_run_{tokens,samples,flops}_total by the rate of
    # gpuenergy_run_active_seconds_total: all four start with the run, the first three are summed over
    # ranks, and active seconds grow with wall time while the run goes and stop (not drop) at its end.
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(200.0), UUID_B: constant(200.0)})
    start, end = T0 + 0.5, T0 + 20.5
    ranks = (("0", UUID_A), ("1", UUID_B))
    meta = {"precision": "bf16", "precision_raw": "bf16-mixed"}
    token_pushes = [trainer(h, "tp", start, end, rate=100.0, rank=r, gpu=g, every=1.0, metadata=meta)
                    for r, g in ranks]
    last = {"t": start}

    def pushes(t: float) -> None:
        for push in token_pushes:
            push(t)
        pt = min(t, end)
        if pt > last["t"]:  # each rank: 4 samples/s and 1e12 FLOP/s
            for rank, gpu in ranks:
                h.push(point("tp", "training_samples_total", 4 * (pt - start), pt, rank, gpu))
                h.push(point("tp", "training_flops_total", 1e12 * (pt - start), pt, rank, gpu))
            last["t"] = pt

    def counters() -> dict[str, float]:
        text = exposition(ledger)
        return {k: served(text, f"gpuenergy_run_{k}_total", "tp")
                for k in ("tokens", "samples", "flops", "steps", "active_seconds")}

    h.run_until(T0 + 10, pushes)
    at10 = counters()
    # 9.5 s since the first point (T0 + 0.5) at the snapshot of T0 + 10; tokens of both ranks pushed at
    # T0 + 9.5 (2 x 900); samples and FLOPs pushed at T0 + 10 (2 x 4 x 9.5, 2 x 9.5e12).
    assert at10 == {"tokens": 1800.0, "samples": 76.0, "flops": 1.9e13, "steps": 18.0, "active_seconds": 9.5}
    h.run_until(T0 + 15, pushes)
    at15 = counters()
    assert at15["active_seconds"] == 14.5
    # What the rules compute: increase over increase of active seconds, the two ranks' throughput summed.
    assert (at15["tokens"] - at10["tokens"]) / (at15["active_seconds"] - at10["active_seconds"]) == 200.0
    assert (at15["samples"] - at10["samples"]) / (at15["active_seconds"] - at10["active_seconds"]) == 8.0
    h.run_until(T0 + 25, pushes)
    assert summary_of(ledger, "tp")["status"] == "finished"
    at25 = counters()
    assert at25 == {"tokens": 4000.0, "samples": 160.0, "flops": 4e13, "steps": 40.0, "active_seconds": 20.0}
    h.run_until(T0 + 40)
    assert counters() == at25, "a finished run's counters stop"
    s = summary_of(ledger, "tp")
    assert (s["precision"], s["precision_raw"]) == ("bf16", "bf16-mixed")


def test_runs_and_one_run_through_the_json_api() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(200.0)})
    pushes = trainer(h, "api", T0, T0 + 100, rate=100.0)
    h.run_until(T0 + 5, pushes)
    server = HTTPServer(("127.0.0.1", 0), api_routes(dict, ledger.runs, ledger.run), name="test").start()
    try:
        with urllib.request.urlopen(server.url + "/api/v1/runs", timeout=10) as r:
            listing = json.loads(r.read())
        with urllib.request.urlopen(server.url + "/api/v1/run?id=api", timeout=10) as r:
            one = json.loads(r.read())
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(server.url + "/api/v1/run?id=nope", timeout=10)
        assert err.value.code == 404
        err.value.close()
    finally:
        server.shutdown()
    assert [r["run_id"] for r in listing["runs"]] == ["api"]
    assert one["status"] == "running" and one["timeline"]


def test_close_writes_active_runs_as_exporter_stopped(tmp_path: Path) -> None:
    clock = Clock()
    ledger = RunLedger(str(tmp_path / "runs.csv"), warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    pushes = trainer(h, "open", T0, T0 + 1000, rate=1.0)
    h.run_until(T0 + 10, pushes)
    ledger.close()
    rows = _rows(tmp_path / "runs.csv")
    assert rows[0]["status"] == "exporter_stopped"
    assert float(rows[0]["duration_s"]) == pytest.approx(10.0)
    assert float(rows[0]["energy_j"]) == pytest.approx(1000.0)


def test_points_after_the_finish_do_not_reopen_the_run_but_a_restart_does() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    pushes = trainer(h, "again", T0, T0 + 10, rate=10.0)
    h.run_until(T0 + 12, pushes)
    # The SDK re-exports its last values until the process exits: ignored.
    h.push(point("again", "training_tokens_total", 100.0, T0 + 12))
    h.push(point("again", "training_run_finished", 1, T0 + 12))
    h.run_until(T0 + 14)
    assert [r["status"] for r in ledger.runs()] == ["finished"]
    # The same run id running again (finished back to 0) is a new instance counted from its first point.
    h.push(point("again", "training_run_finished", 0, T0 + 14.5))
    h.push(point("again", "training_tokens_total", 100.0, T0 + 14.5))
    h.run_until(T0 + 20)
    h.push(point("again", "training_tokens_total", 160.0, T0 + 20))
    h.push(point("again", "training_run_finished", 1, T0 + 20))
    h.run_until(T0 + 21)
    statuses = [(r["status"], r["tokens"]) for r in ledger.runs()]
    assert statuses == [("finished", 100.0), ("finished", 60.0)]
    assert "resumed" in ledger.runs()[1]["ledger_notes"]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_concurrent_points_and_snapshots() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    trace = constant(100.0)
    ledger.on_snapshot(snapshot(T0, (gpu_state(UUID_A, T0, trace),)))
    ledger.on_point(point("conc", "training_run_finished", 0, T0))
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            for i in range(1, 2001):
                ledger.on_point(point("conc", "training_tokens_total", float(i), T0 + i * 0.01, rank=str(r)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for th in threads:
        th.start()
    t = T0
    while any(th.is_alive() for th in threads):
        t += 0.01
        ledger.on_snapshot(snapshot(t, (gpu_state(UUID_A, t, trace),)))
        ledger.collect()
    for th in threads:
        th.join()
    assert errors == []
    assert summary_of(ledger, "conc")["tokens"] == 4 * 2000.0


def test_close_finishes_a_finishing_run_as_finished() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    pushes = trainer(h, "fin", T0, T0 + 9.5, rate=1.0, every=1.0)
    h.run_until(T0 + 9, pushes)
    pushes(T0 + 9.5)  # the finish arrives; no snapshot follows before shutdown
    ledger.close()
    s = summary_of(ledger, "fin")
    assert s["status"] == "finished" and s["duration_s"] == pytest.approx(9.5)
    assert s["energy_j"] == pytest.approx(900.0)
    assert "energy counted to the last snapshot" in s["ledger_notes"]


def test_finished_runs_kept_in_memory_are_bounded_by_count(tmp_path: Path) -> None:
    clock = Clock()
    ledger = RunLedger(str(tmp_path / "runs.csv"), warmup_s=0.0, stale_after_s=300.0, clock=clock,
                       max_finished_runs=3)
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    for k in range(6):
        start = T0 + 10 * k + 0.5
        pushes = trainer(h, f"r{k}", start, start + 5, rate=10.0)
        h.run_until(start + 6, pushes)
    kept = [s["run_id"] for s in ledger.runs()]
    assert kept == ["r3", "r4", "r5"]  # the three most recent, in memory
    with (tmp_path / "runs.csv").open() as f:
        assert sum(1 for _ in f) == 1 + 6  # every run is still in the CSV

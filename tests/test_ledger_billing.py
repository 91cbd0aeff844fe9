"""Run ledger figures you can bill: shared and MIG GPUs split between runs, remote ranks counted apart,
per-GPU sums that add up, peak >= average, per-GPU VRAM, fair run slots, and writes that are never lost.

Same set-up as test_ledger.py: real ``Snapshot`` objects from scripted traces whose energy counter is the
exact integral of the power, real ``AcceptedPoint`` objects, an injected clock.
"""

from __future__ import annotations

import csv
import logging
import math
import re
from pathlib import Path

import pytest
from test_ledger import (
    GIB,
    T0,
    UUID_A,
    UUID_B,
    Clock,
    Harness,
    Trace,
    constant,
    exposition,
    gpu_state,
    point,
    snapshot,
    summary_of,
    trainer,
)

from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.reference.gpu_specs import lookup_peak_flops

UUID_REMOTE = "GPU-cccccccc-0000-4000-8000-000000000003"
MIGS = tuple(f"MIG-{i:08x}-1111-2222-3333-444444444444" for i in range(7))


def _both(*fns):  # type: ignore[no-untyped-def]
    def pushes(t: float) -> None:
        for f in fns:
            f(t)
    return pushes


def _unattributed(text: str, uuid: str) -> float:
    m = re.search(r'gpuenergy_ledger_unattributed_energy_joules_total\{gpu="\d+",gpu_uuid="' + re.escape(uuid)
                  + r'"\} (\S+)', text)
    assert m, f"no unattributed series for {uuid}"
    return float(m.group(1))


def test_two_runs_on_one_gpu_are_each_charged_half() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(200.0)})
    a = trainer(h, "a", T0, T0 + 20, rate=10.0, every=1.0)
    b = trainer(h, "b", T0, T0 + 20, rate=10.0, every=1.0)
    h.run_until(T0 + 21, _both(a, b))
    for run_id, other in (("a", "b"), ("b", "a")):
        s = summary_of(ledger, run_id)
        assert s["status"] == "finished"
        # 200 W x 20 s split evenly: 2000 J each for 200 tokens -> 10 J/token (the whole GPU would say 20).
        assert s["energy_j"] == pytest.approx(2000.0)
        assert s["j_per_token"] == pytest.approx(10.0)
        assert s["avg_power_w"] == pytest.approx(100.0)
        assert s["peak_power_w"] == pytest.approx(100.0)
        assert s["energy_split"] == "even"
        assert f"shared its GPUs with run(s) {other}: energy split (even)" in s["ledger_notes"]
    text = exposition(ledger)
    assert re.search(r'gpuenergy_run_info\{[^}]*run_id="a"[^}]*split="even"', text)


def test_a_run_joining_late_takes_half_from_then_on_and_a_late_first_point_is_recounted() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(300.0)})
    a = trainer(h, "a", T0, T0 + 30, rate=10.0, every=1.0)
    h.run_until(T0 + 15, a)
    # b's first export reaches the exporter 5 s after it was stamped: a already counted those 5 s alone.
    b = trainer(h, "b", T0 + 10, T0 + 20, rate=10.0, every=1.0)
    h.run_until(T0 + 31, _both(a, b))
    sa, sb = summary_of(ledger, "a"), summary_of(ledger, "b")
    assert sb["energy_j"] == pytest.approx(150.0 * 10)
    assert sa["energy_j"] == pytest.approx(300.0 * 20 + 150.0 * 10)
    assert sa["energy_split"] == "even,exclusive" and sb["energy_split"] == "even"
    assert sa["energy_j"] + sb["energy_j"] == pytest.approx(300.0 * 30)


def test_runs_on_two_mig_slices_of_one_gpu_share_it_and_mfu_uses_the_slice_peak() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    power = 350.0

    def snap(t: float) -> None:
        clock.t = t
        ledger.on_snapshot(snapshot(t, (gpu_state(UUID_A, t, constant(power), mig=MIGS),)))

    snap(T0)
    peak = lookup_peak_flops("NVIDIA H100 80GB HBM3")
    assert peak is not None
    flops_per_s = 0.4 * peak.flops["bf16"] / 7  # 40% of a 1g slice
    for run_id, mig in (("m0", MIGS[0]), ("m1", MIGS[1])):
        ledger.on_point(point(run_id, "training_run_info", 1, T0, gpu=mig, precision="bf16"))
        ledger.on_point(point(run_id, "training_tokens_total", 0, T0, gpu=mig))
        ledger.on_point(point(run_id, "training_flops_total", 0, T0, gpu=mig))
    for i in range(1, 21):
        t = T0 + i
        for run_id, mig in (("m0", MIGS[0]), ("m1", MIGS[1])):
            ledger.on_point(point(run_id, "training_tokens_total", 50.0 * i, t, gpu=mig))
            ledger.on_point(point(run_id, "training_flops_total", flops_per_s * i, t, gpu=mig))
            if i == 20:
                ledger.on_point(point(run_id, "training_run_finished", 1, t, gpu=mig))
        snap(t)
    snap(T0 + 21)
    for run_id in ("m0", "m1"):
        s = summary_of(ledger, run_id)
        assert s["status"] == "finished"
        # The two instances in use share the parent's 350 W x 20 s (the other five are idle and absorb
        # nothing, as for pods); before, each run was charged the whole GPU.
        assert s["energy_j"] == pytest.approx(power * 20 / 2)
        assert s["j_per_token"] == pytest.approx(power / 2 / 50.0)
        assert s["energy_split"] == "mig"
        assert s["peak_flops_per_s"] == pytest.approx(peak.flops["bf16"] / 7)
        assert s["mfu"] == pytest.approx(0.4)


def test_ranks_of_two_nodes_pushing_to_one_exporter_charge_only_local_tokens() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(200.0)})
    r0 = trainer(h, "ddp", T0, T0 + 20, rate=10.0, every=1.0, rank="0", gpu=UUID_A)
    r1 = trainer(h, "ddp", T0, T0 + 20, rate=10.0, every=1.0, rank="1", gpu=UUID_REMOTE)
    h.run_until(T0 + 21, _both(r0, r1))
    s = summary_of(ledger, "ddp")
    assert s["status"] == "finished"
    # Local energy 200 W x 20 s over local tokens 10/s x 20 s: 20 J/token (all tokens would say 10).
    assert s["j_per_token"] == pytest.approx(20.0)
    assert s["tokens"] == pytest.approx(400.0)
    assert s["tokens_local"] == pytest.approx(200.0) and s["tokens_remote"] == pytest.approx(200.0)
    assert s["token_coverage"] == pytest.approx(0.5)
    assert s["tokens_per_s"] == pytest.approx(10.0)
    assert s["energy_coverage"] == pytest.approx(1.0), "the other node's GPU is not a gap in this node's energy"
    assert "rank(s) 1 excluded" in s["ledger_notes"]
    text = exposition(ledger)
    assert 'gpuenergy_run_tokens_total{run_id="ddp"} 200.0' in text
    assert 'gpuenergy_run_remote_tokens_total{run_id="ddp"} 200.0' in text
    assert 'gpuenergy_run_token_coverage_ratio{run_id="ddp"} 0.5' in text


def test_per_gpu_energy_charged_to_runs_plus_unattributed_is_the_gpus_energy() -> None:
    clock = Clock()
    # A short history so that intervals settle within the test (stale_after + late window).
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=10.0, clock=clock, late_window_s=5.0)
    trace_a, trace_b = constant(240.0), constant(170.0)
    h = Harness(ledger, clock, {UUID_A: trace_a, UUID_B: trace_b}, interval=1.0)
    h.run_until(T0 + 3)
    p1 = trainer(h, "one", T0 + 3.5, T0 + 30.2, rate=7.0, every=1.0)
    h.run_until(T0 + 8, p1)
    p2 = trainer(h, "two", T0 + 7.3, T0 + 18.6, rate=5.0, every=1.0)  # stamped before the last snapshot
    h.run_until(T0 + 12, _both(p1, p2))
    p3 = trainer(h, "three", T0 + 12.0, T0 + 40.0, rate=3.0, every=1.0, gpu=f"{UUID_A},{UUID_B}")
    h.run_until(T0 + 80, _both(p1, p2, p3))
    runs = {r: summary_of(ledger, r) for r in ("one", "two", "three")}
    assert all(s["status"] == "finished" for s in runs.values())
    text = exposition(ledger)
    settled_to = ledger._history[0].t  # intervals before this left the history and are settled
    for uuid, trace in ((UUID_A, trace_a), (UUID_B, trace_b)):
        charged = sum(next((g["energy_j"] or 0.0) for g in s["gpus"] if g["uuid"] == uuid)
                      for s in runs.values() if any(g["uuid"] == uuid for g in s["gpus"]))
        total = trace.energy(settled_to) - trace.energy(T0)
        assert charged <= trace.energy(T0 + 40.0) - trace.energy(T0 + 3.5) + 1e-6
        assert charged + _unattributed(text, uuid) == pytest.approx(total, rel=1e-9)
    # Hand-computed: GPU A is shared by one (3.5-30.2), two (7.3-18.6) and three (12-40).
    a = 240.0
    one = a * ((7.3 - 3.5) + (12.0 - 7.3) / 2 + (18.6 - 12.0) / 3 + (30.2 - 18.6) / 2)
    assert runs["one"]["energy_j"] == pytest.approx(one)
    two = a * ((12.0 - 7.3) / 2 + (18.6 - 12.0) / 3)
    assert runs["two"]["energy_j"] == pytest.approx(two)
    three = a * ((18.6 - 12.0) / 3 + (30.2 - 18.6) / 2 + (40.0 - 30.2)) + 170.0 * 28.0
    assert runs["three"]["energy_j"] == pytest.approx(three)
    assert runs["one"]["j_per_token"] == pytest.approx(one / (7.0 * 26.7))


def test_peak_power_is_never_below_average_power() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    # Every snapshot lands in a dip: instant power reads 100 W while the counter says 400 W on average.
    dips = Trace(lambda t: 100.0, lambda t: 400.0 * (t - T0))
    h = Harness(ledger, clock, {UUID_A: dips})
    p = trainer(h, "dip", T0, T0 + 10, rate=10.0, every=1.0)
    h.run_until(T0 + 11, p)
    s = summary_of(ledger, "dip")
    assert s["avg_power_w"] == pytest.approx(400.0)
    assert s["peak_power_w"] >= s["avg_power_w"]


def test_vram_figures_are_per_gpu() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(100.0), UUID_B: constant(100.0)},
                mem=lambda t: (12 if t >= T0 + 5 else 8) * GIB)
    p0 = trainer(h, "v", T0, T0 + 10, rate=1.0, every=1.0, rank="0", gpu=UUID_A)
    p1 = trainer(h, "v", T0, T0 + 10, rate=1.0, every=1.0, rank="1", gpu=UUID_B)
    h.run_until(T0 + 11, _both(p0, p1))
    s = summary_of(ledger, "v")
    assert s["vram_peak_bytes"] == pytest.approx(12 * GIB)  # one GPU's peak, not 24 GiB
    assert s["vram_avg_bytes"] == pytest.approx(10 * GIB, rel=0.11)
    assert s["vram_total_bytes"] == pytest.approx(80 * GIB)


def test_a_flood_of_finished_points_takes_no_run_slot_and_writes_no_row(tmp_path: Path) -> None:
    clock = Clock()
    csv_path = tmp_path / "runs.csv"
    ledger = RunLedger(str(csv_path), warmup_s=0.0, stale_after_s=300.0, clock=clock, max_active_runs=16)
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    for i in range(1000):
        h.push(point(f"junk-{i}", "training_run_finished", 1, T0))
    real = trainer(h, "real", T0, T0 + 5, rate=10.0, every=1.0)
    for i in range(1000, 1100):  # more junk while the real run goes
        h.push(point(f"junk-{i}", "training_run_info", 1, T0))
    h.run_until(T0 + 6, real)
    late = trainer(h, "late", T0 + 6, T0 + 20, rate=10.0, every=1.0)
    h.run_until(T0 + 8, late)
    ledger.close()
    with open(csv_path, newline="") as f:
        rows = {r["run_id"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"real", "late"}
    assert rows["real"]["status"] == "finished" and rows["late"]["status"] == "exporter_stopped"
    assert float(rows["real"]["j_per_token"]) == pytest.approx(10.0)
    text = exposition(ledger)
    assert "junk-" not in text
    assert "gpuenergy_ledger_runs_rejected_total 0.0" in text
    assert [r["run_id"] for r in ledger.runs()] == ["real", "late"]


def test_a_failed_write_is_retried_once_the_fault_is_fixed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Works as root: a path component that is a regular file (ENOTDIR), later replaced by a directory.
    blocker = tmp_path / "ledger"
    blocker.write_text("a file where the ledger directory should be")
    csv_path = blocker / "runs.csv"
    clock = Clock()
    ledger = RunLedger(str(csv_path), warmup_s=0.0, stale_after_s=300.0, clock=clock)
    problem = ledger.check_writable()
    assert problem is not None and str(csv_path) in problem and "Not a directory" in problem
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    p = trainer(h, "kept", T0, T0 + 5, rate=10.0, every=1.0)
    with caplog.at_level(logging.ERROR):
        h.run_until(T0 + 8, p)
    assert "cannot write the run ledger" in caplog.text
    assert "gpuenergy_ledger_writes_pending 1.0" in exposition(ledger)
    blocker.unlink()
    blocker.mkdir()
    assert ledger.check_writable() is None
    h.run_until(T0 + 40)  # past the back-off
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["run_id"] for r in rows] == ["kept"]
    assert float(rows[0]["j_per_token"]) == pytest.approx(10.0)
    assert (blocker / rows[0]["summary_file"]).exists()
    assert "gpuenergy_ledger_writes_pending 0.0" in exposition(ledger)


def test_a_failed_write_is_written_at_shutdown(tmp_path: Path) -> None:
    blocker = tmp_path / "ledger"
    blocker.write_text("not a directory")
    csv_path = blocker / "runs.csv"
    clock = Clock()
    ledger = RunLedger(str(csv_path), warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    p = trainer(h, "saved", T0, T0 + 5, rate=10.0, every=1.0)
    h.run_until(T0 + 7, p)
    blocker.unlink()
    blocker.mkdir()
    ledger.close()  # no snapshot since: only shutdown can write it
    with open(csv_path, newline="") as f:
        assert [r["run_id"] for r in csv.DictReader(f)] == ["saved"]


def test_no_gpu_on_this_node_means_no_energy_and_every_token_remote() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = Harness(ledger, clock, {UUID_A: constant(100.0)})
    p = trainer(h, "far", T0, T0 + 5, rate=10.0, every=1.0, gpu=UUID_REMOTE)
    h.run_until(T0 + 6, p)
    s = summary_of(ledger, "far")
    assert s["energy_j"] is None and s["j_per_token"] is None
    assert s["tokens_local"] == 0.0 and s["tokens_remote"] == pytest.approx(50.0)
    assert s["token_coverage"] == pytest.approx(0.0)
    assert not math.isnan(s["tokens"])


def test_exporter_reports_an_unwritable_runs_csv_at_start_up_once(
    start_exporter, fake_nvml_lib: Path, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    blocker = tmp_path / "ledger"
    blocker.write_text("a file where the ledger directory should be")
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", f"--runs.csv={blocker / 'runs.csv'}"]).wait_ready()
    exp.stop()
    log = exp.log()
    lines = [line for line in log.splitlines() if "--runs.csv" in line and "cannot write there" in line]
    assert len(lines) == 1, log
    assert "Not a directory" in lines[0] and "Traceback" not in log

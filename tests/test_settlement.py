"""Settled, not guessed (issue 28): every run charged what the GPU's counter and process samples say, whatever
the power's shape.

The whole node runs in one process on a frozen clock (``settle_rig``): the fake NVML library with a scripted
power trace whose energy counter is its exact integral, the real GPU collector and sampler at the daemon's
defaults (a sample a second, the counter every 30 s), the real run ledger, and trainers pushing as the
training helper does, the exporter reading every counter at each run's edge. Each figure is compared with
the trace's exact integral over the run's own interval.

Before settlement (450c1b4): an 8 s run starting in a high phase of a 10 s 150/650 W square wave was charged
1,916 J of 2,717 (-29.5%); two runs one after the other in one process: the second got only its claim grace.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from fakenvml import Constant, Process, Square, Steps
from settle_rig import EPOCH, Node, Pusher, h100_with, rel_error

UUID = "GPU-00000000-0000-0000-0000-000000000000"

WAVE_10S = Square(150.0, 650.0, 10.0, 0.5)
WAVE_07S = Square(150.0, 650.0, 0.7, 0.5)
STEP = Steps(((47.0, 120.0), (400.0, 690.0)), repeat=False)

TRACES = {"10 s square wave": WAVE_10S, "0.7 s square wave": WAVE_07S, "a step": STEP}


def _uuid(node: Node) -> str:
    return node.gpus[0].uuid


@pytest.mark.parametrize("trace", list(TRACES), ids=list(TRACES))
@pytest.mark.parametrize("offset", [0.0, 0.33, 2.5, 4.9, 7.71])
@pytest.mark.parametrize("length", [8.0, 12.5, 45.0])
@pytest.mark.parametrize("jitter", [0.0, 0.6], ids=["idle", "loaded"])
def test_a_run_is_charged_the_exact_integral_of_its_own_interval(
    fake_nvml_lib: Path, tmp_path: Path, trace: str, offset: float, length: float, jitter: float
) -> None:
    """Runs of 8 s and more, starting anywhere in the wave's phase (a high phase at offset 0, a low one at
    5 s, the step at 47 s), within 1% of the exact integral over [start, end], on an idle machine and on a
    loaded one (each sample up to 0.6 s late: before settlement, -4.9% on the 10 s wave)."""
    node = Node(fake_nvml_lib, tmp_path, [h100_with(0, TRACES[trace])], jitter=jitter, seed=int(offset * 100))
    try:
        start = EPOCH + 40.0 + offset
        node.add(Pusher("r1", start, start + length, _uuid(node)))
        node.run_until(start + length + 3.0)
        s = node.ledger.run("r1")
        assert s is not None and s["status"] == "finished", s
        truth = node.true_energy_j(0, start, start + length)
        assert abs(rel_error(s["energy_j"], truth)) <= 0.01, (s["energy_j"], truth)
        assert s.get("energy_provisional_j", 0.0) == 0.0
    finally:
        node.close()


def test_an_8s_run_starting_in_a_high_phase_of_the_10s_wave(fake_nvml_lib: Path, tmp_path: Path) -> None:
    """The issue's case: 2,717 J of truth, 1,916 J charged before (-29.5%). The run starts 3 s into a high
    phase that follows 37 s of the wave since the last counter read at 30 s."""
    node = Node(fake_nvml_lib, tmp_path, [h100_with(0, WAVE_10S)])
    try:
        start = EPOCH + 63.0
        node.add(Pusher("r1", start, start + 8.0, _uuid(node)))
        node.run_until(start + 12.0)
        s = node.ledger.run("r1")
        assert s is not None
        truth = node.true_energy_j(0, start, start + 8.0)
        assert abs(rel_error(s["energy_j"], truth)) <= 0.01, (s["energy_j"], truth)
    finally:
        node.close()


def test_two_runs_one_after_the_other_in_one_process_are_each_charged_their_own_interval(
    fake_nvml_lib: Path, tmp_path: Path
) -> None:
    """A notebook or a sweep: one process (pid 4242, listed by NVML on the GPU) starts a run, finishes it,
    starts the next. Before, the pid stayed the first (closed) run's, and the second got only its 30 s claim
    grace: 7,500 J for 40 s at 250 W."""
    node = Node(fake_nvml_lib, tmp_path, [h100_with(0, Constant(250.0), [Process(4242, 1 << 30, 90)])])
    try:
        a0, a1 = EPOCH + 20.3, EPOCH + 52.1
        b0, b1 = EPOCH + 53.0, EPOCH + 93.0
        node.add(Pusher("first", a0, a1, _uuid(node), pid=4242))
        node.add(Pusher("second", b0, b1, _uuid(node), pid=4242))
        node.run_until(b1 + 3.0)
        for run_id, (t0, t1) in (("first", (a0, a1)), ("second", (b0, b1))):
            s = node.ledger.run(run_id)
            assert s is not None and s["status"] == "finished"
            truth = node.true_energy_j(0, t0, t1)
            assert abs(rel_error(s["energy_j"], truth)) <= 0.01, (run_id, s["energy_j"], truth, s["ledger_notes"])
    finally:
        node.close()


def _shared_truth(node: Node, parts: list[tuple[float, float, Steps, Steps]], step: float = 0.01
                  ) -> tuple[float, float]:
    """Each of two processes' exact share of the GPU's energy over each (t0, t1, SM trace a, SM trace b): the
    power times its SM share, integrated (the midpoint rule on ``step``; the SM traces are piecewise constant)."""
    sc = node.scenario()
    a = b = 0.0
    for t0, t1, sm_a, sm_b in parts:
        t = t0
        while t < t1 - 1e-12:
            dt = min(step, t1 - t)
            mid = t + dt / 2
            joules = sc.true_energy_j(0, t, t + dt)
            wa, wb = sm_a.power_w(mid - EPOCH), sm_b.power_w(mid - EPOCH)
            a += joules * wa / (wa + wb)
            b += joules * wb / (wa + wb)
            t += dt
    return a, b


@pytest.mark.parametrize(("power", "bound"), [(Constant(400.0), 0.02), (WAVE_10S, 0.03)], ids=["400 W", "10 s wave"])
def test_two_runs_sharing_a_gpu_are_split_by_their_sm_use_when_it_changes(
    fake_nvml_lib: Path, tmp_path: Path, power: Constant | Square, bound: float
) -> None:
    """Two trainers on one GPU from 20 s to 90 s, SM 70/20 until 57 s, then 20/70. Before (weights re-read
    every 10 s and held until the next read): +5.8% / -7.3%. Settled: each span's split uses the samples the
    driver gave over it, one mean per process per ask (every --collector.gpu.process-interval, 10 s): at
    constant power that is the exact split; on a 10 s wave the ask that straddles the swap (51-61 s, mostly
    high power before the swap and low after) weighs its 10 s by its mean, 2.2% off (docs/measurement.md)."""
    sm_a = Steps(((57.0, 70.0), (100.0, 20.0)), repeat=False)
    sm_b = Steps(((57.0, 20.0), (100.0, 70.0)), repeat=False)
    procs = [Process(4242, 1 << 30, 70, sm_trace=sm_a), Process(4343, 1 << 30, 20, sm_trace=sm_b)]
    node = Node(fake_nvml_lib, tmp_path, [h100_with(0, power, procs)])
    try:
        t0, t1 = EPOCH + 20.0, EPOCH + 90.0
        node.add(Pusher("a", t0, t1, _uuid(node), pid=4242))
        node.add(Pusher("b", t0, t1, _uuid(node), pid=4343))
        node.run_until(t1 + 3.0)
        want_a, want_b = _shared_truth(node, [(t0, t1, sm_a, sm_b)])
        got = {r: node.ledger.run(r) for r in ("a", "b")}
        for run_id, want in (("a", want_a), ("b", want_b)):
            s = got[run_id]
            assert s is not None and s["status"] == "finished"
            assert abs(rel_error(s["energy_j"], want)) <= bound, (run_id, s["energy_j"], want, s["energy_split"])
        assert got["a"]["energy_split"] == "sm_util"
    finally:
        node.close()


@pytest.mark.parametrize("power", [Constant(400.0), WAVE_10S, WAVE_07S], ids=["400 W", "10 s wave", "0.7 s wave"])
def test_a_change_of_sharers_falls_on_counter_reads_and_each_run_gets_its_sm_share(
    fake_nvml_lib: Path, tmp_path: Path, power: Constant | Square
) -> None:
    """Run a alone from 20.4 s (SM 80), b joins at 37.3 s (SM 30 against a's 60), a leaves at 71.8 s, b goes on
    to 95.5 s. Each join and leave reads the counter and the per-process utilisation: a within 2% of its
    exact share, b too."""
    sm_a = Steps(((37.3, 80.0), (100.0, 60.0)), repeat=False)
    sm_b = Steps(((71.8, 30.0), (100.0, 70.0)), repeat=False)
    procs = [Process(4242, 1 << 30, 80, sm_trace=sm_a), Process(4343, 1 << 30, 30, sm_trace=sm_b)]
    node = Node(fake_nvml_lib, tmp_path, [h100_with(0, power, procs)])
    try:
        a0, a1, b0, b1 = EPOCH + 20.4, EPOCH + 71.8, EPOCH + 37.3, EPOCH + 95.5
        node.add(Pusher("a", a0, a1, _uuid(node), pid=4242))
        node.add(Pusher("b", b0, b1, _uuid(node), pid=4343))
        node.run_until(b1 + 3.0)
        # NVML lists both processes throughout; a process that is no run's keeps its share (unattributed)
        sc = node.scenario()
        alone_a = sc.true_energy_j(0, a0, b0)
        shared_a, shared_b = _shared_truth(node, [(b0, a1, sm_a, sm_b)])
        pre_a, _ = _shared_truth(node, [(a0, b0, sm_a, sm_b)])
        _, post_b = _shared_truth(node, [(a1, b1, sm_a, sm_b)])
        want = {"a": pre_a + shared_a, "b": shared_b + post_b}
        assert alone_a > pre_a  # b's process, no run's yet, kept its share before b pushed
        for run_id in ("a", "b"):
            s = node.ledger.run(run_id)
            assert s is not None and s["status"] == "finished"
            assert abs(rel_error(s["energy_j"], want[run_id])) <= 0.02, (run_id, s["energy_j"], want[run_id])
    finally:
        node.close()


def test_metrics_serve_every_counter_as_of_the_settled_time_and_the_rest_as_provisional(
    fake_nvml_lib: Path, tmp_path: Path
) -> None:
    """Mid-run, 20 s after the last counter read: the energy counter is what the counter said up to that read,
    the token counter stands at the same instant (so their ratio is the run's J/token so far, exactly), and
    the provisional gauge holds what the power readings say of the 20 s since. At the first collect after the
    start, energy, CO2 and tokens appear together at (nearly) zero, so no rate() loses a first interval."""
    node = Node(fake_nvml_lib, tmp_path, [h100_with(0, WAVE_10S)], carbon=lambda: (400.0, 1.25))
    try:
        start = EPOCH + 40.3
        p = Pusher("r1", start, start + 120.0, _uuid(node), every=1.0)
        node.add(p)
        node.run_until(start + 1.0)  # the start at 40.3 s, its counter read at 40.32 s, a sample at 41 s
        assert node.served("gpuenergy_run_tokens_total", "r1") == 0.0
        first = node.served("gpuenergy_run_energy_joules_total", "r1")
        assert first is not None and first <= 650.0 * 0.05
        assert node.served("gpuenergy_run_co2_grams_total", "r1") == pytest.approx(first / 3.6e6 * 1.25 * 400.0)
        node.run_until(start + 50.0)  # counter reads at start + 0.02 s, then 30 s later; now 20 s after that
        tokens = node.served("gpuenergy_run_tokens_total", "r1")
        energy = node.served("gpuenergy_run_energy_joules_total", "r1")
        provisional = node.served("gpuenergy_run_energy_provisional_joules", "r1")
        assert tokens is not None and energy is not None and provisional is not None
        settled_at = start + tokens / p.rate
        assert 25.0 <= settled_at - start <= 35.0  # the read 30 s after the start's
        assert abs(rel_error(energy, node.true_energy_j(0, start, settled_at))) <= 0.01
        since = node.true_energy_j(0, settled_at, p.pushed[-1])
        assert abs(rel_error(provisional, since)) <= 0.10  # an estimate: the power readings over ~20 s
        live = node.ledger.run("r1")
        assert live is not None and live["energy_provisional_j"] == pytest.approx(provisional)
        assert live["energy_j"] == pytest.approx(energy + provisional)
    finally:
        node.close()


@pytest.mark.parametrize("change_at", [61.37, 72.5, 83.9])
def test_co2_prices_each_part_of_the_run_at_the_intensity_in_force_then(
    fake_nvml_lib: Path, tmp_path: Path, change_at: float
) -> None:
    """The grid intensity falls from 500 to 100 g/kWh inside a sampling interval (the file rewritten at
    ``change_at``): the run's CO2 is within 0.5% of the hand value, each part of the run at its intensity.
    Before, the interval that straddled the change was priced at the new value (-1.9% for a 60 s run)."""
    tc = EPOCH + change_at
    box: dict[str, float] = {}

    def carbon() -> tuple[float, float, tuple[float, float] | None]:
        now = box["now"]()
        return (100.0, 1.2, (tc, 500.0)) if now >= tc else (500.0, 1.2, None)

    node = Node(fake_nvml_lib, tmp_path, [h100_with(0, WAVE_10S)], carbon=carbon)
    box["now"] = node.clock
    try:
        start, end = EPOCH + 40.3, EPOCH + 100.7
        node.add(Pusher("r1", start, end, _uuid(node)))
        node.run_until(end + 3.0)
        s = node.ledger.run("r1")
        assert s is not None and s["status"] == "finished"
        want = (node.true_energy_j(0, start, tc) * 500.0 + node.true_energy_j(0, tc, end) * 100.0) * 1.2 / 3.6e6
        assert abs(rel_error(s["co2_g"], want)) <= 0.005, (s["co2_g"], want)
    finally:
        node.close()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("length", [8.0, 15.0])
@pytest.mark.parametrize("waits", [1, 0], ids=["the next GPU waits", "the run's GPU waits"])
def test_a_run_is_charged_its_own_interval_when_the_gpus_are_read_one_after_the_other_with_waits(
    fake_nvml_lib: Path, tmp_path: Path, seed: int, length: float, waits: int
) -> None:
    """A sample reads its GPUs one after the other; on a loaded two-core machine each read can wait tenths of
    a second (for the GIL, for a core). Here one GPU's read waits 0-0.3 s at each sample, a different wait
    every time: GPU 1, read after the run's GPU 0, or GPU 0 itself.

    The frame's time is the latest read: before GPU 0's energy was carried to it from its own read
    (ledger.snapshot_frames.gpu_frame), the run was charged by an interval that moved with GPU 1's wait,
    -0.7% to +1.4% here (and +1.0% in a CI run of test_ledger_e2e, 0.15 s of two GPUs' power). And a read
    was dated when the sample began, before its wait: the counter's read is now dated by the driver's own
    timestamp of the batched field read (devices.nvml_calls.read_time)."""
    rng = random.Random(seed)
    node = Node(fake_nvml_lib, tmp_path, [h100_with(0, Constant(528.0)), h100_with(1, Constant(500.0), ())],
                read_lag=lambda index: rng.uniform(0.0, 0.3) if index == waits else 0.0)
    try:
        start = EPOCH + 40.0 + 0.1 * seed
        node.add(Pusher("r1", start, start + length, _uuid(node)))
        node.run_until(start + length + 3.0)
        s = node.ledger.run("r1")
        assert s is not None and s["status"] == "finished", s
        truth = node.true_energy_j(0, start, start + length)
        assert abs(rel_error(s["energy_j"], truth)) <= 0.002, (s["energy_j"], truth)
    finally:
        node.close()



@pytest.mark.parametrize(("lag", "start_after"), [(0.0, 0.03), (0.01, 0.03), (0.01, 0.13), (0.05, 0.13), (0.05, 0.4),
                                                  (0.2, 0.4), (0.2, 1.6)])
def test_a_run_that_starts_in_the_exporters_first_second_is_settled_from_its_start(
    fake_nvml_lib: Path, tmp_path: Path, lag: float, start_after: float
) -> None:
    """A run that starts within the exporter's first second (after its first sample, before it has seen a
    counter span long enough to scale the power readings by): GPU 0's 20 ms wave reads 6% high (560.4 W of a
    true 528), GPU 1 is read ``lag`` seconds after it, and the run's own 15 s must still be settled exactly.

    Two faults, found in test_ledger_e2e's +1.0% under full suites (130 J, all on the 20 ms wave's GPU, all
    in the run's first 4 s, the exporter's first frame 32 ms before the run's start):

    - the first counter read after the run's start settles a span that begins at GPU 0's read at the run's
      edge, a little before that frame's time (GPU 1 was read after it); the run had no checkpoint that early
      (its first was that frame), so the recount was skipped with a note, and the run kept the unscaled
      estimate of its first seconds (before: +1.7% at 10 ms, +0.7% at 50 ms);
    - the exporter's first sample reads each counter twice (the second read confirms the first): the GPU was
      dated by the second read but carried to the frame's time by the first read's driver stamp, so the
      frame's energy fell short by GPU 1's read time and settlement put it in the run (before: +1.3% at 0.2 s).
    """
    node = Node(fake_nvml_lib, tmp_path,
                [h100_with(0, Square(150.0, 690.0, 0.02, 0.7)), h100_with(1, Constant(333.0), ())],
                read_lag=lambda index: lag if index == 1 else 0.0)
    try:
        start = node.now + start_after
        node.add(Pusher("r1", start, start + 15.0, _uuid(node), every=0.5))
        node.run_until(start + 18.0)
        s = node.ledger.run("r1")
        assert s is not None and s["status"] == "finished", s
        assert not s["ledger_notes"], s["ledger_notes"]
        truth = node.true_energy_j(0, s["start_unix"], s["end_unix"])
        assert abs(rel_error(s["energy_j"], truth)) <= 0.001, (s["energy_j"], truth)
    finally:
        node.close()


def test_a_run_that_started_before_the_exporters_first_sample_says_what_is_not_charged(
    fake_nvml_lib: Path, tmp_path: Path
) -> None:
    """The exporter's first sample takes 0.4 s (GPU 1's reads wait 0.2 s each) and the run starts 0.03 s into
    it: nothing before that first frame was read, so the run is charged from there, exactly, and its summary
    says how much of its start is not charged (before, nothing said so)."""
    node = Node(fake_nvml_lib, tmp_path,
                [h100_with(0, Square(150.0, 690.0, 0.02, 0.7)), h100_with(1, Constant(333.0), ())],
                read_lag=lambda index: 0.2 if index == 1 else 0.0)
    try:
        start = node.now + 0.03
        node.add(Pusher("r1", start, start + 15.0, _uuid(node), every=0.5))
        node.run_until(start + 18.0)
        s = node.ledger.run("r1")
        assert s is not None and s["status"] == "finished", s
        assert "started 0.4s before the exporter's first snapshot: that part is not charged" in s["ledger_notes"]
        first = start + 0.37  # the first frame: GPU 1's confirming read, 0.4 s after the sample began
        truth = node.true_energy_j(0, first, s["end_unix"])
        assert abs(rel_error(s["energy_j"], truth)) <= 0.001, (s["energy_j"], truth)
    finally:
        node.close()

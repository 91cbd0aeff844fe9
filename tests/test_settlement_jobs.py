"""Settled, not guessed (issue 28) for Slurm jobs: every job charged the exact energy of its own interval, from
the prolog's write of its job-mapping file to the epilog's, in the slurm collector's settled counter and in the
run ledger's job run, whatever the power's shape.

The node runs on a frozen clock (``member_rig``): the fake NVML library (its counter the exact integral of the
scripted power), the real GPU collector at the daemon's defaults (a sample a second, the counter every 30 s),
the real slurm collector reading a real job-mapping directory, the sampler and the run ledger. The prolog and
epilog write the files as the scripts in deploy/slurm do, dated with ``os.utime``; the directory watch
(``slurm.watch``, tested on its own in test_slurm_watch.py) reads every counter in a sample taken 20 ms
later. Before this change a job was charged from the first sample that listed it to the first that did not,
the sample grid (a 12 s job on the 10 s wave: +11.8%), and its counter was the power readings' estimate
between counter reads.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fakenvml import Constant, Process, Square, Steps
from member_rig import MemberNode
from settle_rig import EPOCH, h100_with, rel_error
from test_ledger import T0, UUID_A, Clock, constant, gpu_state, snapshot

from gpu_energy_exporter.core.state import SlurmJob
from gpu_energy_exporter.ledger import RunLedger

WAVE_10S = Square(150.0, 650.0, 10.0, 0.5)
WAVE_07S = Square(150.0, 650.0, 0.7, 0.5)
STEP = Steps(((47.0, 120.0), (400.0, 690.0)), repeat=False)
TRACES = {"10 s square wave": WAVE_10S, "0.7 s square wave": WAVE_07S, "a step": STEP}


@pytest.mark.parametrize("trace", list(TRACES), ids=list(TRACES))
@pytest.mark.parametrize("offset", [0.0, 0.33, 2.5, 4.9, 7.71])
@pytest.mark.parametrize("length", [10.0, 12.0, 45.0])
def test_a_job_is_charged_the_exact_integral_from_its_prolog_to_its_epilog(
    fake_nvml_lib: Path, tmp_path: Path, trace: str, offset: float, length: float
) -> None:
    """Jobs of 10 s and more starting anywhere in the wave's phase (a high phase at offset 0, a low one at
    5 s, the step at 47 s): the collector's settled counter and the ledger's run within 1% of the exact
    integral over [prolog's mtime, epilog's mtime], nothing left provisional once the epilog's read is in."""
    node = MemberNode(fake_nvml_lib, tmp_path, [h100_with(0, TRACES[trace], [Process(4242, 1 << 30, 90)])])
    try:
        start = EPOCH + 40.0 + offset
        end = start + length
        node.prolog("7", start)
        node.epilog("7", end)
        node.ticks_until(end + 3.0)
        truth = node.true_energy_j(0, start, end)
        got = node.job_energy("7")
        assert abs(rel_error(got, truth)) <= 0.01, ("collector", got, truth)
        assert node.slurm.attributor.job_provisional().get("7", 0.0) == 0.0
        run = node.ledger.run("7")
        assert run is not None and run["status"] == "finished", run
        assert abs(rel_error(run["energy_j"], truth)) <= 0.01, ("ledger", run["energy_j"], truth, run["ledger_notes"])
        assert run["duration_s"] == pytest.approx(length, abs=1e-3)
    finally:
        node.close()


def test_a_12s_job_on_the_10s_wave_is_not_charged_the_sample_grid(fake_nvml_lib: Path, tmp_path: Path) -> None:
    """The issue's case: a 12 s job whose prolog and epilog fall 0.6 s after a sample; charged 13.0 s of
    12.0 before (+11.8%). Every joule of the GPU is the job's or unattributed, settled."""
    node = MemberNode(fake_nvml_lib, tmp_path, [h100_with(0, WAVE_10S, [Process(4242, 1 << 30, 90)])])
    try:
        start, end = EPOCH + 43.4, EPOCH + 55.4
        node.prolog("7", start)
        node.epilog("7", end)
        node.ticks_until(EPOCH + 70.0)
        truth = node.true_energy_j(0, start, end)
        assert abs(rel_error(node.job_energy("7"), truth)) <= 0.01, (node.job_energy("7"), truth)
        uuid = node.gpus[0].uuid
        unattributed = node.slurm.attributor.unattributed_energy()[uuid]
        # conservation: the settled job and unattributed counters add up to the counter's delta over the spans
        # settled so far (from the first sample, EPOCH + 5, to the last counter read, at the epilog's read
        # plus one 30 s interval at most: the last span is still open)
        pending = sum(node.slurm.attributor._book.provisional(uuid).values())
        assert pending > 0.0
        state = node.gpu.states()[0]
        assert state.span is not None
        settled_to = state.span.anchor_at
        total = node.true_energy_j(0, EPOCH + 5.0, settled_to)
        assert node.job_energy("7") + unattributed == pytest.approx(total, rel=1e-6)
    finally:
        node.close()


def test_two_jobs_sharing_a_gpu_one_after_the_other_are_each_charged_their_own_interval(
    fake_nvml_lib: Path, tmp_path: Path
) -> None:
    """A job joins a GPU another holds (shards, shared evenly: no process of theirs is in a job cgroup here)
    and the first leaves: each within 1% of its share of the exact integral, in the collector and the
    ledger."""
    node = MemberNode(fake_nvml_lib, tmp_path, [h100_with(0, WAVE_07S, [])])
    try:
        a0, b0, a1, b1 = EPOCH + 20.4, EPOCH + 37.3, EPOCH + 61.8, EPOCH + 80.5
        node.prolog("41", a0)
        node.prolog("42", b0)
        node.epilog("41", a1)
        node.epilog("42", b1)
        node.ticks_until(b1 + 3.0)
        e = node.true_energy_j
        want = {"41": e(0, a0, b0) + e(0, b0, a1) / 2, "42": e(0, b0, a1) / 2 + e(0, a1, b1)}
        for job, truth in want.items():
            assert abs(rel_error(node.job_energy(job), truth)) <= 0.01, (job, node.job_energy(job), truth)
            run = node.ledger.run(job)
            assert run is not None and run["status"] == "finished"
            assert abs(rel_error(run["energy_j"], truth)) <= 0.01, (job, run["energy_j"], truth)
    finally:
        node.close()


@pytest.mark.parametrize(("case", "since", "until", "want_s", "want_e"), [
    ("no edge known: the snapshots that first and no longer list it", None, None, 3.0, 7.0),
    ("the prolog's and epilog's writes", 2.6, 6.3, 2.6, 6.3),
    ("an edge older than the previous snapshot is taken there", -100.0, 6.3, 2.0, 6.3),
    ("an edge after the snapshot is taken at it", 3.4, 9.0, 3.0, 7.0),
])
def test_the_ledger_takes_a_jobs_edges_at_its_files_mtimes_bounded(
    case: str, since: float | None, until: float | None, want_s: float, want_e: float
) -> None:
    """The ledger's job run opens at ``SlurmJob.since`` and ends at the ended entry's ``until`` (wall clock,
    placed through the snapshot's stamp), never before the previous snapshot nor after this one (300 W)."""
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    trace = constant(300.0)
    for t in range(0, 12):
        clock.t = T0 + t
        if 3 <= t <= 6:
            jobs: tuple[SlurmJob, ...] = (SlurmJob("7", (UUID_A,), since=None if since is None else T0 + since),)
        else:
            jobs = (SlurmJob("7", (), until=T0 + until),) if t >= 7 and until is not None else ()
        ledger.on_snapshot(replace(snapshot(T0 + t, (gpu_state(UUID_A, T0 + t, trace),)), slurm_jobs=jobs))
    run = ledger.run("7")
    assert run is not None and run["status"] == "finished", (case, run)
    assert run["duration_s"] == pytest.approx(want_e - want_s), case
    assert run["energy_j"] == pytest.approx(300.0 * (want_e - want_s)), case


@pytest.mark.parametrize(("power", "bound"), [(Constant(400.0), 0.02), (WAVE_07S, 0.02)], ids=["400 W", "0.7 s wave"])
def test_two_jobs_sharing_a_gpu_are_split_by_their_processes_sm_use_when_it_changes(
    fake_nvml_lib: Path, tmp_path: Path, power: Constant | Square, bound: float
) -> None:
    """Two jobs on one GPU (shards) from 20 s to 90 s, their processes found in their cgroups, SM 70/20 until
    57 s, then 20/70: each piece split by the samples NVML gave over it, within 2% (before: the last weights
    read, held until the next read)."""
    sm_a = Steps(((57.0, 70.0), (100.0, 20.0)), repeat=False)
    sm_b = Steps(((57.0, 20.0), (100.0, 70.0)), repeat=False)
    procs = [Process(4242, 1 << 30, 70, sm_trace=sm_a), Process(4343, 1 << 30, 20, sm_trace=sm_b)]
    node = MemberNode(fake_nvml_lib, tmp_path, [h100_with(0, power, procs)], job_pids={4242: "41", 4343: "42"})
    try:
        t0, t1 = EPOCH + 20.0, EPOCH + 90.0
        node.prolog("41", t0)
        node.prolog("42", t0 + 0.5)  # (41 alone for half a second, 42 alone at the end: the whole GPU)
        node.epilog("41", t1)
        node.epilog("42", t1 + 0.5)
        node.ticks_until(t1 + 3.0)
        shared = _shared_truth(node, t0 + 0.5, t1, sm_a, sm_b)
        want = {"41": node.true_energy_j(0, t0, t0 + 0.5) + shared[0],
                "42": shared[1] + node.true_energy_j(0, t1, t1 + 0.5)}
        for job, truth in want.items():
            assert abs(rel_error(node.job_energy(job), truth)) <= bound, (job, node.job_energy(job), truth)
        assert {m for (_, m) in node.slurm.attributor.job_energy()} >= {"sm_utilization"}
    finally:
        node.close()


def _shared_truth(node: MemberNode, t0: float, t1: float, sm_a: Steps, sm_b: Steps, step: float = 0.01
                  ) -> tuple[float, float]:
    """Each of two processes' exact share of the GPU's energy over (t0, t1] by its SM share (midpoint rule)."""
    a = b = 0.0
    t = t0
    while t < t1 - 1e-12:
        dt = min(step, t1 - t)
        joules = node.true_energy_j(0, t, t + dt)
        wa, wb = sm_a.power_w(t + dt / 2 - EPOCH), sm_b.power_w(t + dt / 2 - EPOCH)
        a += joules * wa / (wa + wb)
        b += joules * wb / (wa + wb)
        t += dt
    return a, b

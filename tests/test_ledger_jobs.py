"""Slurm jobs in the ledger's split (``ledger.split``, ``Holding.allocated``; issue 23): pure arithmetic.

A job's allocation confirms its claim on its GPUs: it is never refused by the NVML-process rule, the
processes listed there that are no run's are the job's, and what runs' own processes use stays theirs. The
end-to-end figures (real Slurm, real prolog and epilog, the ledger's rows) are in tests/test_slurm_real.py.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from test_ledger import T0, UUID_A, Clock, Harness, constant, exposition, gpu_state, point, snapshot, trainer

from gpu_energy_exporter.core.state import SlurmJob
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.split import Holding, Proc, charge, piece_shares, unattributed
from gpu_energy_exporter.otlp.store import AcceptedPoint

INF = math.inf


def test_a_job_alone_gets_its_gpu_whatever_nvml_lists_and_after_the_claim_grace() -> None:
    job = Holding("42", 0.0, grace_end=1.0, allocated=True)
    for procs in ((), (Proc(100, 80.0),), (Proc(100, 80.0), Proc(101, 20.0))):
        got = charge("42", 0.0, 10.0, -INF, INF, [job], procs)
        assert got.share_s == pytest.approx(10.0), procs
        assert got.unconfirmed_s == 0.0
        assert unattributed(0.0, 10.0, [job], procs) == pytest.approx(0.0)
    # The same claim without the allocation: after the claim grace (1 s) a listed process that is no run's
    # keeps its share and the claim goes unconfirmed -- the rule a job must not fall under.
    claim = Holding("42", 0.0, grace_end=1.0, has_pid=True)
    got = charge("42", 0.0, 10.0, -INF, INF, [claim], (Proc(100, 80.0),))
    assert got.share_s == pytest.approx(1.0) and got.unconfirmed_s == pytest.approx(9.0)


def test_a_helper_run_in_the_job_keeps_its_processes_share_and_the_job_gets_the_rest() -> None:
    # Run "train" (another run id) owns pid 100 (30% SM); pid 101 (70%) is no run's: the job's.
    hs = [Holding("42", 0.0, allocated=True), Holding("train", 0.0, pids=frozenset({100}), has_pid=True)]
    procs = (Proc(100, 30.0), Proc(101, 70.0))
    assert piece_shares(hs, procs, 0.0) == {"train": (pytest.approx(0.3), "sm_util"),
                                             "42": (pytest.approx(0.7), "sm_util")}
    # The job's own run id pushing (its pid is the run's): one member, the whole GPU, never twice.
    mine = [Holding("42", 0.0, pids=frozenset({100}), has_pid=True, allocated=True)]
    assert piece_shares(mine, (Proc(100, 30.0), Proc(101, 70.0)), 0.0) == {"42": (pytest.approx(1.0), "sm_util")}
    assert piece_shares(mine, (Proc(100, 30.0),), 0.0) == {"42": (1.0, "exclusive")}


def test_two_jobs_sharing_a_gpu_split_it_evenly_and_mig_jobs_get_their_instances_processes() -> None:
    both = [Holding("1", 0.0, allocated=True), Holding("2", 0.0, allocated=True)]
    assert piece_shares(both, (), 0.0) == {"1": (0.5, "even"), "2": (0.5, "even")}
    assert piece_shares(both, None, 0.0) == {"1": (0.5, "even"), "2": (0.5, "even")}
    mig = [Holding("1", 0.0, mig_uuid="mig-a", slices=3, allocated=True),
           Holding("2", 0.0, mig_uuid="mig-b", slices=4, allocated=True)]
    procs = (Proc(100, None, unit="mig-a", slices=3), Proc(101, None, unit="mig-b", slices=4))
    got = piece_shares(mig, procs, 0.0)
    assert got["1"][0] == pytest.approx(3 / 7) and got["2"][0] == pytest.approx(4 / 7)
    # A process on an instance no job holds is no job's: its share stays unattributed.
    got = piece_shares(mig[:1], (*procs, Proc(102, None, unit="mig-c", slices=3)), 0.0)
    assert got == {"1": (pytest.approx(3 / 10), "mig")}


def test_with_jobs_charged_time_plus_unattributed_time_is_the_interval() -> None:
    rnd = random.Random(23)
    for _ in range(400):
        t0, t1 = 0.0, rnd.uniform(0.1, 5.0)
        pids = list(range(100, 100 + rnd.randint(0, 4)))
        procs = None if rnd.random() < 0.2 else tuple(Proc(p, rnd.choice((None, rnd.uniform(0, 100))))
                                                       for p in pids)
        hs = []
        for i in range(rnd.randint(0, 4)):
            a = rnd.uniform(-1.0, t1 + 1.0)
            b = a + rnd.uniform(0.0, 3.0) if rnd.random() < 0.7 else math.inf
            own = frozenset(p for p in pids if rnd.random() < 0.3)
            hs.append(Holding(f"r{i}", a, b, pids=own, grace_end=a + rnd.uniform(0, 2), has_pid=bool(own),
                              allocated=rnd.random() < 0.5))
        total = sum(charge(r, t0, t1, -INF, INF, hs, procs).share_s for r in {h.run_id for h in hs})
        assert total + unattributed(t0, t1, hs, procs) == pytest.approx(t1 - t0)
        if any(h.allocated and h.start <= t0 and h.end >= t1 for h in hs):
            assert total == pytest.approx(t1 - t0)  # a job holds the GPU throughout: nothing unattributed


# ----------------------------------------------------------------------------------------------------
# the ledger: job runs opened, charged and closed by the job-mapping directory's jobs on each snapshot


class JobHarness(Harness):
    """``Harness`` whose snapshots carry the Slurm jobs ``jobs_at(t)`` says hold GPUs then."""

    def __init__(self, ledger: RunLedger, clock: Clock, jobs_at: Callable[[float], tuple[SlurmJob, ...]],
                 watts: float = 300.0) -> None:
        self.jobs_at = jobs_at
        super().__init__(ledger, clock, {UUID_A: constant(watts)}, idle={UUID_A: 100.0})

    def snap_at(self, t: float) -> None:
        self.clock.t = t
        gpus = (gpu_state(UUID_A, t, self.traces[UUID_A], idle=100.0),)
        self.ledger.on_snapshot(dataclasses.replace(snapshot(t, gpus), slurm_jobs=self.jobs_at(t)))


def _job(job_id: str, lo: float, hi: float) -> Callable[[float], tuple[SlurmJob, ...]]:
    """Job ``job_id`` on GPU A in the snapshots from ``lo`` to ``hi`` (the prolog and epilog between)."""
    held = (SlurmJob(job_id, (UUID_A,), "alice", "physics", "gpu"),)
    return lambda t: held if lo - 1e-9 <= t <= hi + 1e-9 else ()


def _unattributed(ledger: RunLedger) -> float:
    m = re.search(r'gpuenergy_ledger_unattributed_energy_joules_total\{[^}]*\} (\S+)', exposition(ledger))
    assert m, "no unattributed series"
    return float(m.group(1))


def test_a_job_that_pushes_nothing_is_a_run_from_prolog_to_epilog_with_one_row(tmp_path: Path) -> None:
    clock = Clock()
    runs_csv = tmp_path / "runs.csv"
    ledger = RunLedger(str(runs_csv), warmup_s=0.0, stale_after_s=1.0, late_window_s=1.0, clock=clock)
    h = JobHarness(ledger, clock, _job("7", T0 + 3, T0 + 6))
    h.run_until(T0 + 12)  # longer than stale_after: a job run never goes stale while the job is listed
    # Listed in the snapshots at T0+3..T0+6: it started after T0+2 and ended before T0+7; counted from the
    # snapshot before the first that lists it to the last that lists it (as the slurm collector does):
    # 300 W x 4 s = 1200 J, 100 W idle x 4 s = 400 J of it idle.
    s = summary_of_finished(ledger, "7")
    assert s["energy_j"] == pytest.approx(1200.0) and s["duration_s"] == pytest.approx(4.0)
    assert s["idle_energy_j"] == pytest.approx(400.0) and s["dynamic_energy_j"] == pytest.approx(800.0)
    assert s["gpu_count"] == 1 and s["tokens"] is None and s["energy_split"] == "exclusive"
    assert "Slurm job 7 (user alice, account physics, partition gpu)" in s["ledger_notes"]
    assert s["metadata"]["slurm_user"] == "alice" and s["metadata"]["slurm_job_id"] == "7"
    ledger.close()
    with open(runs_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run_id"], r["status"], float(r["energy_j"])) for r in rows] == [("7", "finished", 1200.0)]
    assert json.loads((tmp_path / "runs" / "7.json").read_text())["metadata"]["slurm_partition"] == "gpu"
    # Every joule is the job's or unattributed: the intervals settled so far (those out of the 2 s snapshot
    # history at T0+12: up to T0+10) are 300 W x 10 s = 3000 J, 1200 J of them the job's.
    assert _unattributed(ledger) == pytest.approx(3000.0 - 1200.0)


def summary_of_finished(ledger: RunLedger, run_id: str) -> dict:  # type: ignore[type-arg]
    found = [r for r in ledger.runs() if r["run_id"] == run_id]
    assert len(found) == 1, found
    doc = ledger.run(run_id)
    assert doc is not None and doc["status"] == "finished", doc
    return doc


def test_a_job_and_another_run_on_its_gpu_add_up_to_the_gpus_energy() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = JobHarness(ledger, clock, _job("7", T0 + 3, T0 + 8))
    other = trainer(h, "other", T0, T0 + 10, rate=10.0, every=1.0)  # names GPU A, says no pid: its claim
    h.run_until(T0 + 11, other)
    job, run = summary_of_finished(ledger, "7"), summary_of_finished(ledger, "other")
    # The job holds A from T0+2 to T0+8 (6 s), shared evenly with "other" (no process list: the claims).
    assert job["energy_j"] == pytest.approx(150.0 * 6)
    assert run["energy_j"] == pytest.approx(300.0 * 2 + 150.0 * 6 + 300.0 * 2)
    assert job["energy_j"] + run["energy_j"] == pytest.approx(300.0 * 10)


def test_a_rank_pushing_under_its_own_run_id_is_taken_into_its_jobs_run() -> None:
    clock = Clock()
    ledger = RunLedger(None, warmup_s=0.0, stale_after_s=300.0, clock=clock)
    h = JobHarness(ledger, clock, _job("7", T0 + 1, T0 + 10))
    resource = (("slurm_job_id", "7"),)  # the helper's resource: its job identity

    def push(t: float) -> None:
        if T0 + 2 <= t <= T0 + 6:
            for name, value in (("training_tokens_total", 100.0 * (t - T0 - 2)),
                                ("training_run_finished", 1.0 if t >= T0 + 6 else 0.0)):
                p = point("llama", name, value, t)
                h.push(AcceptedPoint(p.run_id, p.name, p.labels, p.value, p.time, p.kind, resource=resource))
    h.run_until(T0 + 12, push)
    assert [r["run_id"] for r in ledger.runs()] == ["7"]
    s = summary_of_finished(ledger, "7")
    # The job's energy (T0 to T0+10, its rank's finish at T0+6 does not end it), the rank's tokens.
    assert s["energy_j"] == pytest.approx(3000.0) and s["tokens"] == pytest.approx(400.0)
    assert s["j_per_token"] == pytest.approx(3000.0 / 400.0)
    assert "its ranks push under run id 'llama'" in s["ledger_notes"]

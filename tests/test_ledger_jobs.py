"""Slurm jobs in the ledger's split (``ledger.split``, ``Holding.allocated``; issue 23): pure arithmetic.

A job's allocation confirms its claim on its GPUs: it is never refused by the NVML-process rule, the
processes listed there that are no run's are the job's, and what runs' own processes use stays theirs. The
end-to-end figures (real Slurm, real prolog and epilog, the ledger's rows) are in tests/test_slurm_real.py.
"""

from __future__ import annotations

import math
import random

import pytest

from gpu_energy_exporter.ledger.split import Holding, Proc, charge, piece_shares, unattributed

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

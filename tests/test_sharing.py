"""The one splitter (core.sharing), the /proc parsing that ties NVML's pids to runs and pods (core.procinfo),
and the ledger's claim rules on plain values (ledger.split): hand-computed parts."""

from __future__ import annotations

import math

import pytest

from gpu_energy_exporter.core import sharing
from gpu_energy_exporter.core.procinfo import ProcessIdentity, parse_cgroup, parse_nspid
from gpu_energy_exporter.ledger import split
from gpu_energy_exporter.ledger.split import Holding, Proc

M = sharing.Member
CID = "a" * 64


def test_processes_share_by_measured_sm_and_a_silent_one_keeps_its_part() -> None:
    parts = sharing.split(500.0, [M("a", weight=90), M("b", weight=10)])
    assert parts == [("a", "sm_util", 450.0), ("b", "sm_util", 50.0)]
    # "nobody" pushes nothing; it used 50 %: it keeps 250 J
    assert sharing.split(500.0, [M("run", weight=50), M("nobody", weight=50)])[1] == ("nobody", "sm_util", 250.0)


def test_even_fallback_exclusive_and_mig_slices() -> None:
    assert sharing.split(90.0, [M("a", weight=None), M("b", weight=30), M("b")]) == [
        ("a", "even", 30.0), ("b", "even", 60.0)]
    assert sharing.split(90.0, [M("a", weight=0), M("b", weight=0)])[0] == ("a", "even", 45.0)
    assert sharing.split(90.0, [M("a", weight=5), M("a", weight=7)]) == [("a", "exclusive", 90.0)]
    # a 3g and a 1g instance in use: 3/4 and 1/4 of the GPU; two owners on the 3g share it evenly
    parts = sharing.split(400.0, [M("x", "MIG-1", 3), M("y", "MIG-1", 3), M("z", "MIG-2", 1)])
    assert parts == [("x", "mig", 150.0), ("y", "mig", 150.0), ("z", "mig", 100.0)]
    assert sharing.split(1.0, []) == []


def test_nspid_and_cgroup_parsing() -> None:
    assert parse_nspid("Name:\tpython\nNSpid:\t4242\t17\n") == (4242, 17)
    assert parse_nspid("Name:\tx\n") == ()
    v2 = (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f2b6a52_1d1e_4c4b_9a39_8f2b1c0de0a1"
          f".slice/cri-containerd-{CID}.scope\n")
    assert parse_cgroup(v2) == ("0f2b6a52-1d1e-4c4b-9a39-8f2b1c0de0a1", CID)
    v1 = f"12:cpuset:/kubepods/burstable/pod6d7e8f90-2a3b-4c5d-8e9f-a0b1c2d3e4f5/{CID}\n"
    assert parse_cgroup(v1) == ("6d7e8f90-2a3b-4c5d-8e9f-a0b1c2d3e4f5", CID)
    assert parse_cgroup("0::/\n") == ("", "")
    assert parse_cgroup(f"0::/system.slice/docker-{CID}.scope") == ("", CID)


def test_a_containerised_pid_matches_only_its_own_container() -> None:
    p = ProcessIdentity(4242, (4242, 17), CID, "")
    assert p.matches(4242)  # the same pid namespace (hostPID, workstation)
    assert p.matches(17, CID)  # inside its container
    assert not p.matches(17, "b" * 64)  # pid 17 of another container
    assert not p.matches(18, CID)
    assert p.matches(17)  # the trainer could not name its container: the innermost pid alone
    assert not ProcessIdentity(17, (17,)).matches(4242)


def test_claims_are_charged_only_when_confirmed_after_the_grace() -> None:
    victim = Holding("v", 0.0, pids=frozenset({100}), grace_end=5.0, has_pid=True)
    attacker = Holding("x", 0.0, grace_end=5.0, has_pid=True)
    procs = (Proc(100, 100.0),)
    # The victim's process is the only one on the GPU: the attacker gets nothing, even within its grace.
    assert split.piece_shares([victim, attacker], procs, 0.0) == {"v": (1.0, "exclusive")}
    c = split.charge("x", 0.0, 10.0, 0.0, 10.0, [victim, attacker], procs)
    assert c.share_s == 0.0 and c.unconfirmed_s == pytest.approx(5.0) and c.reason == split.UNCONFIRMED_NO_PROCESS
    assert split.charge("v", 0.0, 10.0, 0.0, 10.0, [victim, attacker], procs).share_s == pytest.approx(10.0)
    # Within its grace a claim shares only what no run's process uses (nothing listed yet: the whole GPU).
    new = Holding("n", 0.0, grace_end=5.0)
    c = split.charge("n", 0.0, 10.0, 0.0, 10.0, [new], ())
    assert c.share_s == pytest.approx(5.0) and c.unconfirmed_s == pytest.approx(5.0)
    assert c.reason == split.UNCONFIRMED_NO_PID and c.splits == {"exclusive"}  # alone, nothing listed
    # Sharing with a process that is no run's (its own, not matched yet?): the "grace" rule, its share only.
    c = split.charge("n", 0.0, 10.0, 0.0, 10.0, [new], (Proc(7, 30.0),))
    assert c.share_s == pytest.approx(5.0) and c.splits == {"grace"}
    assert split.unattributed(0.0, 10.0, [new], ()) == pytest.approx(5.0)
    # No process list (no host /proc): the claims alone, as before, and said so.
    c = split.charge("x", 0.0, 10.0, 0.0, 10.0, [victim, attacker], None)
    assert c.share_s == pytest.approx(5.0) and c.unverified_s == pytest.approx(10.0)


def test_runs_plus_unattributed_is_the_gpu() -> None:
    a = Holding("a", 0.0, 6.0, pids=frozenset({1}), grace_end=-math.inf, has_pid=True)
    b = Holding("b", 2.0, pids=frozenset({2}), grace_end=-math.inf, has_pid=True)
    procs = (Proc(1, 60.0), Proc(2, 20.0), Proc(3, 20.0))  # pid 3 is no run's
    ca = split.charge("a", 0.0, 10.0, 0.0, 10.0, [a, b], procs).share_s
    cb = split.charge("b", 0.0, 10.0, 0.0, 10.0, [a, b], procs).share_s
    free = split.unattributed(0.0, 10.0, [a, b], procs)
    assert ca == pytest.approx(0.6 * 6.0)  # its process's share while it ran
    assert cb == pytest.approx(0.2 * 8.0)
    assert ca + cb + free == pytest.approx(10.0)


def test_a_run_owns_the_listed_process_its_trainer_is_even_inside_a_container() -> None:
    from gpu_energy_exporter.ledger import process_claims, runs

    def admit(run: runs.Run, res: dict[str, str], rank: str, t: float) -> str:
        return process_claims.admit_process(run, process_claims.process_key(res) or ("", 0, "", ""), res, rank, t)

    run = runs.Run("r", 0.0, 0.0, True, 16, 0.0)
    res = {"process_pid": "17", "host_name": "pod-a", "container_id": CID, "training_world_size": "2",
           "slurm_job_id": "77"}
    assert admit(run, res, "0", 0.0) == ""
    listed = (Proc(4242, 50.0, ProcessIdentity(4242, (4242, 17), CID)),
              Proc(5000, 50.0, ProcessIdentity(5000, (5000, 17), "b" * 64)))
    assert process_claims.own_pids(run, listed) == {4242}
    # Another process under the run id: a rank of the same job (same Slurm job, world size 2) joins...
    rank1 = {**res, "process_pid": "18"}
    assert admit(run, rank1, "1", 1.0) == ""
    # ...one of another job, one beyond the world size, one pushing a live rank are refused.
    other = {**res, "process_pid": "19", "slurm_job_id": "78"}
    assert admit(run, other, "2", 2.0) == process_claims.REFUSED_JOB
    third = {**res, "process_pid": "20"}
    assert admit(run, third, "2", 2.0) == process_claims.REFUSED_WORLD
    solo = runs.Run("s", 0.0, 0.0, True, 16, 0.0)
    one = {"process_pid": "30"}
    admit(solo, one, "0", 0.0)
    twin = {"process_pid": "31"}
    assert admit(solo, twin, "0", 1.0) == process_claims.REFUSED_RANK


def test_the_helper_sends_its_container_and_job_identity(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gpu_energy_exporter.training.meter import process_identity

    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/kubepods.slice/kubepods-pod0f2b6a52_1d1e_4c4b_9a39_8f2b1c0de0a1.slice/"
                      f"cri-containerd-{CID}.scope\n")
    env = {"SLURM_JOB_ID": "4242", "MASTER_ADDR": "node-1", "MASTER_PORT": "29500"}
    assert process_identity(4, env, str(cgroup)) == {
        "training.world_size": 4, "container.id": CID, "k8s.pod.uid": "0f2b6a52-1d1e-4c4b-9a39-8f2b1c0de0a1",
        "slurm.job.id": "4242", "training.job.id": "node-1:29500"}
    cgroup.write_text("0::/\n")
    assert process_identity(1, {"TORCHELASTIC_RUN_ID": "r1"}, str(cgroup)) == {
        "training.world_size": 1, "training.job.id": "r1"}
    assert process_identity(1, {}, str(tmp_path / "missing")) == {"training.world_size": 1}
